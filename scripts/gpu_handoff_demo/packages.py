"""The packages Home Assistant's own integrations import beyond the test tool
chain (its frontend first): ``requirements_demo.txt``, installed once per
file content into a cached ``--target`` directory that only Home Assistant's
process puts on its path.

Two demos started at once (or a demo and the test suite's demo test) would
both install into the same partial directory: a lock file serialises them,
and the second finds the first one's result.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import fcntl
import hashlib
from pathlib import Path
import shutil
import subprocess
import sys

from .output import log
from .places import REPO, cache_dir, shown

REQUIREMENTS_DEMO = REPO / "requirements_demo.txt"


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (created if missing)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another demo is installing the frontend packages: waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def frontend_packages() -> Path | None:
    """The installed directory; None when pip cannot install the file."""
    stamp = hashlib.sha256(REQUIREMENTS_DEMO.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"packages-{stamp}"
    if (target / ".complete").exists():
        return target
    with _locked(cache_dir() / "packages.lock"):
        if (target / ".complete").exists():
            return target
        log(f"installing the Home Assistant frontend into {shown(target)} (once)")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--target",
                str(partial),
                "-r",
                str(REQUIREMENTS_DEMO),
            ],
            check=False,
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            return None
        (partial / ".complete").write_text(stamp, encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return target
