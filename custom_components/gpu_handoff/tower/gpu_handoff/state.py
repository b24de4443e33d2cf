"""The state directory and its trust rules.

The directory belongs to the user the agent runs as (Home Assistant's SSH
user) and nobody else may write to it. Every file in it is reached from a
directory descriptor without following symbolic links; run as root, the agent
first becomes the directory's owner (``act_as_state_owner``). The agent's own
log of unexpected errors lives here too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import stat

from .config import Config
from .wire import ERR_INTERNAL, ERR_STATE_DIR_UNSAFE, AgentError, JsonObj, now_iso

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Iterator, List, Optional, Tuple

#
# The state directory belongs to the user the agent runs as, and nobody else
# may write to it: the agent refuses it otherwise (state_dir_unsafe). Root never
# works in it as root: act_as_state_owner() makes the process the directory's
# owner first. Below it, every file is reached from a directory descriptor and
# never through a symbolic link (O_NOFOLLOW), new files are made with O_EXCL and
# their mode set on the descriptor, and only names the agent writes itself are
# ever removed.

STATE_DIR_MODE = 0o700
STATE_FILE_MODE = 0o600
MAX_STATE_FILE = 1 << 20
CLAIMS_FILE = "claims.json"
ALIASES_FILE = "aliases.json"
MAX_ALIASES = 200
AGENT_LOG = "agent.log"
AGENT_LOG_MAX = 256 << 10
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)
_NEW_FILE = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _unsafe(message: str) -> AgentError:
    return AgentError(ERR_STATE_DIR_UNSAFE, message)


def check_state_dir_fd(fd: int, where: str) -> None:
    """A state directory (or one below it) must be this user's, and only theirs
    to write to."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(f"{where} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise _unsafe(
            f"{where} belongs to uid {st.st_uid}, not to uid {uid} that runs the "
            "agent: chown it to that user"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise _unsafe(
            f"{where} is writable by its group or by others (mode {mode:04o}): "
            f"chmod go-w {where}"
        )


def _open_subdir(parent: int, name: str, where: str, create: bool) -> Optional[int]:
    for _ in range(2):
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, STATE_DIR_MODE, dir_fd=parent)
            continue
        except OSError as err:
            if err.errno in _LINK_ERRNOS:
                raise _unsafe(
                    f"{where} is not a directory (a symbolic link?); the agent "
                    "made no such thing: remove it"
                ) from None
            raise
        try:
            check_state_dir_fd(fd, where)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise _unsafe(f"cannot make {where}")


