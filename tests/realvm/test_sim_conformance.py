"""The tower simulator against the real recordings (recorded/virsh.json and
recorded/shutdowns.json).

The recording holds what real virsh said to real QEMU guests (see
tests.realvm.record). Here the simulator replays the same command sequence, its
simulated clock moved past the agent's start and the shutdown where the real
run waited for them, and must print the same bytes and exit codes: guest-ping
answers and errors, `shutdown --mode agent|acpi` answers and errors, domstate
reasons, and the event lines (agent-lifecycle above all) without timestamps.
The shutdowns (tests.realvm.record_shutdowns) are replayed by hand: an agent
shutdown that blocks, calls made while it does, guests whose agent leaves
before the power-off.

Needs no libvirt or QEMU: it runs everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import subprocess
from typing import Any

import pytest

from tests.realvm.qemu_libvirtd import agent_shutdown_answers
from tests.realvm.record import (
    ACPI_HONOURED,
    ACPI_IGNORED,
    GPU_NODE,
    MISSING,
    RECORDED,
    TIMESTAMP_RE,
    command_entry,
    comparable as comparable_rig,
)
from tests.realvm.record_shutdowns import (
    AGENT_LEAD,
    LEAVES,
    RECORDED as SHUTDOWNS_RECORDED,
    SELF,
    SHUTDOWN_DELAY,
    SLOW,
    Call,
    comparable,
)
from tests.realvm.test_libvirtd_restart import AWAY, DISCONNECTED, EVENTS_RECEIVED

towersim = pytest.importorskip("tests.towersim")
sim_model = pytest.importorskip("tests.towersim.model")

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


def _sim_tower(tmp_path: Path, ignore_acpi: dict[str, bool]) -> Any:
    """A simulated tower with a guest of each name (ignoring the ACPI power
    button or not), whose agents and shutdowns take the simulated times the
    recorded run is replayed with."""
    return towersim.Tower.create(
        tmp_path / "tower",
        [
            towersim.DomainSpec(
                name=name,
                agent_delay=AGENT_DELAY,
                shutdown_duration=SHUTDOWN_DURATION,
                ignore_acpi=ignores,
            )
            for name, ignores in ignore_acpi.items()
        ],
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
    tower = _sim_tower(tmp_path, {GPU_NODE: True})
    cases = [
        c
        for c in recording["commands"]
        if GPU_NODE in c["argv"] or MISSING in c["argv"]
    ]
    assert len(cases) >= 14
    for real, sim in _replay(tower, cases, ADVANCE_BEFORE):
        assert comparable_rig([sim]) == comparable_rig([real])


def test_acpi_shutdowns_match_real_virsh(
    recording: dict[str, Any], tmp_path: Path
) -> None:
    tower = _sim_tower(tmp_path, {ACPI_IGNORED: True, ACPI_HONOURED: False})
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
        assert comparable_rig([sim]) == comparable_rig([real])


def _bare(lines: list[str]) -> list[str]:
    return [TIMESTAMP_RE.sub("", line) for line in lines if not RACY.search(line)]


def test_event_lines_match_real_virsh(
    recording: dict[str, Any], tmp_path: Path
) -> None:
    """Same lines (timestamps aside), same order, for a start, the agent coming
    up, and an agent shutdown; the timestamps have the real format."""
    tower = _sim_tower(tmp_path, {GPU_NODE: False})
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


def test_an_agent_shutdown_that_loses_the_race_with_qemus_exit(
    tmp_path: Path,
) -> None:
    """The simulator's lost race (Tower.agent_sockets_close_first) answers
    exactly what real virsh answered for it (agent_shutdown_answers: seen on a
    real guest under two test workers), and the guest is shut off as after a
    won one; the next shutdown wins again."""
    tower = _sim_tower(tmp_path, {GPU_NODE: False})
    won, lost = agent_shutdown_answers(GPU_NODE)
    for answer in (lost, won):
        assert _sim_virsh(tower, ["start", GPU_NODE]).returncode == 0
        tower.advance(AGENT_DELAY + 1)
        if answer is lost:
            tower.agent_sockets_close_first(GPU_NODE)
        stop = _sim_virsh(tower, ["shutdown", "--mode", "agent", GPU_NODE])
        assert (stop.returncode, stop.stdout, stop.stderr) == answer
        tower.advance(SHUTDOWN_DURATION + 1)
        state = _sim_virsh(tower, ["domstate", "--reason", GPU_NODE])
        assert state.stdout == "shut off (shutdown)\n\n"
        assert tower.agent_sockets_still_to_close() == []


# --- slow graceful stops and guest agents that leave first -------------------
# (recorded/shutdowns.json, tests.realvm.record_shutdowns)

SHUTDOWNS_SCALE = 0.25  # the guests' 4 s take 1 s here
AGENT_UP = 1.0  # simulated seconds after the start


@pytest.fixture(scope="module")
def shutdowns() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SHUTDOWNS_RECORDED.read_text())
    return data


def _real(recording: dict[str, Any], domain: str) -> list[dict[str, Any]]:
    return [c for c in recording["commands"] if domain in c["argv"]]


def _case(recording: dict[str, Any], case: str) -> dict[str, Any]:
    return next(c for c in recording["commands"] if c["case"] == case)


def _state(tower: Any, domain: str) -> str | None:
    state = _sim_virsh(tower, ["domstate", "--reason", domain])
    return state.stdout.strip() if state.returncode == 0 else None


def _run_case(tower: Any, real: dict[str, Any], domain: str) -> dict[str, Any]:
    """A recorded command on the simulator, as the recorder ran it."""
    before = _state(tower, domain)
    return command_entry(
        real["case"], before, real["argv"], _sim_virsh(tower, real["argv"])
    )


def _booted(
    tmp_path: Path,
    domain: str,
    duration: float,
    *,
    agent_leaves_first: bool = False,
    scale: float = SHUTDOWNS_SCALE,
) -> tuple[Any, dict[str, Any]]:
    """A tower with ``domain`` started (its recorded start replayed) and its
    agent up; the start's entry."""
    tower = towersim.Tower.create(
        tmp_path / "tower",
        [
            towersim.DomainSpec(
                name=domain,
                agent_delay=AGENT_UP,
                shutdown_duration=duration,
                agent_leaves_first=agent_leaves_first,
            )
        ],
        time_scale=scale,
    )
    start = _run_case(tower, {"case": "start", "argv": ["start", domain]}, domain)
    tower.wait_until(
        lambda: tower.agent_connected(domain), timeout=10, what="the agent"
    )
    return tower, start


