"""The rest of libvirt's state model in the tower simulator: ``paused``,
``crashed``, ``in shutdown``, and libvirtd restarting under running domains.

Each test cites the libvirt sources it reproduces. What real virsh prints when
libvirtd goes away under ``virsh event --loop`` and when nothing answers a new
connection was read off a real libvirtd (tests/realvm's private daemon,
stopped under a running ``virsh -c URI event --loop --all --timestamp``):

    stdout: "events received: 0\\n\\n"   rc 1
    stderr: "error: Disconnected from URI due to end of file\\n"
            "error: internal error: client socket is closed\\n"
    a later ``virsh -c URI list``: rc 1, no output,
            "error: failed to connect to the hypervisor\\n"
            "error: Failed to connect socket to 'PATH': No such file or directory\\n"
    ``virsh 'echo a ; list'`` without -c: "a\\n\\n" (echo needs no connection)
"""

from __future__ import annotations

from pathlib import Path
import subprocess
import time

import pytest

from tests.towersim import DomainSpec, Tower
from tests.towersim.helpers import run, sim
from tests.towersim.test_hook_lifecycle import install_recorder, ops, stop_ops

FAST = 0.01
NOT_RUNNING = "error: Requested operation is not valid: domain is not running\n"
PING = '{"execute":"guest-ping"}'
CONNECT_FAILED = (
    "error: failed to connect to the hypervisor\n"
    "error: Failed to connect socket to '/var/run/libvirt/libvirt-sock': "
    "No such file or directory\n"
)


@pytest.fixture
def vm(tmp_path: Path) -> Tower:
    """One running domain with its guest agent up (``vm``) and one shut off."""
    return Tower.create(
        tmp_path / "t",
        [DomainSpec("vm", running=True), DomainSpec("other", agent_delay=None)],
        time_scale=FAST,
    )


def ping(tower: Tower, name: str = "vm") -> tuple[int, str]:
    result = sim(tower, "qemu-agent-command", "--domain", name, PING)
    return result.rc, result.err


# --- paused -------------------------------------------------------------------


def test_paused_domain_answers_nothing(vm: Tower) -> None:
    """qemuDomainSuspend: ``paused (user)`` (virshDomainStateReasonToString,
    VIR_DOMAIN_PAUSED_USER), listed as ``paused``, still active. A guest agent
    command and both shutdown modes need VIR_DOMAIN_RUNNING
    (qemuDomainAgentAvailable, qemuDomainShutdownFlagsAgent and
    qemuDomainShutdownFlagsMonitor: VIR_ERR_OPERATION_INVALID "domain is not
    running"); lifecycle events ``Suspended Paused`` and ``Resumed Unpaused``."""
    assert ping(vm) == (0, "")
    vm.pause("vm")
    assert vm.domstate("vm") == "paused (user)"
    assert "paused" in sim(vm, "list").out
    assert sim(vm, "list", "--state-running", "--name").out == "\n"
    assert sim(vm, "list", "--state-paused", "--name").out == "vm\n\n"
    assert ping(vm) == (1, NOT_RUNNING)
    for mode in ("agent", "acpi"):
        result = sim(vm, "shutdown", "--mode", mode, "--domain", "vm")
        assert (result.rc, result.err) == (
            1,
            "error: Failed to shutdown domain 'vm'\n" + NOT_RUNNING,
        )
    assert vm.is_running("vm")
    vm.resume("vm")
    assert vm.domstate("vm") == "running (booted)"
    assert ping(vm) == (0, "")
    events = [e.split(": ", 1)[1] for e in vm.events() if "'vm'" in e]
    assert events[-2:] == [
        "event 'lifecycle' for domain 'vm': Suspended Paused",
        "event 'lifecycle' for domain 'vm': Resumed Unpaused",
    ]


