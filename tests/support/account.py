"""The unprivileged account of the tower agent's tests: the real privilege split.

On a tower, Home Assistant's SSH user is not root, and libvirtd runs the qemu
hook (and so whatever the hook starts) as root. ``scripts/_common.sh`` creates
the account ``gpu-handoff-user`` (a home, a shell, no password) when it
provisions the Debian root. Tests that need the split skip without root or
without the account, and fail instead under ``GPU_HANDOFF_REQUIRE_SYSTEM``.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import os
from pathlib import Path
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest

SPLIT_USER = "gpu-handoff-user"


def split_account() -> pwd.struct_passwd:
    """The unprivileged account; skips (or fails, when required) without it."""
    reason = None
    account = None
    if os.geteuid() != 0:
        reason = "the privilege split needs the tests to run as root"
    else:
        try:
            account = pwd.getpwnam(SPLIT_USER)
        except KeyError:
            reason = f"no account {SPLIT_USER!r} (scripts/_common.sh makes it)"
    if account is None:
        if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
            pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM)")
        pytest.skip(str(reason))
    return account


@contextlib.contextmanager
def shared_dir(prefix: str = "gh-split-") -> Iterator[Path]:
    """A fresh directory of root's that every user may enter (0755), removed
    afterwards (pytest's own are 0700: the account could not reach them)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def give(path: Path, account: pwd.struct_passwd, mode: int) -> Path:
    """Make ``path`` the account's, with ``mode``."""
    os.chown(path, account.pw_uid, account.pw_gid)
    path.chmod(mode)
    return path


def user_env(account: pwd.struct_passwd) -> dict[str, str]:
    """The environment a login of the account has (as sshd gives it)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": account.pw_dir,
        "USER": account.pw_name,
        "LOGNAME": account.pw_name,
        "LANG": "C.UTF-8",
    }


def as_user(
    account: pwd.struct_passwd, argv: list[str], *, stdin: str = "", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the account (its uid, its gid, no other group)."""
    return subprocess.run(
        argv,
        input=stdin,
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
        env=user_env(account),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def python_as_user(
    account: pwd.struct_passwd, code: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` as the account (``sys.argv[1:]`` are ``args``);
    fails the test if it fails."""
    done = as_user(account, [sys.executable, "-c", code, *args])
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done
