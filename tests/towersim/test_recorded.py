"""Conformance with real QEMU guests: the simulator against the recording of
real virsh, libvirtd (qemu driver) and guests with a real guest agent in
tests/realvm/recorded/virsh.json (a live test of that recording lives in
tests/realvm). This pins what libvirt's test driver cannot show: the guest
agent's errors, ``shutdown --mode agent|acpi``, a QEMU domain's errors and
its lifecycle events.

Each recorded command is replayed on a simulated domain put in the recorded
state (``domain_state`` right before the command, and whether the guest agent
was up, which the case's name says).
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import signal
import subprocess
from typing import Any

import pytest

from tests.towersim import DomainSpec, Tower
from tests.towersim.helpers import LineReader, Result, sim

RECORDED = Path(__file__).parent.parent / "realvm" / "recorded" / "virsh.json"
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+0000: ")
AGENT_DOWN_CASES = ("before the agent is up", "while booting", "start of a running")
PING = '{"execute":"guest-ping"}'


def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text(encoding="utf-8"))
    return data


def _cases() -> list[dict[str, Any]]:
    if not RECORDED.exists():
        return []
    cases: list[dict[str, Any]] = recording()["commands"]
    return cases


def test_recording_is_present() -> None:
    assert RECORDED.exists(), (
        f"{RECORDED} is missing: nothing pins the simulator to QEMU"
    )
    assert _cases(), "the recording holds no commands"


def _domain(argv: list[str]) -> str:
    # every recorded command names its domain last but one (ping) or last
    if argv[0] == "qemu-agent-command":
        return argv[-2]
    return argv[-1]


def _prepare(tower: Tower, case: dict[str, Any]) -> None:
    """Put the simulated domain in the state the real one was in."""
    name = _domain(case["argv"])
    state = case["domain_state"]
    if state is None:
        return
    agent_up = not any(words in case["case"] for words in AGENT_DOWN_CASES)
    tower.define(
        DomainSpec(
            name=name,
            agent_delay=5.0 if agent_up else 1000.0,
            ignore_acpi="ignored" in name,
            shutdown_duration=1.0,
            domain_type="kvm",
        )
    )
    if state.startswith("shut off (unknown)"):
        return
    assert sim(tower, "start", name).rc == 0
    if agent_up:
        tower.advance(6.0)
    if state == "shut off (shutdown)":
        assert sim(tower, "shutdown", "--mode", "agent", name).rc == 0
        tower.advance(2.0)
    assert tower.domstate(name) == state, case["case"]


@pytest.mark.parametrize(
    "case", _cases(), ids=lambda c: f"{c['case']}: {' '.join(c['argv'][:1])}"
)
def test_recorded_command(tmp_path: Path, case: dict[str, Any]) -> None:
    tower = Tower.create(tmp_path / "tower", time_scale=1.0)
    _prepare(tower, case)
    got = sim(tower, *case["argv"])
    assert got == Result(case["rc"], case["stdout"], case["stderr"])


def _strip(line: str) -> str:
    assert TIMESTAMP.match(line), line
    return TIMESTAMP.sub("", line)


def test_recorded_agent_shutdown_events(tmp_path: Path) -> None:
    """A guest defined, started, its agent up, stopped through the agent: the
    same event lines, in the same order, as the real QEMU guest."""
    real = [_strip(line) for line in recording()["events"]["gpu-node"]]
    tower = Tower.create(tmp_path / "tower", time_scale=1.0)
    with subprocess.Popen(
        [str(tower.virsh), "-c", tower.uri, "event", "--loop", "--all", "--timestamp"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    ) as events:
        reader = LineReader(events)
        Tower.wait_until(
            lambda: any(c.subscribed for c in tower.calls("event")),
            timeout=20,
            what="the listener",
        )
        tower.define(DomainSpec("gpu-node", agent_delay=5.0, shutdown_duration=1.0))
        assert sim(tower, "start", "gpu-node").rc == 0
        tower.advance(6.0)
        assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 0
        tower.advance(2.0)
        Tower.wait_until(
            lambda: len(reader.poll()) >= len(real), timeout=20, what="the events"
        )
        events.send_signal(signal.SIGINT)
        Tower.wait_until(
            lambda: reader.poll() and reader.closed, timeout=20, what="EOF"
        )
        assert events.wait(timeout=20) == 0
    got = reader.lines
    assert [_strip(line) for line in got[: len(real)]] == real
    assert got[len(real) :] == [
        "event loop interrupted",
        f"events received: {len(real)}",
        "",
    ]


def test_recorded_acpi_events_are_in_the_simulators_vocabulary(tmp_path: Path) -> None:
    """Every kind of line the real guests printed is one the simulator prints."""
    vocabulary = {
        re.sub(r"domain '[^']*'", "domain 'X'", _strip(line))
        for lines in recording()["events"].values()
        for line in lines
    }
    tower = Tower.create(tmp_path / "tower", time_scale=1.0)
    tower.define(DomainSpec("X", agent_delay=1.0, shutdown_duration=1.0))
    assert sim(tower, "start", "X").rc == 0
    tower.advance(2.0)
    assert sim(tower, "shutdown", "--mode", "agent", "X").rc == 0
    tower.advance(2.0)
    ours = {_strip(line) for line in tower.events()}
    # QEMU also reports the agent going away when the guest closes its channel
    # before powering off (seen for one of the recorded guests): not simulated.
    missing = {
        line
        for line in vocabulary - ours
        if "state: 'disconnected' reason: 'channel event'" not in line
    }
    assert not missing
