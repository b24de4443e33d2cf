"""Graceful stops that take their time, and guest agents that leave before
the power-off, against real libvirt + QEMU + qemu-ga.

One run (tests.realvm.record_shutdowns.run_scenario) serves every test: the
guests ``slow-stop`` (qemu-ga's guest-shutdown powers off SHUTDOWN_DELAY s
later, the agent connected meanwhile), ``self-stop`` (the guest shuts itself
down: qemu-ga stops AGENT_LEAD s before the power-off) and ``agent-leaves``
(an agent shutdown whose guest stops qemu-ga AGENT_LEAD s before it powers
off). The last test compares the run with the committed recording
(recorded/shutdowns.json) that the tower simulator's conformance tests use.

libvirt's sources cited are src/qemu/qemu_driver.c, src/qemu/qemu_agent.c,
src/qemu/qemu_process.c, src/qemu/qemu_domain.c and src/conf/virdomainjob.c.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import TYPE_CHECKING

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff.virsh import cmd_ping
from tests.realvm.record import TIMESTAMP_RE
from tests.realvm.record_shutdowns import (
    AGENT_LEAD,
    LEAVES,
    NOT_CONNECTED,
    RACY_CASES,
    RECORDED,
    SELF,
    SHUTDOWN_DELAY,
    SLOW,
    ShutdownRecording,
    comparable,
    run_scenario,
)

if TYPE_CHECKING:
    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

pytestmark = pytest.mark.system

# The domain is stopped this soon after the agent shutdown returned, at most
# (measured: about 0.2 s, QEMU's end after qemuProcessShutdownOrReboot).
STOPPED_WITHIN = 3.0
# Slack for the guest's own timers and virsh's start-up on a busy machine.
SLACK = 1.5
# An agent shutdown that returns this soon after the guest went down did not
# wait for libvirt's 60 s.
RETURNED_WITHIN = 10.0
RACY_DISCONNECT = re.compile(r"state: 'disconnected' reason: 'channel event'")


@pytest.fixture(scope="module")
def run(
    qemu_libvirtd: QemuLibvirtd, guest: Guest, realvm_timings: dict[str, float]
) -> ShutdownRecording:
    recording = run_scenario(qemu_libvirtd, guest)
    realvm_timings.update({f"shutdowns {k}": v for k, v in recording.timings.items()})
    return recording


def _answer(entry: dict[str, object]) -> tuple[object, object, object]:
    return entry["rc"], entry["stdout"], entry["stderr"]


def _bare(lines: list[str]) -> list[str]:
    return [TIMESTAMP_RE.sub("", line) for line in lines]


def _epoch(line: str) -> float:
    stamp = line.split(": event ", 1)[0]
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f%z").timestamp()


def _event(lines: list[str], text: str) -> tuple[int, float]:
    """Where the line ending in ``text`` is, and its time."""
    index = next(i for i, line in enumerate(lines) if line.endswith(text))
    return index, _epoch(lines[index])


def test_an_agent_shutdown_blocks_until_the_guest_goes_down(
    run: ShutdownRecording,
) -> None:
    """``virsh shutdown --mode agent`` returns rc 0 only once the guest goes
    down, SHUTDOWN_DELAY s after the request; the domain is shut off a moment
    (not seconds) after that, and may still be ``running`` or ``in
    shutdown`` when the call has returned.

    qemuDomainShutdownFlags -> qemuDomainShutdownFlagsAgent takes the agent
    job (virDomainObjBeginAgentJob, VIR_AGENT_JOB_MODIFY) and calls
    qemuAgentShutdown, which sends ``guest-shutdown`` with ``await_event =
    QEMU_AGENT_EVENT_SHUTDOWN`` and waits in qemuAgentSend up to
    VIR_DOMAIN_QEMU_AGENT_COMMAND_SHUTDOWN, 60 s (qemu-ga sends no reply to
    guest-shutdown); past that it fails with VIR_ERR_AGENT_UNRESPONSIVE
    "Guest agent is not responding: Guest agent not available for now". (Not
    waited for here: the bound is libvirt's constant.) The wait ends at the
    first of two signs of the power-off: QEMU's SHUTDOWN event
    (qemuProcessHandleShutdown sets VIR_DOMAIN_SHUTDOWN /
    VIR_DOMAIN_SHUTDOWN_UNKNOWN, "in shutdown (unknown)", and calls
    qemuAgentNotifyEvent), or the guest's power-off closing qemu-ga's
    channel first (VSERPORT_CHANGE: processSerialChangedEvent ->
    qemuAgentClose -> qemuAgentNotifyCloseLocked; an awaited event and no
    reply is success in qemuAgentCommandFull) while the domain is still
    ``running``. The domain is stopped (qemuProcessStop, ``Stopped
    Shutdown``) once qemuProcessShutdownOrReboot has ended QEMU."""
    stop = run.command("shutdown --mode agent of a guest that takes its time")
    assert stop["domain_state"] == "running (booted)"
    # Success, or the race with QEMU's exit (RACY_CASES): either way after
    # the guest went down.
    assert _answer(stop) in RACY_CASES[stop["case"]]
    took = run.timings["slow_shutdown_took"]
    assert SHUTDOWN_DELAY <= took < SHUTDOWN_DELAY + RETURNED_WITHIN, run.timings
    during = run.command("domstate while the agent shutdown waits")
    assert during["stdout"] == "running (booted)\n\n"
    right_after = run.command("domstate right after the agent shutdown returned")
    assert _answer(right_after) in RACY_CASES[right_after["case"]]
    assert run.timings["slow_off_after_return"] < STOPPED_WITHIN, run.timings
    assert set(run.states_after_return) <= {
        answer[1].strip() for answer in RACY_CASES[right_after["case"]]
    }
    assert run.command("domstate after the slow guest powered off")["stdout"] == (
        "shut off (shutdown)\n\n"
    )
    serial = run.serial[SLOW]
    assert "gh-guest: shutdown -h -P +0" in serial
    assert f"gh-guest: going down in {SHUTDOWN_DELAY} s" in serial
    lines = run.events[SLOW]
    finished, _ = _event(lines, "Shutdown Finished after guest request")
    stopped, _ = _event(lines, "Stopped Shutdown")
    assert finished < stopped


def test_a_ping_waits_for_the_blocked_agent_shutdown(run: ShutdownRecording) -> None:
    """The tower agent's ``qemu-agent-command --timeout 2 ... guest-ping``
    (its cmd_ping), issued while the agent shutdown waits, answers only when
    that shutdown returns (well after its own ``--timeout``), and fails: it
    waited for the agent job.

    qemuDomainQemuAgentCommand begins with virDomainObjBeginAgentJob, which
    waits while the shutdown holds the job (virDomainObjBeginJobInternal,
    up to VIR_JOB_WAIT_TIME, 30 s, then VIR_ERR_OPERATION_TIMEOUT "cannot
    acquire state change lock (held by agent=...)"); ``--timeout`` bounds
    only the agent's reply (qemuAgentArbitraryCommand), not that wait. Once it
    has the job, virDomainObjCheckActive passes (QEMU still runs) and
    qemuDomainAgentAvailable fails on whichever sign of the power-off came
    first (see the test above): "Requested operation is not valid: domain is
    not running" (VIR_ERR_OPERATION_INVALID, the state is
    VIR_DOMAIN_SHUTDOWN) or "Guest agent is not responding: QEMU guest agent
    is not connected" (VIR_ERR_AGENT_UNRESPONSIVE, priv->agent closed)."""
    ping = run.command("guest-ping while the agent shutdown waits")
    assert ping["argv"] == cmd_ping(SLOW)
    timeout = int(ping["argv"][ping["argv"].index("--timeout") + 1])
    assert timeout + 1 < SHUTDOWN_DELAY  # else the wait would show nothing
    assert ping["domain_state"] == "running (booted)"
    assert _answer(ping) in RACY_CASES[ping["case"]]
    t = run.timings
    # Issued well before the shutdown returned, it outlasted its --timeout
    # and returned with the shutdown.
    assert t["slow_ping_issued_after"] < t["slow_shutdown_took"] - timeout - 1, t
    assert t["slow_ping_took"] > timeout + 0.5, t
    assert abs(t["slow_ping_ended_after_shutdown"]) < 1.0, t


def test_a_guest_shutting_itself_down_loses_its_agent_first(
    run: ShutdownRecording,
) -> None:
    """The guest shuts itself down (here the ACPI power button it takes as
    its own shutdown): qemu-ga stops first; for the AGENT_LEAD s until the
    power-off the domain is ``running (booted)``, an agent shutdown fails at
    once and so does a ping; the events show the agent gone before the
    domain stops.

    QEMU reports the closed port (VSERPORT_CHANGE); processSerialChangedEvent
    closes libvirt's agent (qemuAgentClose, priv->agent = NULL) and emits
    ``agent-lifecycle`` disconnected with
    VIR_CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_REASON_CHANNEL ("channel
    event"). qemuDomainShutdownFlagsAgent then fails in
    qemuDomainAgentAvailable: a configured channel without an agent is
    VIR_ERR_AGENT_UNRESPONSIVE "QEMU guest agent is not connected"; virsh
    prints cmdShutdown's "Failed to shutdown domain" before it."""
    press = run.command("shutdown --mode acpi of a guest that shuts itself down")
    assert _answer(press) == (0, f"Domain '{SELF}' is being shutdown\n\n", "")
    window = [
        "domstate after the guest's agent left",
        "shutdown --mode agent after the guest's agent left",
        "guest-ping after the guest's agent left",
        "domstate after the guest's agent left, again",
    ]
    states, stop, ping, again = (run.command(case) for case in window)
    assert all(
        run.command(case)["domain_state"] == "running (booted)" for case in window
    )
    assert states["stdout"] == again["stdout"] == "running (booted)\n\n"
    assert _answer(stop) == (
        1,
        "\n",
        f"error: Failed to shutdown domain '{SELF}'\n{NOT_CONNECTED}",
    )
    assert _answer(ping) == (1, "\n", NOT_CONNECTED)
    t = run.timings
    assert t["self_window_commands_took"] < AGENT_LEAD - SLACK, t
    assert run.command("domstate after the guest shut itself down")["stdout"] == (
        "shut off (shutdown)\n\n"
    )
    lines = run.events[SELF]
    gone, gone_at = _event(lines, "state: 'disconnected' reason: 'channel event'")
    assert "'agent-lifecycle'" in lines[gone]
    finished, finished_at = _event(lines, "Shutdown Finished after guest request")
    stopped, stopped_at = _event(lines, "Stopped Shutdown")
    assert gone < finished < stopped, lines
    assert AGENT_LEAD - SLACK < finished_at - gone_at < AGENT_LEAD + 5, lines
    assert stopped_at - finished_at < STOPPED_WITHIN, lines
    assert "qemu-ga stopped" in run.serial[SELF]


def test_an_agent_shutdown_returns_when_the_agent_leaves(
    run: ShutdownRecording,
) -> None:
    """A guest that stops its agent before it powers off (as Windows stops
    qemu-ga's service on its way down): ``virsh shutdown --mode agent``
    returns rc 0 at once, while the domain runs on for AGENT_LEAD s, its
    agent gone.

    qemuAgentShutdown's wait in qemuAgentSend is ended by the channel's
    close (processSerialChangedEvent -> qemuAgentClose ->
    qemuAgentNotifyCloseLocked); qemuAgentCommandFull takes no reply with an
    awaited event for success. So rc 0 says the guest is going down, not that
    it is off."""
    stop = run.command("shutdown --mode agent of a guest whose agent leaves first")
    assert stop["domain_state"] == "running (booted)"
    assert _answer(stop) == (0, f"Domain '{LEAVES}' is being shutdown\n\n", "")
    t = run.timings
    assert t["leaves_shutdown_took"] < AGENT_LEAD, t
    after = run.command("domstate right after the agent left")
    assert after["stdout"] == "running (booted)\n\n"
    ping = run.command("guest-ping after the agent left")
    assert ping["domain_state"] == "running (booted)"
    assert _answer(ping) == (1, "\n", NOT_CONNECTED)
    assert t["leaves_window_commands_took"] < AGENT_LEAD - SLACK, t
    assert AGENT_LEAD - SLACK < t["leaves_off_after_return"] < AGENT_LEAD + 5, t
    assert run.command("domstate after the guest whose agent left powered off")[
        "stdout"
    ] == ("shut off (shutdown)\n\n")
    lines = run.events[LEAVES]
    gone, gone_at = _event(lines, "state: 'disconnected' reason: 'channel event'")
    finished, finished_at = _event(lines, "Shutdown Finished after guest request")
    assert gone < finished, lines
    assert finished_at - gone_at > AGENT_LEAD - SLACK, lines
    assert "gh-guest: shutdown -h -P +0" in run.serial[LEAVES]


def _comparable_events(events: dict[str, list[str]]) -> dict[str, list[str]]:
    # Only the slow guest's power-off races its agent's channel close.
    return {
        domain: [
            line
            for line in _bare(lines)
            if not (domain == SLOW and RACY_DISCONNECT.search(line))
        ]
        for domain, lines in events.items()
    }


def test_the_committed_recording_matches_this_run(run: ShutdownRecording) -> None:
    """recorded/shutdowns.json is what the simulator is held to; regenerate
    it with ``python -m tests.realvm.record_shutdowns`` when libvirt's
    answers change."""
    committed = json.loads(RECORDED.read_text())
    live = run.as_json()
    assert comparable(committed["commands"]) == comparable(live["commands"])
    assert _comparable_events(committed["events"]) == _comparable_events(live["events"])
