"""A graceful stop through the guest agent blocks; a guest that shuts itself
down loses its agent first. As libvirt's qemu driver does:

- ``virsh shutdown --mode agent`` (src/qemu/qemu_driver.c
  qemuDomainShutdownFlags -> qemuDomainShutdownFlagsAgent) takes the domain's
  agent job (virDomainObjBeginAgentJob, VIR_AGENT_JOB_MODIFY), sends
  ``guest-shutdown`` (src/qemu/qemu_agent.c qemuAgentShutdown, awaiting
  QEMU_AGENT_EVENT_SHUTDOWN) and waits in qemuAgentSend up to
  VIR_DOMAIN_QEMU_AGENT_COMMAND_SHUTDOWN (60 s). It returns 0 when the guest
  powers off (qemuAgentNotifyEvent) or its agent goes away
  (qemuAgentNotifyCloseLocked: no reply, an awaited event: not an error);
  after 60 s it fails with VIR_ERR_AGENT_UNRESPONSIVE "Guest agent not
  available for now" although the guest may still be going down.
- Meanwhile another agent call on that domain (``qemu-agent-command``:
  qemuDomainQemuAgentCommand begins with virDomainObjBeginAgentJob) waits for
  the agent job up to VIR_JOB_WAIT_TIME (30 s) and then fails in
  virDomainObjBeginJobInternal (src/conf/virdomainjob.c) with
  VIR_ERR_OPERATION_TIMEOUT "cannot acquire state change lock (held by
  agent=%1$s)", the blocked API's name. Its ``--timeout`` bounds the agent's
  reply (qemuAgentArbitraryCommand), not that wait.
- Without ``--mode`` or with ``acpi`` among the modes, a failed agent
  shutdown falls back to ACPI (qemuDomainShutdownFlags: ``ret < 0 &&
  (acpiRequested || !flags)``); ``--mode acpi`` (qemuDomainShutdownFlagsMonitor)
  sends QEMU's system_powerdown and returns at once.
- A guest shutting itself down: its guest agent (stopped by the guest's own
  shutdown) closes the channel seconds before the power-off (QEMU's
  VSERPORT_CHANGE, processSerialChangedEvent -> qemuAgentClose; the
  real-QEMU recording shows ``agent-lifecycle ... 'disconnected' reason:
  'channel event'`` before ``Shutdown Finished``); a ``shutdown --mode agent``
  then fails with "QEMU guest agent is not connected"
  (qemuDomainAgentAvailable) while ``domstate`` still says ``running``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import subprocess
import time

import pytest

from tests.towersim import DomainSpec, Tower
from tests.towersim.helpers import Result, sim
from tests.towersim.model import IN_SHUTDOWN
from tests.towersim.virsh import AGENT_NOT_AVAILABLE, JOB_TIMED_OUT

SCALE = 0.01  # 60 s -> 0.6 s, 30 s -> 0.3 s
# The slow guest's shutdown: well over libvirt's 60 s, and long enough (10 s
# here) that it never ends on its own while a test looks, however loaded the
# machine; a test that wants it off moves the tower's clock on.
SLOW = 1000.0
# libvirt's agent shutdown wait where a test makes a call wait behind it: long
# enough (6 s here) that the call always starts while the job is held; the
# test then moves the clock past it.
LONG_AGENT_WAIT = 600.0
PING = '{"execute":"guest-ping"}'
NOT_CONNECTED = (
    "error: Guest agent is not responding: QEMU guest agent is not connected\n"
)


@pytest.fixture
def tower(tmp_path: Path) -> Tower:
    return Tower.create(
        tmp_path / "t",
        [
            DomainSpec("slow", agent_delay=1.0, shutdown_duration=SLOW),
            DomainSpec("medium", agent_delay=1.0, shutdown_duration=100.0),
            DomainSpec("quick", agent_delay=1.0, shutdown_duration=20.0),
            DomainSpec(
                "deaf", agent_delay=1.0, shutdown_duration=100.0, ignore_acpi=True
            ),
        ],
        time_scale=SCALE,
    )


def _boot(tower: Tower, name: str) -> None:
    assert sim(tower, "start", "--domain", name).rc == 0
    tower.advance(2.0 * SCALE)
    assert tower.agent_connected(name)


@contextmanager
def _agent_shutdown_holding_the_job(
    tower: Tower, name: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``virsh shutdown --mode agent NAME`` running, once it holds the agent job."""
    with subprocess.Popen(
        [str(tower.virsh), "-c", tower.uri, "shutdown", "--mode", "agent", name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as shutdown:
        tower.wait_until(lambda: tower.agent_job_held(name), timeout=10, what="job")
        yield shutdown


def _returned_at_the_power_off(tower: Tower, name: str) -> None:
    """Right after the call: the guest has powered off, and libvirt is
    ending QEMU (``in shutdown``, a short moment) or has (``shut off``);
    then it is shut off."""
    assert tower.domstate(name) in ("in shutdown (unknown)", "shut off (shutdown)")
    tower.wait_until(
        lambda: tower.domstate(name) == "shut off (shutdown)", timeout=10, what="off"
    )


def _timed(tower: Tower, *args: str) -> tuple[Result, float]:
    began = time.monotonic()
    result = sim(tower, *args)
    return result, time.monotonic() - began


def test_libvirt_texts() -> None:
    """virerror.c: VIR_ERR_AGENT_UNRESPONSIVE is "Guest agent is not
    responding: %1$s", VIR_ERR_OPERATION_TIMEOUT "Timed out during operation:
    %1$s"; the blocked API is remoteDispatchDomainShutdownFlags."""
    assert AGENT_NOT_AVAILABLE == (
        "Guest agent is not responding: Guest agent not available for now"
    )
    assert JOB_TIMED_OUT == (
        "Timed out during operation: cannot acquire state change lock "
        "(held by agent=remoteDispatchDomainShutdownFlags)"
    )


def test_agent_shutdown_blocks_until_the_guest_is_off(tower: Tower) -> None:
    """A guest that powers off within 60 s: the call returns then, rc 0.
    It returns at the power-off (QEMU's SHUTDOWN event), while libvirt
    still ends QEMU: ``in shutdown`` for a moment, then ``shut off``."""
    _boot(tower, "quick")
    result, took = _timed(tower, "shutdown", "--mode", "agent", "--domain", "quick")
    assert result == Result(0, "Domain 'quick' is being shutdown\n\n", "")
    assert took >= (20.0 - IN_SHUTDOWN) * SCALE
    _returned_at_the_power_off(tower, "quick")


def test_agent_shutdown_fails_after_60s_while_the_guest_goes_down(
    tower: Tower,
) -> None:
    """A guest that needs longer: the call fails at 60 s, the domain still
    running; it powers off in its own time anyway."""
    _boot(tower, "slow")
    result, took = _timed(tower, "shutdown", "--mode", "agent", "--domain", "slow")
    assert result == Result(
        1,
        "\n",
        f"error: Failed to shutdown domain 'slow'\nerror: {AGENT_NOT_AVAILABLE}\n",
    )
    assert took >= 60.0 * SCALE * 0.9
    assert tower.domstate("slow") == "running (booted)"
    _power_off(tower, "slow")
    assert tower.domstate("slow") == "shut off (shutdown)"


def _power_off(tower: Tower, name: str) -> None:
    """Move the clock past the guest's shutdown, and see it off."""
    tower.advance(SLOW * SCALE)
    tower.wait_until(lambda: not tower.is_running(name), timeout=10, what="off")


def test_the_timeout_is_configurable(tower: Tower) -> None:
    """A guest that needs 100 s, and libvirt waiting 150 s: the call returns
    as it powers off."""
    tower.set_libvirt_waits(agent_shutdown_timeout=150.0)
    _boot(tower, "medium")
    result = sim(tower, "shutdown", "--mode", "agent", "--domain", "medium")
    assert result.rc == 0
    _returned_at_the_power_off(tower, "medium")


def test_a_ping_waits_for_the_agent_job_then_fails(tower: Tower) -> None:
    """While the agent shutdown blocks, a guest-ping (whatever its
    ``--timeout``) waits the job wait time (30 s) and fails with libvirt's
    text; another domain's ping answers at once; a second agent shutdown
    waits for the job too."""
    tower.set_libvirt_waits(agent_shutdown_timeout=LONG_AGENT_WAIT)
    _boot(tower, "slow")
    _boot(tower, "quick")
    with _agent_shutdown_holding_the_job(tower, "slow") as shutdown:
        cmd = ("qemu-agent-command", "--timeout", "1", "--domain")
        other = sim(tower, *cmd, "quick", PING)
        assert other == Result(0, '{"return":{}}\n\n', "")
        result, took = _timed(tower, *cmd, "slow", PING)
        assert result == Result(1, "\n", f"error: {JOB_TIMED_OUT}\n")
        assert took >= 30.0 * SCALE * 0.9
        assert tower.is_running("slow")
        tower.advance(LONG_AGENT_WAIT * SCALE)
        assert shutdown.wait(timeout=10) == 1
    assert not tower.agent_job_held("slow")
    _power_off(tower, "slow")


def test_a_second_agent_shutdown_waits_for_the_job(tower: Tower) -> None:
    tower.set_libvirt_waits(agent_shutdown_timeout=LONG_AGENT_WAIT)
    _boot(tower, "slow")
    with _agent_shutdown_holding_the_job(tower, "slow") as shutdown:
        second = sim(tower, "shutdown", "--mode", "agent", "--domain", "slow")
        assert second == Result(
            1,
            "\n",
            f"error: Failed to shutdown domain 'slow'\nerror: {JOB_TIMED_OUT}\n",
        )
        tower.advance(LONG_AGENT_WAIT * SCALE)
        assert shutdown.wait(timeout=10) == 1


def test_a_ping_after_the_power_off_is_not_running(tower: Tower) -> None:
    """The job ends with the power-off: a waiting ping gets it and finds the
    domain off (virDomainObjCheckActive)."""
    tower.set_libvirt_waits(job_wait=200.0)
    _boot(tower, "quick")
    with _agent_shutdown_holding_the_job(tower, "quick") as shutdown:
        result = sim(tower, "qemu-agent-command", "--domain", "quick", PING)
        assert result == Result(
            1, "\n", "error: Requested operation is not valid: domain is not running\n"
        )
        assert shutdown.wait(timeout=10) == 0


def test_acpi_returns_at_once_and_ignores_the_agent_job(tower: Tower) -> None:
    """The call returns while the guest goes down (it does not wait for the
    power-off), without the agent job."""
    _boot(tower, "slow")
    result = sim(tower, "shutdown", "--mode", "acpi", "--domain", "slow")
    assert result == Result(0, "Domain 'slow' is being shutdown\n\n", "")
    assert tower.is_running("slow")
    assert not tower.agent_job_held("slow")


@pytest.mark.parametrize("mode", [None, "agent,acpi"])
def test_a_timed_out_agent_shutdown_falls_back_to_acpi(
    tower: Tower, mode: str | None
) -> None:
    """Not forced to the agent: after the agent's 60 s, ACPI; rc 0."""
    _boot(tower, "deaf")
    args = ["shutdown", "--domain", "deaf"] + (["--mode", mode] if mode else [])
    result, took = _timed(tower, *args)
    assert result == Result(0, "Domain 'deaf' is being shutdown\n\n", "")
    assert took >= 60.0 * SCALE * 0.9
    tower.wait_until(lambda: not tower.is_running("deaf"), timeout=10, what="off")


def test_the_agent_shutdown_sees_the_stop_and_runs_its_hooks(
    tower: Tower, tmp_path: Path
) -> None:
    """The call returns as the guest powers off (QEMU's SHUTDOWN event ends
    the wait): the domain is ``in shutdown`` or off then, never ``running``
    (the real rig: shut off about 0.2 s later, tests/realvm/test_shutdowns.py);
    the stop's hooks run once it is off."""
    log = tmp_path / "hook.log"
    script = tmp_path / "hook.sh"
    script.write_text(f'#!/bin/sh\necho "$1 $2 $3" >> {log}\n', encoding="utf-8")
    script.chmod(0o755)
    _boot(tower, "quick")
    tower.set_hook([str(script)])
    assert sim(tower, "shutdown", "--mode", "agent", "--domain", "quick").rc == 0
    assert not tower.domstate("quick").startswith("running")
    tower.wait_until(lambda: not tower.is_running("quick"), timeout=10, what="off")
    tower.run_stop_hooks()
    assert log.read_text(encoding="utf-8").splitlines() == [
        "quick stopped end",
        "quick release end",
    ]


def test_a_guest_shutting_itself_down_loses_its_agent_first(tower: Tower) -> None:
    """The agent disconnects at once, the domain runs on for its shutdown
    duration; an agent shutdown meanwhile is refused, a ping too."""
    _boot(tower, "slow")
    tower.guest_shutdown("slow")
    assert not tower.agent_connected("slow")
    assert tower.domstate("slow") == "running (booted)"
    result = sim(tower, "shutdown", "--mode", "agent", "--domain", "slow")
    assert result == Result(
        1, "\n", "error: Failed to shutdown domain 'slow'\n" + NOT_CONNECTED
    )
    assert sim(tower, "qemu-agent-command", "--domain", "slow", PING) == Result(
        1, "\n", NOT_CONNECTED
    )
    tower.advance(50.0 * SCALE)
    assert not tower.agent_connected("slow")  # it never comes back
    _power_off(tower, "slow")
    lines = [line.split(": ", 1)[1] for line in tower.events()]
    gone = lines.index(
        "event 'agent-lifecycle' for domain 'slow': state: 'disconnected' "
        "reason: 'channel event'"
    )
    assert "channel-lifecycle" in lines[gone + 1]
    assert "'disconnected' reason: 'channel event'" in lines[gone + 1]
    assert lines[gone + 2 :] == [
        "event 'lifecycle' for domain 'slow': Shutdown Finished after guest request",
        "event 'lifecycle' for domain 'slow': Stopped Shutdown",
    ]


def test_an_agent_shutdown_ends_when_the_agent_goes_away(tower: Tower) -> None:
    """qemuAgentNotifyCloseLocked: the guest shuts itself down while an agent
    shutdown waits: the agent closes, the call returns 0 at once."""
    _boot(tower, "slow")
    with _agent_shutdown_holding_the_job(tower, "slow") as shutdown:
        tower.guest_shutdown("slow")
        assert shutdown.wait(timeout=10) == 0
    assert tower.is_running("slow")
    assert not tower.agent_job_held("slow")


def test_a_guest_shutdown_racing_the_next_stop(tower: Tower) -> None:
    """``guest_shutdown_on_next_stop``: the next shutdown finds the agent
    gone (once); the guest is off after its shutdown duration."""
    _boot(tower, "slow")
    tower.guest_shutdown_on_next_stop("slow")
    assert tower.agent_connected("slow")
    result = sim(tower, "shutdown", "--mode", "agent", "--domain", "slow")
    assert result.err == "error: Failed to shutdown domain 'slow'\n" + NOT_CONNECTED
    assert tower.domstate("slow") == "running (booted)"
    _power_off(tower, "slow")
    _boot(tower, "slow")
    with _agent_shutdown_holding_the_job(tower, "slow") as shutdown:
        tower.advance(SLOW * SCALE)  # the guest powers off: the wait ends
        assert shutdown.wait(timeout=10) == 0


def test_a_guest_whose_agent_leaves_first_ends_the_wait_at_once(
    tmp_path: Path,
) -> None:
    """Windows stops its services, the guest agent among them, before it
    powers off, whoever asked (``agent_leaves_first``): the agent shutdown's
    wait ends as the channel closes (qemuAgentNotifyCloseLocked), rc 0 at once,
    while the domain runs on without its agent (the real rig's gh.agent_lead,
    tests/realvm/test_shutdowns.py)."""
    tower = Tower.create(
        tmp_path / "t",
        [
            DomainSpec(
                "win",
                agent_delay=1.0,
                shutdown_duration=SLOW,
                agent_leaves_first=True,
            )
        ],
        time_scale=SCALE,
    )
    tower.set_libvirt_waits(agent_shutdown_timeout=1000.0)  # 10 s here
    _boot(tower, "win")
    result, took = _timed(tower, "shutdown", "--mode", "agent", "--domain", "win")
    assert result == Result(0, "Domain 'win' is being shutdown\n\n", "")
    assert took < 5.0  # not libvirt's wait
    assert tower.domstate("win") == "running (booted)"
    assert sim(tower, "qemu-agent-command", "--domain", "win", PING) == Result(
        1, "\n", NOT_CONNECTED
    )
    _power_off(tower, "win")
