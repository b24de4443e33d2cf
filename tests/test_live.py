"""Live updates: changes on the tower reach Home Assistant through the agent's
``watch`` stream, without waiting for the poll.

Real parts: sshd on 127.0.0.1 forcing the real agent, which drives the tower
simulator (the stand-in for GPUs and VFIO, pinned to real virsh by its
conformance tests); the Kubernetes API emulator over HTTPS. The poll interval
is 30 s here, so an update seen within a few seconds came through the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
import shutil

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from tests.conftest import add_tower_entry
from tests.k8semu import K8sEmulator
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd, sshd_available
from tests.support.testdriver import agent_command
from tests.towersim import Tower, realistic_tower

HANDOFF = "sensor.gpu_node_handoff_state"
# Bound for a pushed update (the poll would take 30 s).
PUSH_BOUND = 10.0


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Tower]:
    """The realistic simulated tower, with 100x faster guests."""
    tower = realistic_tower(tmp_path / "sim", time_scale=0.01)
    yield tower
    tower.close()


@pytest.fixture
def sim_sshd(sim: Tower, tmp_path: Path, socket_enabled: None) -> Iterator[Sshd]:
    """sshd forcing the real agent, configured for the simulated tower."""
    if not sshd_available() or shutil.which("ssh-keygen") is None:
        pytest.skip("needs OpenSSH's sshd")
    config = write_agent_config(sim, tmp_path / "agent")
    server = Sshd(tmp_path / "sshd", agent_command(config)).start()
    yield server
    server.stop()


@pytest.fixture
def entry(hass: HomeAssistant, sim_sshd: Sshd, cluster: K8sEmulator) -> MockConfigEntry:
    """An entry for the simulated tower, gaming-1 added, 30 s poll."""
    return add_tower_entry(hass, sim_sshd, cluster, vms=(1,))


async def _until(what: Callable[[], bool]) -> None:
    """Wait, bounded by PUSH_BOUND, until ``what`` holds."""
    async with asyncio.timeout(PUSH_BOUND):
        while not what():  # noqa: ASYNC110 - polls state the test cannot await
            await asyncio.sleep(0.05)


async def _until_in_executor(hass: HomeAssistant, what: Callable[[], bool]) -> None:
    """``_until`` for a check that reads files (the simulator's records)."""
    async with asyncio.timeout(PUSH_BOUND):
        while not await hass.async_add_executor_job(what):  # noqa: ASYNC110 - files
            await asyncio.sleep(0.05)


async def _state_becomes(hass: HomeAssistant, entity_id: str, wanted: str) -> None:
    """Wait for a state that only a pushed update can bring this soon."""

    def reached() -> bool:
        state = hass.states.get(entity_id)
        return state is not None and state.state == wanted

    await _until(reached)


async def test_tower_changes_are_pushed(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    """The GPU node powering off, then starting again, shows without a poll."""
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    await _state_becomes(hass, HANDOFF, "serving")
    assert hass.states.get("sensor.tower_gpus_lent_to_the_cluster").state == "3"
    await _until(lambda: entry.runtime_data.session.connected)

    sim.guest_shutdown("gpu-node")
    await _state_becomes(hass, HANDOFF, "off")
    cards = hass.states.get(HANDOFF).attributes["cards"]
    assert {card["held_by"] for card in cards} == {None}
    assert hass.states.get("sensor.tower_gpus_lent_to_the_cluster").state == "0"


async def test_the_gpu_node_stops_until_its_qemu_has_exited(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    """After the guest powered off, libvirt says ``in shutdown`` until QEMU
    has exited (seconds with large memory or devices to release), and the GPU
    node still holds its cards: the Handoff state says stopping, with the
    cards held, and off only once it is shut off, with none (a status read
    in that moment said off with every card still held)."""
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    await _state_becomes(hass, HANDOFF, "serving")
    await _until(lambda: entry.runtime_data.session.connected)
    # The session listens before its first status, but virsh has registered
    # for events a moment later: what happens before is seen at the next
    # event or refresh (here, the domain shut off), so wait for it.
    await _until_in_executor(
        hass,
        lambda: any(
            c.has("event") and c.subscribed and c.end is None for c in sim.commands()
        ),
    )
    # QEMU takes 3 s to exit once the guest has powered off, at once
    sim.set_shutdown_duration("gpu-node", 300)
    sim.set_in_shutdown_duration("gpu-node", 300)

    sim.guest_shutdown("gpu-node")

    def vm_state() -> str | None:
        state = hass.states.get(HANDOFF)
        return None if state is None else state.attributes.get("vm_state")

    await _until(lambda: vm_state() == "in_shutdown")
    state = hass.states.get(HANDOFF)
    assert state is not None
    assert state.state == "stopping"
    assert {card["held_by"] for card in state.attributes["cards"]} == {"gpu-node"}
    await _state_becomes(hass, HANDOFF, "off")
    state = hass.states.get(HANDOFF)
    assert state is not None
    assert state.attributes["vm_state"] == "shut_off"
    assert {card["held_by"] for card in state.attributes["cards"]} == {None}


async def test_event_stream_comes_back(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, sim_sshd: Sshd
) -> None:
    """When the tower drops the stream, the coordinator reconnects it and
    pushed updates flow again."""
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    session = entry.runtime_data.session
    await _until(lambda: session.connected)
    sim_sshd.stop()  # ends every session, the stream's too
    await _until(lambda: not session.connected)
    sim_sshd.start_again()
    await _until(lambda: session.connected)
    sim.guest_shutdown("gpu-node")
    await _state_becomes(hass, HANDOFF, "off")
