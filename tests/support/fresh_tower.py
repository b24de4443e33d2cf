"""A fresh tower for the guided install: real accounts, real sudo, a real sshd.

The guided install logs in to a tower with an administrator's login, uploads
the agent and runs ``sudo python3 .../gpu_handoff.py install``, which writes to
/etc, /usr/local/bin, /var/lib, /etc/libvirt/hooks and a user's
~/.ssh/authorized_keys. ``FreshTower`` lets that run for real on this machine
without changing it: a keeper process in a private mount namespace lays
overlays over /etc, /usr, /home, /root and /var (their upper layers live in the
tower's directory), a private tmpfs over /run, and then becomes the tower's
``sshd``. Every SSH session, every ``sudo`` and everything they start live in
that namespace; whatever they write lands in the upper layers, which ``stop()``
throws away with the namespace.

Inside, the tower is a Debian host that has just been set up:

- ``/usr/bin/python3`` (the symlink Debian's python3 package makes), and a host
  name in /etc/hosts (sudo complains on stderr without one);
- administrators made with the real tools (``useradd``, ``chpasswd`` with an
  ``openssl passwd -6`` hash, a drop-in under /etc/sudoers.d checked by
  ``visudo -c``), each with a random password and an ed25519 key:
  ``gh-admin`` (sudo without a password), ``gh-admin-pw`` (in the ``sudo``
  group: sudo asks for the password), ``gh-plain`` (no sudo) and ``root``;
- ``sshd`` on 127.0.0.1 with passwords and keys, ``PermitRootLogin yes``,
  ``StrictModes yes``, the default ``.ssh/authorized_keys`` and Debian's SFTP
  server;
- libvirt: a private libvirtd serving the test driver with ``gpu-node`` (cards
  01 and 02) and ``win-1``/``win-2`` (one card each), its socket at
  /run/libvirt/libvirt-sock inside (so every user reaches it);
- ``systemctl`` is the root's own, which reaches no service manager here
  (systemd is not PID 1 and /run is the tower's: outside a chroot it refuses,
  in one it ignores what it is told), so nothing is restarted. A tower whose
  libvirtd.service really restarts (the guided install's
  ``--restart-libvirt``) is the box tower (tests/support/box_tower.py), which
  the guided-install tests and ``scripts/demo --guided`` use; this one serves
  the benchmark (tests/bench/bench_handoff.py), the tests of both towers
  (tests/tower/test_fresh_tower.py) and, with ``private_mounts_argv``, the box.

Not made: the agent's own SSH user (the install's ``--create-user`` makes it).
/tmp is the test process's own (a tmpfs in the test root): what is uploaded
there is visible from both sides, and gone when the test run ends.

    with FreshTower(tmp_path / "tower") as tower:
        admin = tower.admins["gh-admin"]
        ...  # log in to 127.0.0.1:tower.port, run the install
        assert tower.read("/etc/gpu-handoff/config.json") is not None
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
import functools
import hashlib
import os
from pathlib import Path
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from typing import TYPE_CHECKING, Literal, Protocol, Self

from tests.support.sshd import (
    SSH_KEYGEN,
    SSHD,
    _free_port,
    generate_key,
    key_fingerprint,
)

if TYPE_CHECKING:
    from tests.support.libvirtd import LibvirtTestDriver

type Python = Literal["present", "missing", "old"]
type SudoRule = Literal["nopasswd", "password", "none", "root"]

# What the overlays cover: everything an install (and useradd, sudo, sshd's
# login records) may write to.
OVERLAID = ("/etc", "/usr", "/home", "/root", "/var")
# The tower's own /run: sudo's time stamps, sshd's privilege separation
# directory, the libvirt socket; and no /run/systemd/system (systemd is not
# running).
RUN = "/run"
LIBVIRT_RUN = "/run/libvirt"

ADMIN = "gh-admin"
ADMIN_PW = "gh-admin-pw"
PLAIN = "gh-plain"
ROOT = "root"
ACCOUNTS: dict[str, SudoRule] = {
    ADMIN: "nopasswd",
    ADMIN_PW: "password",
    PLAIN: "none",
    ROOT: "root",
}

RUNUSER = "/usr/sbin/runuser"  # not on a user's PATH
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
USER_PATH = "/usr/local/bin:/usr/bin:/bin"

# Paths of the test root an install (or the tower's setup) writes to inside;
# outside they must stay as they were (see root_snapshot).
WATCHED = (
    "/etc/passwd",
    "/etc/group",
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/hosts",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/gpu-handoff",
    "/etc/libvirt/hooks",
    "/etc/python3.14/sitecustomize.py",
    "/usr/local/bin",
    "/usr/bin/python3",
    "/usr/bin/systemctl",
    "/usr/bin/virsh",
    "/home",
    "/root/.ssh",
    "/var/lib/gpu-handoff",
    "/var/lib/sudo",
)

# Keeps the mount namespace alive until the tower is set up, then becomes
# sshd. "ready" tells the parent the namespace exists; "go" on stdin lets it
# go on. Its stdout is a pipe the parent stops reading: sshd's goes to stderr.
_KEEPER = (
    'echo ready; read -r word && [ "$word" = go ] && exec "$@" </dev/null >&2; exit 1'
)

# Version probes of the stand-in for an old Python (python="old").
_OLD_VERSION = (3, 7, 17)
_OLD_PYTHON = f"""#!/bin/sh
# Stand-in for Python {".".join(map(str, _OLD_VERSION))} (tests/support/fresh_tower.py): no old
# Python can be installed in the test root. It runs the installed Python, whose
# sitecustomize reports the old version in sys.version_info.
case "${{1-}}" in
  -V | --version) echo "Python {".".join(map(str, _OLD_VERSION))}"; exit 0 ;;
