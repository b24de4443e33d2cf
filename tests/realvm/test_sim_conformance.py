"""The tower simulator against the real recording (recorded/virsh.json).

The recording holds what real virsh said to real QEMU guests (see
tests.realvm.record). Here the simulator replays the same command sequence, its
simulated clock moved past the agent's start and the shutdown where the real
run waited for them, and must print the same bytes and exit codes: guest-ping
answers and errors, `shutdown --mode agent|acpi` answers and errors, domstate
reasons, and the event lines (agent-lifecycle above all) without timestamps.

Needs no libvirt or QEMU: it runs everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import subprocess
from typing import Any

import pytest

from tests.realvm.record import (
    ACPI_HONOURED,
    ACPI_IGNORED,
    GPU_NODE,
    MISSING,
    RECORDED,
    TIMESTAMP_RE,
)

towersim = pytest.importorskip("tests.towersim")

AGENT_DELAY = 30.0  # simulated; the sim clock is moved past it explicitly
SHUTDOWN_DURATION = 5.0
# Before these recorded cases the real run waited (for the agent, for the
# shutdown, for the ACPI bound); the simulator's clock is moved by this much.
ADVANCE_BEFORE = {
    "guest-ping after the agent is up": AGENT_DELAY + 1,
    "domstate after an agent shutdown": SHUTDOWN_DURATION + 1,
}
RACY = re.compile(r"state: 'disconnected' reason: 'channel event'")


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text())
    return data


def _sim_virsh(tower: Any, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tower.virsh), "-c", tower.uri, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _replay(
    tower: Any, cases: list[dict[str, Any]], advance: dict[str, float]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run each recorded command on the simulator; (recorded, simulated) pairs."""
    pairs = []
    for case in cases:
        if case["case"] in advance:
            tower.advance(advance[case["case"]])
        domain = (
            case["argv"][-1]
            if case["argv"][0] != "qemu-agent-command"
            else case["argv"][3]
        )
        state = _sim_virsh(tower, ["domstate", "--reason", domain])
        result = _sim_virsh(tower, case["argv"])
        pairs.append(
            (
                case,
                {
                    "case": case["case"],
                    "domain_state": state.stdout.strip()
                    if state.returncode == 0
                    else None,
                    "argv": case["argv"],
                    "rc": result.returncode,
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                },
            )
        )
    return pairs


def test_guest_agent_commands_match_real_virsh(
    recording: dict[str, Any], tmp_path: Path
) -> None:
    """gpu-node and a missing domain: every recorded command, same order."""
    tower = towersim.Tower.create(
        tmp_path / "tower",
        [
            towersim.DomainSpec(
                name=GPU_NODE,
                agent_delay=AGENT_DELAY,
                shutdown_duration=SHUTDOWN_DURATION,
                ignore_acpi=True,
            )
        ],
    )
    cases = [
        c
        for c in recording["commands"]
        if GPU_NODE in c["argv"] or MISSING in c["argv"]
    ]
    assert len(cases) >= 14
    for real, sim in _replay(tower, cases, ADVANCE_BEFORE):
        assert sim == real


def test_acpi_shutdowns_match_real_virsh(
    recording: dict[str, Any], tmp_path: Path
) -> None:
    tower = towersim.Tower.create(
        tmp_path / "tower",
        [
            towersim.DomainSpec(
                name=ACPI_IGNORED,
                agent_delay=AGENT_DELAY,
                shutdown_duration=SHUTDOWN_DURATION,
                ignore_acpi=True,
            ),
            towersim.DomainSpec(
                name=ACPI_HONOURED,
                agent_delay=AGENT_DELAY,
                shutdown_duration=SHUTDOWN_DURATION,
                ignore_acpi=False,
            ),
        ],
    )
    cases = [
        c
        for c in recording["commands"]
        if ACPI_IGNORED in c["argv"] or ACPI_HONOURED in c["argv"]
    ]
    # The real run waited for both agents before the ACPI requests, and then
    # for the honouring guest to shut off.
    advance = {"domstate after an ACPI shutdown": SHUTDOWN_DURATION + 1}
    first_acpi = next(
        c["case"] for c in cases if c["argv"][:3] == ["shutdown", "--mode", "acpi"]
    )
    advance[first_acpi] = AGENT_DELAY + 1
    assert len(cases) >= 8
    for real, sim in _replay(tower, cases, advance):
        assert sim == real


def _bare(lines: list[str]) -> list[str]:
    return [TIMESTAMP_RE.sub("", line) for line in lines if not RACY.search(line)]


def test_event_lines_match_real_virsh(
    recording: dict[str, Any], tmp_path: Path
) -> None:
    """Same lines (timestamps aside), same order, for a start, the agent coming
    up, and an agent shutdown; the timestamps have the real format."""
    tower = towersim.Tower.create(
        tmp_path / "tower",
        [
            towersim.DomainSpec(
                name=GPU_NODE,
                agent_delay=AGENT_DELAY,
                shutdown_duration=SHUTDOWN_DURATION,
            )
        ],
    )
    assert _sim_virsh(tower, ["start", GPU_NODE]).returncode == 0
    tower.advance(AGENT_DELAY + 1)
    assert _sim_virsh(tower, ["shutdown", "--mode", "agent", GPU_NODE]).returncode == 0
    tower.advance(SHUTDOWN_DURATION + 1)
    sim = [line for line in tower.events() if f"for domain '{GPU_NODE}'" in line]
    real = recording["events"][GPU_NODE]
    assert all(TIMESTAMP_RE.match(line) for line in sim), sim
    assert _bare(sim) == _bare(real)
    agent_lines = [line for line in _bare(real) if "'agent-lifecycle'" in line]
    assert len(agent_lines) == 2  # disconnected at start, connected when up
