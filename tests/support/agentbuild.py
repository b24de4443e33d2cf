"""Where the tests find the tower agent's program, and what its bytes are.

The agent reaches a tower as one executable file: ``install``, ``update`` and
the guided install copy it there, and sshd, libvirt's hook and systemd-run
run it. This module is the one place the tests learn which file that is,
so that none of them assumes how the program is made:

- ``AGENT`` is the program the tests run, copy and compare (with
  ``agent_bytes()``, what is copied to a tower);
- ``SOURCE`` is the agent's source package (``MODULES`` its modules), for
  the tests that read it (parse it, look for a word in it);
- ``agent_variant()`` (``agent_variant_bytes()``) is the program made from
  the source with a few of its lines changed (a broken agent, an older
  version).

The program is built from the source (custom_components/gpu_handoff/tower/
build.py) once per source, into ``.build/`` of the repository (content-
addressed; a test worker that finds it built uses it): every test that runs
the agent runs the built file, as a tower does, so a module the build leaves
out fails them. ``old_agent_bytes()`` is the agent as a 0.3 release installed
it (its one source file, with the marker and VERSION lines such a file had),
for the tests of what an update replaces.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
import re
import shutil
import tempfile

from custom_components.gpu_handoff.tower import build

# The repository's top directory.
REPO = Path(__file__).resolve().parents[2]
# The agent's source package, and its modules (in the build's order).
SOURCE = REPO / "custom_components" / "gpu_handoff" / "tower" / "gpu_handoff"
MODULES = tuple(
    SOURCE.parent / entry for entry in build.package_modules(str(SOURCE.parent))
)
# Built programs, by their bytes' hash (the box tests see the repository at
# /src, so the program is found there too).
BUILT = REPO / ".build"
# The source's version line (its VERSION constant).
_VERSION_LINE = re.compile(r'^VERSION = "[^"\n]*"\n', re.MULTILINE)


def built_program(data: bytes) -> Path:
    """The built program ``data`` as a file under BUILT (written once), and
    beside it its module compiled for this Python, as ``install`` leaves
    it on a tower (a Python of another version, the oldest the tests run,
    finds none and compiles it)."""
    path = BUILT / f"gpu-handoff-{hashlib.sha256(data).hexdigest()[:16]}"
    if not path.exists() or path.read_bytes() != data:
        BUILT.mkdir(mode=0o755, exist_ok=True)
        build.write(str(path), data)
    if not Path(build.cache_path(str(path))).exists():
        build.write_cache(str(path))
    return path


# The program the tests run: the agent built from the source.
AGENT = built_program(build.archive_bytes(str(SOURCE.parent)))


def agent_bytes() -> bytes:
    """The program's bytes: what install, update and the guided install put
    on a tower."""
    return AGENT.read_bytes()


def _edited_sources(
    replace: list[tuple[str, str]] | None, version: str | None
) -> dict[Path, str]:
    """The package's modules, with each ``old`` of ``replace`` (found exactly
    once in all of them) replaced, and the VERSION line changed to
    ``version``."""
    texts = {path: path.read_text(encoding="utf-8") for path in MODULES}
    for old, new in replace or []:
        where = [path for path, text in texts.items() if old in text]
        found = sum(texts[path].count(old) for path in where)
        assert found == 1, f"{old!r} is {found} times in the agent's source"
        texts[where[0]] = texts[where[0]].replace(old, new)
    if version is not None:
        lines = [
            (path, line)
            for path, text in texts.items()
            for line in _VERSION_LINE.findall(text)
        ]
        assert len(lines) == 1, f"the agent's source has VERSION lines {lines}"
        path = lines[0][0]
        texts[path] = _VERSION_LINE.sub(
            lambda _: f'VERSION = "{version}"\n', texts[path]
        )
    return texts


def agent_variant_bytes(
    *, replace: list[tuple[str, str]] | None = None, version: str | None = None
) -> bytes:
    """The program built from the source with each ``(old, new)`` of
    ``replace`` applied (each ``old`` found exactly once) and, with
    ``version``, its VERSION changed to that (the prefix's too)."""
    texts = _edited_sources(replace, version)
    with tempfile.TemporaryDirectory() as directory:
        top = Path(directory)
        shutil.copyfile(SOURCE.parent / build.BUILDER, top / build.BUILDER)
        (top / SOURCE.name).mkdir()
        for path, text in texts.items():
            (top / SOURCE.name / path.name).write_text(text, encoding="utf-8")
        return build.archive_bytes(directory)


def old_agent_bytes(
    *, replace: list[tuple[str, str]] | None = None, version: str | None = None
) -> bytes:
    """The agent as a 0.3 release installed it: one source file, whose
    docstring's first line is the marker and which has one VERSION line (with
    ``replace`` and ``version`` as for agent_variant_bytes); what a tower
    updated from such a release has. Made of this agent's modules one after
    the other, it is read (its marker, its version), not run."""
    texts = _edited_sources(replace, version)
    init = SOURCE / "__init__.py"
    body = [texts[init], *(text for path, text in texts.items() if path != init)]
    return ("#!/usr/bin/env python3\n" + "".join(body)).encode("utf-8")


def agent_variant(
    directory: Path,
    *,
    replace: list[tuple[str, str]] | None = None,
    version: str | None = None,
) -> Path:
    """Write the program of ``agent_variant_bytes(replace=, version=)`` into
    ``directory`` (made if missing), runnable as the agent is; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "gpu-handoff"
    program.write_bytes(agent_variant_bytes(replace=replace, version=version))
    shutil.copymode(AGENT, program)
    return program