def test_pause_holds_a_shutdown_under_way(vm: Tower) -> None:
    """A paused guest's vCPUs do not run: a shutdown it began goes on only
    after the resume (QEMU stops the vCPUs; the guest's own time stops)."""
    vm.set_shutdown_duration("vm", 20)  # 0.2 s here
    assert sim(vm, "shutdown", "--mode", "acpi", "--domain", "vm").rc == 0
    vm.pause("vm")
    time.sleep(0.4)
    assert vm.domstate("vm") == "paused (user)"
    vm.resume("vm")
    assert vm.is_running("vm")
    vm.wait_until(lambda: not vm.is_running("vm"), timeout=5, what="shut off")
    assert vm.domstate("vm") == "shut off (shutdown)"


# --- crashed ------------------------------------------------------------------


def test_crash_preserved_and_destroyed(tmp_path: Path) -> None:
    """A guest panic (qemuProcessHandleGuestPanic): the event ``Crashed
    Panicked``; with ``<on_crash>preserve</on_crash>`` the domain stays
    ``crashed (panicked)`` (VIR_DOMAIN_CRASHED_PANICKED), active and answering
    nothing; with the default (destroy) qemuProcessStop makes it ``shut off
    (crashed)``, runs its stop hooks with the reason ``crashed`` and sends
    ``Stopped Crashed``."""
    tower = Tower.create(
        tmp_path / "t",
        [DomainSpec("kept", running=True), DomainSpec("gone", running=True)],
        time_scale=FAST,
    )
    log = install_recorder(tower, tmp_path / "hook")
    tower.crash("kept", preserve=True)
    assert tower.domstate("kept") == "crashed (panicked)"
    assert ping(tower, "kept") == (1, NOT_RUNNING)
    result = sim(tower, "shutdown", "--domain", "kept")
    assert result.rc == 1
    assert result.err.endswith(NOT_RUNNING)
    tower.crash("gone")
    assert sim(tower, "domstate", "--reason", "gone").out == "shut off (crashed)\n\n"
    assert ops(log) == stop_ops("gone", "crashed")
    texts = [e.split(": ", 1)[1] for e in tower.events()]
    assert texts[-3:] == [
        "event 'lifecycle' for domain 'kept': Crashed Panicked",
        "event 'lifecycle' for domain 'gone': Crashed Panicked",
        "event 'lifecycle' for domain 'gone': Stopped Crashed",
    ]


# --- in shutdown --------------------------------------------------------------


def test_in_shutdown_between_power_off_and_stop(tmp_path: Path) -> None:
    """QEMU's SHUTDOWN event (the guest powered off; ``-no-shutdown`` keeps
    QEMU) makes qemuProcessHandleShutdown set ``in shutdown (unknown)``
    (VIR_DOMAIN_SHUTDOWN_UNKNOWN, as the real rig shows) and send ``Shutdown Finished``; libvirt then
    ends QEMU (qemuProcessShutdownOrReboot) and the domain is ``shut off
    (shutdown)`` with ``Stopped Shutdown``. In between it is active but not
    RUNNING: no guest agent, no shutdown, no start ("Domain is already
    active", cmdStart)."""
    tower = Tower.create(
        tmp_path / "t", [DomainSpec("vm", running=True)], time_scale=1.0
    )
    tower.set_shutdown_duration("vm", 1.0)
    assert sim(tower, "shutdown", "--mode", "acpi", "--domain", "vm").rc == 0
    assert tower.domstate("vm") == "running (booted)"
    tower.wait_until(
        lambda: tower.domstate("vm").startswith("in shutdown"), timeout=5, what="in"
    )
    assert tower.domstate("vm") == "in shutdown (unknown)"
    assert ping(tower) == (1, NOT_RUNNING)
    start = sim(tower, "start", "--domain", "vm")
    assert (start.rc, start.err) == (1, "error: Domain is already active\n")
    tower.wait_until(lambda: not tower.is_running("vm"), timeout=5, what="off")
    assert tower.domstate("vm") == "shut off (shutdown)"
    stamped = [e for e in tower.events() if "Shutdown" in e]
    assert [e.split(": ", 1)[1] for e in stamped] == [
        "event 'lifecycle' for domain 'vm': Shutdown Finished after guest request",
        "event 'lifecycle' for domain 'vm': Stopped Shutdown",
    ]
    assert stamped[0] < stamped[1]  # the SHUTDOWN event came first (timestamps)


