"""Real libvirt around guest shutdowns that take their time, and guests whose
agent leaves before they power off; recorded for the tower simulator.

    python -m tests.realvm.record_shutdowns   # rewrites recorded/shutdowns.json

Three guests under the private libvirtd (knobs: build_guest):

- ``slow-stop`` (``gh.shutdown_delay``): qemu-ga's ``guest-shutdown`` powers
  off SHUTDOWN_DELAY s after it ran, the agent connected meanwhile. A
  ``virsh shutdown --mode agent`` blocks until then; a ``guest-ping`` issued
  while it waits waits too.
- ``self-stop`` (``gh.acpi=on gh.agent_lead``): the guest shuts itself down
  (the player quits Windows; here a press of the ACPI power button, which the
  guest takes as its own shutdown): qemu-ga stops first, the power goes
  AGENT_LEAD s later. In that window an agent shutdown, a ping and domstate
  are asked.
- ``agent-leaves`` (``gh.agent_lead``): an agent shutdown whose guest stops
  its agent AGENT_LEAD s before it powers off (a Windows guest stops its
  services, qemu-ga's among them, before it powers off, whoever asked).

The file has the format of recorded/virsh.json (see tests.realvm.record):
``commands`` (exact ``rc``/``stdout``/``stderr``; ``domain_state`` is the
``domstate --reason`` asked last before the call: for the calls made while
the slow guest's shutdown blocked, the one asked meanwhile) and ``events``
per domain. Some answers race inside libvirtd
(RACY_CASES: which of two of its threads runs first); a run may record any
of the answers listed there, and the tests compare those by membership.
``run_scenario`` also measures (``Recording.timings``, not in the file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from custom_components.gpu_handoff.tower.gpu_handoff.virsh import cmd_ping
from tests.realvm import record
from tests.realvm.qemu_libvirtd import (
    EventLog,
    QemuLibvirtd,
    agent_shutdown_answers,
    define_guest,
)
from tests.realvm.record import (
    EVENT_DOMAIN_RE,
    SHUTDOWN_TIMEOUT,
    Recording,
    _Recorder,
    _versions,
    command_entry,
    record_to,
)
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.realvm.build_guest import Guest

RECORDED = Path(__file__).parent / "recorded" / "shutdowns.json"

SLOW = "slow-stop"
SELF = "self-stop"
LEAVES = "agent-leaves"
SHUTDOWN_DELAY = 4
AGENT_LEAD = 4

NOT_CONNECTED = (
    "error: Guest agent is not responding: QEMU guest agent is not connected\n"
)
NOT_RUNNING = "error: Requested operation is not valid: domain is not running\n"

# The cases whose answer depends on which libvirtd thread runs first, and the
# answers they may have (exactly these; see the tests' docstrings):
# - the agent shutdown's wait ends at the first of QEMU's SHUTDOWN event
#   (qemuProcessHandleShutdown: "in shutdown (unknown)", then
#   qemuAgentNotifyEvent) and the guest's power-off closing qemu-ga's channel
#   (processSerialChangedEvent -> qemuAgentClose -> qemuAgentNotifyCloseLocked:
#   still "running", the agent gone); the domain is stopped (qemuProcessStop)
#   a moment later;
# - the ping that waited for the agent job gets it right then, and fails on
#   whichever of the two came first (qemuDomainAgentAvailable);
# - the agent shutdown itself fails with "End of file from agent socket" when
#   QEMU's exit closes the agent's socket first (agent_shutdown_answers).
RACY_CASES: dict[str, tuple[tuple[int, str, str], ...]] = {
    "domstate right after the agent shutdown returned": tuple(
        (0, f"{state}\n\n", "")
        for state in (
            "running (booted)",
            "in shutdown (unknown)",
            "shut off (shutdown)",
        )
    ),
    "shutdown --mode agent of a guest that takes its time": agent_shutdown_answers(
        SLOW
    ),
    "guest-ping while the agent shutdown waits": (
        (1, "\n", NOT_RUNNING),
        (1, "\n", NOT_CONNECTED),
    ),
}


def agent_ping_argv(domain: str) -> list[str]:
    """The tower agent's own guest-ping (``qemu-agent-command --timeout``)."""
    return cmd_ping(domain)


type Virsh = Callable[[list[str]], subprocess.CompletedProcess[str]]


