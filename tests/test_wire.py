"""The wire module: what the tower agent and Home Assistant both read.

Home Assistant reads the agent's protocol version, job words, error and
finding codes from ``tower/gpu_handoff/wire.py`` alone, never from the rest
of the agent program (its installer, PNG encoder, fcntl/pwd/grp); every code
the agent can send reaches the user as a translated text in every language;
and the module runs as it is on the oldest Python a tower may have.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
import re
import subprocess
import sys
from typing import Any

import pytest

from custom_components.gpu_handoff import protocol
from custom_components.gpu_handoff.errors import tower_error_key
from custom_components.gpu_handoff.repair_sync import FINDING_PLACEHOLDERS
from custom_components.gpu_handoff.tower.gpu_handoff import wire
from custom_components.gpu_handoff.tower_client import AgentCommandError
from tests.support.oldpython import oldest_python

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = REPO / "custom_components" / "gpu_handoff"
AGENT = INTEGRATION / "tower" / "gpu_handoff"
LANGUAGES = {
    "strings": INTEGRATION / "strings.json",
    "en": INTEGRATION / "translations" / "en.json",
    "fr": INTEGRATION / "translations" / "fr.json",
}
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What a finding's issue is given besides its own placeholders (repair_sync).
FINDING_COMMON = {"domain", "details"}


def _codes(prefix: str) -> dict[str, str]:
    return {k: v for k, v in vars(wire).items() if k.startswith(prefix)}


def _text(language: dict[str, Any], *path: str) -> str:
    node: Any = language
    for key in path:
        assert isinstance(node, dict), ".".join(path)
        assert key in node, ".".join(path)
        node = node[key]
    assert isinstance(node, str), ".".join(path)
    assert node.strip(), ".".join(path)
    return node


@pytest.fixture(scope="module")
def languages() -> dict[str, dict[str, Any]]:
    return {
        name: json.loads(path.read_text(encoding="utf-8"))
        for name, path in LANGUAGES.items()
    }


def test_the_integration_imports_no_agent_module_but_wire() -> None:
    """Every module of the integration (outside tower/) that imports from the
    agent's package imports its wire module, and nothing else of it."""
    found = []
    for path in sorted(INTEGRATION.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = node.module
                if module == "tower.gpu_handoff":
                    assert [a.name for a in node.names] == ["wire"], path.name
                    found.append(path.name)
                elif module.startswith("tower.gpu_handoff."):
                    assert module == "tower.gpu_handoff.wire", path.name
                elif module == "tower":
                    assert {a.name for a in node.names} <= {"build"}, path.name
    assert "protocol.py" in found


def test_loading_the_integration_loads_wire_alone_of_the_agent() -> None:
    """Imported whole, the integration holds the agent's wire module and its
    build, and no other module of the agent program."""
    probe = (
        "import importlib, pkgutil, sys\n"
        "import custom_components.gpu_handoff as package\n"
        "for info in pkgutil.iter_modules(package.__path__):\n"
        "    importlib.import_module(f'{package.__name__}.{info.name}')\n"
        "print('\\n'.join(sorted(m for m in sys.modules if '.tower.' in m)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    tower = "custom_components.gpu_handoff.tower"
    assert done.stdout.split() == [
        f"{tower}.build",
        f"{tower}.gpu_handoff",
        f"{tower}.gpu_handoff.wire",
    ]


def test_the_job_words_are_the_agents(tmp_path: Path) -> None:
    """The integration's job kinds, states and steps are the agent's own
    enums, and the words the agent's records hold are theirs."""
    assert protocol.JobKind is wire.JobKind
    assert protocol.JobState is wire.JobState
    assert protocol.StepName is wire.StepName
    assert tuple(wire.JobKind) == wire.JOB_KINDS
    assert tuple(wire.JobState) == wire.JOB_STATES
    assert set(wire.STOP_STEPS) | set(wire.START_VM_STEPS) | set(
        wire.START_STEPS
    ) == set(wire.StepName)
    # A member is its word: printed, formatted, compared and serialised.
    kind = wire.JobKind.HANDOFF
    assert (str(kind), f"{kind}", json.dumps(kind)) == (
        "handoff",
        "handoff",
        '"handoff"',
    )
    assert kind == "handoff"
    assert {"handoff": 1}[kind] == 1
    assert [s for s in wire.JobState if s.active] == [
        wire.JobState.QUEUED,
        wire.JobState.RUNNING,
    ]


@pytest.mark.parametrize("code", sorted(_codes("ERR_").values()))
def test_every_error_code_reaches_the_user_translated(
    code: str, languages: dict[str, dict[str, Any]]
) -> None:
    """An error the agent answers is told to the user by the key
    tower_error_key gives it: a message with the agent's own words
    ({error}) in every language, in an action and in a flow."""
    assert code in wire.ERROR_CODES
    key = tower_error_key(AgentCommandError(code, "what the agent said"))
    for name, language in languages.items():
        message = _text(language, "exceptions", key, "message")
        assert set(PLACEHOLDER.findall(message)) == {"error"}, (name, key)
        flow = _text(language, "config", "error", key)
        assert set(PLACEHOLDER.findall(flow)) <= {"error"}, (name, key)


def test_error_codes_are_listed_once() -> None:
    codes = _codes("ERR_")
    assert set(codes.values()) == wire.ERROR_CODES
    assert len(set(codes.values())) == len(codes)


@pytest.mark.parametrize("code", sorted(_codes("FINDING_").values()))
def test_every_finding_is_an_issue_translated(
    code: str, languages: dict[str, dict[str, Any]]
) -> None:
    """A finding of the agent's becomes a repair issue named after its code:
    a title and a description in every language, whose placeholders are the
    ones the issue is given."""
    given = FINDING_COMMON | set(FINDING_PLACEHOLDERS.get(code, {}))
    for name, language in languages.items():
        _text(language, "issues", code, "title")
        description = _text(language, "issues", code, "description")
        assert set(PLACEHOLDER.findall(description)) <= given, (name, code)
    assert set(FINDING_PLACEHOLDERS) <= set(_codes("FINDING_").values())


def test_wire_runs_on_the_oldest_python() -> None:
    """wire.py is the standard library alone and needs no other module of
    the agent: the oldest Python a tower may have imports it on its own."""
    python, env = oldest_python()
    probe = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import wire; "
        "print(json.dumps([wire.PROTOCOL, wire.VERSION, sorted(wire.ERROR_CODES), "
        "wire.JOB_KINDS, str(wire.JobKind.LEND), f'{wire.StepName.START}', "
        "wire.virsh_reads_as('1'), wire.local_libvirt_uri('qemu:///system')]))"
    )
    done = subprocess.run(
        [python, "-I", "-S", "-c", probe, str(AGENT)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == [
        wire.PROTOCOL,
        wire.VERSION,
        sorted(wire.ERROR_CODES),
        list(wire.JOB_KINDS),
        "lend",
        "start",
        "id",
        True,
    ]