esac
exec /usr/bin/python3.14 "$@"
"""
_OLD_SITECUSTOMIZE = f"""
# Added by the fresh tower of the tests (python="old"): this tower's Python
# says it is {".".join(map(str, _OLD_VERSION))}.
import collections as _collections
import sys as _sys

_sys.version_info = _collections.namedtuple(
    "version_info", "major minor micro releaselevel serial"
)({_OLD_VERSION[0]}, {_OLD_VERSION[1]}, {_OLD_VERSION[2]}, "final", 0)
_sys.version = "{".".join(map(str, _OLD_VERSION))} " + _sys.version.split(" ", 1)[1]
_sys.hexversion = {(_OLD_VERSION[0] << 24) | (_OLD_VERSION[1] << 16) | (_OLD_VERSION[2] << 8) | 0xF0}
"""


class FreshTowerError(RuntimeError):
    """The fresh tower could not be set up (the message says which step)."""


@dataclass(frozen=True)
class Admin:
    """One login of the tower (``sudo``: what sudo lets it do)."""

    name: str
    password: str
    key_path: Path
    public_key: str
    sudo: SudoRule

    @property
    def home(self) -> str:
        return "/root" if self.name == ROOT else f"/home/{self.name}"


# --- availability --------------------------------------------------------------------


_TOOLS = (
    "unshare",
    "nsenter",
    "mount",
    "useradd",
    "usermod",
    "chpasswd",
    "openssl",
    "visudo",
    "sudo",
    SSH_KEYGEN,
)


@functools.cache
def private_mounts_argv() -> tuple[str, ...] | None:
    """How to start a private mount namespace here, or None.

    ``unshare -m`` makes every mount private first; inside a chroot (the
    test root) that fails, as "/" is no mount point there. Then the mounts
    must already be private (the root's runner made them so), checked in
    /proc/self/mountinfo: a shared mount would pass the overlays on to the
    machine outside.
    """
    if shutil.which("unshare") is None:
        return None
    plain = subprocess.run(
        ["unshare", "-m", "true"], capture_output=True, check=False, timeout=30
    )
    if plain.returncode == 0:
        return ("unshare", "-m")
    mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8")
    if any(
        field.startswith("shared:")
        for line in mountinfo.splitlines()
        for field in line.split(" - ", 1)[0].split()
    ):
        return None
    return ("unshare", "-m", "--propagation", "unchanged")


def fresh_tower_unavailable() -> str | None:
    """Why no fresh tower can be made here, or None when one can."""
    if os.geteuid() != 0:
        return "a fresh tower needs the tests to run as root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    missing += [path for path in (SSHD, RUNUSER) if not Path(path).exists()]
    if missing:
        return f"a fresh tower needs {', '.join(missing)}"
    if not Path("/etc/sudoers").exists():
        return "a fresh tower needs sudo's /etc/sudoers"
    filesystems = Path("/proc/filesystems").read_text(encoding="utf-8").split()
    if "overlay" not in filesystems:
        return "a fresh tower needs overlayfs"
    if private_mounts_argv() is None:
        return "a fresh tower needs a private mount namespace (unshare -m)"
    return None


def fresh_tower_available() -> bool:
    """Whether a fresh tower can be made here."""
    return fresh_tower_unavailable() is None


def require_fresh_tower() -> None:
    """Skip the test without a fresh tower; fail when the system must have one
    (``GPU_HANDOFF_REQUIRE_SYSTEM``), as tests/support/account.py does."""
    import pytest  # only the tests that want a tower need it

    reason = fresh_tower_unavailable()
    if reason is None:
        return
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM)")
    pytest.skip(reason)


# --- what must not leak ----------------------------------------------------------------


def root_snapshot(paths: Iterable[str] = WATCHED) -> dict[str, object]:
    """What ``paths`` hold in this process's view: for a file its type, mode,
    owner and content hash; for a directory the same for every entry below it
    (so a listing changes with any file added, removed or changed)."""
    return {path: _describe_tree(Path(path)) for path in paths}


def _describe_tree(path: Path) -> object:
    if not path.is_dir() or path.is_symlink():
        return _describe(path)
    entries: dict[str, object] = {".": _describe(path)}
    for directory, dirnames, filenames in os.walk(path):
        for name in sorted([*dirnames, *filenames]):
            full = Path(directory) / name
            entries[str(full.relative_to(path))] = _describe(full)
    return entries


def _describe(path: Path) -> object:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    kind = stat.S_IFMT(info.st_mode)
    detail: str | None = None
    if stat.S_ISLNK(info.st_mode):
        detail = str(path.readlink())
    elif stat.S_ISREG(info.st_mode):
        detail = hashlib.sha256(path.read_bytes()).hexdigest()
    return (kind, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, detail)


# --- the tower ----------------------------------------------------------------------


class FreshTower:
    """A freshly set-up Debian tower in a private mount namespace (see the
    module's docstring); a context manager.

    Knobs, each changing only the namespace's view:

    - ``libvirt=False``: no libvirtd at all; ``uri`` is then ``qemu:///system``,
      which fails from the tower as on a host that is no libvirt host;
    - ``running``: the domains that run when the tower starts;
    - ``python="missing"``: no ``/usr/bin/python3*`` at all (whiteouts);
      ``python="old"``: ``/usr/bin/python3`` is a stand-in that answers version
      probes (``sys.version_info``, ``sys.version``, ``sys.hexversion``,
      ``--version``) as Python 3.7: no old Python can be installed in the test
      root, so it runs the installed 3.14, which stays on disk;
    - ``virsh=False``: no ``/usr/bin/virsh``;
    - ``read_only_usr_local=True``: /usr/local is mounted read-only;
    - ``port``: sshd's port (a free one by default).
    """

    def __init__(
        self,
        directory: Path,
        *,
        libvirt: bool = True,
        running: tuple[str, ...] = ("gpu-node",),
        python: Python = "present",
        virsh: bool = True,
        read_only_usr_local: bool = False,
        port: int = 0,
    ) -> None:
        self.directory = directory
        self.with_libvirt = libvirt
        self.running = running
        self.python = python
        self.with_virsh = virsh
        self.read_only_usr_local = read_only_usr_local
        self.port = port
        self.admins: dict[str, Admin] = {}
        self.libvirt: LibvirtTestDriver | None = None
        self.keeper: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._namespace: str | None = None
        self._hashes: dict[str, str] = {}
        self._owns_directory = False

    # -- what tests read

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def host_key(self) -> Path:
        return self.directory / "host_key"

    @property
    def host_public_key(self) -> str:
        """sshd's host key line (``ssh-ed25519 AAAA...``)."""
        return self.host_key.with_suffix(".pub").read_text(encoding="utf-8").strip()

    @property
    def host_fingerprint(self) -> str:
        """The host key's SHA256 fingerprint as ``ssh-keygen -l`` prints it."""
        return key_fingerprint(self.host_key)

    @property
    def log(self) -> str:
        """What sshd logged so far (and the keeper's errors)."""
        return "".join(
            path.read_text("utf-8", "replace")
            for path in (self.directory / "keeper.log", self.directory / "sshd.log")
            if path.exists()
        )

    @property
    def uri(self) -> str:
        """The libvirt URI that reaches the tower's libvirt from inside (any user)."""
        if not self.with_libvirt:
            return "qemu:///system"
        return f"test+unix:///default?socket={LIBVIRT_RUN}/libvirt-sock"

    @property
    def pid(self) -> int:
        """The keeper's (sshd's) process id: ``nsenter -t PID -m -r -w`` enters."""
        if self.keeper is None:
            raise FreshTowerError("the tower is not running")
        return self.keeper.pid

    def nsenter_argv(self, user: str = ROOT) -> list[str]:
        """The argv prefix that runs a command inside the tower as ``user``."""
        argv = ["nsenter", "-t", str(self.pid), "-m", "-r", "-w", "--"]
        if user != ROOT:
            argv += [RUNUSER, "-u", user, "--"]
        return argv

    def run(
        self,
        argv: list[str],
        user: str = ROOT,
        *,
        stdin: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the tower as ``user`` (runuser: its groups, its
        HOME), with the PATH a login of that user has. Never raises on a
        failure of the command."""
        env = {
            "PATH": ROOT_PATH if user == ROOT else USER_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
        }
        return subprocess.run(
            [*self.nsenter_argv(user), *argv],
            input=stdin if stdin is not None else "",
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def read(self, path: str) -> str | None:
        """The text of ``path`` inside the tower (read as root), or None when
        there is no such file."""
        done = self.run(["cat", "--", path])
        if done.returncode == 0:
            return done.stdout
        if "No such file or directory" in done.stderr:
            return None
        raise FreshTowerError(f"cannot read {path} in the tower: {done.stderr}")

    # -- start and stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> Self:
        """Set the tower up; on any failure everything made so far is undone."""
        began = time.monotonic()
        self._check_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._owns_directory = True
        try:
            self._make_keys()
            self._start_keeper()
            self._mount()
            self._start_libvirt()
            self._prepare_files()
            self._make_accounts()
            self._write_sshd_config()
            if self.read_only_usr_local:
                self._mount_read_only("/usr/local")
            self._serve(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop sshd, every process still in the namespace (sessions, what
        they left running) and libvirtd; remove the directory. Safe to call
        after a failed start, and more than once."""
        libvirt, self.libvirt = self.libvirt, None
        if libvirt is not None:
            libvirt.stop()
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            if keeper.poll() is None:
                keeper.terminate()
            self._kill_namespace()
            try:
                keeper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                keeper.kill()
                keeper.wait()
            for pipe in (keeper.stdin, keeper.stdout):
                if pipe is not None:
                    pipe.close()
        self._kill_namespace()  # what the last sessions started meanwhile
        self._namespace = None  # its number may be given to another one now
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._owns_directory = False

    def _kill_namespace(self) -> None:
        """SIGKILL every process in the tower's mount namespace until none is left."""
        if self._namespace is None:
            return
        for _ in range(50):
            pids = [pid for pid in _all_pids() if _namespace_of(pid) == self._namespace]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            time.sleep(0.02)
        raise FreshTowerError("processes of the tower survived SIGKILL")

    # -- the steps of start()

    def _check_directory(self) -> None:
        """Refuse a directory overlay options cannot name, one under an
        overlaid tree, or one that holds anything (stop() removes it)."""
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"a fresh tower's directory must be new: {self.directory}")
        path = str(self.directory.resolve())
        # Overlay mount options are comma and colon separated.
        if any(char in path for char in ",:\\") or any(char.isspace() for char in path):
            raise ValueError(f"a fresh tower's directory must be a plain path: {path}")
        for target in OVERLAID:
            if path == target or path.startswith(target + "/"):
                raise ValueError(f"a fresh tower's directory cannot be under {target}")

    def _make_keys(self) -> None:
        generate_key(self.host_key)
        self.admins, self._hashes = make_logins(self.directory)

    def _start_libvirt(self) -> None:
        if not self.with_libvirt:
            return
        from tests.support.libvirtd import LibvirtTestDriver
        from tests.tower import nodes

        directory = self.directory / "libvirtd"
        directory.mkdir()
        self.libvirt = LibvirtTestDriver(directory)
        # libvirtd runs inside: it looks its clients' uids up in the tower's
        # /etc/passwd (a user made by the install exists only there).
        self.libvirt.argv = [*self.nsenter_argv(), "libvirtd"]
        self.libvirt.sock_dir.mkdir(mode=0o755)  # every user reaches the socket
        self._inside("mkdir", "-m", "0755", LIBVIRT_RUN)
        self._inside("mount", "--bind", str(self.libvirt.sock_dir), LIBVIRT_RUN)
        self.libvirt.start()
        for name, devices in nodes.domains().items():
            self.libvirt.define(
                nodes.domain_xml(name, devices, running=True, test_driver_file=False)
            )
        for name in self.running:
            self.libvirt.virsh("start", name, check=True)

    def _start_keeper(self) -> None:
        argv = private_mounts_argv()
        if argv is None:
            raise FreshTowerError(str(fresh_tower_unavailable()))
        with (self.directory / "keeper.log").open("wb") as log:
            self.keeper = subprocess.Popen(
                [
                    *argv,
                    "/bin/sh",
                    "-c",
                    _KEEPER,
                    "fresh-tower",
                    SSHD,
                    "-D",
                    "-e",
                    "-f",
                    str(self.directory / "sshd_config"),
                    "-E",
                    str(self.directory / "sshd.log"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd="/",
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            )
        assert self.keeper.stdout is not None
        if self.keeper.stdout.readline() != b"ready\n":
            raise FreshTowerError(f"the keeper did not start: {self.log}")
        self._namespace = _namespace_of(self.keeper.pid)
        if self._namespace is None or self._namespace == _namespace_of(os.getpid()):
            raise FreshTowerError("the keeper has no mount namespace of its own")

    def _mount(self) -> None:
        for target in OVERLAID:
            layers = self.directory / "overlay" / target.strip("/")
            upper, work = layers / "upper", layers / "work"
            upper.mkdir(parents=True)
            work.mkdir()
            # The overlay's top directory takes the upper layer's owner and
            # mode: /home must stay 0755 for sshd's StrictModes, /root 0700.
            info = Path(target).stat()
            os.chown(upper, info.st_uid, info.st_gid)
            upper.chmod(stat.S_IMODE(info.st_mode))
            self._inside(
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={target},upperdir={upper},workdir={work}",
                target,
            )
        self._inside("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", RUN)
        self._inside("mkdir", "-m", "0755", "/run/sshd")

    def _mount_read_only(self, path: str) -> None:
        self._inside("mount", "--bind", path, path)
        self._inside("mount", "-o", "remount,bind,ro", path)

    def _prepare_files(self) -> None:
        prepare_files(
            Path(f"/proc/{self.pid}/root"),
            socket.gethostname(),
            python=self.python,
            virsh=self.with_virsh,
        )

    def _make_accounts(self) -> None:
        make_accounts(
            self._inside,
            Path(f"/proc/{self.pid}/root"),
            self.admins,
            self._hashes,
        )

    def _write_sshd_config(self) -> None:
        self.port = self.port or _free_port()
        (self.directory / "sshd_config").write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.host_key}",
                    f"PidFile {RUN}/sshd.pid",
                    # No PAM: no logind to register sessions with here.
                    "UsePAM no",
                    *SSHD_SETTINGS,
                    "Subsystem sftp /usr/lib/openssh/sftp-server",  # as Debian ships it
                    "",
                ]
            ),
            encoding="utf-8",
        )

    def _serve(self, timeout: float) -> None:
        keeper = self.keeper
        assert keeper is not None
        assert keeper.stdin is not None
        keeper.stdin.write(b"go\n")
        keeper.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if keeper.poll() is not None:
                raise FreshTowerError(
                    f"sshd exited with {keeper.returncode}: {self.log}"
                )
            # Its own word, not just an open port: another program may hold it.
            if f"Server listening on {self.host} port {self.port}." in self.log:
                with socket.create_connection((self.host, self.port), timeout=5):
                    return
            time.sleep(0.02)
        raise FreshTowerError(f"sshd did not listen on port {self.port}: {self.log}")

    def _inside(
        self, *argv: str, user: str = ROOT, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a setup step inside; any failure fails the start."""
        done = self.run(list(argv), user, stdin=stdin)
        if done.returncode != 0:
            raise FreshTowerError(
                f"{argv[0]} failed in the tower ({done.returncode}): "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done


# What sshd allows on a fresh tower (both kinds, tests/support/box_tower.py
# too): password and key logins, root's included, and strict modes.
SSHD_SETTINGS = (
    "PasswordAuthentication yes",
    "KbdInteractiveAuthentication no",
    "PubkeyAuthentication yes",
    "PermitRootLogin yes",
    "StrictModes yes",
    "AuthorizedKeysFile .ssh/authorized_keys",
    "LogLevel VERBOSE",
)


class Inside(Protocol):
    """Runs a setup step inside a tower as ``user``; raises on a failure."""

    def __call__(
        self, *argv: str, user: str = ..., stdin: str | None = ...
    ) -> subprocess.CompletedProcess[str]: ...


def make_logins(directory: Path) -> tuple[dict[str, Admin], dict[str, str]]:
    """Every account's login: a random password and an ed25519 key pair in
    ``directory``; (the logins by name, the passwords' crypt hashes)."""
    passwords = {name: secrets.token_urlsafe(18) for name in ACCOUNTS}
    hashes = _password_hashes(passwords)
    admins = {
        name: Admin(
            name=name,
            password=passwords[name],
            key_path=directory / f"{name}_key",
            public_key=generate_key(directory / f"{name}_key"),
            sudo=rule,
        )
        for name, rule in ACCOUNTS.items()
    }
    return admins, hashes


def prepare_files(root: Path, hostname: str, *, python: Python, virsh: bool) -> None:
    """The host name in /etc/hosts (sudo complains on stderr without it),
    ``/usr/bin/python3`` as asked, and ``virsh`` (or not), in the tower whose
    root is ``root`` (as this process sees it)."""
    hosts = root / "etc/hosts"
    text = hosts.read_text(encoding="utf-8")
    if hostname not in text.split():
        hosts.write_text(
            text + ("" if text.endswith("\n") else "\n") + f"127.0.1.1\t{hostname}\n",
            encoding="utf-8",
        )
    bin_dir = root / "usr/bin"
    if python == "present":
        (bin_dir / "python3").symlink_to("python3.14")
    elif python == "missing":
        for program in bin_dir.glob("python3*"):
            program.unlink()  # a whiteout in the upper layer
    else:
        _write_program(bin_dir / "python3", _OLD_PYTHON)
        sitecustomize = root / "etc/python3.14/sitecustomize.py"
        with sitecustomize.open("a", encoding="utf-8") as handle:
            handle.write(_OLD_SITECUSTOMIZE)
    if not virsh:
        (bin_dir / "virsh").unlink()


def make_accounts(
    inside: Inside, root: Path, admins: dict[str, Admin], hashes: dict[str, str]
) -> None:
    """The administrators, made with the real tools (see the module's
    docstring), each with its key in its own ``~/.ssh/authorized_keys``."""
    for name in (ADMIN, ADMIN_PW, PLAIN):
        inside("useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name)
    inside("usermod", "--append", "--groups", "sudo", ADMIN_PW)
    inside(
        "chpasswd",
        "--encrypted",
        stdin="".join(f"{name}:{hashes[name]}\n" for name in ACCOUNTS),
    )
    drop_in = root / f"etc/sudoers.d/{ADMIN}"
    drop_in.write_text(f"{ADMIN} ALL=(ALL:ALL) NOPASSWD: ALL\n", encoding="utf-8")
    drop_in.chmod(0o440)
    inside("visudo", "--check")
    for admin in admins.values():
        # As ssh-copy-id does it: the user's own files, the user's modes.
        inside(
            "sh",
            "-c",
            'umask 077 && mkdir -p "$HOME/.ssh" && cat >> "$HOME/.ssh/authorized_keys"',
            user=admin.name,
            stdin=admin.public_key + "\n",
        )


def _password_hashes(passwords: dict[str, str]) -> dict[str, str]:
    """``openssl passwd -6`` hashes (SHA-512 crypt), passwords on stdin."""
    done = subprocess.run(
        ["openssl", "passwd", "-6", "-stdin"],
        input="".join(f"{password}\n" for password in passwords.values()),
        capture_output=True,
        text=True,
        check=True,
    )
    hashes = done.stdout.split()
    if len(hashes) != len(passwords):
        raise FreshTowerError("openssl passwd did not give one hash per password")
    return dict(zip(passwords, hashes, strict=True))


def _write_program(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


def _all_pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _namespace_of(pid: int) -> str | None:
    try:
        return str(Path(f"/proc/{pid}/ns/mnt").readlink())
    except OSError:
        return None


__all__ = [
    "ACCOUNTS",
    "ADMIN",
    "ADMIN_PW",
    "PLAIN",
    "ROOT",
    "SSHD_SETTINGS",
    "WATCHED",
    "Admin",
    "FreshTower",
    "FreshTowerError",
    "fresh_tower_available",
    "fresh_tower_unavailable",
    "make_accounts",
    "make_logins",
    "prepare_files",
    "require_fresh_tower",
    "root_snapshot",
]