class Call:
    """A virsh call running in the background (``virsh`` runs it: the real
    one or the simulator's): its result and when it ended."""

    def __init__(self, virsh: Virsh, argv: list[str]) -> None:
        self.argv = argv
        self._done: tuple[subprocess.CompletedProcess[str], float] | None = None
        self.began = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(virsh,), daemon=True)
        self._thread.start()

    def _run(self, virsh: Virsh) -> None:
        result = virsh(self.argv)
        self._done = (result, time.monotonic())

    def wait(self) -> tuple[subprocess.CompletedProcess[str], float]:
        """The result and the (monotonic) time the call returned."""
        self._thread.join(SHUTDOWN_TIMEOUT + 60)
        if self._done is None:
            raise TimeoutError(f"virsh {' '.join(self.argv)} did not return")
        return self._done


@dataclass
class ShutdownRecording(Recording):
    # every distinct ``domstate --reason`` seen from the slow guest's agent
    # shutdown returning until it was shut off (not part of the file)
    states_after_return: list[str] = field(default_factory=list)


def _serial_shows(serial: Path, text: str, what: str) -> None:
    wait_until(
        lambda: text in serial.read_text(errors="replace"),
        timeout=SHUTDOWN_TIMEOUT,
        interval=0.02,
        what=what,
    )


def run_scenario(daemon: QemuLibvirtd, guest: Guest) -> ShutdownRecording:
    rec = ShutdownRecording(versions=_versions(daemon, guest))
    r = _Recorder(daemon, rec)
    events = EventLog(daemon, "shutdown-events")
    try:
        serials = {
            SLOW: define_guest(
                daemon, guest, SLOW, knobs=f"gh.shutdown_delay={SHUTDOWN_DELAY}"
            ),
            SELF: define_guest(
                daemon, guest, SELF, knobs=f"gh.acpi=on gh.agent_lead={AGENT_LEAD}"
            ),
            LEAVES: define_guest(
                daemon, guest, LEAVES, knobs=f"gh.agent_lead={AGENT_LEAD}"
            ),
        }
        # Two boot at once; the third boots while the first two are stopped
        # (they mostly wait), so that the run takes little longer than two;
        # the self-stopping guest goes down while the third is stopped.
        started = time.monotonic()
        for name in (SLOW, SELF):
            r.run("start", ["start", name], name)
        for name in (SLOW, SELF):
            r.wait_ping(name)
        _serial_shows(
            serials[SELF],
            "honouring the ACPI power button",
            "the self-stopping guest to watch its power button",
        )
        rec.timings["boot_two_guests"] = time.monotonic() - started
        third = time.monotonic()
        r.run("start", ["start", LEAVES], LEAVES)
        _slow_guest(daemon, r, rec, serials[SLOW])
        _guest_shuts_itself_down(r, rec, events)
        r.wait_ping(LEAVES)
        rec.timings["third_guest_up_after"] = time.monotonic() - third
        # The self-stopping guest goes down meanwhile (its events tell when).
        _agent_leaves_during_the_shutdown(r, rec)
        r.wait_shut_off(SELF)
        r.run(
            "domstate after the guest shut itself down",
            ["domstate", "--reason", SELF],
            SELF,
        )
        for name, serial in serials.items():
            events.wait_for(f"for domain '{name}': Stopped", timeout=SHUTDOWN_TIMEOUT)
            rec.serial[name] = serial.read_text(errors="replace")
    finally:
        lines = events.stop()
    for line in lines:
        match = EVENT_DOMAIN_RE.search(line)
        if match:
            rec.events.setdefault(match.group("domain"), []).append(line)
    for name in (SLOW, SELF, LEAVES):
        daemon.virsh("undefine", name)
    return rec


