"""Prepare ahead: the cards freed and held for a gaming VM that starts soon.

``gpu_handoff.prepare`` drains the GPU node and shuts it down through its
guest agent as a handoff does, then holds the VM's cards without starting
it: turning the VM on within the hold is one start job. Nobody starts it in
time: the cards go back (an event says so, and the cluster is told). The
hold is stored, shown on the Handoff state, ended by a return, by another VM
turned on, or by the VM's own start on the tower; while it lasts, nothing
gives the held card to the GPU node.

Real parts: sshd forcing the real agent on the simulated tower, the
Kubernetes API emulator over HTTPS with the kubelet stand-in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.util import dt as dt_util
from kubernetes_asyncio.client import CoreV1Api
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.cluster_events import REPORTING_CONTROLLER
from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_HOLD_EXPIRED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    SERVICE_PREPARE,
    SERVICE_RETURN_CARDS,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    lend_free_cards,
    lent_cards,
    play,
    serving_with,
    setup_entry,
    start_by_hand,
    switch,
    until,
)
from tests.towersim import Tower

GTX_960 = "0000:01:00"
RTX_1 = "0000:03:00"  # Gaming station 1's
RTX_2 = "0000:04:00"  # Gaming station 2's


async def prepare(
    hass: HomeAssistant, entry: MockConfigEntry, vm: str, **data: Any
) -> None:
    await hass.services.async_call(
        DOMAIN,
        SERVICE_PREPARE,
        {"config_entry_id": entry.entry_id, "vm": vm, **data},
        blocking=True,
    )


def settled(entry: MockConfigEntry) -> bool:
    return idle(entry) and not entry.runtime_data.controller.requests


def gpu_node_jobs(sim: Tower) -> int:
    """How many times the GPU node was shut down."""
    return len(sim.calls("shutdown", "gpu-node"))


async def held(hass: HomeAssistant, entry: MockConfigEntry, vm: str) -> None:
    """The prepare is done and the Handoff state shows the hold."""
    await until(lambda: settled(entry))
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await until(lambda: hass.states.get(HANDOFF).attributes["held_for"] == vm)


async def reasons(operator: CoreV1Api) -> list[str]:
    listed = await operator.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={GPU_NODE}"
    )
    ours = [e for e in listed.items if e.reporting_component == REPORTING_CONTROLLER]
    return [e.reason for e in sorted(ours, key=lambda e: e.event_time)]


async def test_prepared_the_press_only_starts_the_vm(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Prepare gaming station 1: the GPU node is cordoned, drained and shut
    down through its guest agent, gaming station 1 stays off, and the
    Handoff state says the cards are held for it, with the hold's end and
    the minutes left. The switch then starts it with one start job: no
    drain, no shutdown, no wait for the GPU node."""
    await setup_entry(hass, entry)
    prepared = async_capture_events(hass, EVENT_PREPARE_SUCCEEDED)
    before = dt_util.utcnow()

    await prepare(hass, entry, "gaming-1", hold_minutes=20)
    await held(hass, entry, "gaming-1")

    assert not sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert cordoned(cluster)
    assert gpu_node_jobs(sim) == 1
    state = hass.states.get(HANDOFF)
    assert state.state == "held"
    ends = dt_util.parse_datetime(state.attributes["hold_ends"])
    assert ends is not None
    assert 19 * 60 < (ends - before).total_seconds() <= 20 * 60 + 30
    assert state.attributes["hold_minutes_left"] == 20
    assert hass.states.get(SWITCH_1).state == "off"
    assert [e.data["vm"] for e in prepared] == ["gaming-1"]
    assert prepared[0].data["hold_ends"] == state.attributes["hold_ends"]

    evictions = len(cluster.requests_for(resource="pods/eviction"))
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.is_running("gaming-1"))
    await until(lambda: settled(entry))
    assert gpu_node_jobs(sim) == 1  # not shut down again
    assert len(cluster.requests_for(resource="pods/eviction")) == evictions
    assert entry.runtime_data.controller.state.hold is None
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    state = hass.states.get(HANDOFF)
    assert state.state == "off"
    assert state.attributes["held_for"] is None
    assert entry.runtime_data.controller.desired == {"gaming-1"}


