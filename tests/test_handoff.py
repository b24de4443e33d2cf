"""The handoff, end to end: switches, the controller, the tower and the cluster.

Real parts: Home Assistant with the integration; sshd on 127.0.0.1 forcing the
real agent; the tower simulator behind it (the stand-in for GPUs and VFIO,
pinned to real virsh); the Kubernetes API emulator over HTTPS. A small
"kubelet" task plays the k3s agent inside the GPU node VM: the emulator's node
is Ready while the simulated VM runs, and goes NotReady when it stops.
Every test checks that nothing ever asked the tower for ``destroy``.
"""

from __future__ import annotations

from pathlib import Path
import subprocess

from homeassistant.config_entries import ConfigEntryState
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import issue_registry as ir
from homeassistant.setup import async_setup_component
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.cluster_client import CORDON_ANNOTATION
from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_GPU_NODE,
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)
from custom_components.gpu_handoff.tower_client import generate_key_pair
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.sshd import Sshd
from tests.support.stories import (
    BOUND,
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    play,
    quit_game,
    setup_entry,
    start_by_hand,
    switch,
    until,
)
from tests.towersim import Tower


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
    await setup_entry(hass, entry)
    assert hass.states.get(SWITCH_1).state == "off"
    assert hass.states.get(HANDOFF).state == "serving"

    await switch(hass, "turn_on", SWITCH_1)
    # Accepted at once: the switch shows the request and its step.
    assert hass.states.get(SWITCH_1).state == "on"
    await until(lambda: idle(entry))
    await until(lambda: hass.states.get(HANDOFF).state == "off")
    assert sim.is_running("gaming-1")
    assert not sim.is_running("gpu-node")
    assert cordoned(cluster)
    names = [event.data["step"] for event in steps]
    assert names[0] == "draining"
    assert "starting_vm" in names
    assert names.index("draining") < names.index("starting_vm")
    assert [e.data["vm"] for e in started] == ["gaming-1"]
    assert [e.data["vm"] for e in succeeded] == ["gaming-1"]
    device_id = started[0].data["device_id"]
    assert device_id is not None
    cards = hass.states.get(HANDOFF).attributes["cards"]
    held = {card["card"]: card["held_by"] for card in cards}
    assert held["0000:03:00"] == "gaming-1"  # its RTX 3050
    assert held["0000:01:00"] is None
    # The agent waited for the guest agent before it asked for the stop.
    shutdowns = sim.calls("shutdown", "gpu-node")
    assert len(shutdowns) == 1
    assert "agent" in shutdowns[0].argv
    assert hass.states.get(SWITCH_1).state == "on"

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert not cordoned(cluster)
    await entry.runtime_data.coordinator.async_refresh()
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
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await play(hass, entry, sim, 2)
    await until(lambda: sim.is_running("gaming-1"))

    await quit_game(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert returned == []

    await switch(hass, "turn_off", SWITCH_2)
    await until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not cordoned(cluster)


async def test_pdb_refuses_until_the_timeout(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, cluster: K8sEmulator
) -> None:
    """The trainer's PDB refuses eviction: the handoff fails, the node is
    uncordoned, nothing was stopped."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert sim.calls("shutdown") == []
    assert not cordoned(cluster)
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
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))
    assert failed[0].data["code"] == "agent_timeout"
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert sim.calls("shutdown", "gpu-node") == []
    await until(lambda: not cordoned(cluster))


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


async def test_started_by_hand_on_the_tower(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    agent_config: Path,
    no_pdb: None,
) -> None:
    """libvirt's hook records a gaming VM started by hand; Home Assistant
    notices and performs the handoff, so the player's retry finds it running."""
    await setup_entry(hass, entry)
    refused = start_by_hand(sim, "gaming-2")
    assert "is in use" in refused.stderr, refused.stderr
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: sim.is_running("gaming-2"))
    await until(lambda: idle(entry))
    assert not sim.is_running("gpu-node")


async def test_a_drain_stops_waiting_once_the_hook_shut_the_gpu_node_down(
    hass: HomeAssistant,
    sim_sshd: Sshd,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: None,
    no_pdb: None,
) -> None:
    """A start by hand: libvirt's hook shuts the GPU node down while Home
    Assistant drains it. Pods still terminating when the GPU node goes off
    can never finish there (a kubelet that is down deletes nothing: they stay
    Terminating, as on a real cluster, until kubectl's
    --skip-wait-for-delete-timeout of 60 s or the drain timeout), so the
    drain stops waiting for them and the player gets the cards at once."""
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1, 2), drain_timeout=300)
    for name in ("llm-inference-5d9c8b7f6-q4w8z", "trainer-7c6d5e4f3-m2n9v"):
        cluster.set_pod_stop_seconds(name, "ai", 25.0)  # within their 30 s grace
    sim.set_shutdown_duration("gpu-node", 150.0)  # 1.5 s here: the drain begins first
    await setup_entry(hass, entry)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    start_by_hand(sim, "gaming-2")
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: sim.is_running("gaming-2"))
    await until(lambda: idle(entry))
    assert [event.data["vm"] for event in succeeded] == ["gaming-2"]
    assert not sim.is_running("gpu-node")
    left = cluster.get("Pod", "llm-inference-5d9c8b7f6-q4w8z", "ai")
    assert left is not None
    assert left["metadata"].get("deletionTimestamp")  # still Terminating there


