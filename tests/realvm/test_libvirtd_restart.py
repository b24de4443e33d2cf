"""libvirtd restarting under a running guest, the tower agent its live hook.

On a tower libvirtd restarts now and then (a package update, an admin's
`systemctl restart`), with the domains running: their QEMU processes are not
libvirtd's, and live on. Here the private daemon is stopped with SIGTERM and
started again (``QemuLibvirtd.stop_daemon``/``start_daemon``) under one real
guest, its guest agent up, and what the tower simulator claims
(tests/towersim/test_libvirt_states.py, ``Tower.restart_libvirtd``) is held
to real libvirt:

1. a running ``virsh event --loop --all --timestamp`` ends when libvirtd goes
   away: virshCatchDisconnect (tools/virsh.c) reports the connection closed
   by end of file, cmdEvent (tools/virsh-domain-event.c) prints "events
   received: N", and deregistering its callbacks on the closed connection
   fails: rc 1;
2. while libvirtd is away its socket is gone and a call fails at once: rc 1,
   virshConnect's "failed to connect to the hypervisor" (tools/virsh.c) and
   the remote driver's "Failed to connect socket to 'PATH'"
   (virNetSocketNewConnectUNIX, src/rpc/virnetsocket.c);
3. the guest's QEMU process survives; back, libvirtd reconnects to it and
   runs the qemu hook's ``DOMAIN reconnect begin -`` (qemuProcessReconnect in
   src/qemu/qemu_process.c, VIR_HOOK_QEMU_OP_RECONNECT): the agent's hook
   exits 0, and the guest runs on with the same id and its guest agent;
4. a hook that fails its ``reconnect`` gets the domain killed: "If the
   script fails, the existing QEMU process will be killed off"
   (docs/hooks.rst); qemuProcessReconnect's error path stops it with
   VIR_DOMAIN_SHUTOFF_DAEMON, ``shut off (daemon)``, and the stop hooks run
   (``release end`` carries the reason, "daemon").

The failing hook is a second script in ``hooks/qemu.d``, sorted after the
agent's (virHookCall in src/util/virhook.c runs every executable there, in
strcmp order, and reads the directory on every call; which hooks exist at all
is looked at once, when the daemon starts). It is there only for the second
restart. One guest boot and two restarts: 5 to 10 s.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
import shlex
import time
from typing import TYPE_CHECKING

import pytest

from tests.realvm.qemu_libvirtd import EventLog, define_guest
from tests.realvm.towers import make_tower
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator
    import subprocess

    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import HookCall, QemuLibvirtd

pytestmark = pytest.mark.system

NAME = "restart-vm"
PING = '{"execute":"guest-ping"}'
AGENT_TIMEOUT = 90.0
EVENT_END_TIMEOUT = 30.0

# What real virsh prints (test_sim_conformance.py holds the simulator to
# these too): a running `virsh -c URI event --loop` when libvirtd goes away...
DISCONNECTED = (
    "error: Disconnected from {uri} due to end of file\n"
    "error: internal error: client socket is closed\n"
)
EVENTS_RECEIVED = re.compile(r"events received: (\d+)\n\n\Z")
# ...and a new `virsh -c URI ...` while it is away (PATH: the URI's socket).
AWAY = (
    "error: failed to connect to the hypervisor\n"
    "error: Failed to connect socket to '{path}': No such file or directory\n"
)

FAIL_HOOK_NAME = "zz-fail-reconnect"
FAIL_HOOK = """#!/bin/sh
# Fails the qemu hook's reconnect (tests/realvm/test_libvirtd_restart.py).
cat >/dev/null
rc=0
[ "$2" = reconnect ] && rc=1
printf '%s %s\\n' "$rc" "$*" >>{log}
exit $rc
"""


@dataclass
class Restart:
    """What one stop and start of libvirtd under the running guest left."""

    event_rc: int | None
    event_stdout: str
    event_stderr: str
    socket_while_away: bool
    away: subprocess.CompletedProcess[str]
    pids_before: list[int]
    pids_while_away: list[int]
    pids_after: list[int]
    id_before: str
    id_after: str
    state_after: str
    calls: list[HookCall]
    ping: subprocess.CompletedProcess[str]


@dataclass
class FailedReconnect:
    """A restart with a hook that fails its reconnect."""

    calls: list[HookCall]
    fail_log: list[str]
    state: str
    pids_before: list[int]
    pids_after: list[int]


def ping(daemon: QemuLibvirtd) -> subprocess.CompletedProcess[str]:
    return daemon.virsh("qemu-agent-command", NAME, PING)


def own(calls: list[HookCall]) -> list[tuple[str, str, str, str, int]]:
    """The hook's calls for this module's guest (another module's guest may
    run too)."""
    return [(c.domain, c.op, c.subop, c.extra, c.rc) for c in calls if c.domain == NAME]


@pytest.fixture(scope="module")
def booted(
    qemu_libvirtd: QemuLibvirtd, guest: Guest, realvm_timings: dict[str, float]
) -> Iterator[QemuLibvirtd]:
    """The guest running, its guest agent up, and the agent the daemon's live
    hook with a configuration of its own."""
    d = qemu_libvirtd
    define_guest(d, guest, NAME)
    tower = make_tower(
        d,
        "restart",
        NAME,
        {"agent": 120.0, "shutdown": 60.0, "start": 60.0},
        gaming=[f"{NAME}-game"],
    )
    d.set_hook_config(tower.config)
    fail_hook = d.dirs["etc"] / "hooks" / "qemu.d" / FAIL_HOOK_NAME
    try:
        started = time.monotonic()
        begun = d.virsh("start", NAME)
        assert begun.returncode == 0, begun.stderr
        wait_until(
            lambda: ping(d).returncode == 0,
            timeout=AGENT_TIMEOUT,
            interval=0.2,
            what=f"{NAME}'s guest agent",
        )
        realvm_timings["restart: guest boot to agent"] = time.monotonic() - started
        yield d
    finally:
        fail_hook.unlink(missing_ok=True)
        if not d.daemon_is_up():  # a test failed with libvirtd away
            d.start_daemon()
        d.set_hook_config(None)
        d.virsh("destroy", NAME)
        d.virsh("undefine", NAME)


@pytest.fixture(scope="module")
def restart(booted: QemuLibvirtd, realvm_timings: dict[str, float]) -> Restart:
    d = booted
    events = EventLog(d, "restart-events", split_stderr=True)
    pids_before = d.qemu_pids()
    id_before = d.virsh("domid", NAME).stdout
    since = len(d.hook_calls())
    started = time.monotonic()
    d.stop_daemon()
    realvm_timings["restart: libvirtd stop"] = time.monotonic() - started
    try:
        event_rc = events.proc.wait(timeout=EVENT_END_TIMEOUT)
    finally:
        events.stop()
    socket_while_away = d.socket.exists()
    away = d.virsh("list")
    pids_while_away = d.qemu_pids()
    started = time.monotonic()
    d.start_daemon()
    realvm_timings["restart: libvirtd start until it answers"] = (
        time.monotonic() - started
    )
    calls = d.wait_hook(NAME, "reconnect begin", since=since)
    realvm_timings["restart: libvirtd start until the reconnect hook ran"] = (
        time.monotonic() - started
    )
    return Restart(
        event_rc=event_rc,
        event_stdout=events.path.read_text(errors="replace"),
        event_stderr=events.stderr_path.read_text(errors="replace"),
        socket_while_away=socket_while_away,
        away=away,
        pids_before=pids_before,
        pids_while_away=pids_while_away,
        pids_after=d.qemu_pids(),
        id_before=id_before,
        id_after=d.virsh("domid", NAME).stdout,
        state_after=d.virsh("domstate", "--reason", NAME).stdout,
        calls=calls,
        ping=ping(d),
    )


@pytest.fixture(scope="module")
def failed_reconnect(
    booted: QemuLibvirtd, restart: Restart, realvm_timings: dict[str, float]
) -> FailedReconnect:
    d = booted
    log = d.data_dir / "fail-hook.log"
    script = d.dirs["etc"] / "hooks" / "qemu.d" / FAIL_HOOK_NAME
    script.write_text(FAIL_HOOK.format(log=shlex.quote(str(log))), encoding="utf-8")
    script.chmod(0o755)
    try:
        pids_before = d.qemu_pids()
        since = len(d.hook_calls())
        started = time.monotonic()
        d.restart_daemon()
        calls = d.wait_hook(NAME, "release end", since=since)
        realvm_timings["restart: with a failing hook, until the domain was killed"] = (
            time.monotonic() - started
        )

        def fail_log() -> list[str] | None:
            """The second script's lines once its own ``release end`` is in:
            it runs after the agent's (qemu.d in strcmp order)."""
            text = log.read_text() if log.exists() else ""
            lines = [line for line in text.splitlines() if line.split(" ")[1] == NAME]
            return lines if any(" release end" in line for line in lines) else None

        lines = wait_until(fail_log, timeout=30, what="the failing hook's release")
    finally:
        script.unlink(missing_ok=True)
    return FailedReconnect(
        calls=calls,
        fail_log=lines,
        state=d.virsh("domstate", "--reason", NAME).stdout,
        pids_before=pids_before,
        pids_after=d.qemu_pids(),
    )