async def test_nobody_comes_the_cards_go_back(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    operator: CoreV1Api,
    no_pdb: None,
) -> None:
    """A hold of two seconds passes with nobody starting gaming station 1:
    the cards go back to the cluster (started, Ready, uncordoned), an event
    says the hold expired, and the node's Kubernetes events say so too."""
    await setup_entry(hass, entry)
    expired = async_capture_events(hass, EVENT_HOLD_EXPIRED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    controller = entry.runtime_data.controller

    task = await controller.async_prepare("gaming-1", hold=2.0)
    assert await task
    hold = controller.state.hold
    assert hold is not None
    await until(lambda: bool(expired))
    assert expired[0].data["vm"] == "gaming-1"
    assert expired[0].data["hold_ends"] == hold.until
    late = (expired[0].time_fired - dt_util.parse_datetime(hold.until)).total_seconds()
    assert 0 <= late < 2.0
    await until(lambda: bool(returned))
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    assert not sim.is_running("gaming-1")
    assert controller.state.hold is None
    told = await reasons(operator)
    async with asyncio.timeout(10):
        while "Uncordoned" not in told:
            await asyncio.sleep(0.05)
            told = await reasons(operator)
    assert "HoldExpired" in told
    assert told.index("HoldExpired") < told.index("Uncordoned")


async def test_a_hold_survives_a_restart_of_home_assistant(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The hold is stored: after the entry is unloaded and set up again (as
    at a restart) the Handoff state still shows it, and the switch still
    only starts the VM."""
    await setup_entry(hass, entry)
    await prepare(hass, entry, "gaming-2")
    await held(hass, entry, "gaming-2")
    ends = hass.states.get(HANDOFF).attributes["hold_ends"]

    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    await until(lambda: hass.states.get(HANDOFF).state == "held")
    assert hass.states.get(HANDOFF).attributes["hold_ends"] == ends

    await switch(hass, "turn_on", SWITCH_2)
    await until(lambda: sim.is_running("gaming-2"))
    await until(lambda: settled(entry))
    assert gpu_node_jobs(sim) == 1


async def test_a_hold_that_ran_out_while_home_assistant_was_away_ends_at_set_up(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Cards held for gaming station 1 for a second; Home Assistant is away
    (the entry unloaded) past the hold's end. Set up again, it finds the
    hold over: it says so and the cards go back, the VM left off."""
    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller
    assert await (await controller.async_prepare("gaming-1", hold=1.0))
    hold = controller.state.hold
    assert hold is not None
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    ends = dt_util.parse_datetime(hold.until)
    assert ends is not None
    await asyncio.sleep(max(0.0, (ends - dt_util.utcnow()).total_seconds()) + 0.1)
    expired = async_capture_events(hass, EVENT_HOLD_EXPIRED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)

    await setup_entry(hass, entry)
    await until(lambda: bool(expired) and bool(returned))
    assert [e.data["vm"] for e in expired] == ["gaming-1"]
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    assert not sim.is_running("gaming-1")
    assert entry.runtime_data.controller.state.hold is None


async def test_return_cards_ends_the_hold(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Return the cards while they are held: the hold ends and the GPU node
    serves again, uncordoned."""
    await setup_entry(hass, entry)
    await prepare(hass, entry, "gaming-1")
    await held(hass, entry, "gaming-1")

    await hass.services.async_call(
        DOMAIN,
        SERVICE_RETURN_CARDS,
        {"config_entry_id": entry.entry_id},
        blocking=True,
    )
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    await until(lambda: settled(entry))
    assert entry.runtime_data.controller.state.hold is None
    await until(lambda: hass.states.get(HANDOFF).state == "serving")
    assert hass.states.get(HANDOFF).attributes["held_for"] is None


async def test_another_vm_turned_on_ends_the_hold(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Cards held for gaming station 1, and gaming station 2 is turned on
    instead: it starts (one start job, the GPU node off already), the hold
    ends, and when gaming station 2 stops the cards go back."""
    await setup_entry(hass, entry)
    await prepare(hass, entry, "gaming-1")
    await held(hass, entry, "gaming-1")

    await play(hass, entry, sim, 2)
    assert gpu_node_jobs(sim) == 1
    assert entry.runtime_data.controller.state.hold is None

    await switch(hass, "turn_off", SWITCH_2)
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    assert not sim.is_running("gaming-1")


async def test_while_held_a_stop_elsewhere_gives_the_gpu_node_nothing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 2 plays (the GPU node off); cards are held for gaming
    station 1 (nothing to drain); gaming station 2 stops: the GPU node is
    not started, for it would take the held card; gaming station 1 then
    starts with it. Without the hold that stop would have started the GPU
    node."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 2)
    shutdowns = gpu_node_jobs(sim)
    controller = entry.runtime_data.controller

    assert await (await controller.async_prepare("gaming-1", hold=600.0))
    assert controller.state.hold is not None
    assert gpu_node_jobs(sim) == shutdowns  # it held the cards already

    await switch(hass, "turn_off", SWITCH_2)
    await until(lambda: not sim.is_running("gaming-2"))
    await until(lambda: settled(entry))
    await controller.coordinator.async_refresh()
    await hass.async_block_till_done()
    assert not sim.is_running("gpu-node")
    assert sim.calls("start", "gpu-node") == []
    assert hass.states.get(HANDOFF).state == "held"

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.is_running("gaming-1"))
    await until(lambda: settled(entry))
    assert not sim.is_running("gpu-node")


async def test_unloaded_while_an_operation_runs_under_a_hold_leaves_no_timer(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Cards are held for gaming station 1 while gaming station 2's stop
    runs; the entry unloads meanwhile. The stop ends as it is cancelled and
    no hold timer is left behind (Home Assistant's test harness fails on a
    lingering one at teardown); set up again, the hold is watched again."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 2)
    controller = entry.runtime_data.controller
    assert await (await controller.async_prepare("gaming-1", hold=600.0))
    sim.set_shutdown_duration("gaming-2", 300.0)  # 3 s at the tests' scale

    await switch(hass, "turn_off", SWITCH_2)
    await until(lambda: bool(sim.calls("shutdown", "gaming-2")))
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    assert controller._hold_timer is None

    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller
    assert controller.state.hold is not None
    assert controller._hold_timer is not None


async def test_the_player_starts_the_held_vm_on_the_tower(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The player starts gaming station 1 on the tower while its cards are
    held: it starts at once (the GPU node is off), the hold ends, its
    session is followed, and its end brings the cards back."""
    await setup_entry(hass, entry)
    await prepare(hass, entry, "gaming-1")
    await held(hass, entry, "gaming-1")

    assert start_by_hand(sim, "gaming-1").returncode == 0
    controller = entry.runtime_data.controller
    await until(lambda: controller.state.hold is None)
    await until(lambda: controller.desired == {"gaming-1"})
    await until(lambda: hass.states.get(SWITCH_1).state == "on")

    sim.guest_shutdown("gaming-1")
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    await until(lambda: settled(entry))


async def test_a_prepare_is_refused_clearly_and_changes_nothing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """A VM that runs has its cards; a VM GPU Handoff does not know, a hold
    out of range, and a prepare on top of an operator's cordon are refused,
    translated, and nothing is drained or held."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    controller = entry.runtime_data.controller
    evictions = len(cluster.requests_for(resource="pods/eviction"))

    with pytest.raises(ServiceValidationError) as err:
        await prepare(hass, entry, "gaming-1")
    assert err.value.translation_key == "vm_plays"
    with pytest.raises(ServiceValidationError) as err:
        await prepare(hass, entry, "gaming-9")
    assert err.value.translation_key == "unknown_vm"
    for minutes in (0, 241, "soon"):
        with pytest.raises(Exception, match="hold_minutes"):
            await prepare(hass, entry, "gaming-2", hold_minutes=minutes)
    assert controller.state.hold is None
    assert controller.requests == {}

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: sim.is_running("gpu-node") and not cordoned(cluster))
    await until(lambda: settled(entry))
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )
    await controller.coordinator.async_refresh()
    await hass.async_block_till_done()
    with pytest.raises(HomeAssistantError) as err:
        await prepare(hass, entry, "gaming-2")
    assert err.value.translation_key == "cordoned_by_operator"
    assert controller.state.hold is None
    assert sim.is_running("gpu-node")
    assert len(cluster.requests_for(resource="pods/eviction")) == evictions


async def test_lending_keeps_the_free_cards_lent_and_the_held_one_free(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Lending: prepare gaming station 1 and the GPU node comes back with
    the GTX 960 and gaming station 2's card, not gaming station 1's; the
    Handoff state serves and says the cards are held; turning gaming
    station 1 on starts it without touching the GPU node again."""
    await lend_free_cards(hass, entry)
    await prepare(hass, entry, "gaming-1")
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_2})
    controller = entry.runtime_data.controller
    assert controller.state.hold is not None
    assert hass.states.get(HANDOFF).attributes["held_for"] == "gaming-1"
    assert not sim.is_running("gaming-1")
    shutdowns = gpu_node_jobs(sim)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.is_running("gaming-1"))
    await until(lambda: settled(entry))
    assert gpu_node_jobs(sim) == shutdowns
    assert lent_cards(sim) == {GTX_960, RTX_2}
    assert controller.state.hold is None