def open_state_dir(state_dir: str, sub: str = "", create: bool = True) -> Optional[int]:
    """A descriptor of the checked state directory, or of its subdirectory
    `sub`; None when it is missing and `create` is false."""
    try:
        try:
            top = os.open(state_dir, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
            os.makedirs(state_dir, mode=STATE_DIR_MODE, exist_ok=True)
            top = os.open(state_dir, _DIR_FLAGS)
    except OSError as err:
        raise _unsafe(
            f"cannot open the state directory {state_dir}: {err.strerror or err}"
        ) from None
    try:
        check_state_dir_fd(top, state_dir)
        if not sub:
            return top
        fd = _open_subdir(top, sub, os.path.join(state_dir, sub), create)
    except BaseException:
        os.close(top)
        raise
    os.close(top)
    return fd


@contextlib.contextmanager
def state_dir_fd(state_dir: str, sub: str = "") -> Iterator[int]:
    """The state directory (or `sub` below it), made if missing."""
    fd = open_state_dir(state_dir, sub, create=True)
    if fd is None:  # pragma: no cover - create=True makes it or raises
        raise _unsafe(f"cannot make {os.path.join(state_dir, sub)}")
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def existing_state_fd(state_dir: str, sub: str = "") -> Iterator[Optional[int]]:
    """The state directory (or `sub` below it) if it exists; else None."""
    fd = open_state_dir(state_dir, sub, create=False)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _exists_at(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _read_at(dfd: int, name: str) -> Optional[bytes]:
    """A regular file's bytes (at most MAX_STATE_FILE); None otherwise."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: List[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_STATE_FILE:
                return None
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_json_at(dfd: int, name: str) -> Optional[Any]:
    data = _read_at(dfd, name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_json_at(dfd: int, name: str, data: Any) -> None:
    """Replace `name` in the directory atomically (see replace_file_at), as a
    state record: mode 0600, not synced (a record lost with the machine is
    read as missing, and every reader copes with that)."""
    payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    replace_file_at(dfd, name, payload, STATE_FILE_MODE, durable=False)


def open_file_at(dfd: int, name: str, flags: int, where: str) -> int:
    """A regular file opened (made if missing) in the directory, mode 0600,
    never through a symbolic link."""
    try:
        fd = os.open(name, flags | _NEW_FILE, STATE_FILE_MODE, dir_fd=dfd)
    except OSError as err:
        if err.errno in _LINK_ERRNOS:
            raise _unsafe(
                f"{where} is a symbolic link; the agent made no such thing: remove it"
            ) from None
        if err.errno == errno.ENXIO:  # a FIFO or socket nobody reads
            raise _unsafe(
                f"{where} is not a regular file; the agent made no such thing"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _unsafe(f"{where} is not a regular file; the agent made no such thing")
    return fd


def open_lock_at(dfd: int, name: str, where: str) -> int:
    """A lock file's descriptor (see open_file_at); flock it."""
    return open_file_at(dfd, name, os.O_RDWR, where)


def _split_state_path(path: str, state_dir: str) -> Tuple[str, str]:
    """(subdirectory or "", name) of a file of the state directory."""
    parts = os.path.relpath(path, state_dir).split(os.sep)
    if len(parts) > 2 or any(p in ("", os.curdir, os.pardir) for p in parts):
        raise AgentError(ERR_INTERNAL, f"{path} is not in the state directory")
    return (parts[0] if len(parts) == 2 else ""), parts[-1]


def write_json_atomic(path: str, data: Any, state_dir: str) -> None:
    """write_json_at for a path in the state directory."""
    sub, name = _split_state_path(path, state_dir)
    with state_dir_fd(state_dir, sub) as dfd:
        write_json_at(dfd, name, data)


def act_as_state_owner(cfg: Config) -> None:
    """As root, become the state directory's owner for good before touching it:
    nothing its owner planted there (a symbolic link, a rewritten record) can
    then make root do more than its owner could."""
    if os.geteuid() != 0:
        return
    try:
        st = os.stat(cfg.state_dir)
    except OSError:
        return  # made by root, for root (install makes it for its user)
    if st.st_uid != 0:
        drop_privileges(st.st_uid, st.st_gid, cfg.env)


def drop_privileges(uid: int, gid: int, env: Dict[str, str]) -> None:
    """Become `uid` for good: its groups, then its gid, then its uid."""
    try:
        account: Optional[pwd.struct_passwd] = pwd.getpwuid(uid)
    except KeyError:
        account = None
    try:
        if account is not None:
            os.initgroups(account.pw_name, account.pw_gid)
            os.setgid(account.pw_gid)
        else:
            os.setgroups([])
            os.setgid(gid)
        os.setuid(uid)
    except OSError as err:
        raise _unsafe(
            f"cannot become uid {uid}, the state directory's owner: "
            f"{err.strerror or err}"
        ) from None
    if (os.getuid(), os.geteuid()) != (uid, uid):  # pragma: no cover - setuid said so
        raise _unsafe(f"could not become uid {uid}, the state directory's owner")
    for key in (
        "XDG_RUNTIME_DIR",
        "XDG_CONFIG_HOME",
        "XDG_CACHE_HOME",
        "DBUS_SESSION_BUS_ADDRESS",
    ):
        env.pop(key, None)
    if account is not None:
        env["HOME"] = account.pw_dir
        env["USER"] = env["LOGNAME"] = account.pw_name
    runtime = f"/run/user/{uid}"
    if os.path.isdir(runtime):  # its systemd user manager, if it lingers
        env["XDG_RUNTIME_DIR"] = runtime


def _append_log(dfd: int, text: str) -> None:
    with contextlib.suppress(OSError):
        if (
            os.stat(AGENT_LOG, dir_fd=dfd, follow_symlinks=False).st_size
            > AGENT_LOG_MAX
        ):
            os.replace(AGENT_LOG, AGENT_LOG + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
    fd = open_file_at(dfd, AGENT_LOG, os.O_WRONLY | os.O_APPEND, AGENT_LOG)
    try:
        _write_all(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def log_internal(cfg: Optional[Config], where: str, err: BaseException) -> str:
    """Log an unexpected error on the tower; the incident id to answer with.

    The log is STATE_DIR/agent.log (0600; past 256 KiB it moves to agent.log.1);
    without a usable state directory, syslog (tag gpu-handoff). The client only
    learns the incident id: never the exception's text.
    """
    import traceback  # 17 ms of every start, needed only here

    incident = os.urandom(4).hex()
    detail = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    text = (
        f"{now_iso()} [{os.getpid()}] internal error {incident} in {where}:\n{detail}"
    )
    if cfg is not None:
        try:
            with existing_state_fd(cfg.state_dir) as dfd:
                if dfd is not None:
                    _append_log(dfd, text)
                    return incident
        except Exception:  # noqa: BLE001, S110 - syslog below, then
            pass
    try:
        import syslog  # only needed here

        syslog.openlog("gpu-handoff", syslog.LOG_PID, syslog.LOG_USER)
        for line in text.splitlines():
            syslog.syslog(syslog.LOG_ERR, line)
    except Exception:  # noqa: BLE001, S110 - nowhere left to log to
        pass
    return incident


def internal_error(incident: str) -> JsonObj:
    """The `error` a client gets for an unexpected error: a code and an id."""
    return {
        "code": ERR_INTERNAL,
        "message": f"internal error {incident}; the details are in the tower's log",
    }


def claims_cache_path(cfg: Config) -> str:
    return os.path.join(cfg.state_dir, CLAIMS_FILE)


def replace_file_at(
    dfd: int, name: str, data: bytes, mode: int, durable: bool = True
) -> None:
    """`name` in the directory holds `data` with `mode`, atomically: a new file
    (O_EXCL, never through a link) written, renamed over the old name (a
    symbolic link there is replaced, never followed), and, when `durable`,
    synced first and the rename synced after. On failure the old file is as
    it was and the new one is removed."""
    tmp = f".tmp-{os.urandom(8).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_EXCL | _NEW_FILE, 0o600, dir_fd=dfd)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if durable:
        with contextlib.suppress(OSError):
            os.fsync(dfd)  # the rename, on disk