def test_an_event_loop_ends_when_libvirtd_goes_away(
    restart: Restart, qemu_libvirtd: QemuLibvirtd
) -> None:
    """Claim 1: virshCatchDisconnect (tools/virsh.c) on the close of the
    connection (VIR_CONNECT_CLOSE_REASON_EOF), then cmdEvent
    (tools/virsh-domain-event.c): "events received: N" on stdout, and the
    deregistration on the closed connection fails the command."""
    assert restart.event_rc == 1
    assert restart.event_stderr == DISCONNECTED.format(uri=qemu_libvirtd.uri)
    received = EVENTS_RECEIVED.search(restart.event_stdout)
    assert received is not None, restart.event_stdout
    # N counts the events printed before (the listener's own probe's).
    printed = [line for line in restart.event_stdout.splitlines() if "event '" in line]
    assert int(received.group(1)) == len(printed) > 0


def test_a_call_fails_at_once_while_libvirtd_is_away(
    restart: Restart, qemu_libvirtd: QemuLibvirtd
) -> None:
    """Claim 2: libvirtd removed its socket on the way out; virshConnect
    (tools/virsh.c) reports the remote driver's failure to connect
    (virNetSocketNewConnectUNIX, src/rpc/virnetsocket.c)."""
    assert not restart.socket_while_away
    assert (restart.away.returncode, restart.away.stdout, restart.away.stderr) == (
        1,
        "",
        AWAY.format(path=qemu_libvirtd.socket),
    )


