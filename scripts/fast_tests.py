"""The inner loop: lint, types and the tests a change touches, in about a minute.

``scripts/test --fast`` runs ``ruff check`` and ``ruff format --check`` on the
changed Python files, ``mypy --strict`` (incremental: its cache makes a
second run take seconds), and pytest without coverage on the tests the change
touches:

- a changed test file itself, and every test file beside a changed
  ``conftest.py`` or helper module of a test directory;
- for a changed module of the integration, every test file that names it
  (``gpu_handoff.drain``, ``from custom_components.gpu_handoff import drain``,
  ``from .drain``); for the tower agent, every test that runs it;
- for strings, translations, the manifest, services.yaml or icons.json, the
  tests that read them.

The long parts (the chaos soak, real QEMU, systemd boxes, the benchmark, the
demo, the faithful-world stories and a few long files) run only when a file
of theirs changed; the whole suite (``scripts/test``) stays
the gate. "The change" is the working tree against HEAD (untracked files
included), or the last commit when the tree is clean; ``--since REV``
compares with REV instead (scripts/test asks git, outside the provisioned
environment, and passes the files with ``--changed``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import re
import subprocess
import sys
import time

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "custom_components/gpu_handoff"
# The agent's sources (its package) and its build: a change to either
# changes the program every test that runs the agent runs.
AGENT_PACKAGE = f"{PACKAGE}/tower/gpu_handoff/"
AGENT_BUILD = f"{PACKAGE}/tower/build.py"
# Tests that read the integration's data files, by file name.
DATA_READERS = {
    "strings.json": ("tests/test_manifest.py", "tests/test_hassfest.py"),
    "manifest.json": ("tests/test_manifest.py", "tests/test_hassfest.py"),
    "services.yaml": ("tests/test_manifest.py", "tests/test_hassfest.py"),
    "icons.json": ("tests/test_manifest.py", "tests/test_hassfest.py"),
    "quality_scale.yaml": ("tests/test_hassfest.py",),
}
# Run only when one of their own files changed: a minute or more each (the
# whole suite's "time by part" names them).
LONG = (
    "tests/chaos/",
    "tests/realvm/",
    "tests/box/",
    "tests/bench/",
    "tests/test_demo.py",
    "tests/test_faithful_world.py",
    "tests/test_cluster_promise.py",
    "tests/tower/test_probe_race.py",
    "tests/towersim/test_agent_on_sim.py",
)


def test_files() -> list[str]:
    return sorted(
        p.relative_to(REPO).as_posix() for p in REPO.glob("tests/**/test_*.py")
    )


def names_module(text: str, module: str) -> bool:
    """Whether a test's source imports or names the integration's module."""
    dotted = module.replace("/", ".")
    leaf = dotted.rsplit(".", 1)[-1]
    patterns = (
        rf"\bgpu_handoff\.{re.escape(dotted)}\b",
        rf"from custom_components\.gpu_handoff(\.\w+)* import [^\n]*\b{re.escape(leaf)}\b",
    )
    return any(re.search(pattern, text) for pattern in patterns)


def runs_agent(text: str) -> bool:
    return bool(
        re.search(
            r"\bAGENT\b|agentbuild|tower import (build, )?gpu_handoff|tower\.gpu_handoff\b",
            text,
        )
        or "simtower" in text
    )


def select(changed: list[str]) -> tuple[list[str], list[str]]:
    """The test files the change touches, and the long ones left out."""
    tests = test_files()
    sources = {t: (REPO / t).read_text(encoding="utf-8") for t in tests}
    chosen: set[str] = set()
    for path in changed:
        name = Path(path).name
        if path.startswith("tests/") and path.endswith(".py"):
            if name.startswith("test_"):
                chosen.add(path)
            else:  # a conftest or helper: the tests beside it and below
                folder = str(Path(path).parent) + "/"
                if folder == "tests/":
                    module = Path(path).stem
                    chosen.update(
                        t for t in tests if re.search(rf"\b{module}\b", sources[t])
                    )
                else:
                    chosen.update(t for t in tests if t.startswith(folder))
        elif path.startswith((AGENT_PACKAGE, "nixos/")) or path == AGENT_BUILD:
            chosen.update(t for t in tests if runs_agent(sources[t]))
        elif path.startswith(PACKAGE + "/") and path.endswith(".py"):
            module = path[len(PACKAGE) + 1 : -3].removesuffix("/__init__")
            chosen.update(t for t in tests if names_module(sources[t], module))
        elif path.startswith(PACKAGE + "/"):
            reader = "strings.json" if "/translations/" in path else name
            chosen.update(t for t in DATA_READERS.get(reader, ()) if t in sources)
        elif path.startswith(("README.md", "docs/")):
            chosen.add("tests/test_docs.py")
    direct = {p for p in changed if p.startswith(LONG)}
    left_out = sorted(t for t in chosen if t.startswith(LONG) and t not in direct)
    return sorted(chosen - set(left_out)), left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/test --fast")
    parser.add_argument("--changed", nargs="*", default=[], help="the changed files")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    changed = sorted({f for f in args.changed if (REPO / f).exists()})
    print(f"changed: {len(changed)} file(s)")
    python = [f for f in changed if f.endswith(".py")]
    steps: list[list[str]] = []
    if python:
        steps += [["ruff", "check", *python], ["ruff", "format", "--check", *python]]
    steps.append(["mypy"])
    tests, left_out = select(changed)
    if left_out:
        print("left to the whole suite (long, none of their files changed):")
        print("".join(f"  {t}\n" for t in left_out), end="")
    if tests:
        steps.append(["pytest", "-q", "--no-cov", "-x", *tests, *args.pytest_args])
    else:
        print("no test touched")
    for step in steps:
        shown = " ".join(
            step if len(step) < 8 else [*step[:4], f"... ({len(step) - 4} more)"]
        )
        print(f"\n== {shown}", flush=True)
        status = subprocess.run(step, cwd=REPO, check=False).returncode
        if status:
            print(f"\nfailed after {time.monotonic() - began:.0f} s")
            return status
    print(f"\npassed in {time.monotonic() - began:.0f} s ({len(tests)} test files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
