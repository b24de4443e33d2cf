"""Two towers in one Home Assistant: two config entries, each its own tower
(a simulator behind its own sshd and agent) and GPU node, one cluster.

Each tower has its own devices (named after the tower, as its agent reports
it), entities, operations, storage, actions and diagnostics: what one does
never shows in, blocks or changes the other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
import json
from pathlib import Path

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
from homeassistant.helpers import device_registry as dr, entity_registry as er
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)
from pytest_homeassistant_custom_component.components.diagnostics import (
    get_diagnostics_for_config_entry,
)
from pytest_homeassistant_custom_component.typing import ClientSessionGenerator

from custom_components.gpu_handoff.const import (
    CONF_K8S_NODE,
    DOMAIN,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
)
from custom_components.gpu_handoff.owned import handoff_store
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.kubelet import FAST, Kubelet
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd
from tests.support.stories import idle, setup_entry, until
from tests.support.testdriver import agent_command
from tests.towersim import Tower, realistic_tower

GPU_NODE_2 = "gpu-node-2"


def _named_agent(sim: Tower, directory: Path, name: str) -> Path:
    config = write_agent_config(sim, directory, agent=3.0)
    data = json.loads(config.read_text(encoding="utf-8"))
    config.write_text(json.dumps(data | {"name": name}), encoding="utf-8")
    return config


@pytest.fixture
def towers(tmp_path: Path, socket_enabled: None) -> Iterator[list[tuple[Tower, Sshd]]]:
    """Two simulated towers, each behind its own sshd forcing its own agent."""
    made: list[tuple[Tower, Sshd]] = []
    try:
        for n in (1, 2):
            sim = realistic_tower(tmp_path / f"sim{n}", time_scale=0.01)
            config = _named_agent(sim, tmp_path / f"agent{n}", f"tower-{n}")
            server = Sshd(tmp_path / f"sshd{n}", agent_command(config)).start()
            made.append((sim, server))
        yield made
    finally:
        for sim, server in made:
            server.stop()
            assert sim.destroy_attempts() == []
            sim.close()


@pytest.fixture
async def two_entries(
    hass: HomeAssistant,
    towers: list[tuple[Tower, Sshd]],
    cluster: K8sEmulator,
    no_pdb: None,
) -> AsyncIterator[list[MockConfigEntry]]:
    """Tower 1 lends to gpu-node, tower 2 to gpu-node-2, in one cluster."""
    cluster.add_node(GPU_NODE_2, gpus=3, address="10.0.0.11")
    kubelets = [
        Kubelet(towers[0][0], cluster, node=GPU_NODE, **FAST),
        Kubelet(towers[1][0], cluster, node=GPU_NODE_2, **FAST),
    ]
    for kubelet in kubelets:
        kubelet.start()
    first = add_tower_entry(hass, towers[0][1], cluster, drain_timeout=5)
    second = add_tower_entry(hass, towers[1][1], cluster, drain_timeout=5)
    # Titled as the config flow titles them: by the name each agent reports.
    hass.config_entries.async_update_entry(first, title="tower-1")
    hass.config_entries.async_update_entry(
        second, title="tower-2", data=second.data | {CONF_K8S_NODE: GPU_NODE_2}
    )
    try:
        # Setting the integration up sets up both of its entries.
        await setup_entry(hass, first)
        assert second.state is ConfigEntryState.LOADED
        yield [first, second]
    finally:
        for kubelet in kubelets:
            await kubelet.stop()


def _switch(hass: HomeAssistant, entry: MockConfigEntry, vm: str) -> str:
    """The entity id of ``vm``'s switch on ``entry``'s tower."""
    registry = er.async_get(hass)
    for entity in er.async_entries_for_config_entry(registry, entry.entry_id):
        if entity.domain == "switch" and f"_{vm}_" in entity.unique_id:
            return entity.entity_id
    raise AssertionError(f"no switch for {vm} on {entry.title}")


def _cordoned(cluster: K8sEmulator, node: str) -> bool:
    return bool(cluster.get("Node", node, "")["spec"].get("unschedulable"))


async def test_two_towers_are_independent(
    hass: HomeAssistant,
    towers: list[tuple[Tower, Sshd]],
    two_entries: list[MockConfigEntry],
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
) -> None:
    """Each tower is named after itself, and a handoff on each at the same
    time touches only its own tower, GPU node, storage and entities."""
    (sim1, _), (sim2, _) = towers
    first, second = two_entries
    devices = dr.async_get(hass)

    def tower_names() -> set[str | None]:
        names = set()
        for entry in two_entries:
            tower_devices = [
                device
                for device in dr.async_entries_for_config_entry(devices, entry.entry_id)
                if device.via_device_id is None
            ]
            assert len(tower_devices) == 1
            names.add(tower_devices[0].name)
        return names

    # Named once each agent's session says who it is.
    await until(lambda: tower_names() == {"tower-1", "tower-2"})
    lent = sorted(
        state.entity_id
        for state in hass.states.async_all("sensor")
        if state.entity_id.endswith("gpus_lent_to_the_cluster")
    )
    assert lent == [
        "sensor.tower_1_gpus_lent_to_the_cluster",
        "sensor.tower_2_gpus_lent_to_the_cluster",
    ]

    switch_1 = _switch(hass, first, "gaming-1")
    switch_2 = _switch(hass, second, "gaming-2")
    assert switch_1 != switch_2
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    # Both at once: one operation per tower, not one for both.
    await hass.services.async_call(
        "switch", "turn_on", {"entity_id": [switch_1, switch_2]}, blocking=True
    )
    assert first.runtime_data.controller.requests == {"gaming-1": "handoff"}
    assert second.runtime_data.controller.requests == {"gaming-2": "handoff"}
    await until(lambda: len(handed) == 2, bound=60)
    await until(lambda: idle(first))
    await until(lambda: idle(second))

    assert [sim1.is_running(f"gaming-{n}") for n in (1, 2)] == [True, False]
    assert [sim2.is_running(f"gaming-{n}") for n in (1, 2)] == [False, True]
    assert not sim1.is_running("gpu-node")
    assert not sim2.is_running("gpu-node")
    assert {(e.data["config_entry_id"], e.data["vm"]) for e in handed} == {
        (first.entry_id, "gaming-1"),
        (second.entry_id, "gaming-2"),
    }
    assert _cordoned(cluster, GPU_NODE)
    assert _cordoned(cluster, GPU_NODE_2)
    stored = [await handoff_store(hass, e.entry_id).async_load() for e in two_entries]
    assert [s["desired"] if s else None for s in stored] == [["gaming-1"], ["gaming-2"]]

    # The action returns the cards of the tower it names, and only those.
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    await hass.services.async_call(
        "switch", "turn_off", {"entity_id": switch_2}, blocking=True
    )
    await until(lambda: sim2.is_running("gpu-node"), bound=60)
    await until(lambda: idle(second) and not _cordoned(cluster, GPU_NODE_2))
    assert sim1.is_running("gaming-1")
    assert not sim1.is_running("gpu-node")
    assert _cordoned(cluster, GPU_NODE)
    assert all(e.data["config_entry_id"] == second.entry_id for e in returned)

    # Diagnostics of one tower say nothing of the other.
    diagnostics = await get_diagnostics_for_config_entry(hass, hass_client, first)
    text = json.dumps(diagnostics)
    assert GPU_NODE_2 not in text
    assert second.entry_id not in text

    # One tower unloaded: the other goes on.
    assert await hass.config_entries.async_unload(second.entry_id)
    await hass.async_block_till_done()
    await hass.services.async_call(
        "switch", "turn_off", {"entity_id": switch_1}, blocking=True
    )
    await until(lambda: sim1.is_running("gpu-node"), bound=60)
    await until(lambda: idle(first) and not _cordoned(cluster, GPU_NODE))
    assert sim2.is_running("gpu-node")


async def test_an_action_names_its_tower(
    hass: HomeAssistant,
    towers: list[tuple[Tower, Sshd]],
    two_entries: list[MockConfigEntry],
) -> None:
    """`start_handoff` with `config_entry_id` works on that tower alone."""
    (sim1, _), (sim2, _) = towers
    first, second = two_entries
    response = await hass.services.async_call(
        DOMAIN,
        "start_handoff",
        {"config_entry_id": second.entry_id, "vm": "gaming-1", "wait": True},
        blocking=True,
        return_response=True,
    )
    assert response == {"vm": "gaming-1", "succeeded": True, "error": None}
    assert sim2.is_running("gaming-1")
    assert not sim1.is_running("gaming-1")
    assert sim1.is_running("gpu-node")
    assert idle(first)
    assert first.runtime_data.controller.desired == set()
    assert second.runtime_data.controller.desired == {"gaming-1"}
