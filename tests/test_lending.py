"""Partial lending: while someone plays, the GPU node keeps the cards nobody
plays with.

With the option on, a handoff ends for the player as soon as their VM runs;
then the GPU node starts again with every free card (a live-only definition on
the tower: `virsh create` of its own definition without the busy cards), its
node comes back Ready with that many GPUs, and GPU Handoff's cordon goes. A
player who stops brings the GPU node back with more. The persistent
definition never changes. Without the option nothing of this happens
(tests/test_handoff.py).

Real parts: sshd forcing the real agent, the tower simulator (its `create`
pinned against real virsh in tests/towersim/test_conformance_create.py), the
Kubernetes emulator with the kubelet stand-in, which advertises the cards the
GPU node runs with once its device plugin registers.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
import signal
import subprocess
import sys

from homeassistant.core import HomeAssistant
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    EVENT_STOP_SUCCEEDED,
)
from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_configuration,
    jobs as agent_jobs,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.sshd import Sshd
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    idle,
    lend_free_cards,
    serving_with,
    setup_entry,
    switch,
    until,
)
from tests.support.testdriver import AGENT
from tests.towersim import Tower

GTX_960 = "0000:01:00"
RTX_1 = "0000:03:00"  # Gaming station 1's
RTX_2 = "0000:04:00"  # Gaming station 2's
BOUND = 60.0


@pytest.fixture
async def lending(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, no_pdb: None
) -> str:
    """The option on; the GPU node's persistent definition before anything."""
    await lend_free_cards(hass, entry)
    return sim.defined_xml("gpu-node")


def _uses(hass: HomeAssistant) -> dict[str, str]:
    cards = hass.states.get(HANDOFF).attributes["cards"]
    return {row["card"]: row["use"] for row in cards}


async def test_one_player_leaves_the_cluster_two_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """Gaming station 1 plays with its RTX 3050; the GPU node serves again
    with the GTX 960 and the other RTX 3050. The player's handoff succeeded
    before the GPU node's restart began."""
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    cards_back = async_capture_events(hass, EVENT_CARDS_RETURNED)
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(handed), BOUND)
    assert sim.is_running("gaming-1")
    assert not returned  # the player did not wait for the GPU node
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_2})

    assert len(returned) == len(cards_back) == 1
    assert handed[0].time_fired < returned[0].time_fired
    assert sim.runs_live_definition("gpu-node")
    assert sim.defined_xml("gpu-node") == lending
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    assert len(sim.calls("create")) == 1
    assert _uses(hass) == {GTX_960: "cluster", RTX_1: "player", RTX_2: "cluster"}
    assert hass.states.get(SWITCH_1).state == "on"
    # The restart shows as the GPU node's return, step by step.
    return_steps = [e.data["step"] for e in steps if e.data["kind"] == "return"]
    assert "starting_gpu_node" in return_steps
    assert return_steps[-1] == "uncordoning"
    assert entry.runtime_data.controller.progress.last_error == {}


async def test_two_players_leave_the_gtx_960_and_cost_one_restart(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """Both players at once: the second request waits behind the first, so
    the GPU node restarts once, after both, with the GTX 960 alone."""
    await hass.services.async_call(
        "switch", "turn_on", {"entity_id": [SWITCH_1, SWITCH_2]}, blocking=True
    )
    await until(lambda: sim.is_running("gaming-1") and sim.is_running("gaming-2"))
    await serving_with(hass, entry, sim, cluster, {GTX_960})
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    assert len(sim.calls("create")) == 1
    assert sim.defined_xml("gpu-node") == lending
    assert _uses(hass) == {GTX_960: "cluster", RTX_1: "player", RTX_2: "player"}


async def test_players_stopping_one_then_the_other(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """Each player who stops brings the GPU node back with one more card;
    the last one with every card, from its own definition."""
    stopped = async_capture_events(hass, EVENT_STOP_SUCCEEDED)
    await hass.services.async_call(
        "switch", "turn_on", {"entity_id": [SWITCH_1, SWITCH_2]}, blocking=True
    )
    await serving_with(hass, entry, sim, cluster, {GTX_960})

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: not sim.is_running("gaming-1"), BOUND)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1})
    assert sim.runs_live_definition("gpu-node")

    await switch(hass, "turn_off", SWITCH_2)
    await until(lambda: not sim.is_running("gaming-2"), BOUND)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1, RTX_2})
    assert not sim.runs_live_definition("gpu-node")  # a plain start
    assert sim.defined_xml("gpu-node") == lending
    assert [e.data["vm"] for e in stopped] == ["gaming-1", "gaming-2"]
    assert sim.destroy_attempts() == []


