"""Setting up a tower: entities, availability, reauth, host key repair, findings.

Real parts: sshd forcing the agent on a libvirt test-driver tower (rewriting its
node file changes what the next status sees), and the Kubernetes API emulator
over HTTPS.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from homeassistant.components.diagnostics import REDACTED
from homeassistant.config_entries import (
    SOURCE_REAUTH,
    ConfigEntryState,
)
from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import HomeAssistant
from homeassistant.helpers import (
    device_registry as dr,
    entity_registry as er,
    issue_registry as ir,
)
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry
from pytest_homeassistant_custom_component.components.diagnostics import (
    get_diagnostics_for_config_entry,
    get_diagnostics_for_device,
)
from pytest_homeassistant_custom_component.typing import ClientSessionGenerator
from syrupy.assertion import SnapshotAssertion
from syrupy.filters import props

from custom_components.gpu_handoff.const import (
    CONF_HOST_KEY,
    CONF_KUBECONFIG,
    CONF_PRIVATE_KEY,
    DOMAIN,
)
from custom_components.gpu_handoff.tower import gpu_handoff as agent
from custom_components.gpu_handoff.tower_client import generate_key_pair
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.sshd import Sshd, generate_key
from tests.support.testdriver import write_tower

HANDOFF = "sensor.gpu_node_handoff_state"


@pytest.fixture
def entry(hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator) -> MockConfigEntry:
    """A tower entry with both gaming VMs."""
    return add_tower_entry(hass, tower, cluster, vms=(1, 2))


async def _setup(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED


async def _refresh(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """How many warnings or errors mention ``text``."""
    return sum(
        1
        for record in caplog.records
        if record.levelno >= logging.WARNING and text in record.getMessage()
    )


def _states(hass: HomeAssistant) -> dict[str, Any]:
    return {
        state.entity_id: state.state
        for state in hass.states.async_all()
        if state.entity_id.split(".")[0] in ("sensor", "binary_sensor")
    }


async def test_entities_show_the_tower_and_the_node(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """Every card's owner, the node's health and each VM's state."""
    await _setup(hass, entry)
    assert _states(hass) == {
        HANDOFF: "serving",
        "sensor.gpu_node_vm_state": "running",
        "sensor.gpu_node_gpus_in_use": "2",
        "sensor.gpu_node_pods_left_to_evict": "2",
        "binary_sensor.gpu_node_guest_agent": "off",
        "binary_sensor.gpu_node_kubernetes_node": "on",
        "binary_sensor.gpu_node_cordoned": "off",
        "sensor.tower_gpus_lent_to_the_cluster": "3",
        "sensor.gaming_station_1_vm_state": "shut_off",
        "sensor.gaming_station_2_vm_state": "shut_off",
        "binary_sensor.gaming_station_1_guest_agent": "off",
        "binary_sensor.gaming_station_2_guest_agent": "off",
    }
    attributes = hass.states.get(HANDOFF).attributes
    assert attributes["cordoned"] is False
    assert attributes["pods_left"] == 2
    assert attributes["node_ready"] is True
    assert attributes["guest_agent_ready"] is False
    assert attributes["gpus_allocatable"] == 3
    # One row per card, its functions (GPU and HDMI audio) inside.
    assert attributes["cards"][1] == {
        "card": "0000:02:00",
        "functions": ["0000:02:00.0", "0000:02:00.1"],
        "held_by": "gpu-node",
        "claimed_by": ["gaming-1", "gpu-node"],
    }
    assert len(attributes["cards"]) == 3
    assert attributes["options"] == [
        "serving",
        "cordoned",
        "draining",
        "stopping",
        "off",
        "starting",
        "joining",
        "unreachable",
    ]


