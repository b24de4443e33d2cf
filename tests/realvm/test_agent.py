"""The tower agent's `stop` job against real QEMU guests with a real guest agent.

Two guests boot at once under the private libvirtd: "gpu-node", whose guest
agent starts AGENT_DELAY s after boot, and "silent-node", which never starts
one. Each is stopped by its own agent configuration (two "towers": jobs of one
tower run one after another), right after `virsh start`, while no agent is up.

The agent runs virsh through a wrapper that logs every invocation with its
time, so the tests see exactly which commands reached libvirt and when
(towers.py); the agent is libvirtd's live qemu hook meanwhile, with the
configuration of the "gpu-node" tower.

Not real here: the guests run under TCG (KVM guests hang on these machines)
and carry no <hostdev> (no VFIO: libvirt refuses to start them), so card
ownership is left to the test-driver and simulator tests and to the stand-in
cards of test_live_hook.py (cards.py); jobs detach as plain
processes (no systemd in the test environment); the agent runs as root, not as
a member of the libvirt group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import datetime as dt
from typing import TYPE_CHECKING, Any

import pytest

from tests.realvm.qemu_libvirtd import EventLog, HookCall, define_guest
from tests.realvm.towers import Tower, iso_epoch, make_tower, wait_job
from tests.support.agentbuild import AGENT
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

pytestmark = pytest.mark.system

GPU_NODE = "gpu-node"
SILENT = "silent-node"
AGENT_DELAY = 12
SILENT_AGENT_TIMEOUT = 8.0


def event_epoch(line: str) -> float:
    stamp = line.split(": event ", 1)[0]
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f%z").timestamp()


@dataclass
class Run:
    gpu_tower: Tower
    silent_tower: Tower
    gpu_job: dict[str, Any]
    silent_job: dict[str, Any]
    submitted_gpu: dict[str, Any]
    events: list[str]
    states: dict[str, str]
    domain_logs: dict[str, str]
    hook_calls: list[HookCall]


@pytest.fixture(scope="module")
def stop_jobs(
    qemu_libvirtd: QemuLibvirtd, guest: Guest, realvm_timings: dict[str, float]
) -> Iterator[Run]:
    if not AGENT.exists():
        pytest.fail(f"the tower agent is missing: {AGENT}")
    d = qemu_libvirtd
    gpu_tower = make_tower(d, "a", GPU_NODE, {"agent": 180.0, "shutdown": 60.0})
    silent_tower = make_tower(
        d, "b", SILENT, {"agent": SILENT_AGENT_TIMEOUT, "shutdown": 30.0}
    )
    define_guest(d, guest, GPU_NODE, knobs=f"gh.agent_delay={AGENT_DELAY}")
    # The silent guest honours ACPI only so that teardown can stop it without
    # destroying it; the agent is configured for agent shutdowns only.
    define_guest(d, guest, SILENT, knobs="gh.agent=off gh.acpi=on")
    events = EventLog(d, "agent-events")
    hooks_before = len(d.hook_calls())
    d.set_hook_config(gpu_tower.config)
    try:
        for name in (GPU_NODE, SILENT):
            assert d.virsh("start", name).returncode == 0
        submitted_gpu = gpu_tower.agent("stop", GPU_NODE)
        submitted_silent = silent_tower.agent("stop", SILENT)
        assert submitted_gpu["ok"], submitted_gpu
        assert submitted_silent["ok"], submitted_silent
        gpu_job = wait_job(gpu_tower, submitted_gpu["job"]["id"])
        silent_job = wait_job(silent_tower, submitted_silent["job"]["id"])
        events.wait_for(f"for domain '{GPU_NODE}': Stopped", timeout=60)
        hook_calls = [
            call
            for call in d.wait_hook(GPU_NODE, "release end", since=hooks_before)
            if call.domain == GPU_NODE
        ]
        states = {
            name: d.virsh("domstate", "--reason", name).stdout.strip()
            for name in (GPU_NODE, SILENT)
        }
        domain_logs = {
            name: d.domain_log(name).read_text(errors="replace")
            for name in (GPU_NODE, SILENT)
        }
        realvm_timings["agent gpu-node stop job"] = iso_epoch(
            gpu_job["finished"]
        ) - iso_epoch(gpu_job["created"])
        yield Run(
            gpu_tower=gpu_tower,
            silent_tower=silent_tower,
            gpu_job=gpu_job,
            silent_job=silent_job,
            submitted_gpu=submitted_gpu,
            events=events.lines(),
            states=states,
            domain_logs=domain_logs,
            hook_calls=hook_calls,
        )
    finally:
        d.set_hook_config(None)
        # Stop the silent guest gracefully (it honours ACPI), then forget both.
        if d.virsh("domstate", SILENT).stdout.strip() == "running":
            d.virsh("shutdown", "--mode", "acpi", SILENT)
            # If it does not stop, the daemon's teardown destroys what is left.
            with contextlib.suppress(TimeoutError):
                wait_until(
                    lambda: d.virsh("domstate", SILENT).stdout.strip() == "shut off",
                    timeout=60,
                    what="the silent guest to shut off",
                )
        events.stop()
        for name in (GPU_NODE, SILENT):
            d.virsh("undefine", name)


def test_stop_waits_for_the_guest_agent_then_shuts_the_domain_off(
    stop_jobs: Run,
) -> None:
    job = stop_jobs.gpu_job
    assert job["state"] == "succeeded", job
    steps = {s["name"]: s for s in job["steps"]}
    assert [s["result"] for s in job["steps"]] == ["ok", "ok", "ok"], job["steps"]
    # libvirt returns once it sees QEMU's SHUTDOWN event; when the guest
    # agent's socket reaches end of file first (QEMU exiting; a loaded
    # machine makes it likelier), the call fails while the domain is off,
    # and the step says so (qemu_agent.c, qemuAgentIO; the simulator's
    # agent_sockets_close_first)
    assert steps["shutdown"]["detail"] in (
        "shutdown --mode agent accepted",
        (
            f"shut off; libvirt answered: agent: Failed to shutdown domain "
            f"'{GPU_NODE}' / internal error: End of file from agent socket"
        ),
    )
    assert stop_jobs.states[GPU_NODE] == "shut off (shutdown)"
    assert "shutting down, reason=shutdown" in stop_jobs.domain_logs[GPU_NODE]


def test_stop_sends_no_shutdown_before_the_agent_is_up(stop_jobs: Run) -> None:
    connected = next(
        line
        for line in stop_jobs.events
        if f"'agent-lifecycle' for domain '{GPU_NODE}': state: 'connected'" in line
    )
    connected_at = event_epoch(connected)
    # The job was submitted while the agent was down, else this proves nothing.
    assert iso_epoch(stop_jobs.gpu_job["created"]) < connected_at
    shutdowns = [
        (t, args)
        for t, args in stop_jobs.gpu_tower.invocations()
        if " shutdown " in f" {args} "
    ]
    assert len(shutdowns) == 1, shutdowns
    assert shutdowns[0][0] >= connected_at, (shutdowns, connected)
    assert "--mode agent" in shutdowns[0][1]
    # It polled the agent while waiting (more than once: the agent was late).
    pings = [
        a for _, a in stop_jobs.gpu_tower.invocations() if "qemu-agent-command" in a
    ]
    assert len(pings) >= 2


def test_stop_of_a_guest_without_agent_fails_after_its_timeout_and_leaves_it_running(
    stop_jobs: Run,
) -> None:
    job = stop_jobs.silent_job
    assert job["state"] == "failed", job
    assert job["error"]["code"] == "agent_timeout"
    steps = {s["name"]: s for s in job["steps"]}
    assert steps["wait_agent"]["result"] == "failed"
    assert steps["shutdown"]["result"] is None
    assert (
        iso_epoch(job["finished"]) - iso_epoch(job["created"]) >= SILENT_AGENT_TIMEOUT
    )
    assert stop_jobs.states[SILENT] == "running (booted)"
    assert not any(
        " shutdown " in f" {a} " for _, a in stop_jobs.silent_tower.invocations()
    )
    assert not any(
        " destroy " in f" {a} " for _, a in stop_jobs.silent_tower.invocations()
    )


def test_nothing_was_destroyed(stop_jobs: Run) -> None:
    assert not [line for line in stop_jobs.events if "Destroyed" in line]
    for name, text in stop_jobs.domain_logs.items():
        # (QEMU's log says "terminating on signal 15 from ... (libvirtd)" after
        # a graceful shutdown too: libvirt ends a powered-off QEMU itself.)
        assert "reason=destroyed" not in text, name


def test_libvirtd_ran_the_agent_as_its_hook_for_the_start_and_the_stop(
    stop_jobs: Run,
) -> None:
    """The agent is the daemon's live qemu hook (a GPU node is no request)."""
    assert [(c.domain, c.event) for c in stop_jobs.hook_calls] == [
        (GPU_NODE, "prepare begin"),
        (GPU_NODE, "start begin"),
        (GPU_NODE, "started begin"),
        (GPU_NODE, "stopped end"),
        (GPU_NODE, "release end"),
    ]
    assert [c.rc for c in stop_jobs.hook_calls] == [0] * 5
    assert stop_jobs.gpu_tower.agent("status")["hook_requests"] == []