def _slow_guest(
    daemon: QemuLibvirtd, r: _Recorder, rec: ShutdownRecording, serial: Path
) -> None:
    before = r.state(SLOW)
    stop_argv = ["shutdown", "--mode", "agent", "--domain", SLOW]

    def virsh(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return daemon.virsh(*argv, timeout=SHUTDOWN_TIMEOUT + 30)

    stop = Call(virsh, stop_argv)
    # The shim runs: guest-shutdown reached the guest, the agent job is held.
    _serial_shows(serial, "gh-guest: going down in", "the slow guest's shim")
    rec.timings["slow_shim_after"] = time.monotonic() - stop.began
    during = r.state(SLOW)
    ping = Call(virsh, agent_ping_argv(SLOW))
    rec.timings["slow_ping_issued_after"] = ping.began - stop.began
    state_during = daemon.virsh("domstate", "--reason", SLOW)
    stopped, stop_ended = stop.wait()
    right_after = daemon.virsh("domstate", "--reason", SLOW)
    seen = [right_after.stdout.strip()]
    while not seen[-1].startswith("shut off"):
        if time.monotonic() - stop_ended > SHUTDOWN_TIMEOUT:
            break
        seen.append(r.state(SLOW) or "")
    rec.timings["slow_off_after_return"] = time.monotonic() - stop_ended
    rec.states_after_return = list(dict.fromkeys(seen))
    pinged, ping_ended = ping.wait()
    rec.timings["slow_shutdown_took"] = stop_ended - stop.began
    rec.timings["slow_ping_took"] = ping_ended - ping.began
    rec.timings["slow_ping_ended_after_shutdown"] = ping_ended - stop_ended
    # In the order they were issued; the calls made while the shutdown
    # blocked have the state asked meanwhile as their domain_state.
    rec.commands += [
        command_entry(
            "shutdown --mode agent of a guest that takes its time",
            before,
            stop_argv,
            stopped,
        ),
        command_entry(
            "guest-ping while the agent shutdown waits",
            during,
            agent_ping_argv(SLOW),
            pinged,
        ),
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
    ]
    r.wait_shut_off(SLOW)
    r.run(
        "domstate after the slow guest powered off",
        ["domstate", "--reason", SLOW],
        SLOW,
    )


def _guest_shuts_itself_down(
    r: _Recorder, rec: ShutdownRecording, events: EventLog
) -> None:
    pressed = time.monotonic()
    r.run(
        "shutdown --mode acpi of a guest that shuts itself down",
        ["shutdown", "--mode", "acpi", "--domain", SELF],
        SELF,
    )
    gone = (
        f"event 'agent-lifecycle' for domain '{SELF}': "
        "state: 'disconnected' reason: 'channel event'"
    )
    events.wait_for(gone, timeout=SHUTDOWN_TIMEOUT)
    window = time.monotonic()
    rec.timings["self_agent_gone_after_press"] = window - pressed
    r.run(
        "domstate after the guest's agent left",
        ["domstate", "--reason", SELF],
        SELF,
    )
    r.run(
        "shutdown --mode agent after the guest's agent left",
        ["shutdown", "--mode", "agent", "--domain", SELF],
        SELF,
    )
    r.run("guest-ping after the guest's agent left", agent_ping_argv(SELF), SELF)
    r.run(
        "domstate after the guest's agent left, again",
        ["domstate", "--reason", SELF],
        SELF,
    )
    rec.timings["self_window_commands_took"] = time.monotonic() - window


def _agent_leaves_during_the_shutdown(r: _Recorder, rec: ShutdownRecording) -> None:
    began = time.monotonic()
    r.run(
        "shutdown --mode agent of a guest whose agent leaves first",
        ["shutdown", "--mode", "agent", "--domain", LEAVES],
        LEAVES,
    )
    returned = time.monotonic()
    rec.timings["leaves_shutdown_took"] = returned - began
    r.run(
        "domstate right after the agent left",
        ["domstate", "--reason", LEAVES],
        LEAVES,
    )
    r.run("guest-ping after the agent left", agent_ping_argv(LEAVES), LEAVES)
    rec.timings["leaves_window_commands_took"] = time.monotonic() - returned
    r.wait_shut_off(LEAVES)
    rec.timings["leaves_off_after_return"] = time.monotonic() - returned
    r.run(
        "domstate after the guest whose agent left powered off",
        ["domstate", "--reason", LEAVES],
        LEAVES,
    )


def comparable(commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The commands with each racy answer that is one of RACY_CASES' replaced
    by a mark (an unexpected answer stays as it is)."""
    return record.comparable(commands, RACY_CASES)


def main() -> None:
    rec = record_to(RECORDED, run_scenario, "tests.realvm.record_shutdowns")
    assert isinstance(rec, ShutdownRecording)
    for key, value in rec.timings.items():
        print(f"{key}: {value:.2f} s")
    print(f"states after the slow agent shutdown returned: {rec.states_after_return}")


if __name__ == "__main__":
    main()