# --- libvirtd restarts ----------------------------------------------------------


def test_event_loop_ends_when_libvirtd_restarts(vm: Tower) -> None:
    """A restart closes every client connection: virshCatchDisconnect
    (tools/virsh.c) prints "Disconnected from URI due to end of file" and ends
    the event wait; cmdEvent (tools/virsh-domain-event.c) prints "events
    received: N", and deregistering its callbacks on the closed connection
    fails: rc 1, "internal error: client socket is closed" (as the real
    daemon showed, module docstring). Events after the restart never reach it."""
    proc = subprocess.Popen(
        [str(vm.virsh), "-c", vm.uri, "event", "--loop", "--all"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.3)
        assert sim(vm, "start", "--domain", "other").rc == 0
        time.sleep(0.2)
        vm.restart_libvirtd(50)  # 0.5 s here
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert err == (
        f"error: Disconnected from {vm.uri} due to end of file\n"
        "error: internal error: client socket is closed\n"
    )
    lines = out.splitlines()
    assert lines[-2:] == ["events received: 4", ""], out
    assert [line.split(": ", 1)[1] for line in lines[2:4]] == [
        "Resumed Unpaused",
        "Started Booted",
    ]


def test_calls_while_libvirtd_is_away(vm: Tower, tmp_path: Path) -> None:
    """While libvirtd is away its socket is gone: a URI given with -c is
    connected to before any command (virshInit) and the call fails at once
    (rc 1, nothing run); without -c each command that needs the connection
    fails (vshCommandRun; ``echo`` has VSH_CMD_FLAG_NOCONNECT). Domains keep
    running. Back, libvirtd runs ``reconnect begin -`` for each running
    domain (qemuProcessReconnect, VIR_HOOK_QEMU_OP_RECONNECT)."""
    log = install_recorder(vm, tmp_path / "hook")
    vm.restart_libvirtd(100)  # 1 s here
    listed = sim(vm, "list", "--all")
    assert (listed.rc, listed.out, listed.err) == (1, "", CONNECT_FAILED)
    plain = run([str(vm.virsh), "echo a ; list"])
    assert (plain.rc, plain.out, plain.err) == (1, "a\n\n", CONNECT_FAILED)
    assert ops(log) == []
    vm.wait_until(lambda: sim(vm, "list").rc == 0, timeout=10, what="libvirtd back")
    assert vm.domstate("vm") == "running (booted)"
    assert ops(log) == [["vm", "reconnect", "begin", "-"]]
    sim(vm, "list")
    assert len(ops(log)) == 1  # once a restart


def test_socket_activated_restart_makes_calls_wait(vm: Tower) -> None:
    """With systemd's socket activation (libvirtd.socket) the listening socket
    outlives the daemon: a new connection waits in its backlog until the new
    daemon accepts it, so a call made during the restart answers once it is
    back instead of failing."""
    vm.restart_libvirtd(60, socket_activated=True)  # 0.6 s here
    began = time.monotonic()
    result = sim(vm, "domstate", "--domain", "vm")
    waited = time.monotonic() - began
    assert (result.rc, result.out) == (0, "running\n\n")
    assert waited >= 0.3


def test_failing_reconnect_hook_kills_the_domain(vm: Tower, tmp_path: Path) -> None:
    """docs/hooks.rst: "If the script fails, the existing QEMU process will be
    killed off" — qemuProcessReconnect's error path stops it with
    VIR_DOMAIN_SHUTOFF_DAEMON: ``shut off (daemon)``, its stop hooks run."""
    log = install_recorder(vm, tmp_path / "hook", fail={"reconnect": "broken\n"})
    vm.restart_libvirtd(10)
    vm.wait_until(lambda: sim(vm, "list").rc == 0, timeout=10, what="libvirtd back")
    assert vm.domstate("vm") == "shut off (daemon)"
    sim(vm, "list")
    assert ops(log) == [["vm", "reconnect", "begin", "-"], *stop_ops("vm", "daemon")]