def _sim_events(tower: Any, domain: str) -> list[str]:
    return [line for line in tower.events() if f"for domain '{domain}'" in line]


def _unstamped(lines: list[str]) -> list[str]:
    """The lines without their timestamps; none left out (the agent's
    disconnect is no race when it leaves seconds before the power-off)."""
    return [TIMESTAMP_RE.sub("", line) for line in lines]


def test_a_slow_agent_shutdown_matches_real_virsh(
    shutdowns: dict[str, Any], tmp_path: Path
) -> None:
    """A guest that powers off SHUTDOWN_DELAY s after qemu-ga's
    guest-shutdown: the agent shutdown blocks that long and returns the same
    bytes; a ping issued meanwhile waits for it and gets one of the answers
    real libvirt gives (which one is a race in libvirtd, RACY_CASES); so
    does domstate right after the return; the events are the same but for
    the agent's disconnect, whose place is a race too. The simulated guest
    powers off SHUTDOWN_DELAY s after the request, as the real one did, and
    is shut off a moment later (``in shutdown`` meanwhile)."""
    tower, start = _booted(tmp_path, SLOW, SHUTDOWN_DELAY + sim_model.IN_SHUTDOWN)
    real = _real(shutdowns, SLOW)
    stop_real = _case(shutdowns, "shutdown --mode agent of a guest that takes its time")
    ping_real = _case(shutdowns, "guest-ping while the agent shutdown waits")

    def virsh(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return _sim_virsh(tower, argv)

    before = _state(tower, SLOW)
    stop = Call(virsh, stop_real["argv"])
    tower.wait_until(lambda: tower.agent_job_held(SLOW), timeout=10, what="the job")
    during = _state(tower, SLOW)
    ping = Call(virsh, ping_real["argv"])
    state_during = _sim_virsh(tower, ["domstate", "--reason", SLOW])
    stopped, stop_ended = stop.wait()
    right_after = _sim_virsh(tower, ["domstate", "--reason", SLOW])
    pinged, ping_ended = ping.wait()
    tower.wait_until(lambda: not tower.is_running(SLOW), timeout=10, what="off")
    after = _run_case(
        tower, _case(shutdowns, "domstate after the slow guest powered off"), SLOW
    )
    sim = [
        start,
        command_entry(stop_real["case"], before, stop_real["argv"], stopped),
        command_entry(ping_real["case"], during, ping_real["argv"], pinged),
        command_entry(
            "domstate while the agent shutdown waits",
            during,
            ["domstate", "--reason", SLOW],
            state_during,
        ),
        command_entry(
            "domstate right after the agent shutdown returned",
            during,
            ["domstate", "--reason", SLOW],
            right_after,
        ),
        after,
    ]
    assert comparable(sim) == comparable(real)
    assert stop_ended - stop.began >= SHUTDOWN_DELAY * SHUTDOWNS_SCALE
    assert ping_ended >= stop_ended - 0.1
    sim_lines = _bare(_sim_events(tower, SLOW))
    assert sim_lines == _bare(shutdowns["events"][SLOW])


def test_a_guest_shutting_itself_down_matches_real_virsh(
    shutdowns: dict[str, Any], tmp_path: Path
) -> None:
    """The guest shuts itself down, its agent gone AGENT_LEAD s before the
    power-off: ``Tower.guest_shutdown`` stands for what the rig's guest did
    on the ACPI press (the press itself is not replayed: the simulator's
    guests that honour ACPI keep their agent until the power-off). The same
    domstate, the same failed agent shutdown and ping while it runs on, the
    same events in the same order, the agent's disconnect included."""
    # The replay's calls must all land before the guest powers off, AGENT_LEAD
    # simulated seconds after it began: at SHUTDOWNS_SCALE (1 s) a loaded
    # machine's virsh calls overran it. At 1.0 they have 4 s, and the wait
    # for the power-off after them is skipped by moving the clock on.
    tower, start = _booted(tmp_path, SELF, AGENT_LEAD, scale=1.0)
    real = _real(shutdowns, SELF)
    assert real[0]["case"] == "start"
    assert real[1]["argv"][:3] == ["shutdown", "--mode", "acpi"]
    tower.guest_shutdown(SELF)
    sim = [start, real[1]]
    sim += [_run_case(tower, case, SELF) for case in real[2:-1]]
    tower.advance(AGENT_LEAD)
    tower.wait_until(lambda: not tower.is_running(SELF), timeout=10, what="off")
    sim.append(_run_case(tower, real[-1], SELF))
    assert sim == real
    real_lines = _unstamped(shutdowns["events"][SELF])
    assert _unstamped(_sim_events(tower, SELF)) == real_lines


def test_an_agent_shutdown_whose_agent_leaves_matches_real_virsh(
    shutdowns: dict[str, Any], tmp_path: Path
) -> None:
    """An agent shutdown whose guest stops its agent on the way down
    (``DomainSpec.agent_leaves_first``). The call returns 0 at once; the
    domain runs on, agent gone; same events."""
    # (At 1.0, as the guest shutting itself down: the calls after the stop
    # must land before the power-off.)
    tower, start = _booted(
        tmp_path, LEAVES, AGENT_LEAD, agent_leaves_first=True, scale=1.0
    )
    real = _real(shutdowns, LEAVES)
    stop_real = real[1]
    assert stop_real["argv"][:3] == ["shutdown", "--mode", "agent"]

    def virsh(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return _sim_virsh(tower, argv)

    before = _state(tower, LEAVES)
    stop = Call(virsh, stop_real["argv"])
    stopped, stop_ended = stop.wait()
    sim = [start, command_entry(stop_real["case"], before, stop_real["argv"], stopped)]
    sim += [_run_case(tower, case, LEAVES) for case in real[2:-1]]
    # It returned before the guest powered off, AGENT_LEAD after it began.
    assert stop_ended - stop.began < AGENT_LEAD
    tower.advance(AGENT_LEAD)
    tower.wait_until(lambda: not tower.is_running(LEAVES), timeout=10, what="off")
    sim.append(_run_case(tower, real[-1], LEAVES))
    assert sim == real
    real_lines = _unstamped(shutdowns["events"][LEAVES])
    assert _unstamped(_sim_events(tower, LEAVES)) == real_lines


# --- libvirtd restarting under a running domain -------------------------------
# (tests.realvm.test_libvirtd_restart pins real virsh's texts, URI and socket
# path aside; the simulator's URI is its own, its socket libvirt's default)

SIM_SOCKET = "/var/run/libvirt/libvirt-sock"
RESTART_SCALE = 0.01  # simulated seconds to real ones
RESTART_AWAY = 500.0  # simulated: 5 s here, for the calls made meanwhile


def test_a_libvirtd_restart_prints_what_real_virsh_prints(tmp_path: Path) -> None:
    """``Tower.restart_libvirtd`` under a running ``virsh event --loop --all
    --timestamp`` and a call while libvirtd is away: the same rc and bytes as
    real virsh (test_libvirtd_restart: DISCONNECTED, EVENTS_RECEIVED, AWAY)."""
    tower = towersim.Tower.create(
        tmp_path / "tower",
        [towersim.DomainSpec(name="vm", running=True)],
        time_scale=RESTART_SCALE,
    )
    out_path = tmp_path / "events.out"
    listen = ["event", "--loop", "--all", "--timestamp"]
    with out_path.open("wb") as out:
        events = subprocess.Popen(
            [str(tower.virsh), "-c", tower.uri, *listen],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )

    def subscribed() -> bool:
        """Whether an event reached the listener; if not, pause or resume the
        domain (events before the listener subscribed are lost)."""
        if "event '" in out_path.read_text():
            return True
        if tower.domstate("vm").startswith("paused"):
            tower.resume("vm")
        else:
            tower.pause("vm")
        return False

    try:
        tower.wait_until(subscribed, timeout=30, interval=0.2, what="the listener")
        tower.restart_libvirtd(RESTART_AWAY)
        _, event_stderr = events.communicate(timeout=30)
    finally:
        if events.poll() is None:
            events.kill()
            events.wait()
    away = _sim_virsh(tower, ["list"])
    assert events.returncode == 1
    assert event_stderr == DISCONNECTED.format(uri=tower.uri)
    event_stdout = out_path.read_text()
    received = EVENTS_RECEIVED.search(event_stdout)
    assert received is not None, event_stdout
    printed = [line for line in event_stdout.splitlines() if "event '" in line]
    assert int(received.group(1)) == len(printed) > 0
    assert (away.returncode, away.stdout, away.stderr) == (
        1,
        "",
        AWAY.format(path=SIM_SOCKET),
    )