async def test_actions(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """start_handoff waits and answers with the result; return_cards brings the
    cards back; bad requests change nothing."""
    await setup_entry(hass, entry)
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
    await until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not cordoned(cluster)


# Each action with the fields it needs, on an entry that is not loaded.
NOT_LOADED_CALLS = {
    "return_cards": {},
    "start_handoff": {"vm": "gaming-1", "wait": True},
    "capture_screen": {"vm": "gpu-node", "filename": "/config/www/screen.png"},
}


@pytest.mark.parametrize(
    "state", [ConfigEntryState.NOT_LOADED, ConfigEntryState.SETUP_ERROR]
)
@pytest.mark.parametrize("action", sorted(NOT_LOADED_CALLS))
async def test_actions_on_an_entry_that_is_not_loaded(
    hass: HomeAssistant, action: str, state: ConfigEntryState
) -> None:
    """Every action on a tower whose entry is not loaded (never set up, or
    failed to set up) raises the translated entry_not_loaded, with the
    entry's id in the message, and touches nothing."""
    private, public = generate_key_pair()
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="tower",
        minor_version=2,
        data={
            CONF_HOST: "127.0.0.1",
            CONF_PORT: 1,
            CONF_USERNAME: "gpu-handoff",
            CONF_PRIVATE_KEY: private,
            CONF_PASSPHRASE: None,
            CONF_HOST_KEY: public,
            CONF_GPU_NODE: "gpu-node",
            # Unusable: setting the entry up fails before any connection.
            CONF_KUBECONFIG: "clusters: [",
            CONF_K8S_NODE: "gpu-node",
        },
    )
    if state is ConfigEntryState.SETUP_ERROR:
        entry.add_to_hass(hass)
    assert await async_setup_component(hass, DOMAIN, {})
    await hass.async_block_till_done()
    if state is ConfigEntryState.NOT_LOADED:
        entry.add_to_hass(hass)
    assert entry.state is state
    with pytest.raises(ServiceValidationError) as err:
        await hass.services.async_call(
            DOMAIN,
            action,
            {"config_entry_id": entry.entry_id, **NOT_LOADED_CALLS[action]},
            blocking=True,
            return_response=action != "return_cards",
        )
    assert err.value.translation_domain == DOMAIN
    assert err.value.translation_key == "entry_not_loaded"
    assert err.value.translation_placeholders == {"entry_id": entry.entry_id}
    # strings.json's message, which Home Assistant ends without its stop.
    assert str(err.value) == f"The tower {entry.entry_id} is not loaded"
    assert entry.state is state


async def test_requests_while_the_tower_is_away(
    hass: HomeAssistant, entry: MockConfigEntry, sim_sshd: Sshd
) -> None:
    """With the tower unreachable a handoff request raises a translated error
    and changes nothing (the switch is unavailable, so it is not offered)."""
    await setup_entry(hass, entry)
    sim_sshd.stop()
    await entry.runtime_data.coordinator.async_refresh()
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
    assert entry.runtime_data.controller.plan is None


async def test_a_second_request_for_the_same_vm(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, no_pdb: None
) -> None:
    """A second handoff to a VM whose handoff runs is refused, translated."""
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    with pytest.raises(ServiceValidationError) as err:
        await switch(hass, "turn_on", SWITCH_1)
    assert err.value.translation_key == "already_in_progress"
    await until(lambda: idle(entry))
    assert sim.is_running("gaming-1")


async def test_a_leftover_cordon_of_ours_is_lifted(
    hass: HomeAssistant, entry: MockConfigEntry, cluster: K8sEmulator
) -> None:
    """A cordon of ours that no operation accounts for (a crash between the
    node's return and the uncordon) is lifted as soon as the GPU node serves
    and nothing is pending."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await setup_entry(hass, entry)
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: (
            node["spec"].update(unschedulable=True),
            node["metadata"]
            .setdefault("annotations", {})
            .update({CORDON_ANNOTATION: "handoff to gaming-1"}),
        ),
    )
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: not cordoned(cluster))
    await until(lambda: idle(entry))
    assert len(returned) == 1
    annotations = cluster.get("Node", GPU_NODE, "")["metadata"].get("annotations")
    assert CORDON_ANNOTATION not in (annotations or {})


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
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await quit_game(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert hass.states.get(HANDOFF).state == "off"

    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await hass.services.async_call(
        DOMAIN, "return_cards", {"config_entry_id": entry.entry_id}, blocking=True
    )
    await until(lambda: bool(returned))
    assert sim.is_running("gpu-node")
    assert not cordoned(cluster)