async def test_devices(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """The tower, the GPU node and each gaming VM (linked to the tower)."""
    await _setup(hass, entry)
    registry = dr.async_get(hass)
    tower = registry.async_get_device_by_identifier(
        (DOMAIN, entry.entry_id), entry.entry_id
    )
    assert tower is not None
    vms = {
        device.name: device
        for device in dr.async_entries_for_config_entry(registry, entry.entry_id)
        if device.id != tower.id
    }
    assert set(vms) == {"GPU node", "Gaming station 1", "Gaming station 2"}
    assert all(device.via_device_id == tower.id for device in vms.values())
    # Once the agent session is open, the tower shows the agent it runs.
    async with asyncio.timeout(10):
        while registry.async_get(tower.id).sw_version != agent.VERSION:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_state_follows_the_tower(
    hass: HomeAssistant, entry: MockConfigEntry, tower_dir: Path
) -> None:
    """A gaming VM holding its card shows in ownership and counts."""
    await _setup(hass, entry)
    write_tower(tower_dir, gpu_node_running=False, gaming_running=("gaming-1",))
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "off"
    assert hass.states.get("sensor.gaming_station_1_vm_state").state == "running"
    assert hass.states.get("sensor.tower_gpus_lent_to_the_cluster").state == "0"
    cards = hass.states.get(HANDOFF).attributes["cards"]
    assert {card["card"]: card["held_by"] for card in cards}["0000:02:00"] == (
        "gaming-1"
    )


async def test_cordoned_and_not_ready_node(
    hass: HomeAssistant, entry: MockConfigEntry, cluster: K8sEmulator
) -> None:
    """Cordon and readiness of the node drive the handoff state."""
    await _setup(hass, entry)
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "cordoned"
    assert hass.states.get("binary_sensor.gpu_node_cordoned").state == "on"
    cluster.set_node_up(GPU_NODE, up=False)
    await _refresh(hass, entry)
    # The VM runs but its guest agent does not answer yet: still booting.
    assert hass.states.get(HANDOFF).state == "starting"
    assert hass.states.get("binary_sensor.gpu_node_kubernetes_node").state == "off"


async def test_tower_away_and_back(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: Sshd,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Entities go unavailable once, log once, and recover without a reload."""
    await _setup(hass, entry)
    tower.stop()
    await _refresh(hass, entry)
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == STATE_UNAVAILABLE
    assert hass.states.get("sensor.gaming_station_1_vm_state").state == (
        STATE_UNAVAILABLE
    )
    assert _logged(caplog, "Cannot reach the tower") == 1
    tower.start_again()
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "serving"
    assert entry.state is ConfigEntryState.LOADED


async def test_cluster_away_and_back(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    cluster: K8sEmulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without the cluster the tower's entities stay; the node's go unavailable."""
    await _setup(hass, entry)
    cluster.fail_next(2, 503, resource="nodes")
    await _refresh(hass, entry)
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "unreachable"
    assert hass.states.get(HANDOFF).attributes["cluster_error"] == (
        "cluster_unreachable"
    )
    assert hass.states.get("binary_sensor.gpu_node_kubernetes_node").state == (
        STATE_UNAVAILABLE
    )
    assert hass.states.get("sensor.gpu_node_gpus_in_use").state == STATE_UNAVAILABLE
    assert hass.states.get("sensor.gaming_station_1_vm_state").state == "shut_off"
    assert _logged(caplog, "unavailable") == 1
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "serving"
    assert "available again" in caplog.text


async def test_refused_key_starts_reauth(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A key the tower refuses fails setup and asks the user for a new key."""
    hass.config_entries.async_update_entry(
        entry, data=entry.data | {CONF_PRIVATE_KEY: generate_key_pair()[0]}
    )
    assert not await hass.config_entries.async_setup(entry.entry_id)
    assert entry.state is ConfigEntryState.SETUP_ERROR
    flows = hass.config_entries.flow.async_progress_by_handler(DOMAIN)
    assert [flow["context"]["source"] for flow in flows] == [SOURCE_REAUTH]


async def test_unusable_stored_kubeconfig(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A stored kubeconfig that cannot be parsed is a setup error, not a retry."""
    hass.config_entries.async_update_entry(
        entry, data=entry.data | {CONF_KUBECONFIG: "nope: ["}
    )
    assert not await hass.config_entries.async_setup(entry.entry_id)
    assert entry.state is ConfigEntryState.SETUP_ERROR


async def test_host_key_change_raises_a_repair(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: Sshd,
    hass_client: ClientSessionGenerator,
) -> None:
    """A new host key is refused; the repair shows both fingerprints and, once
    accepted, pins the new key and the entry works again."""
    await _setup(hass, entry)
    old = tower.host_fingerprint
    tower.stop()
    generate_key(tower.host_key)
    tower.start_again()
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == STATE_UNAVAILABLE
    issue_id = f"host_key_mismatch_{entry.entry_id}"
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_placeholders == {
        "host": "127.0.0.1",
        "old": old,
        "new": tower.host_fingerprint,
    }

    from homeassistant.components.repairs import (
        DOMAIN as REPAIRS,
    )
    from homeassistant.setup import async_setup_component

    assert await async_setup_component(hass, REPAIRS, {})
    client = await hass_client()
    response = await client.post(
        "/api/repairs/issues/fix", json={"handler": DOMAIN, "issue_id": issue_id}
    )
    flow = await response.json()
    assert flow["step_id"] == "confirm"
    assert flow["description_placeholders"]["new"] == tower.host_fingerprint
    response = await client.post(f"/api/repairs/issues/fix/{flow['flow_id']}")
    assert (await response.json())["type"] == "create_entry"
    await hass.async_block_till_done()
    assert entry.data[CONF_HOST_KEY].split()[:2] == tower.host_public_key.split()[:2]
    assert hass.states.get(HANDOFF).state == "serving"
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None


async def test_findings_become_repair_issues(
    hass: HomeAssistant, entry: MockConfigEntry, tower_dir: Path
) -> None:
    """A GPU node card without rom bar off is a repair issue until it is fixed."""
    write_tower(tower_dir, gpu_node_rom_bar_off=False)
    await _setup(hass, entry)
    issue_id = f"rom_bar_not_off_{entry.entry_id}_gpu-node"
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert "0000:03:00.1" in issue.translation_placeholders["details"]
    write_tower(tower_dir)
    await _refresh(hass, entry)
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None


async def test_adding_a_gaming_vm_reloads(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A gaming VM removed or added later brings or takes its entities."""
    await _setup(hass, entry)
    subentry = next(
        sub for sub in entry.subentries.values() if sub.unique_id == "gaming-2"
    )
    hass.config_entries.async_remove_subentry(entry, subentry.subentry_id)
    await hass.async_block_till_done()
    assert hass.states.get("sensor.gaming_station_2_vm_state") is None
    assert (
        dr.async_get(hass).async_get_device_by_identifier(
            (DOMAIN, f"{entry.entry_id}_gaming-2"), entry.entry_id
        )
        is None
    )
    assert hass.states.get("sensor.gaming_station_1_vm_state").state == "shut_off"


def _lines(secret: str) -> list[str]:
    """A secret's non-blank lines, stripped."""
    return [line.strip() for line in secret.splitlines() if line.strip()]


def _strings(value: Any) -> list[str]:
    """Every string in a diagnostics structure, keys too, as it is (not
    escaped as ``str()`` of the structure would show it)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple | set):
        return [s for item in value for s in _strings(item)]
    return [str(value)]


def _assert_no_line_of(secrets: tuple[str, ...], diagnostics: Any) -> None:
    """No line of any secret appears in any string of ``diagnostics``."""
    strings = _strings(diagnostics)
    for secret in secrets:
        for line in _lines(secret):
            leaked = [s for s in strings if line in s]
            assert not leaked, f"{line!r} reached diagnostics"


async def test_diagnostics_are_redacted(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    hass_client: ClientSessionGenerator,
    tower: Sshd,
) -> None:
    """Keys, kubeconfig, host and user never reach diagnostics: no line of
    any of them (``str()`` escapes newlines, so a multi-line secret as a whole
    could never be found in it even when it leaked)."""
    await _setup(hass, entry)
    diagnostics = await get_diagnostics_for_config_entry(hass, hass_client, entry)
    secrets = (
        entry.data[CONF_PRIVATE_KEY],
        entry.data[CONF_KUBECONFIG],
        tower.host_public_key.split()[1],
        "127.0.0.1",
    )
    assert len(_lines(entry.data[CONF_PRIVATE_KEY])) > 2
    assert len(_lines(entry.data[CONF_KUBECONFIG])) > 2
    _assert_no_line_of(secrets, diagnostics)
    assert diagnostics["entry"]["data"][CONF_PRIVATE_KEY] == REDACTED
    assert diagnostics["snapshot"]["tower"]["gpu_node"] == "gpu-node"
    assert diagnostics["snapshot"]["node"]["ready"] is True

    device = dr.async_get(hass).async_get_device_by_identifier(
        (DOMAIN, f"{entry.entry_id}_gaming-1"), entry.entry_id
    )
    assert device is not None
    device_diagnostics = await get_diagnostics_for_device(
        hass, hass_client, entry, device
    )
    _assert_no_line_of(secrets, device_diagnostics)
    assert set(device_diagnostics["domains"]) == {"gaming-1"}
    assert {card["address"] for card in device_diagnostics["cards"]} == {
        "0000:02:00.0",
        "0000:02:00.1",
    }


async def test_unload(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Unloading closes the SSH connection and the cluster session."""
    await _setup(hass, entry)
    coordinator = entry.runtime_data.coordinator
    assert coordinator.tower.connected
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.NOT_LOADED
    assert not coordinator.tower.connected


async def test_entity_snapshot(
    hass: HomeAssistant, entry: MockConfigEntry, snapshot: SnapshotAssertion
) -> None:
    """Every entity's registry entry, state and attributes, pinned."""
    await _setup(hass, entry)
    registry = er.async_get(hass)
    entities = sorted(
        er.async_entries_for_config_entry(registry, entry.entry_id),
        key=lambda item: item.entity_id,
    )
    pinned = {}
    for item in entities:
        state = hass.states.get(item.entity_id)
        pinned[item.entity_id] = {
            "unique_id": item.unique_id.removeprefix(entry.entry_id),
            "translation_key": item.translation_key,
            "entity_category": item.entity_category,
            "disabled_by": item.disabled_by,
            "device_class": item.original_device_class,
            "state": state.state if state else None,
            "attributes": dict(state.attributes) if state else None,
        }
    assert pinned == snapshot(exclude=props("lease_age"))


async def test_diagnostics_snapshot(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    hass_client: ClientSessionGenerator,
    snapshot: SnapshotAssertion,
) -> None:
    """The diagnostics' shape, pinned (volatile values left out), with the
    agent session open."""
    await _setup(hass, entry)
    coordinator = entry.runtime_data.coordinator
    async with asyncio.timeout(10):
        while not (  # noqa: ASYNC110 - the session opens in the background
            coordinator.session_connected
            and coordinator.tower.session is not None
            and coordinator.tower.session.status is not None
        ):
            await asyncio.sleep(0.02)
    diagnostics = await get_diagnostics_for_config_entry(hass, hass_client, entry)
    assert diagnostics["session_connected"] is True
    assert diagnostics == snapshot(
        exclude=props(
            "lease_age",
            "age",
            "virsh_calls",
            "entry_id",
            "subentry_id",
            "created_at",
            "modified_at",
            "port",
        )
    )
