"""The moments between steps: a cut, a lost reply, a restart, mid-job.

Real parts as in the other stories: Home Assistant with the integration, sshd
forcing the real agent (protocol 2: one session, request ids) on the tower
simulator, the Kubernetes API emulator. The GPU node's guest shutdown takes
3 s here, so a job is still running when the cut or the restart comes. Each
story checks that the tower ran exactly one job for the handoff, that Home
Assistant followed that very job to its end, and that nothing was rolled back
under it (the handoff succeeds; the GPU node's cordon is not lifted under a
shutdown).
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)
from custom_components.gpu_handoff.coordinator import tower_credentials
from custom_components.gpu_handoff.protocol import Job, JobKind, parse_jobs
from custom_components.gpu_handoff.tower_client import (
    TowerClient,
    TowerConnectionError,
    TowerSession,
)
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.stories import SWITCH_1, cordoned, idle, setup_entry, switch, until
from tests.towersim import Tower

SLOW_SHUTDOWN = 300.0  # sim seconds: 3 s at the sim's pace


async def _jobs(entry: MockConfigEntry) -> tuple[Job, ...]:
    """Every job the agent has a record of (one-shot, on a connection of its
    own: the entry may be unloaded)."""
    tower = TowerClient(tower_credentials(entry))
    try:
        return parse_jobs(await tower.call("jobs"))
    finally:
        await tower.close()


def _pending_job_id(entry: MockConfigEntry) -> str | None:
    job = entry.runtime_data.controller.progress.pending_job
    return job.job_id if job is not None else None


async def _settled_after_handoff(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    await until(lambda: sim.is_running("gaming-1") and idle(entry))
    assert not sim.is_running("gpu-node")


@pytest.fixture
def slow_gpu_node(sim: Tower) -> None:
    """The GPU node takes 3 s to shut down: long enough to strike mid-job."""
    sim.set_shutdown_duration("gpu-node", SLOW_SHUTDOWN)


@pytest.mark.parametrize("moment", ["stopping_gpu_node", "waiting_for_guest_agent"])
async def test_a_restart_mid_job_follows_the_same_job(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    slow_gpu_node: None,
    moment: str,
) -> None:
    """Home Assistant stops while the tower job runs (at the step named) and
    starts again on the same storage: the stored job is followed to its end,
    by its id, and no second job is asked for."""
    if moment == "waiting_for_guest_agent":
        # The GPU node's guest agent is not up yet when the handoff starts.
        sim.guest_shutdown("gpu-node")
        await until(lambda: not sim.is_running("gpu-node"))
        sim.set_agent_delay("gpu-node", 300.0)
        sim.set_shutdown_duration("gpu-node", 100.0)
        await asyncio.to_thread(
            subprocess.run,
            [str(sim.virsh), "-c", sim.uri, "start", "gpu-node"],
            check=True,
            capture_output=True,
        )
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    controller = entry.runtime_data.controller
    await until(
        lambda: (
            controller.progress.operation is not None
            and controller.progress.operation.step.startswith(moment)
            and _pending_job_id(entry) is not None
        )
    )
    job_id = _pending_job_id(entry)
    running = [job for job in await _jobs(entry) if job.state.active]
    assert [job.id for job in running] == [job_id]

    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    steps.clear()
    await setup_entry(hass, entry)
    assert entry.runtime_data.controller.progress.pending_job is not None
    assert _pending_job_id(entry) == job_id
    await _settled_after_handoff(hass, entry, sim)
    assert [event.data["vm"] for event in succeeded] == ["gaming-1"]
    assert "starting_vm" in [event.data["step"] for event in steps]
    jobs = await _jobs(entry)
    assert [job.id for job in jobs if job.kind is JobKind.HANDOFF] == [job_id]
    assert len(sim.calls("shutdown", "gpu-node")) == 1


async def test_a_restart_before_the_job_was_asked_for(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request id is stored, the request is not yet sent, and Home
    Assistant stops: after the restart the job is asked for under the same
    request id, once."""
    gate = asyncio.Event()
    original = TowerSession.request

    async def held(self: TowerSession, verb: str, *args: str, **kwargs: Any) -> Any:
        if verb == "handoff":
            await gate.wait()  # never set: Home Assistant stops here
        return await original(self, verb, *args, **kwargs)

    monkeypatch.setattr(TowerSession, "request", held)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    controller = entry.runtime_data.controller
    await until(lambda: controller.progress.pending_job is not None)
    request_id = controller.progress.pending_job.request_id  # type: ignore[union-attr]
    assert controller.progress.pending_job.job_id is None  # type: ignore[union-attr]
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    assert [job for job in await _jobs(entry) if job.kind is JobKind.HANDOFF] == []

    monkeypatch.setattr(TowerSession, "request", original)
    await setup_entry(hass, entry)
    await _settled_after_handoff(hass, entry, sim)
    handoffs = [job for job in await _jobs(entry) if job.kind is JobKind.HANDOFF]
    assert [job.request_id for job in handoffs] == [request_id]


