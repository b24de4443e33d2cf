"""Where the demo keeps things, and how the user's machine names those places.

Everything the demo downloads or writes lives in the project's cache: the
frontend packages once, and one directory per run (configuration, logs, the
simulated towers) that the user can open while the demo runs and that
``--keep`` keeps. On a machine where the scripts run inside the Debian root,
the cache is mounted at another path in there (and the repository at
``/src``); ``scripts/demo`` then tells the demo where both are on the machine
itself, so that the paths it prints can be opened there.
"""

from __future__ import annotations

import os
from pathlib import Path
import tempfile
import time

# The cache as this process sees it (set inside the Debian root).
CACHE_ENV = "GPU_HANDOFF_CACHE_DIR"
# The same directories as the user's machine names them (set by scripts/demo).
HOST_CACHE_ENV = "GPU_HANDOFF_HOST_CACHE_DIR"
HOST_REPO_ENV = "GPU_HANDOFF_HOST_REPO_DIR"
REPO = Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """The project's cache directory, as this process sees it."""
    base = os.environ.get(CACHE_ENV)
    return Path(base) if base else Path.home() / ".cache" / "gpu-handoff"


def cache_dir() -> Path:
    """The demo's part of the cache."""
    return cache_root() / "demo"


def new_run_dir() -> Path:
    """A new, empty directory for one run, named by its start time."""
    runs = cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))


def _mounts() -> list[tuple[Path, Path]]:
    """(inside, on the machine) for each directory mounted elsewhere."""
    pairs = ((cache_root(), HOST_CACHE_ENV), (REPO, HOST_REPO_ENV))
    return [
        (inside.resolve(), Path(host))
        for inside, env in pairs
        if (host := os.environ.get(env))
    ]


def shown(path: Path) -> str:
    """``path`` as the user's machine names it (outside the Debian root)."""
    for inside, host in _mounts():
        if path.resolve().is_relative_to(inside):
            return str(host / path.resolve().relative_to(inside))
    return str(path)


def reachable(path: Path) -> bool:
    """Whether the user's machine sees ``path`` too: anywhere where the
    scripts run on the machine itself, else under the cache or the repository."""
    mounts = _mounts()
    return not mounts or any(path.resolve().is_relative_to(i) for i, _ in mounts)
