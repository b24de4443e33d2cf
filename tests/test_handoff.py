"""The handoff, end to end: switches, the controller, the tower and the cluster.

Real parts: Home Assistant with the integration; sshd on 127.0.0.1 forcing the
real agent; the tower simulator behind it (the stand-in for GPUs and VFIO,
pinned to real virsh); the Kubernetes API emulator over HTTPS. A small
"kubelet" task plays the k3s agent inside the GPU node VM: the emulator's node
is Ready while the simulated VM runs, and goes NotReady when it stops.
Every test checks that nothing ever asked the tower for ``destroy``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
import subprocess
import sys

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import issue_registry as ir
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd
from tests.support.testdriver import AGENT, agent_command
from tests.towersim import Tower, realistic_tower

SWITCH_1 = "switch.gaming_station_1"
SWITCH_2 = "switch.gaming_station_2"
HANDOFF = "sensor.gpu_node_handoff_state"
BOUND = 30.0  # seconds any single wait below may take at most


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Tower]:
    """The realistic simulated tower, guests 100x faster than real ones."""
    tower = realistic_tower(tmp_path / "sim", time_scale=0.01)
    yield tower
    assert tower.destroy_attempts() == []
    tower.close()


@pytest.fixture
def agent_config(sim: Tower, tmp_path: Path) -> Path:
    """The agent's configuration: short guest-agent wait for the failure tests."""
    return write_agent_config(sim, tmp_path / "agent", agent=3.0)


@pytest.fixture
def sim_sshd(
    agent_config: Path, tmp_path: Path, socket_enabled: None
) -> Iterator[Sshd]:
    """sshd forcing the real agent on the simulated tower."""
    server = Sshd(tmp_path / "sshd", agent_command(agent_config)).start()
    yield server
    server.stop()


@pytest.fixture
async def kubelet(sim: Tower, cluster: K8sEmulator) -> AsyncIterator[None]:
    """The emulator's gpu-node is Ready exactly while the simulated VM runs."""

    async def follow() -> None:
        up = True
        while True:
            running = sim.is_running("gpu-node")
            if running != up:
                cluster.set_node_up(GPU_NODE, running)
                up = running
            await asyncio.sleep(0.05)

    task = asyncio.create_task(follow())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
def no_pdb(cluster: K8sEmulator) -> None:
    """Let the trainer pod be evicted (its PDB otherwise refuses forever)."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")


@pytest.fixture
def entry(
    hass: HomeAssistant, sim_sshd: Sshd, cluster: K8sEmulator, kubelet: None
) -> MockConfigEntry:
    """A tower with both gaming VMs; a short drain timeout."""
    return add_tower_entry(hass, sim_sshd, cluster, vms=(1, 2), drain_timeout=2)


async def _setup(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED


async def _until(what: Callable[[], bool], bound: float = BOUND) -> None:
    async with asyncio.timeout(bound):
        while not what():  # noqa: ASYNC110 - polls state the test cannot await
            await asyncio.sleep(0.05)


def _idle(entry: MockConfigEntry) -> bool:
    controller = entry.runtime_data.controller
    return controller.operation is None and controller.pending is None


def _cordoned(cluster: K8sEmulator) -> bool:
    return bool(cluster.get("Node", GPU_NODE, "")["spec"].get("unschedulable"))


async def _switch(hass: HomeAssistant, service: str, entity_id: str) -> None:
    await hass.services.async_call(
        "switch", service, {"entity_id": entity_id}, blocking=True
    )


async def _play(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, n: int
) -> None:
    """Turn Gaming station ``n`` on and wait until it runs and all is settled."""
    await _switch(hass, "turn_on", f"switch.gaming_station_{n}")
    await _until(lambda: sim.is_running(f"gaming-{n}"))
    await _until(lambda: _idle(entry))


async def _quit(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, n: int
) -> None:
    """Turn Gaming station ``n`` off and wait until it is off and all settled."""
    await _switch(hass, "turn_off", f"switch.gaming_station_{n}")
    await _until(lambda: not sim.is_running(f"gaming-{n}"))
    await _until(lambda: _idle(entry))
    await entry.runtime_data.async_refresh()
    await hass.async_block_till_done()


async def test_full_handoff_and_return(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Toggle on: cordon, drain, agent wait, stop, start, seen in the entities
    and events. Toggle off: the GPU node starts and is uncordoned."""
    started = async_capture_events(hass, EVENT_HANDOFF_STARTED)
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _setup(hass, entry)
    assert hass.states.get(SWITCH_1).state == "off"
    assert hass.states.get(HANDOFF).state == "serving"

    await _switch(hass, "turn_on", SWITCH_1)
    # Accepted at once: the switch shows the request and its step.
    assert hass.states.get(SWITCH_1).state == "on"
    await _until(lambda: _idle(entry))
    await _until(lambda: hass.states.get(HANDOFF).state == "off")
    assert sim.is_running("gaming-1")
    assert not sim.is_running("gpu-node")
    assert _cordoned(cluster)
    names = [event.data["step"] for event in steps]
    assert names[0] == "draining"
    assert "starting_vm" in names
    assert names.index("draining") < names.index("starting_vm")
    assert [e.data["vm"] for e in started] == ["gaming-1"]
    assert [e.data["vm"] for e in succeeded] == ["gaming-1"]
    device_id = started[0].data["device_id"]
    assert device_id is not None
    cards = hass.states.get(HANDOFF).attributes["cards"]
    held = {card["address"]: card["held_by"] for card in cards}
    assert held["0000:03:00.0"] == "gaming-1"  # its RTX 3050
    assert held["0000:01:00.0"] is None
    # The agent waited for the guest agent before it asked for the stop.
    shutdowns = sim.calls("shutdown", "gpu-node")
    assert len(shutdowns) == 1
    assert "agent" in shutdowns[0].argv
    assert hass.states.get(SWITCH_1).state == "on"

    await _switch(hass, "turn_off", SWITCH_1)
    await _until(lambda: bool(returned))
    await _until(lambda: _idle(entry))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert not _cordoned(cluster)
    await entry.runtime_data.async_refresh()
    assert hass.states.get(SWITCH_1).state == "off"
    assert hass.states.get(HANDOFF).state == "serving"