async def test_a_sessions_end_behind_another_stop_returns_the_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """Gaming station 1 plays and the GPU node serves the other cards until
    the operator shuts it down: it stays off. Station 1 is turned off, and
    while its guest goes down, so is station 2, which never ran. Station
    1's stop ended a session, which asks for the cards back; lending leaves
    the return to the end of the burst, and station 2's stop, which shut
    nothing down, must still make it (found by ``scripts/chaos --lend
    --cycles 60 --seed 2468``: the GPU node stayed off with nobody playing
    and nothing reported)."""
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)
    stopped = async_capture_events(hass, EVENT_STOP_SUCCEEDED)
    await switch(hass, "turn_on", SWITCH_1)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_2})
    sim.guest_shutdown("gpu-node")  # the operator
    await until(lambda: not sim.is_running("gpu-node"), BOUND)
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: idle(entry))
    assert not sim.is_running("gpu-node")  # lending leaves it as the operator did

    sim.set_shutdown_duration("gaming-1", 300.0)  # 3 s at the rig's pace
    await switch(hass, "turn_off", SWITCH_1)
    await until(
        lambda: any(
            e.data["vm"] == "gaming-1" and e.data["step"] == "stopping_vm"
            for e in steps
        ),
        BOUND,
    )
    await switch(hass, "turn_off", SWITCH_2)
    # station 2's request waits behind station 1's stop, still running
    controller = entry.runtime_data.controller
    assert controller.plan is not None
    assert controller.plan.vm == "gaming-1"
    assert set(controller.requests) == {"gaming-1", "gaming-2"}
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1, RTX_2})
    assert [e.data["vm"] for e in stopped] == ["gaming-1", "gaming-2"]
    assert entry.runtime_data.controller.progress.last_error == {}


async def test_a_stop_while_the_gpu_node_restarts(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """The player quits while the GPU node is still coming back with two
    cards: the stop waits its turn, then the GPU node comes back with all."""
    controller = entry.runtime_data.controller
    await switch(hass, "turn_on", SWITCH_1)
    await until(
        lambda: (
            controller.progress.operation is not None
            and controller.progress.operation.kind == "return"
        ),
        BOUND,
    )
    await switch(hass, "turn_off", SWITCH_1)
    assert controller.requests.get("gaming-1") == "stop"
    await until(lambda: not sim.is_running("gaming-1"), BOUND)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1, RTX_2})
    assert sim.defined_xml("gpu-node") == lending


async def test_a_restart_while_the_gpu_node_restarts_with_fewer_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: str,
) -> None:
    """Home Assistant stops while the GPU node's lending restart runs (its
    tower job stored); after the restart the same job is followed to its
    end and the GPU node serves with two cards, started once."""
    controller = entry.runtime_data.controller
    await switch(hass, "turn_on", SWITCH_1)
    await until(
        lambda: (
            controller.plan is not None
            and controller.plan.kind == "return"
            and controller.progress.pending_job is not None
            and controller.progress.pending_job.job_id is not None
        ),
        BOUND,
    )
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    await setup_entry(hass, entry)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_2})
    assert len(sim.calls("create")) == 1
    assert sim.defined_xml("gpu-node") == lending


async def test_an_ssh_cut_while_the_gpu_node_restarts(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    sim_sshd: Sshd,
    lending: str,
) -> None:
    """Every SSH connection is cut while the lending job runs: the job goes
    on on the tower and is followed again once Home Assistant reconnects."""
    controller = entry.runtime_data.controller
    await switch(hass, "turn_on", SWITCH_1)
    await until(
        lambda: (
            controller.plan is not None
            and controller.plan.kind == "return"
            and controller.progress.pending_job is not None
            and controller.progress.pending_job.job_id is not None
        ),
        BOUND,
    )
    sim_sshd.cut_connections()
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_2})
    assert len(sim.calls("create")) == 1


def _virsh(sim: Tower, command: str, domain: str) -> None:
    """Run one virsh command on the simulated tower, as an operator would."""
    subprocess.run(
        [str(sim.virsh), "-c", sim.uri, command, "--domain", domain],
        check=True,
        capture_output=True,
    )


def _lent_gpu_node(sim: Tower) -> None:
    """Gaming station 1 plays; the GPU node runs with the other two cards
    from a live-only definition, as after a lending handoff."""
    sim.guest_shutdown("gpu-node")
    sim.wait_until(lambda: not sim.is_running("gpu-node"), timeout=30, what="off")
    _virsh(sim, "start", "gaming-1")
    sim.start_live(
        "gpu-node",
        [f"{card}.{fn}" for card in (GTX_960, RTX_2) for fn in (0, 1)],
    )


