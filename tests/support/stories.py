"""Helpers for the end-to-end stories: set up, wait, act as a user would.

The fixtures these stories use (the simulated tower, sshd forcing the real
agent, the "kubelet", the entry) live in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import subprocess

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import CONF_DOMAIN_NAME, CONF_LEND_FREE_CARDS
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.towersim import Tower

SWITCH_1 = "switch.gaming_station_1"
SWITCH_2 = "switch.gaming_station_2"
HANDOFF = "sensor.gpu_node_handoff_state"
BOUND = 30.0  # seconds any single wait below may take at most


async def setup_entry(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED


async def until(what: Callable[[], bool], bound: float = BOUND) -> None:
    async with asyncio.timeout(bound):
        while not what():  # noqa: ASYNC110 - polls state the test cannot await
            await asyncio.sleep(0.05)


def idle(entry: MockConfigEntry) -> bool:
    controller = entry.runtime_data.controller
    return controller.progress.operation is None and controller.plan is None


def cordoned(cluster: K8sEmulator) -> bool:
    return bool(cluster.get("Node", GPU_NODE, "")["spec"].get("unschedulable"))


async def switch(hass: HomeAssistant, service: str, entity_id: str) -> None:
    await hass.services.async_call(
        "switch", service, {"entity_id": entity_id}, blocking=True
    )


async def play(hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, n: int) -> None:
    """Turn Gaming station ``n`` on and wait until it runs and all is settled."""
    await switch(hass, "turn_on", f"switch.gaming_station_{n}")
    await until(lambda: sim.is_running(f"gaming-{n}"))
    await until(lambda: idle(entry))


async def quit_game(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, n: int
) -> None:
    """Turn Gaming station ``n`` off and wait until it is off and all settled."""
    await switch(hass, "turn_off", f"switch.gaming_station_{n}")
    await until(lambda: not sim.is_running(f"gaming-{n}"))
    await until(lambda: idle(entry))
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


def start_by_hand(sim: Tower, vm: str) -> subprocess.CompletedProcess[str]:
    """Someone runs ``virsh start VM`` on the tower: libvirtd runs the
    agent's hook (which records the start when the GPU node holds the VM's
    cards and starts the GPU node's stop), and the start fails while the GPU
    node holds them ("PCI device ... is in use"), leaving the VM ``shut off
    (failed)``, as libvirt does. Home Assistant reads the record only after
    (libvirt answers nothing about the domain while it starts)."""
    return subprocess.run(
        [str(sim.virsh), "-c", sim.uri, "start", "--domain", vm],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def lent_cards(sim: Tower) -> set[str] | None:
    """The cards the GPU node runs with (None while it is off)."""
    functions = sim.live_hostdevs("gpu-node")
    if functions is None:
        return None
    return {address.rsplit(".", 1)[0] for address in functions}


async def remove_gaming_vm(
    hass: HomeAssistant, entry: MockConfigEntry, vm: str
) -> None:
    """Remove ``vm``'s subentry (the entry reloads) and wait until loaded."""
    subentry = next(
        sub for sub in entry.subentries.values() if sub.data[CONF_DOMAIN_NAME] == vm
    )
    assert hass.config_entries.async_remove_subentry(entry, subentry.subentry_id)
    await hass.async_block_till_done()
    await until(lambda: entry.state is ConfigEntryState.LOADED)


async def lend_free_cards(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Turn "Keep lending the free cards" on, and set the entry up."""
    hass.config_entries.async_update_entry(
        entry, options=entry.options | {CONF_LEND_FREE_CARDS: True}
    )
    await setup_entry(hass, entry)


def allocatable_gpus(cluster: K8sEmulator) -> int:
    """The GPU node's allocatable ``nvidia.com/gpu``."""
    node = cluster.get("Node", GPU_NODE, "")
    return int(node["status"]["allocatable"].get("nvidia.com/gpu", 0))


async def serving_with(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    cards: set[str],
) -> None:
    """Everything settles with the GPU node serving these cards."""
    await until(lambda: lent_cards(sim) == cards, 60.0)
    await until(lambda: idle(entry) and not entry.runtime_data.controller.requests)
    await until(lambda: not cordoned(cluster))
    await until(lambda: allocatable_gpus(cluster) == len(cards))
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await until(lambda: hass.states.get(HANDOFF).state == "serving")