async def test_a_lost_reply_is_looked_up_not_sent_twice(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    slow_gpu_node: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent accepts the handoff and the connection is cut before its
    reply arrives. Home Assistant looks the request id up (the job exists),
    follows it, and the tower runs one job; the cordon is not rolled back
    under it and the handoff succeeds."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    original = TowerSession.request
    cut: list[str] = []

    async def reply_lost(
        self: TowerSession, verb: str, *args: str, **kwargs: Any
    ) -> Any:
        reply = await original(self, verb, *args, **kwargs)
        if verb == "handoff" and not cut:
            cut.append(reply["job"]["id"])
            await entry.runtime_data.coordinator.tower.close()  # the cut
            raise TowerConnectionError("connection lost before the reply")
        return reply

    monkeypatch.setattr(TowerSession, "request", reply_lost)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(cut))
    assert cordoned(cluster)
    await _settled_after_handoff(hass, entry, sim)
    assert failed == []
    handoffs = [job for job in await _jobs(entry) if job.kind is JobKind.HANDOFF]
    assert [job.id for job in handoffs] == cut


@pytest.mark.parametrize("cut", ["session", "connection"])
async def test_a_cut_mid_job_loses_nothing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    slow_gpu_node: None,
    cut: str,
) -> None:
    """The agent session (or the whole SSH connection) dies while the GPU
    node shuts down: the job goes on on the tower, Home Assistant follows it
    (polling while the session is down, then from the new session) to its
    end, with no second job and no rollback."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    coordinator = entry.runtime_data.coordinator
    await until(lambda: entry.runtime_data.session.connected)
    await switch(hass, "turn_on", SWITCH_1)
    controller = entry.runtime_data.controller
    await until(
        lambda: (
            controller.progress.operation is not None
            and controller.progress.operation.step == "stopping_gpu_node"
        )
    )
    job_id = _pending_job_id(entry)
    session = coordinator.tower.session
    assert session is not None
    if cut == "session":
        await session.close()
    else:
        await coordinator.tower.close()
    await _settled_after_handoff(hass, entry, sim)
    assert failed == []
    handoffs = [job for job in await _jobs(entry) if job.kind is JobKind.HANDOFF]
    assert [job.id for job in handoffs] == [job_id]
    await until(lambda: entry.runtime_data.session.connected)
    assert coordinator.tower.session is not session


async def test_a_stop_by_the_hook_shows_stopping(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    slow_gpu_node: None,
) -> None:
    """A stop job the libvirt hook (or a person on the tower) started acts on
    the GPU node: Home Assistant shows `stopping` while it runs."""
    await setup_entry(hass, entry)
    tower = entry.runtime_data.coordinator.tower
    await tower.call("stop", "gpu-node")
    await until(
        lambda: hass.states.get("sensor.gpu_node_handoff_state").state == "stopping"
    )
    await until(lambda: hass.states.get("sensor.gpu_node_handoff_state").state == "off")
    assert entry.state is ConfigEntryState.LOADED


async def test_a_restart_mid_stop_follows_the_stop(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Both play; one quits, and Home Assistant restarts while that gaming
    VM's stop job runs: the same stop is followed to its end, and the GPU
    node stays off (the other still plays)."""
    await setup_entry(hass, entry)
    for n in (1, 2):
        await switch(hass, "turn_on", f"switch.gaming_station_{n}")
        await until(lambda n=n: sim.is_running(f"gaming-{n}") and idle(entry))
    sim.set_shutdown_duration("gaming-1", SLOW_SHUTDOWN)
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: _pending_job_id(entry) is not None)
    job_id = _pending_job_id(entry)
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    await setup_entry(hass, entry)
    await until(lambda: not sim.is_running("gaming-1") and idle(entry))
    assert sim.is_running("gaming-2")
    assert not sim.is_running("gpu-node")
    stops = [job for job in await _jobs(entry) if job.kind is JobKind.STOP]
    assert [job.id for job in stops] == [job_id]


async def test_a_node_that_never_turns_ready_fails_the_return(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Any,
    cluster: K8sEmulator,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node runs again but its Kubernetes node never reports Ready
    (no kubelet here): the return fails after its bound with a translated
    reason, and our cordon stays (the node is not serving)."""
    monkeypatch.setattr(
        "custom_components.gpu_handoff.node_return.NODE_READY_TIMEOUT", 1.0
    )
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1,), drain_timeout=10)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.is_running("gaming-1") and idle(entry))
    cluster.set_node_up(GPU_NODE, up=False)
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(failed))
    assert failed[0].data["code"] == "node_not_ready"
    assert sim.is_running("gpu-node")
    assert cordoned(cluster)


async def test_a_request_lost_before_it_arrived_is_asked_again(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection drops before the handoff request reaches the agent:
    the look-up by request id finds no job, so the request is sent again
    under the same id, and the tower runs exactly one job."""
    original = TowerSession.request
    lost: list[str] = []

    async def lost_on_the_way(
        self: TowerSession, verb: str, *args: str, **kwargs: Any
    ) -> Any:
        if verb == "handoff" and not lost:
            lost.append(kwargs["request_id"])
            raise TowerConnectionError("connection lost before the request")
        return await original(self, verb, *args, **kwargs)

    monkeypatch.setattr(TowerSession, "request", lost_on_the_way)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await _settled_after_handoff(hass, entry, sim)
    handoffs = [job for job in await _jobs(entry) if job.kind is JobKind.HANDOFF]
    assert [job.request_id for job in handoffs] == lost