def test_the_guest_runs_on_through_the_restart(restart: Restart) -> None:
    """Claim 3: QEMU is no child of libvirtd; back, libvirtd reconnects to it
    (qemuProcessReconnect) and the domain is the same running domain."""
    assert len(restart.pids_before) == 1, restart.pids_before
    assert restart.pids_while_away == restart.pids_before
    assert restart.pids_after == restart.pids_before
    assert restart.id_after == restart.id_before
    assert restart.state_after == "running (booted)\n\n"
    # The guest agent's channel was reconnected too.
    assert (restart.ping.returncode, restart.ping.stdout, restart.ping.stderr) == (
        0,
        '{"return":{}}\n\n',
        "",
    )


def test_libvirtd_back_runs_the_agents_reconnect_hook(
    restart: Restart, qemu_libvirtd: QemuLibvirtd
) -> None:
    """Claim 3: ``DOMAIN reconnect begin -`` (VIR_HOOK_QEMU_OP_RECONNECT,
    VIR_HOOK_SUBOP_BEGIN, no extra), once, and the agent's hook exits 0:
    the domain is left alone."""
    assert own(restart.calls) == [(NAME, "reconnect", "begin", "-", 0)]
    assert qemu_libvirtd.hook_errors() == ""


def test_a_hook_failing_its_reconnect_gets_the_domain_killed(
    failed_reconnect: FailedReconnect, qemu_libvirtd: QemuLibvirtd
) -> None:
    """Claim 3's other side (docs/hooks.rst; qemuProcessReconnect's error
    path, VIR_DOMAIN_SHUTOFF_DAEMON): the agent's hook exits 0, the second
    script 1, and virHookCall's result is the worst of them; libvirtd kills
    the QEMU process and runs the stop hooks (for both scripts: they exit
    0), ``release end`` with the reason "daemon"."""
    assert failed_reconnect.state == "shut off (daemon)\n\n"
    assert len(failed_reconnect.pids_before) == 1
    assert not set(failed_reconnect.pids_before) & set(failed_reconnect.pids_after)
    assert own(failed_reconnect.calls) == [
        (NAME, "reconnect", "begin", "-", 0),
        (NAME, "stopped", "end", "-", 0),
        (NAME, "release", "end", "daemon", 0),
    ]
    assert failed_reconnect.fail_log == [
        f"1 {NAME} reconnect begin -",
        f"0 {NAME} stopped end -",
        f"0 {NAME} release end daemon",
    ]
    assert qemu_libvirtd.hook_errors() == ""


def test_libvirtd_answers_after_the_restarts(
    failed_reconnect: FailedReconnect, qemu_libvirtd: QemuLibvirtd
) -> None:
    """The daemon the other modules share is up, its hook dir as before."""
    assert qemu_libvirtd.daemon_is_up()
    assert qemu_libvirtd.virsh("uri").returncode == 0
    hooks = qemu_libvirtd.dirs["etc"] / "hooks" / "qemu.d"
    assert sorted(p.name for p in hooks.iterdir()) == ["gpu-handoff"]
