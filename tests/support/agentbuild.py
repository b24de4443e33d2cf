"""Where the tests find the tower agent's program, and what its bytes are.

The agent reaches a tower as one executable file: ``install``, ``update`` and
the guided install copy it there, and sshd, libvirt's hook and systemd-run
run it. This module is the one place the tests learn which file that is,
so that none of them assumes how the program is made:

- ``AGENT`` is the program the tests run, copy and compare (with
  ``agent_bytes()``, what is copied to a tower);
- ``SOURCE`` is the agent's source, for the tests that read it (parse it,
  look for a word in it);
- ``agent_variant()`` (``agent_variant_bytes()``) is the program made from
  the source with a few of its lines changed (a broken agent, an older
  version).

Today the program is the agent's source file itself, so ``AGENT`` and
``SOURCE`` name the same file and a variant is the edited source.
"""

from __future__ import annotations

from pathlib import Path
import re
import shutil

# The repository's top directory.
REPO = Path(__file__).resolve().parents[2]
# The agent's source.
SOURCE = REPO / "custom_components" / "gpu_handoff" / "tower" / "gpu_handoff.py"
# The program the tests run: today the source file itself.
AGENT = SOURCE
# The source's version line (its VERSION constant).
_VERSION_LINE = re.compile(r'^VERSION = "[^"\n]*"\n', re.MULTILINE)


def agent_bytes() -> bytes:
    """The program's bytes: what install, update and the guided install put
    on a tower."""
    return AGENT.read_bytes()


def agent_variant_bytes(
    *, replace: list[tuple[str, str]] | None = None, version: str | None = None
) -> bytes:
    """The program made from the source with each ``(old, new)`` of
    ``replace`` applied (each ``old`` found exactly once) and, with
    ``version``, its VERSION changed to that."""
    text = SOURCE.read_text(encoding="utf-8")
    for old, new in replace or []:
        found = text.count(old)
        assert found == 1, f"{old!r} is {found} times in the agent's source"
        text = text.replace(old, new)
    if version is not None:
        lines = _VERSION_LINE.findall(text)
        assert len(lines) == 1, f"the agent's source has VERSION lines {lines}"
        text = _VERSION_LINE.sub(lambda _: f'VERSION = "{version}"\n', text)
    return text.encode("utf-8")


def agent_variant(
    directory: Path,
    *,
    replace: list[tuple[str, str]] | None = None,
    version: str | None = None,
) -> Path:
    """Write the program of ``agent_variant_bytes(replace=, version=)`` into
    ``directory`` (made if missing), runnable as the agent is; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / AGENT.name
    program.write_bytes(agent_variant_bytes(replace=replace, version=version))
    shutil.copymode(AGENT, program)
    return program
