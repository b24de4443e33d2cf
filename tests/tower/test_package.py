"""The agent's package: one module per concern, dependencies one way.

The package's docstring lists its modules in order; each module imports
only modules listed before it (no cycle, and a reader can take them in that
order), and none is too long to read at once.
"""

from __future__ import annotations

import ast
from pathlib import Path
import re

from custom_components.gpu_handoff.tower import build, gpu_handoff
from tests.support.agentbuild import MODULES, SOURCE

# About what a reader takes in at once.
LONGEST = 700


def _order() -> list[str]:
    """The modules in the order the package's docstring lists them."""
    assert gpu_handoff.__doc__ is not None
    listed = re.search(
        r"listed before it\): (.*?)\. Home Assistant", gpu_handoff.__doc__, re.S
    )
    assert listed is not None, gpu_handoff.__doc__
    return [name.strip() for name in listed.group(1).split(",")]


def _imports(module: Path) -> set[str]:
    """The package's modules ``module`` imports."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            assert node.module is not None, f"{module.name}: from . import ..."
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            assert not any(
                str(name).startswith(("gpu_handoff", "custom_components"))
                for name in names
            ), f"{module.name} imports the package by its name"
    return found


def test_the_docstring_lists_every_module_once() -> None:
    order = _order()
    assert len(order) == len(set(order))
    assert sorted(order) == sorted(
        path.stem for path in MODULES if path.name != "__init__.py"
    )


def test_each_module_imports_only_those_before_it() -> None:
    order = _order()
    for position, name in enumerate(order):
        imported = _imports(SOURCE / f"{name}.py")
        later = imported - set(order[:position])
        assert not later, f"{name} imports {sorted(later)}, listed after it"


def test_no_module_is_too_long_to_read_at_once() -> None:
    lengths = {
        path.name: len(path.read_text(encoding="utf-8").splitlines())
        for path in MODULES
    }
    assert max(lengths.values()) <= LONGEST, lengths


def test_the_build_takes_every_module_but_the_checkout_entry() -> None:
    """The build's package entries are exactly the package's modules; its
    __main__.py, which runs the package from a checkout, stays out."""
    entries = build.package_modules()
    assert entries == sorted(f"{SOURCE.name}/{path.name}" for path in MODULES)
    assert (SOURCE / "__main__.py").is_file()
    assert f"{SOURCE.name}/__main__.py" not in entries
