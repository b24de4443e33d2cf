"""What real libvirt + QEMU + qemu-ga do, pinned on this machine's versions.

One scenario (tests.realvm.record.run_scenario) boots three TCG guests: a
"gpu-node" whose guest agent starts a few seconds after boot, then two at once
that ignore and honour the ACPI power button. Every test below reads what that
run recorded; the last one compares it with the committed recording
(recorded/virsh.json) that the tower simulator's conformance tests use.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import pytest

from tests.realvm.record import (
    ACPI_HONOURED,
    ACPI_IGNORED,
    GPU_NODE,
    RACY_CASES,
    RECORDED,
    TIMESTAMP_RE,
    Recording,
    comparable,
    run_scenario,
)

if TYPE_CHECKING:
    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

pytestmark = pytest.mark.system

NOT_CONNECTED = (
    "error: Guest agent is not responding: QEMU guest agent is not connected\n"
)


@pytest.fixture(scope="module")
def rig(
    qemu_libvirtd: QemuLibvirtd, guest: Guest, realvm_timings: dict[str, float]
) -> Recording:
    recording = run_scenario(qemu_libvirtd, guest)
    realvm_timings.update({f"rig {k}": v for k, v in recording.timings.items()})
    return recording


def events_without_time(lines: list[str]) -> list[str]:
    return [TIMESTAMP_RE.sub("", line) for line in lines]


def test_guest_ping_before_the_agent_is_up_is_not_connected(rig: Recording) -> None:
    ping = rig.command("guest-ping before the agent is up")
    assert ping["domain_state"] == "running (booted)"
    assert (ping["rc"], ping["stdout"], ping["stderr"]) == (1, "\n", NOT_CONNECTED)


def test_guest_ping_answers_once_the_agent_is_up(rig: Recording) -> None:
    ping = rig.command("guest-ping after the agent is up")
    assert (ping["rc"], ping["stdout"], ping["stderr"]) == (0, '{"return":{}}\n\n', "")


def test_agent_shutdown_before_the_agent_is_up_fails_at_once(rig: Recording) -> None:
    stop = rig.command("shutdown --mode agent before the agent is up")
    assert stop["rc"] == 1
    assert (
        stop["stderr"]
        == f"error: Failed to shutdown domain '{GPU_NODE}'\n{NOT_CONNECTED}"
    )
    # ...and the guest keeps running: nothing was stopped.
    assert rig.command("domstate while booting")["stdout"] == "running (booted)\n\n"


def test_agent_shutdown_after_the_agent_is_up_shuts_the_domain_off(
    rig: Recording,
) -> None:
    stop = rig.command("shutdown --mode agent after the agent is up")
    # Success, or the race with QEMU's exit that a loaded machine may lose.
    assert (stop["rc"], stop["stdout"], stop["stderr"]) in RACY_CASES[stop["case"]]
    after = rig.command("domstate after an agent shutdown")
    assert after["stdout"] == "shut off (shutdown)\n\n"
    assert "gh-guest: shutdown -h -P +0" in rig.serial[GPU_NODE]


def test_domstate_reason_texts(rig: Recording) -> None:
    assert (
        rig.command("domstate of a defined domain")["stdout"]
        == "shut off (unknown)\n\n"
    )
    assert rig.command("domstate while booting")["stdout"] == "running (booted)\n\n"
    assert rig.command("domstate after an agent shutdown")["stdout"] == (
        "shut off (shutdown)\n\n"
    )
    missing = rig.command("domstate of a missing domain")
    assert (missing["rc"], missing["stderr"]) == (
        1,
        "error: failed to get domain 'no-such-domain'\n",
    )


def test_lifecycle_and_agent_lifecycle_events(rig: Recording) -> None:
    lines = rig.events[GPU_NODE]
    assert all(TIMESTAMP_RE.match(line) for line in lines), lines
    prefix = f"event 'lifecycle' for domain '{GPU_NODE}': "
    agent = f"event 'agent-lifecycle' for domain '{GPU_NODE}': "
    expected_in_order = [
        prefix + "Defined Added",
        agent + "state: 'disconnected' reason: 'domain started'",
        prefix + "Started Booted",
        agent + "state: 'connected' reason: 'channel event'",
        prefix + "Shutdown Finished after guest request",
        prefix + "Stopped Shutdown",
    ]
    bare = events_without_time(lines)
    positions = [bare.index(line) for line in expected_in_order]
    assert positions == sorted(positions), bare
    assert not any("Destroyed" in line for line in bare)


def test_a_guest_ignoring_acpi_keeps_running_after_an_acpi_shutdown(
    rig: Recording,
) -> None:
    """The honouring guest is the control: the same request, sent at the same
    moment, shut it off; the ignoring guest was still running after the bound
    (max of 10 s and 3x the control's time) and its agent still answered."""
    for name in (ACPI_IGNORED, ACPI_HONOURED):
        request = next(
            c
            for c in rig.commands
            if c["case"] == "shutdown --mode acpi" and c["argv"][-1] == name
        )
        assert (request["rc"], request["stdout"]) == (
            0,
            f"Domain '{name}' is being shutdown\n\n",
        )
    assert rig.command("domstate after an ACPI shutdown")["stdout"] == (
        "shut off (shutdown)\n\n"
    )
    assert "ACPI power button pressed" in rig.serial[ACPI_HONOURED]
    assert rig.command("domstate after an ignored ACPI shutdown")["stdout"] == (
        "running (booted)\n\n"
    )
    assert rig.command("guest-ping after an ignored ACPI shutdown")["rc"] == 0
    assert "ignoring the ACPI power button" in rig.serial[ACPI_IGNORED]


def test_no_qemu_process_is_left_once_every_guest_shut_off(
    rig: Recording, qemu_libvirtd: QemuLibvirtd
) -> None:
    assert rig.command("domstate after an agent shutdown")["rc"] == 0
    assert qemu_libvirtd.virsh("list", "--name").stdout.split() == []
    assert qemu_libvirtd.qemu_pids() == []


def _comparable_events(events: dict[str, list[str]]) -> dict[str, list[str]]:
    # An agent that the guest's own poweroff disconnects may or may not report
    # it before the lifecycle event: that line is a race, not behaviour.
    racy = re.compile(r"state: 'disconnected' reason: 'channel event'")
    return {
        domain: [line for line in events_without_time(lines) if not racy.search(line)]
        for domain, lines in events.items()
    }


def test_the_committed_recording_matches_this_run(rig: Recording) -> None:
    """recorded/virsh.json is what the simulator is held to; regenerate it with
    `python -m tests.realvm.record` when libvirt's answers change."""
    committed = json.loads(RECORDED.read_text())
    live = rig.as_json()
    assert comparable(committed["commands"]) == comparable(live["commands"])
    assert _comparable_events(committed["events"]) == _comparable_events(live["events"])
