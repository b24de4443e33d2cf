"""Installing, the system's part: files, accounts and services.

Each step of an install that changes the system (a directory, a file, a
user, a group membership, linger, a tmpfiles entry, libvirtd's restart) is
undone if a later step fails (``Undo``), so a failed install leaves the tower
as it was.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import grp
import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import types

from .jobs import LINGER_DIR, SYSTEMD_RUNTIME_DIR, program_path
from .state import (
    _DIR_FLAGS,
    STATE_DIR_MODE,
    _write_all,
    drop_privileges,
    replace_file_at,
)
from .wire import ERR_INTERNAL, AgentError, JsonObj, reply_error

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

# What install adds to a tower's accounts and services, when asked.
# sudo runs commands with its secure_path; this is the usual one where PATH is unset.
ADMIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ADMIN_TIMEOUT = 120.0
ADMIN_OUTPUT_MAX = 400
LIBVIRT_GROUP = "libvirt"
# libvirt loads its hooks when its daemon starts: the monolithic libvirtd, or
# the QEMU driver's own virtqemud where the modular daemons run.
LIBVIRT_UNITS = ("libvirtd.service", "virtqemud.service")
PROGRAM_MODE = 0o755


def _as_account(
    account: pwd.struct_passwd, work: Callable[[], JsonObj], what: str
) -> JsonObj:
    """`work`'s reply, computed in a child process that is `account` (root only)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, measured by its result
        try:
            os.close(read_fd)
            try:
                drop_privileges(account.pw_uid, account.pw_gid, {})
                result = work()
            except AgentError as error:
                result = reply_error(error.code, error.message, **error.extra)
            except Exception as error:  # noqa: BLE001 - reported to the parent
                result = reply_error(ERR_INTERNAL, f"{type(error).__name__}: {error}")
            _write_all(write_fd, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    try:
        answer: Any = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return reply_error(ERR_INTERNAL, f"{what} as the SSH user said nothing")
    return answer


def as_user(
    account: pwd.struct_passwd, work: Callable[[], JsonObj], what: str
) -> JsonObj:
    """`work`'s reply (an error reply for an AgentError), computed as the SSH
    user: run as root, in a child process that becomes the user first, so that
    nothing the user controls (a symbolic link in its home or its state
    directory) can make root act where the user could not."""
    if os.geteuid() == 0 and account.pw_uid != 0:
        return _as_account(account, work, what)
    try:
        return work()
    except AgentError as error:
        return reply_error(error.code, error.message, **error.extra)


class StepError(Exception):
    """An install step failed; `reason` is an errno name or "command"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


_STEP_ERRORS = (OSError, StepError)


def errno_name(error: BaseException) -> str:
    """EROFS, EACCES, ENOSPC...: what failed, for a program to read."""
    return errno.errorcode.get(getattr(error, "errno", 0) or 0, "unknown")


class Undo:
    """What one install did so far, undone in reverse when a later step
    fails: a failed install leaves the tower as it found it."""

    def __init__(self) -> None:
        self._steps: List[Tuple[str, Callable[[], None]]] = []
        self._tidy: List[Callable[[], None]] = []

    def add(self, what: str, action: Callable[[], None]) -> None:
        """`action` undoes a step; `what` names what is left if it cannot."""
        self._steps.append((what, action))

    def on_success(self, action: Callable[[], None]) -> None:
        """`action` tidies up once every step succeeded (drops a backup)."""
        self._tidy.append(action)

    def rollback(self) -> List[str]:
        """Undo every step, the last one first; what could not be undone."""
        left: List[str] = []
        for what, action in reversed(self._steps):
            try:
                action()
            except _STEP_ERRORS:
                left.append(what)
        self._steps, self._tidy = [], []
        return left

    def commit(self) -> None:
        for action in self._tidy:
            with contextlib.suppress(OSError):
                action()
        self._steps, self._tidy = [], []


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def make_dirs(path: str, undo: Undo) -> None:
    """`path` and its missing parents, 0755 whatever the umask; undo removes
    each one made (if it is empty: rmdir)."""
    missing: List[str] = []
    while not os.path.isdir(path) and path not in missing:
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory, PROGRAM_MODE)
        undo.add(directory, functools.partial(os.rmdir, directory))
        os.chmod(directory, PROGRAM_MODE)


def install_file(path: str, data: bytes, mode: int, undo: Undo) -> None:
    """One file of the install, replaced atomically. Undo removes it, or gives
    back the file it replaced: a hard link keeps that one until the install
    succeeds, so restoring it takes no space and restores it byte for byte,
    with its mode and owner."""
    directory, name = os.path.split(path)
    make_dirs(directory, undo)
    dfd = os.open(directory, _DIR_FLAGS)
    try:
        try:
            previous: Optional[os.stat_result] = os.stat(
                name, dir_fd=dfd, follow_symlinks=False
            )
        except FileNotFoundError:
            previous = None
        if previous is None:
            # Registered once made: removing a file that is not there fails
            # on a read-only file system.
            replace_file_at(dfd, name, data, mode)
            undo.add(path, functools.partial(_remove_file, path))
            return
        if stat.S_ISDIR(previous.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        backup = f".{name}.previous-{os.urandom(6).hex()}"
        os.link(name, backup, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        kept = os.path.join(directory, backup)
        undo.add(path, functools.partial(os.replace, kept, path))
        undo.on_success(functools.partial(os.unlink, kept))
        replace_file_at(dfd, name, data, mode)
    finally:
        os.close(dfd)


def _restore_dir(path: str, uid: int, gid: int, mode: int) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def install_state_dir(path: str, account: pwd.struct_passwd, undo: Undo) -> None:
    """The state directory, the SSH user's alone: nobody else may write to it
    (or read it). Undo gives a directory that was there its owner and mode back."""
    existed = os.path.isdir(path)
    make_dirs(path, undo)
    fd = os.open(path, _DIR_FLAGS)
    try:
        if existed:
            st = os.fstat(fd)
            undo.add(
                path,
                functools.partial(
                    _restore_dir, path, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)
                ),
            )
        if os.geteuid() == 0:
            os.fchown(fd, account.pw_uid, account.pw_gid)
        os.fchmod(fd, STATE_DIR_MODE)
    finally:
        os.close(fd)


def systemd_runs() -> bool:
    """Whether systemd is this system's init (sd_booted(3))."""
    return os.path.isdir(SYSTEMD_RUNTIME_DIR)


def enable_linger(account: pwd.struct_passwd, env: Dict[str, str], undo: Undo) -> str:
    """The SSH user's systemd manager kept running without a session, so a
    job's unit outlives the SSH request that started it (see user_lingers):
    "enabled", "already" or "no_systemd" (an init without user managers:
    the runners are plain processes there). Undo turns it off again."""
    name = account.pw_name
    if not systemd_runs():
        return "no_systemd"
    if os.path.isfile(os.path.join(LINGER_DIR, name)):
        return "already"
    run_admin(["loginctl", "enable-linger", name], env)
    undo.add(
        f"lingering of {name}",
        functools.partial(run_admin, ["loginctl", "disable-linger", name], env),
    )
    return "enabled"


def tmpfiles_entry(state_dir: str, account: pwd.struct_passwd) -> bytes:
    """systemd-tmpfiles' line for the state directory (tmpfiles.d(5), type
    d): made at boot if it is missing, its owner and mode set back if they
    were changed; never cleaned (age "-")."""
    try:
        group = grp.getgrgid(account.pw_gid).gr_name
    except KeyError:
        group = str(account.pw_gid)
    return (
        "# GPU Handoff's state directory: the SSH user's alone.\n"
        f"d {state_dir} {STATE_DIR_MODE:04o} {account.pw_name} {group} -\n"
    ).encode()


def own_program() -> bytes:
    """This program's bytes: what install and update put on the tower. Run
    from its sources (a checkout: the package's directory), the agent first
    builds the one file a tower runs from them (build.py beside the
    package)."""
    path = program_path()
    if os.path.isdir(path):
        built: bytes = build_tool().archive_bytes(os.path.dirname(path))
        return built
    with open(path, "rb") as handle:
        return handle.read()


def _checkout_builder(path: str) -> str:
    return os.path.join(os.path.dirname(path), "build.py")


def build_tool() -> Any:
    """The agent's build (build.py): from this program's archive, or beside
    this package in a checkout."""
    archive = getattr(globals().get("__loader__"), "archive", None)
    if isinstance(archive, str):
        source: bytes = globals()["__loader__"].get_data("build.py")
        path = f"{archive}/build.py"
    else:
        path = _checkout_builder(program_path())
        with open(path, "rb") as handle:
            source = handle.read()
    module = types.ModuleType("gpu_handoff_build")
    module.__file__ = path
    exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    return module


def compiled_program(program: str, data: bytes) -> Optional[Tuple[str, bytes]]:
    """Where the program ``data``, run as ``program``, finds its modules
    compiled for this Python (it compiles them at each start without), and
    the compiled modules; None if this Python keeps none (or ``data`` is a
    0.3 agent's single source file)."""
    tool = build_tool()
    try:
        return tool.cache_path(program), tool.compiled(data, program)
    except tool.BuildError:
        return None


def _trimmed(text: str) -> str:
    """A program's output on one line, bounded."""
    text = " ".join(text.split())
    if len(text) > ADMIN_OUTPUT_MAX:
        text = text[: ADMIN_OUTPUT_MAX - 3] + "..."
    return text or "(it said nothing)"


def _admin_process(
    argv: List[str], env: Dict[str, str], timeout: float
) -> "subprocess.CompletedProcess[bytes]":
    """Run an administration program (useradd, usermod, systemctl...) found on
    the caller's PATH (sudo's secure_path), with an argument list, never
    through a shell; StepError (reason "command") if it cannot run."""
    search = env.get("PATH") or ADMIN_PATH
    command = shlex.join(argv)
    program = shutil.which(argv[0], path=search)
    if program is None:
        raise StepError("command", f"{command}: {argv[0]} is not on PATH ({search})")
    try:
        return subprocess.run(
            [program, *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={"PATH": search, "LC_ALL": "C"},
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StepError(
            "command", f"{command} did not finish within {timeout:g} s"
        ) from None
    except OSError as error:
        raise StepError("command", f"{command}: {error}") from None


def _admin_failure(
    argv: List[str], done: "subprocess.CompletedProcess[bytes]"
) -> StepError:
    said = (done.stderr.strip() or done.stdout).decode(errors="replace")
    return StepError(
        "command",
        f"{shlex.join(argv)} exited with {done.returncode}: {_trimmed(said)}",
    )


def run_admin(
    argv: List[str], env: Dict[str, str], timeout: float = ADMIN_TIMEOUT
) -> None:
    """Run an administration program (see _admin_process); StepError unless
    it succeeds."""
    done = _admin_process(argv, env, timeout)
    if done.returncode != 0:
        raise _admin_failure(argv, done)


def lookup_account(name: str) -> Optional[pwd.struct_passwd]:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def create_user(name: str, env: Dict[str, str], undo: Undo) -> pwd.struct_passwd:
    """The SSH user, made: a home, a group of its own, a shell (sshd runs a
    forced command through it) and "*" for a password: no password, yet not
    locked, which sshd requires of a key login where PAM is off."""
    argv = ["useradd", "--create-home", "--user-group", "--shell", "/bin/sh"]
    remove = functools.partial(run_admin, ["userdel", "--remove", name], env)
    try:
        run_admin([*argv, "--password", "*", name], env)
    except StepError:
        # useradd can fail half-way and leave the account behind (exit 12:
        # the home directory could not be made, after the account was
        # written): the install removes what it made.
        if lookup_account(name) is not None:
            undo.add(f"user {name}", remove)
        raise
    undo.add(f"user {name}", remove)
    account = lookup_account(name)
    if account is None:
        raise StepError("command", f"useradd succeeded, yet there is no user {name!r}")
    return account


def libvirt_membership(
    account: pwd.struct_passwd, group: Optional[grp.struct_group]
) -> str:
    """What to do: "missing" (no such group), "member" (already) or "add"."""
    if group is None:
        return "missing"
    if account.pw_name in group.gr_mem or account.pw_gid == group.gr_gid:
        return "member"
    return "add"


def join_libvirt_group(
    account: pwd.struct_passwd, env: Dict[str, str], undo: Undo
) -> str:
    """The SSH user in the libvirt group (libvirt's system socket is the
    group's): "added", "member" or "missing" (a tower without the group)."""
    try:
        group: Optional[grp.struct_group] = grp.getgrnam(LIBVIRT_GROUP)
    except KeyError:
        group = None
    decision = libvirt_membership(account, group)
    if decision != "add":
        return decision
    name = account.pw_name
    run_admin(["usermod", "-aG", LIBVIRT_GROUP, name], env)
    undo.add(
        f"{name} in the group {LIBVIRT_GROUP}",
        functools.partial(run_admin, ["gpasswd", "--delete", name, LIBVIRT_GROUP], env),
    )
    return "added"


def restart_libvirt(env: Dict[str, str]) -> JsonObj:
    """Restart the libvirt daemons that run now, so they load the hook
    (running guests keep running); a failure is reported, not an install
    failure. `systemctl is-active` prints one state per unit (systemctl(1)),
    whether the unit exists or not; a daemon that does not run loads the hook
    when it starts (socket activation included), so it is left alone."""
    ask = ["systemctl", "is-active", *LIBVIRT_UNITS]
    try:
        states = _admin_process(ask, env, ADMIN_TIMEOUT)
        words = states.stdout.decode(errors="replace").split()
        if len(words) != len(LIBVIRT_UNITS):
            raise _admin_failure(ask, states)
        running = [
            unit for unit, state in zip(LIBVIRT_UNITS, words) if state == "active"
        ]
        if running:
            run_admin(["systemctl", "restart", *running], env)
    except StepError as failure:
        return {"done": False, "message": failure.message}
    if not running:
        return {
            "done": True,
            "restarted": [],
            "message": "neither libvirtd nor virtqemud runs now: libvirt loads "
            "the hook when it starts",
        }
    return {
        "done": True,
        "restarted": running,
        "message": f"restarted {' and '.join(running)}",
    }