async def test_two_players(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Both gaming VMs on; one off (cards stay); the other off (cards return)."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _setup(hass, entry)
    await _switch(hass, "turn_on", SWITCH_1)
    await _play(hass, entry, sim, 2)
    await _until(lambda: sim.is_running("gaming-1"))

    await _quit(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert returned == []

    await _switch(hass, "turn_off", SWITCH_2)
    await _until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not _cordoned(cluster)


async def test_pdb_refuses_until_the_timeout(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, cluster: K8sEmulator
) -> None:
    """The trainer's PDB refuses eviction: the handoff fails, the node is
    uncordoned, nothing was stopped."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await _setup(hass, entry)
    await _switch(hass, "turn_on", SWITCH_1)
    await _until(lambda: bool(failed))
    await _until(lambda: _idle(entry))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert sim.calls("shutdown") == []
    assert not _cordoned(cluster)
    assert "PodDisruptionBudget" in failed[0].data["error"]
    assert hass.states.get(SWITCH_1).state == "off"
    assert "PodDisruptionBudget" in hass.states.get(SWITCH_1).attributes["last_error"]
    issue = ir.async_get(hass).async_get_issue(
        DOMAIN, f"handoff_failed_{entry.entry_id}_gaming-1"
    )
    assert issue is not None


async def test_guest_agent_never_comes_up(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """A GPU node whose guest agent never answers: the handoff fails after the
    agent's wait, the GPU node keeps running and is uncordoned."""
    _reboot_without_agent(sim)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await _setup(hass, entry)
    await _switch(hass, "turn_on", SWITCH_1)
    await _until(lambda: bool(failed))
    await _until(lambda: _idle(entry))
    assert failed[0].data["code"] == "agent_timeout"
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert sim.calls("shutdown", "gpu-node") == []
    await _until(lambda: not _cordoned(cluster))


def _libvirt_hook(sim: Tower, agent_config: Path, vm: str) -> None:
    """Run the agent's hook as libvirtd does when ``vm`` is being prepared."""
    xml = subprocess.run(
        [str(sim.virsh), "-c", sim.uri, "dumpxml", vm],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    hook = subprocess.run(
        [
            sys.executable,
            str(AGENT),
            "--config",
            str(agent_config),
            "hook",
            vm,
            "prepare",
            "begin",
            "-",
        ],
        input=xml,
        capture_output=True,
        text=True,
        check=False,
    )
    assert hook.returncode == 0


def _reboot_without_agent(sim: Tower) -> None:
    """Restart the simulated GPU node with a guest agent that never starts."""
    sim.guest_shutdown("gpu-node")
    sim.wait_until(lambda: not sim.is_running("gpu-node"), timeout=BOUND, what="off")
    sim.set_agent_delay("gpu-node", None)
    subprocess.run(
        [str(sim.virsh), "-c", sim.uri, "start", "gpu-node"],
        check=True,
        capture_output=True,
    )


async def test_restart_in_the_middle_of_a_handoff(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Home Assistant stops while the tower job runs; after the restart the
    controller follows the same job to the end instead of starting over."""
    sim.set_shutdown_duration("gpu-node", 2.0)
    await _setup(hass, entry)
    await _switch(hass, "turn_on", SWITCH_1)
    controller = entry.runtime_data.controller
    await _until(lambda: controller.pending is not None and controller.pending["job"])
    job = controller.pending["job"]
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()

    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    await _until(lambda: _idle(entry))
    assert sim.is_running("gaming-1")
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    # One tower job, submitted before the restart and followed after it.
    runs = [unit for unit in sim.unit_runs() if "run-job" in unit.argv]
    assert [job in unit.name for unit in runs] == [True]


async def test_started_by_hand_on_the_tower(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    agent_config: Path,
    no_pdb: None,
) -> None:
    """libvirt's hook records a gaming VM started by hand; Home Assistant
    notices and performs the handoff, so the player's retry finds it running."""
    await _setup(hass, entry)
    _libvirt_hook(sim, agent_config, "gaming-2")
    await entry.runtime_data.async_refresh()
    await _until(lambda: sim.is_running("gaming-2"))
    await _until(lambda: _idle(entry))
    assert not sim.is_running("gpu-node")


async def test_actions(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """start_handoff waits and answers with the result; return_cards brings the
    cards back; bad requests change nothing."""
    await _setup(hass, entry)
    response = await hass.services.async_call(
        DOMAIN,
        "start_handoff",
        {"config_entry_id": entry.entry_id, "vm": "gaming-2", "wait": True},
        blocking=True,
        return_response=True,
    )
    assert response == {"vm": "gaming-2", "succeeded": True, "error": None}
    assert sim.is_running("gaming-2")

    with pytest.raises(ServiceValidationError):
        await hass.services.async_call(
            DOMAIN,
            "start_handoff",
            {"config_entry_id": entry.entry_id, "vm": "not-a-vm"},
            blocking=True,
        )
    with pytest.raises(ServiceValidationError):
        await hass.services.async_call(
            DOMAIN, "return_cards", {"config_entry_id": "nope"}, blocking=True
        )

    # The player quits from inside the game: the cards come back by themselves.
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    sim.guest_shutdown("gaming-2")
    await _until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not _cordoned(cluster)


async def test_requests_while_the_tower_is_away(
    hass: HomeAssistant, entry: MockConfigEntry, sim_sshd: Sshd
) -> None:
    """With the tower unreachable a handoff request raises a translated error
    and changes nothing (the switch is unavailable, so it is not offered)."""
    await _setup(hass, entry)
    sim_sshd.stop()
    await entry.runtime_data.async_refresh()
    assert hass.states.get(SWITCH_1).state == "unavailable"
    with pytest.raises(HomeAssistantError) as err:
        await hass.services.async_call(
            DOMAIN,
            "start_handoff",
            {"config_entry_id": entry.entry_id, "vm": "gaming-1"},
            blocking=True,
        )
    assert err.value.translation_key == "tower_unreachable"
    with pytest.raises(HomeAssistantError) as err:
        await hass.services.async_call(
            DOMAIN, "return_cards", {"config_entry_id": entry.entry_id}, blocking=True
        )
    assert err.value.translation_key == "tower_unreachable"
    assert entry.runtime_data.controller.desired == set()
    assert entry.runtime_data.controller.pending is None


async def test_a_second_request_for_the_same_vm(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, no_pdb: None
) -> None:
    """A second handoff to a VM whose handoff runs is refused, translated."""
    await _setup(hass, entry)
    await _switch(hass, "turn_on", SWITCH_1)
    with pytest.raises(ServiceValidationError) as err:
        await _switch(hass, "turn_on", SWITCH_1)
    assert err.value.translation_key == "already_in_progress"
    await _until(lambda: _idle(entry))
    assert sim.is_running("gaming-1")


async def test_a_leftover_cordon_is_lifted(
    hass: HomeAssistant, entry: MockConfigEntry, cluster: K8sEmulator
) -> None:
    """A cordon no handoff accounts for (say, from an interrupted drain) is
    lifted as soon as the GPU node serves and nothing is pending."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _setup(hass, entry)
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )
    await entry.runtime_data.async_refresh()
    await _until(lambda: not _cordoned(cluster))
    await _until(lambda: _idle(entry))
    assert len(returned) == 1


async def test_cards_return_on_demand_only(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """With automatic return off, the GPU node stays off after the game until
    the return_cards action."""
    hass.config_entries.async_update_entry(
        entry, options=entry.options | {CONF_AUTO_RETURN: False}
    )
    await _setup(hass, entry)
    await _play(hass, entry, sim, 1)
    await _quit(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert hass.states.get(HANDOFF).state == "off"

    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await hass.services.async_call(
        DOMAIN, "return_cards", {"config_entry_id": entry.entry_id}, blocking=True
    )
    await _until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not _cordoned(cluster)