@pytest.mark.parametrize("moment", ["waiting_for_guest_agent", "shut_down", "created"])
def test_an_agent_killed_mid_lend_leaves_the_definition(
    sim: Tower, agent_config: Path, moment: str
) -> None:
    """A lend job's runner killed (SIGKILL) while it waits for the guest
    agent, after it asked for the shutdown, and after its `virsh create`:
    each time the GPU node's persistent definition is byte for byte what it
    was, and a plain start gives it every card again. (The agent never
    writes that definition: the reduced set exists only as the running
    domain's live definition.)"""
    _lent_gpu_node(sim)
    before = sim.defined_xml("gpu-node")
    full = sorted(sim.defined_hostdevs("gpu-node"))
    if moment == "waiting_for_guest_agent":
        sim.set_agent_delay("gpu-node", None)  # the guest agent never answers
    else:
        sim.set_shutdown_duration("gpu-node", 1000.0)  # 10 s here
    cfg = agent_configuration.load_config(str(agent_config), {"PATH": "/usr/bin:/bin"})
    job_id = str(agent_jobs.create_job(cfg, "lend", None, "cli")["id"])
    runner = subprocess.Popen(
        [sys.executable, str(AGENT), "--config", str(agent_config), "run-job", job_id],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if moment == "waiting_for_guest_agent":
            # its first ping went unanswered (this agent gives up after 3 s:
            # on a loaded machine a second ping may never come)
            sim.wait_until(
                lambda: len(sim.calls("qemu-agent-command", "gpu-node")) >= 1,
                timeout=BOUND,
                what="that moment",
            )
        elif moment == "shut_down":
            sim.wait_until(
                lambda: bool(sim.calls("shutdown", "gpu-node")),
                timeout=BOUND,
                what="that moment",
            )
        else:
            sim.set_shutdown_duration("gpu-node", 1.0)
            sim.wait_until(
                lambda: bool(sim.calls("create")), timeout=BOUND, what="that moment"
            )
    finally:
        runner.send_signal(signal.SIGKILL)
        runner.wait()
    if moment == "created":
        # libvirtd finishes a create whose client died (its hooks run first).
        sim.wait_until(
            lambda: sim.is_running("gpu-node"), timeout=BOUND, what="the create"
        )
    assert sim.defined_xml("gpu-node") == before
    if sim.is_running("gpu-node"):
        if moment == "waiting_for_guest_agent":
            sim.set_agent_delay("gpu-node", 0.0)
        sim.set_shutdown_duration("gpu-node", 1.0)
        sim.guest_shutdown("gpu-node")
        sim.wait_until(
            lambda: not sim.is_running("gpu-node"), timeout=BOUND, what="that moment"
        )
    _virsh(sim, "shutdown", "gaming-1")
    sim.wait_until(
        lambda: not sim.is_running("gaming-1"), timeout=BOUND, what="that moment"
    )
    _virsh(sim, "start", "gpu-node")
    assert sorted(sim.live_hostdevs("gpu-node") or []) == full
    assert sim.defined_xml("gpu-node") == before


async def test_workloads_that_need_more_gpus_than_are_lent_wait(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    lending: str,
) -> None:
    """Both play: the GPU node comes back with one GPU, so of the two
    workloads the drain evicted (one GPU each) one runs on it again and the
    other waits, Pending and unscheduled for lack of nvidia.com/gpu; once
    nobody plays the GPU node has all three and the waiting one runs."""
    kubelet.follow_workloads()
    await hass.services.async_call(
        "switch", "turn_on", {"entity_id": [SWITCH_1, SWITCH_2]}, blocking=True
    )
    await serving_with(hass, entry, sim, cluster, {GTX_960})

    def workloads() -> list[tuple[str, str]]:
        return sorted(
            (pod["spec"].get("nodeName") or "-", pod["status"]["phase"])
            for pod in cluster.list_objects("Pod", "ai")
            if not pod["metadata"].get("deletionTimestamp")
        )

    await until(lambda: workloads() == [("-", "Pending"), (GPU_NODE, "Running")])
    waiting = next(
        pod
        for pod in cluster.list_objects("Pod", "ai")
        if not pod["spec"].get("nodeName")
    )
    [scheduled] = waiting["status"]["conditions"]
    assert (scheduled["type"], scheduled["reason"]) == ("PodScheduled", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]

    await hass.services.async_call(
        "switch", "turn_off", {"entity_id": [SWITCH_1, SWITCH_2]}, blocking=True
    )
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1, RTX_2})
    await until(lambda: workloads() == [(GPU_NODE, "Running"), (GPU_NODE, "Running")])


async def test_an_agent_that_cannot_lend_is_reported(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    lending: str,
) -> None:
    """An agent older than lending (its hello lists no `lend`): the player
    gets their VM, and the GPU node's return fails saying the agent must be
    updated, without asking the agent for a job it does not know."""
    tower = entry.runtime_data.coordinator.tower
    await until(lambda: tower.session is not None and not tower.session.closed)
    session = tower.session
    assert session is not None
    session.hello = replace(
        session.hello, verbs=tuple(v for v in session.hello.verbs if v != "lend")
    )
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(handed) and bool(failed), BOUND)
    await until(lambda: idle(entry))
    assert (failed[0].data["vm"], failed[0].data["kind"]) == ("gpu-node", "return")
    assert failed[0].data["code"] == "agent_cannot_lend"
    assert "update it" in entry.runtime_data.controller.progress.last_error["gpu-node"]
    assert sim.calls("create") == []
    assert sim.is_running("gaming-1")
