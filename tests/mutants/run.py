"""Apply a named mutant to a scratch copy of the repository and run, there, the
tests that should notice it.

The copy lives under ``.scratch/mutants/`` (inside the repository, which the
provisioned environment always sees) and is removed afterwards. Verdicts:
``killed`` (a test failed), ``survived`` (all passed: the suite does not
protect that promise), ``stale`` (the patch's text is not in the file exactly
once: the code moved on, update the mutant) and ``error`` (the tests could not
run: collection failed, or they ran into the time limit).
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path
import shutil
import subprocess
import sys
import tempfile
import time

from .catalog import Mutant

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = frozenset(
    {
        ".git",
        ".venv",
        ".scratch",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        "__pycache__",
        "htmlcov",
    }
)
TIMEOUT = 900.0
PYTEST_FAILED = 1  # pytest's exit code when a test failed


class StaleMutantError(Exception):
    """A patch's text is not in its file exactly once."""


@dataclass(frozen=True)
class Result:
    """What became of one mutant."""

    mutant: Mutant
    verdict: str  # killed | survived | stale | error
    seconds: float
    detail: str = ""

    def line(self) -> str:
        text = f"{self.verdict:<8} {self.mutant.name:<34} {self.seconds:6.1f} s"
        return f"{text}  {self.detail}" if self.detail else text


def _ignore(directory: str, names: list[str]) -> list[str]:
    return [
        name
        for name in names
        if name in SKIP_DIRS or name.startswith(".coverage") or name.endswith(".pyc")
    ]


def scratch_copy(destination: Path, source: Path = REPO) -> None:
    """The repository without its caches, history and scratch files."""
    shutil.copytree(source, destination, ignore=_ignore, symlinks=True)


def stale_patches(mutant: Mutant, root: Path = REPO) -> list[str]:
    """Why each patch that no longer applies does not (empty: all apply)."""
    problems = []
    for patch in mutant.patches:
        try:
            text = (root / patch.path).read_text(encoding="utf-8")
        except OSError as err:
            problems.append(f"{patch.path}: {err}")
            continue
        count = text.count(patch.old)
        if count != 1:
            problems.append(
                f"{patch.path}: the text to replace is there {count} times, "
                f"not once: {patch.old.strip()[:60]!r}"
            )
    return problems


def apply(mutant: Mutant, root: Path) -> None:
    """Patch the copy at ``root``."""
    problems = stale_patches(mutant, root)
    if problems:
        raise StaleMutantError("; ".join(problems))
    for patch in mutant.patches:
        path = root / patch.path
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(patch.old, patch.new), encoding="utf-8")


def _pytest(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str]:
    # Nothing of the calling run leaks in: not its import path, not its
    # coverage measurement (the copy's files are gone afterwards).
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "PYTHONPATH" and not key.startswith(("COV_CORE_", "COVERAGE_"))
    }
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    command = [
        sys.executable,
        "-m",
        "pytest",
        *tests,
        "-x",
        "-q",
        "--no-header",
        "-p",
        "no:cacheprovider",
    ]
    try:
        proc = subprocess.run(
            command,
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return -1, f"the tests ran into the {timeout:.0f} s limit"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else proc.stderr.strip()[-300:]


def run(mutant: Mutant, *, timeout: float = TIMEOUT, keep: bool = False) -> Result:
    """Apply ``mutant`` to a scratch copy and run its tests there."""
    started = time.monotonic()
    base = REPO / ".scratch" / "mutants"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=base))
    try:
        scratch_copy(root / "repo")
        try:
            apply(mutant, root / "repo")
        except StaleMutantError as err:
            return Result(mutant, "stale", time.monotonic() - started, str(err))
        code, last = _pytest(root / "repo", mutant.tests, timeout)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.monotonic() - started
    if code == PYTEST_FAILED:
        return Result(mutant, "killed", seconds, last)
    if code == 0:
        return Result(mutant, "survived", seconds, f"{last} with the mutant in place")
    return Result(mutant, "error", seconds, f"pytest exit code {code}: {last}")


def baseline(mutants: list[Mutant], *, timeout: float = TIMEOUT) -> tuple[bool, str]:
    """Whether the mutants' tests all pass on an unmutated copy (else a
    failing test would 'kill' every mutant)."""
    tests = tuple(dict.fromkeys(test for mutant in mutants for test in mutant.tests))
    base = REPO / ".scratch" / "mutants"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="baseline-", dir=base))
    try:
        scratch_copy(root / "repo")
        code, last = _pytest(root / "repo", tests, timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return code == 0, last
