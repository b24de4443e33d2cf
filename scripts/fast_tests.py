"""The inner loop: lint, types and the tests a change touches, in about a minute.

``scripts/test --fast`` runs ``ruff check`` and ``ruff format --check`` on the
changed Python files, ``mypy --strict`` (incremental: its cache makes a
second run take seconds), and pytest without coverage (on the whole suite's
four workers when there are several files) on the tests the change touches:

- a changed test file itself, and every test file beside a changed
  ``conftest.py`` or helper module of a test directory;
- for a changed module of the integration, every test file that names it
  (``gpu_handoff.drain``, ``from custom_components.gpu_handoff import drain``,
  ``from .drain``) or names a module of the integration that imports it,
  directly or through others (a change to ``progress`` runs the tests of
  ``controller``, which imports it), and the test file named after either
  (``tests/test_config_flow.py``; ``tests/test_init.py`` for the package's
  own ``__init__``); for the tower agent, every test that runs it. Most of the
  integration also runs in every test that sets it up in Home Assistant: the
  run says how many of those it leaves to the whole suite;
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
import ast
import functools
import os
from pathlib import Path
import re
import subprocess
import sys
import time
from typing import NamedTuple

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


def module_of(path: str) -> str:
    """The integration's module a file under PACKAGE is (``drain`` for
    ``drain.py``; ``__init__`` for the package's own ``__init__.py``)."""
    return path[len(PACKAGE) + 1 : -3].removesuffix("/__init__")


def imported_by(root: Path = REPO) -> dict[str, set[str]]:
    """For each module of the integration (the tower agent's aside), the
    modules of the integration that use it: import it or a name from it
    (``from .x import``, ``from . import x``, ``from ..x import``,
    ``from custom_components.gpu_handoff.x import``). Python also runs a
    package's ``__init__`` for each of its modules; that is not counted,
    or every module would use every other one through the package's own."""
    package = root / PACKAGE
    files = {
        module_of(p.relative_to(root).as_posix()): p
        for p in package.rglob("*.py")
        if not p.relative_to(package).as_posix().startswith("tower/")
    }
    users: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        parts = [] if module == "__init__" else module.split("/")
        if path.name != "__init__.py":
            parts = parts[:-1]  # the package the module is in
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            named = (node.module or "").split(".") if node.module else []
            if node.level:
                base = parts[: len(parts) - (node.level - 1)] + named
            elif named[:2] == ["custom_components", "gpu_handoff"]:
                base = named[2:]
            else:
                continue
            for alias in node.names:
                # a module by its name, else a name the module or package
                # ``base`` defines
                target = "/".join([*base, alias.name])
                if target not in users:
                    target = "/".join(base) or "__init__"
                if target in users and target != module:
                    users[target].add(module)
    return users


def importers(module: str, users: dict[str, set[str]]) -> set[str]:
    """``module`` and every module of the integration that imports it,
    directly or through others."""
    found = {module}
    todo = [module]
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in found:
                found.add(user)
                todo.append(user)
    return found


def runs_agent(text: str) -> bool:
    return bool(
        re.search(
            r"\bAGENT\b|agentbuild|tower import (build, )?gpu_handoff|tower\.gpu_handoff\b",
            text,
        )
        or "simtower" in text
    )


class Selection(NamedTuple):
    """The test files a change touches: those to run, the long ones left to
    the whole suite, and those that run the changed code only as Home
    Assistant sets the integration up (left to the whole suite too)."""

    tests: list[str]
    left_out: list[str]
    through_setup: list[str]


# What Home Assistant loads of the integration by itself: the package (and
# with it what it imports), its platforms, and the modules it looks up by
# name (the config flow, diagnostics, the logbook's descriptions).
LOADED_BY_NAME = ("__init__", "config_flow", "diagnostics", "logbook")


@functools.cache
def _entry_modules() -> frozenset[str]:
    """The modules Home Assistant loads by name: LOADED_BY_NAME and the
    platforms the package's ``__init__`` names (read once)."""
    text = (REPO / PACKAGE / "__init__.py").read_text(encoding="utf-8")
    platforms = re.findall(r"Platform\.(\w+)", text)
    return frozenset({*LOADED_BY_NAME, *(name.lower() for name in platforms)})


def loaded_by_home_assistant(modules: set[str]) -> bool:
    """Whether Home Assistant runs any of ``modules`` when it sets the
    integration up or starts its config flow."""
    return bool(modules & _entry_modules())


def sets_up(text: str) -> bool:
    """Whether a test file runs Home Assistant (its ``hass`` fixture)."""
    return "hass: HomeAssistant" in text


def select(changed: list[str]) -> Selection:
    """The test files the change touches (see Selection)."""
    tests = test_files()
    sources = {t: (REPO / t).read_text(encoding="utf-8") for t in tests}
    chosen: set[str] = set()
    through_setup: set[str] = set()
    users = imported_by()
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
            modules = importers(module_of(path), users)
            named = {
                f"tests/test_{module.rsplit('/', 1)[-1].strip('_')}.py"
                for module in modules
            }
            chosen.update(
                t
                for t in tests
                if t in named
                or any(names_module(sources[t], module) for module in modules)
            )
            if loaded_by_home_assistant(modules):
                through_setup.update(t for t in tests if sets_up(sources[t]))
        elif path.startswith(PACKAGE + "/"):
            reader = "strings.json" if "/translations/" in path else name
            chosen.update(t for t in DATA_READERS.get(reader, ()) if t in sources)
        elif path.startswith(("README.md", "docs/")):
            chosen.add("tests/test_docs.py")
    direct = {p for p in changed if p.startswith(LONG)}
    left_out = sorted(t for t in chosen if t.startswith(LONG) and t not in direct)
    return Selection(
        sorted(chosen - set(left_out)), left_out, sorted(through_setup - chosen)
    )


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
    tests, left_out, through_setup = select(changed)
    if left_out:
        print("left to the whole suite (long, none of their files changed):")
        print("".join(f"  {t}\n" for t in left_out), end="")
    if through_setup:
        print(
            f"left to the whole suite: {len(through_setup)} more test files run "
            "the change as Home Assistant sets the integration up "
            "(name them after -- to run them here)"
        )
    if tests:
        # several files on the whole suite's workers (scripts/_checks.sh)
        workers = os.environ.get("GPU_HANDOFF_WORKERS", "4")
        parallel = ["-n", workers, "--dist", "worksteal"] if len(tests) > 1 else []
        steps.append(
            ["pytest", "-q", "--no-cov", "-x", *parallel, *tests, *args.pytest_args]
        )
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
