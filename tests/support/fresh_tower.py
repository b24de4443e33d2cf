"""The fresh tower's accounts and files, shared: a Debian tower as it is
right after its set-up, before GPU Handoff.

The guided install's fresh tower is ``BoxFreshTower``
(tests/support/box_tower.py: the test root booted in a box under its own
systemd, whose ssh.service and libvirtd.service are the tower's). What its
set-up makes, and the tests read, is here:

- the logins (``make_logins``) and the accounts (``make_accounts``):
  administrators made with the real tools (``useradd``, ``chpasswd`` with an
  ``openssl passwd -6`` hash, a drop-in under /etc/sudoers.d checked by
  ``visudo -c``), each with a random password and an ed25519 key in its own
  ``~/.ssh/authorized_keys``: ``gh-admin`` (sudo without a password),
  ``gh-admin-pw`` (in the ``sudo`` group: sudo asks for the password),
  ``gh-plain`` (no sudo) and ``root``;
- the files (``prepare_files``): the host name in /etc/hosts (sudo complains
  on stderr without one), ``/usr/bin/python3`` (the symlink Debian's python3
  package makes; or none, or a stand-in that reports Python 3.7) and
  ``virsh`` (or none);
- what its sshd allows (``SSHD_SETTINGS``: passwords and keys,
  ``PermitRootLogin yes``, ``StrictModes yes``, the default
  ``.ssh/authorized_keys``), and the PATH a login of root or of a user has.

And two helpers of the tests around it: ``root_snapshot``, what the test
root holds at the paths an install writes to (``WATCHED``), which a tower
must leave as they were; and ``private_mounts_argv``, how to start a private
mount namespace here (tests/support/box.py's launcher, and
tests/tower/test_install.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
import functools
import hashlib
import os
from pathlib import Path
import secrets
import shutil
import stat
import subprocess
from typing import Literal, Protocol

from tests.support.sshd import generate_key

type Python = Literal["present", "missing", "old"]
type SudoRule = Literal["nopasswd", "password", "none", "root"]

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


# --- mount namespaces and what must not leak ------------------------------------------


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


# --- the tower's set-up ---------------------------------------------------------------


# What sshd allows on the fresh tower (tests/support/box_tower.py writes them
# in a drop-in): password and key logins, root's included, and strict modes.
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
        raise RuntimeError("openssl passwd did not give one hash per password")
    return dict(zip(passwords, hashes, strict=True))


def _write_program(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


__all__ = [
    "ACCOUNTS",
    "ADMIN",
    "ADMIN_PW",
    "PLAIN",
    "ROOT",
    "ROOT_PATH",
    "SSHD_SETTINGS",
    "USER_PATH",
    "WATCHED",
    "Admin",
    "Inside",
    "Python",
    "SudoRule",
    "make_accounts",
    "make_logins",
    "prepare_files",
    "private_mounts_argv",
    "root_snapshot",
]
