"""Setting up a tower: entities, availability, reauth, host key repair, findings.

Real parts: sshd forcing the agent on a libvirt test-driver tower (rewriting its
node file changes what the next status sees), and the Kubernetes API emulator
over HTTPS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
import re
from typing import Any

from homeassistant.components.diagnostics import REDACTED
from homeassistant.components.repairs import DOMAIN as REPAIRS
from homeassistant.config_entries import (
    SOURCE_REAUTH,
    SOURCE_USER,
    ConfigEntryState,
)
from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import HomeAssistant
from homeassistant.helpers import (
    device_registry as dr,
    entity_registry as er,
    issue_registry as ir,
)
from homeassistant.setup import async_setup_component
from homeassistant.util import dt as dt_util
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry
from pytest_homeassistant_custom_component.components.diagnostics import (
    get_diagnostics_for_config_entry,
    get_diagnostics_for_device,
)
from pytest_homeassistant_custom_component.typing import (
    ClientSessionGenerator,
    WebSocketGenerator,
)
from syrupy.assertion import SnapshotAssertion
from syrupy.filters import props

from custom_components.gpu_handoff.const import (
    CONF_DOMAIN_NAME,
    CONF_HOST_KEY,
    CONF_HOST_KEY_PINNED_AT,
    CONF_KNOWN_VMS,
    CONF_KUBECONFIG,
    CONF_PRIVATE_KEY,
    DOMAIN,
    SUBENTRY_GAMING_VM,
)
from custom_components.gpu_handoff.diagnostics import async_get_config_entry_diagnostics
from custom_components.gpu_handoff.models import domain_identifier, tower_identifier
from custom_components.gpu_handoff.tower.gpu_handoff import wire
from custom_components.gpu_handoff.tower_client import fingerprint, generate_key_pair
from tests.conftest import add_tower_entry, tower_entry_data
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.sshd import Sshd, generate_key
from tests.support.testdriver import write_tower

HANDOFF = "sensor.gpu_node_handoff_state"
COMPONENT = Path(__file__).resolve().parent.parent / "custom_components" / DOMAIN


def _configure_agent(tower_dir: Path, **changes: Any) -> None:
    """Change the tower agent's configuration (a session opened later, or a
    one-shot call, reads it)."""
    config = tower_dir / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    config.write_text(json.dumps(data | changes), encoding="utf-8")


@pytest.fixture
def entry(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator, tower_dir: Path
) -> MockConfigEntry:
    """A tower entry with both gaming VMs; the agent calls the tower what the
    entry is titled, so the names shown do not depend on the machine."""
    _configure_agent(tower_dir, name="tower")
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
        "binary_sensor.gpu_node_health": "off",
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
        "iommu_group": None,
        "blocked_by": None,
        "use": "cluster",
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
        "held",
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
        while registry.async_get(tower.id).sw_version != wire.VERSION:  # noqa: ASYNC110
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


async def _fix(
    hass: HomeAssistant, hass_client: ClientSessionGenerator, issue_id: str
) -> tuple[dict[str, Any], Any]:
    """Open the fix flow of an issue as the frontend does: (its first step,
    a function that submits it and returns the result)."""
    assert await async_setup_component(hass, REPAIRS, {})
    client = await hass_client()
    response = await client.post(
        "/api/repairs/issues/fix", json={"handler": DOMAIN, "issue_id": issue_id}
    )
    flow: dict[str, Any] = await response.json()

    async def submit() -> dict[str, Any]:
        response = await client.post(f"/api/repairs/issues/fix/{flow['flow_id']}")
        result: dict[str, Any] = await response.json()
        await hass.async_block_till_done()
        return result

    return flow, submit


async def _change_host_key(
    hass: HomeAssistant, entry: MockConfigEntry, tower: Sshd
) -> str:
    """The tower gets a new host key; the next refresh raises the repair."""
    tower.stop()
    generate_key(tower.host_key)
    tower.start_again()
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == STATE_UNAVAILABLE
    return f"host_key_mismatch_{entry.entry_id}"


async def test_host_key_change_raises_a_repair(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: Sshd,
    hass_client: ClientSessionGenerator,
) -> None:
    """A new host key is refused; the repair shows both fingerprints and, once
    accepted, pins the new key, which is the tower's identity from then on,
    and the entry works again."""
    await _setup(hass, entry)
    old = tower.host_fingerprint
    assert entry.unique_id == old
    issue_id = await _change_host_key(hass, entry, tower)
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_placeholders == {
        "host": "127.0.0.1",
        "old": old,
        "new": tower.host_fingerprint,
    }
    flow, submit = await _fix(hass, hass_client, issue_id)
    assert flow["step_id"] == "confirm"
    assert flow["description_placeholders"]["new"] == tower.host_fingerprint
    accepted = dt_util.utcnow()
    assert (await submit())["type"] == "create_entry"
    assert entry.data[CONF_HOST_KEY].split()[:2] == tower.host_public_key.split()[:2]
    assert entry.unique_id == tower.host_fingerprint != old
    # When: the update repair takes no password for a day after it.
    pinned = dt_util.parse_datetime(entry.data[CONF_HOST_KEY_PINNED_AT])
    assert pinned is not None
    assert abs((pinned - accepted).total_seconds()) < 60
    assert hass.states.get(HANDOFF).state == "serving"
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None


async def test_a_host_key_of_another_tower_is_not_accepted(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: Sshd,
    hass_client: ClientSessionGenerator,
) -> None:
    """If the new key is the key of another tower that is set up, accepting
    it would make two entries of one tower: refused, nothing changes."""
    await _setup(hass, entry)
    before = dict(entry.data)
    issue_id = await _change_host_key(hass, entry, tower)
    MockConfigEntry(
        domain=DOMAIN,
        title="another tower",
        unique_id=tower.host_fingerprint,
        minor_version=2,
        data={CONF_HOST_KEY: tower.host_public_key},
    ).add_to_hass(hass)
    _, submit = await _fix(hass, hass_client, issue_id)
    result = await submit()
    assert result["type"] == "abort"
    assert result["reason"] == "other_tower_configured"
    assert dict(entry.data) == before
    assert entry.unique_id == fingerprint(before[CONF_HOST_KEY])


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
    # Every placeholder of its text is given (the XML comes as one).
    strings = json.loads((COMPONENT / "strings.json").read_text(encoding="utf-8"))
    text = strings["issues"]["rom_bar_not_off"]["description"]
    assert set(re.findall(r"\{(\w+)\}", text)) <= set(issue.translation_placeholders)
    assert issue.translation_placeholders["rom_element"] == "<rom bar='off'/>"
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
    tower_dir: Path,
) -> None:
    """Keys, kubeconfig, host, the tower's name and user never reach
    diagnostics: no line of any of them (``str()`` escapes newlines, so a
    multi-line secret as a whole could never be found in it even when it
    leaked)."""
    _configure_agent(tower_dir, name="attic-tower.example.net")
    await _setup(hass, entry)
    registry = dr.async_get(hass)
    tower_device = registry.async_get_device_by_identifier(
        tower_identifier(entry.entry_id), entry.entry_id
    )
    assert tower_device is not None
    async with asyncio.timeout(10):
        while registry.async_get(tower_device.id).name != "attic-tower.example.net":  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    diagnostics = await get_diagnostics_for_config_entry(hass, hass_client, entry)
    secrets = (
        entry.data[CONF_PRIVATE_KEY],
        entry.data[CONF_KUBECONFIG],
        tower.host_public_key.split()[1],
        tower.host_fingerprint,
        "127.0.0.1",
        "attic-tower",
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
    assert device_diagnostics["device"]["name"] == "Gaming station 1"
    tower_diagnostics = await get_diagnostics_for_device(
        hass, hass_client, entry, registry.async_get(tower_device.id)
    )
    _assert_no_line_of(secrets, tower_diagnostics)
    assert tower_diagnostics["device"] == {"name": REDACTED, "model": "libvirt tower"}


async def test_unload(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Unloading closes the SSH connection and the cluster session: the
    cluster client's aiohttp session, and with it its connections."""
    await _setup(hass, entry)
    coordinator = entry.runtime_data.coordinator
    session = coordinator.cluster._api.rest_client.pool_manager
    assert coordinator.tower.connected
    assert not session.closed
    assert await coordinator.cluster.node_names()  # the session is in use
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.NOT_LOADED
    assert not coordinator.tower.connected
    assert session.closed
    assert session.connector is None


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
        value = state.state if state else None
        if item.domain == "image" and value not in (None, "unavailable"):
            # An image's state is when its picture last changed: a time.
            assert dt_util.parse_datetime(str(value)) is not None
            value = "<a timestamp>"
        pinned[item.entity_id] = {
            "unique_id": item.unique_id.removeprefix(entry.entry_id),
            "translation_key": item.translation_key,
            "entity_category": item.entity_category,
            "disabled_by": item.disabled_by,
            "device_class": item.original_device_class,
            "state": value,
            "attributes": dict(state.attributes) if state else None,
        }
    # An image's access token (and the picture URL that carries it) is random.
    assert pinned == snapshot(
        exclude=props("lease_age", "access_token", "entity_picture")
    )


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
            entry.runtime_data.session.connected
            and coordinator.tower.session is not None
            and coordinator.tower.session.status is not None
        ):
            await asyncio.sleep(0.02)
    diagnostics = await get_diagnostics_for_config_entry(hass, hass_client, entry)
    assert diagnostics["session_connected"] is True
    # (The tower's libvirt URI names the test's own directory.)
    assert diagnostics["snapshot"]["tower"]["uri"].endswith("/tower/node.xml")
    assert diagnostics == snapshot(
        exclude=props(
            "uri",
            "lease_age",
            "boot_id",
            "age",
            "virsh_calls",
            "entry_id",
            "subentry_id",
            "created_at",
            "modified_at",
            "port",
        )
    )


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("qemu:///system", "qemu:///system"),
        (
            "qemu+ssh://alice@tower.example:2222/system?keyfile=/root/.ssh/id",
            "qemu+ssh://**REDACTED**/system?**REDACTED**",
        ),
        ("qemu+ext:///system?command=/opt/x", "qemu+ext:///system?**REDACTED**"),
        ("qemu+tls://tower.example/system", "qemu+tls://**REDACTED**/system"),
    ],
)
async def test_diagnostics_redact_the_libvirt_uri(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    uri: str,
    shown: str,
) -> None:
    """The status's libvirt URI may name a user, another host and a key
    file: diagnostics show its scheme and path only."""
    await _setup(hass, entry)
    coordinator = entry.runtime_data.coordinator
    data = coordinator.data
    coordinator.async_set_updated_data(
        dataclasses.replace(data, tower=dataclasses.replace(data.tower, uri=uri))
    )
    # (Read at once, before a push of the session's could replace the data.)
    diagnostics = await async_get_config_entry_diagnostics(hass, entry)
    assert diagnostics["snapshot"]["tower"]["uri"] == shown
    for secret in ("alice", "tower.example", "2222", "/root/.ssh/id", "/opt/x"):
        assert secret not in json.dumps(diagnostics)


# --- the tower's name and identity ---------------------------------------------


async def test_tower_device_is_named_after_the_tower(
    hass: HomeAssistant, entry: MockConfigEntry, tower_dir: Path
) -> None:
    """The session's hello names the tower device as the agent names the
    tower; entity ids, made before, keep the entry's title; a name the user
    gave the device stays theirs."""
    _configure_agent(tower_dir, name="Attic tower")
    await _setup(hass, entry)
    registry = dr.async_get(hass)
    tower = registry.async_get_device_by_identifier(
        tower_identifier(entry.entry_id), entry.entry_id
    )
    assert tower is not None
    async with asyncio.timeout(10):
        while registry.async_get(tower.id).name != "Attic tower":  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert hass.states.get("sensor.tower_gpus_lent_to_the_cluster") is not None
    registry.async_update_device(tower.id, name_by_user="Living room tower")
    _configure_agent(tower_dir, name="Renamed tower")
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    async with asyncio.timeout(10):
        while registry.async_get(tower.id).name != "Renamed tower":  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert registry.async_get(tower.id).name_by_user == "Living room tower"


async def test_migration_makes_the_host_key_the_identity(
    hass: HomeAssistant, entry: MockConfigEntry, tower: Sshd
) -> None:
    """An entry of version 1.1 was identified by "host:port"; it is set up as
    1.2, identified by its pinned host key's fingerprint."""
    assert (entry.version, entry.minor_version) == (1, 1)
    assert entry.unique_id == f"127.0.0.1:{tower.port}"
    await _setup(hass, entry)
    assert entry.minor_version == 2
    assert entry.unique_id == tower.host_fingerprint


async def test_an_entry_without_a_readable_key_fails_migration(
    hass: HomeAssistant,
) -> None:
    """Nothing to take the identity from: a migration error, nothing set up."""
    broken = MockConfigEntry(
        domain=DOMAIN, unique_id="tower.lan:22", data={CONF_HOST_KEY: "x"}
    )
    broken.add_to_hass(hass)
    assert not await hass.config_entries.async_setup(broken.entry_id)
    assert broken.state is ConfigEntryState.MIGRATION_ERROR
    assert (broken.minor_version, broken.unique_id) == (1, "tower.lan:22")


async def test_two_entries_of_one_tower_from_before(
    hass: HomeAssistant, entry: MockConfigEntry, tower: Sshd, cluster: K8sEmulator
) -> None:
    """The same tower added by IP address and by name before the host key was
    the identity: the first keeps the identity, the second gets a repair
    issue until the first is deleted, then takes it over."""
    await _setup(hass, entry)
    by_name = MockConfigEntry(
        domain=DOMAIN,
        title="tower by name",
        unique_id=f"tower.lan:{tower.port}",
        data=tower_entry_data(tower) | {CONF_KUBECONFIG: entry.data[CONF_KUBECONFIG]},
    )
    by_name.add_to_hass(hass)
    await _setup(hass, by_name)
    assert entry.unique_id == tower.host_fingerprint
    assert by_name.unique_id == f"tower.lan:{tower.port}"
    issue_id = f"duplicate_tower_{by_name.entry_id}"
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_placeholders == {
        "title": "tower by name",
        "other": "tower",
        "fingerprint": tower.host_fingerprint,
    }
    await hass.config_entries.async_remove(entry.entry_id)
    assert await hass.config_entries.async_reload(by_name.entry_id)
    await hass.async_block_till_done()
    assert by_name.unique_id == tower.host_fingerprint
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None


# --- gaming VMs that come and go ------------------------------------------------


def _new_vm_issue(hass: HomeAssistant, entry: MockConfigEntry, vm: str) -> Any:
    return ir.async_get(hass).async_get_issue(
        DOMAIN, f"new_gaming_vm_{entry.entry_id}_{vm}"
    )


@pytest.fixture
def one_vm_entry(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator, tower_dir: Path
) -> MockConfigEntry:
    """A tower whose agent manages gaming-1 only, with its switch; the
    libvirt tower also defines gaming-2."""
    _configure_agent(tower_dir, name="tower", gaming=["gaming-1"])
    return add_tower_entry(hass, tower, cluster, vms=(1,))


async def test_a_gaming_vm_defined_later_is_offered(
    hass: HomeAssistant,
    one_vm_entry: MockConfigEntry,
    tower_dir: Path,
    hass_client: ClientSessionGenerator,
) -> None:
    """The agent starts managing gaming-2: a fixable repair offers it, and
    its fix adds the subentry, so its switch and device appear."""
    entry = one_vm_entry
    await _setup(hass, entry)
    assert entry.data[CONF_KNOWN_VMS] == ["gaming-1"]
    assert _new_vm_issue(hass, entry, "gaming-2") is None

    _configure_agent(tower_dir, gaming=["gaming-1", "gaming-2"])
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    issue = _new_vm_issue(hass, entry, "gaming-2")
    assert issue is not None
    assert issue.is_fixable
    assert issue.translation_key == "new_gaming_vm"
    assert issue.translation_placeholders == {
        "name": "Gaming station 2",
        "domain": "gaming-2",
    }
    assert hass.states.get("switch.gaming_station_2") is None

    flow, submit = await _fix(hass, hass_client, issue.issue_id)
    assert flow["step_id"] == "confirm"
    assert flow["description_placeholders"]["name"] == "Gaming station 2"
    assert (await submit())["type"] == "create_entry"
    assert entry.state is ConfigEntryState.LOADED
    assert [
        (sub.title, dict(sub.data))
        for sub in entry.subentries.values()
        if sub.unique_id == "gaming-2"
    ] == [("Gaming station 2", {CONF_DOMAIN_NAME: "gaming-2"})]
    assert hass.states.get("switch.gaming_station_2") is not None
    assert entry.data[CONF_KNOWN_VMS] == ["gaming-1", "gaming-2"]
    assert _new_vm_issue(hass, entry, "gaming-2") is None


async def test_a_vm_left_out_at_setup_is_no_news(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator, tower_dir: Path
) -> None:
    """A VM the agent managed when the user picked (and left out) is not
    offered again."""
    _configure_agent(tower_dir, name="tower")
    entry = add_tower_entry(hass, tower, cluster, vms=(1,))
    hass.config_entries.async_update_entry(
        entry, data=entry.data | {CONF_KNOWN_VMS: ["gaming-1", "gaming-2"]}
    )
    await _setup(hass, entry)
    assert _new_vm_issue(hass, entry, "gaming-2") is None
    assert [sub.unique_id for sub in entry.subentries.values()] == ["gaming-1"]


async def test_a_gaming_vm_the_agent_drops_is_removed(
    hass: HomeAssistant, entry: MockConfigEntry, tower_dir: Path
) -> None:
    """The agent stops managing gaming-2: its subentry goes, and with it its
    switch, entities and device (the agent would refuse every request for
    it). Managed again later, it is offered as new."""
    await _setup(hass, entry)
    registry = dr.async_get(hass)
    identifier = domain_identifier(entry.entry_id, "gaming-2")
    assert registry.async_get_device_by_identifier(identifier, entry.entry_id)

    _configure_agent(tower_dir, gaming=["gaming-1"])
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    assert [sub.unique_id for sub in entry.subentries.values()] == ["gaming-1"]
    assert hass.states.get("switch.gaming_station_2") is None
    assert hass.states.get("sensor.gaming_station_2_vm_state") is None
    assert registry.async_get_device_by_identifier(identifier, entry.entry_id) is None
    assert hass.states.get("switch.gaming_station_1") is not None
    assert entry.data[CONF_KNOWN_VMS] == ["gaming-1"]

    _configure_agent(tower_dir, gaming=["gaming-1", "gaming-2"])
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    assert _new_vm_issue(hass, entry, "gaming-2") is not None
    # Deleting the entry deletes its repair issues.
    await hass.config_entries.async_remove(entry.entry_id)
    assert _new_vm_issue(hass, entry, "gaming-2") is None


async def test_a_new_vm_fix_that_comes_too_late(
    hass: HomeAssistant,
    one_vm_entry: MockConfigEntry,
    tower_dir: Path,
    hass_client: ClientSessionGenerator,
) -> None:
    """Confirmed while the tower is not set up, after the agent dropped the
    VM again, or after the tower's entry was deleted: nothing is added."""
    entry = one_vm_entry
    await _setup(hass, entry)
    _configure_agent(tower_dir, gaming=["gaming-1", "gaming-2"])
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    issue_id = f"new_gaming_vm_{entry.entry_id}_gaming-2"

    _, submit = await _fix(hass, hass_client, issue_id)
    assert await hass.config_entries.async_unload(entry.entry_id)
    result = await submit()
    assert (result["type"], result["reason"]) == ("abort", "tower_not_loaded")

    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    _, submit = await _fix(hass, hass_client, issue_id)
    _configure_agent(tower_dir, gaming=["gaming-1"])
    await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    result = await submit()
    assert (result["type"], result["reason"]) == ("abort", "vm_gone")
    assert result["description_placeholders"]["name"] == "Gaming station 2"
    assert [sub.unique_id for sub in entry.subentries.values()] == ["gaming-1"]

    _configure_agent(tower_dir, gaming=["gaming-1", "gaming-2"])
    await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    _, submit = await _fix(hass, hass_client, issue_id)
    await hass.config_entries.async_remove(entry.entry_id)
    result = await submit()
    assert (result["type"], result["reason"]) == ("abort", "entry_removed")


# --- removing devices by hand ------------------------------------------------------


async def test_only_a_device_of_a_vm_gone_from_the_tower_can_be_deleted(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    hass_ws_client: WebSocketGenerator,
) -> None:
    """The tower, the GPU node and a gaming VM with its subentry are refused;
    a leftover device of a VM the agent no longer manages is deleted, but
    not while the entry is not loaded (nothing says what the tower has)."""
    await _setup(hass, entry)
    assert await async_setup_component(hass, "config", {})
    registry = dr.async_get(hass)
    leftover = registry.async_get_or_create(
        config_entry_id=entry.entry_id,
        identifiers={domain_identifier(entry.entry_id, "retired-vm")},
        name="Retired VM",
    )
    client = await hass_ws_client(hass)

    async def remove(device_id: str) -> bool:
        await client.send_json_auto_id(
            {"type": "config/device_registry/remove", "device_id": device_id}
        )
        response = await client.receive_json()
        return bool(response["success"])

    def device(identifier: tuple[str, str]) -> str:
        found = registry.async_get_device_by_identifier(identifier, entry.entry_id)
        assert found is not None
        return found.id

    for kept in (
        tower_identifier(entry.entry_id),
        domain_identifier(entry.entry_id, "gpu-node"),
        domain_identifier(entry.entry_id, "gaming-1"),
    ):
        assert not await remove(device(kept))
        assert registry.async_get(device(kept)) is not None

    assert await hass.config_entries.async_unload(entry.entry_id)
    assert not await remove(leftover.id)
    assert await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert await remove(leftover.id)
    assert registry.async_get(leftover.id) is None


async def test_a_new_vm_added_meanwhile_is_not_added_twice(
    hass: HomeAssistant,
    one_vm_entry: MockConfigEntry,
    tower_dir: Path,
    hass_client: ClientSessionGenerator,
) -> None:
    """The VM got its switch from the integration's page while its repair
    was open: confirming it changes nothing."""
    entry = one_vm_entry
    await _setup(hass, entry)
    _configure_agent(tower_dir, gaming=["gaming-1", "gaming-2"])
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    _, submit = await _fix(
        hass, hass_client, f"new_gaming_vm_{entry.entry_id}_gaming-2"
    )
    result = await hass.config_entries.subentries.async_init(
        (entry.entry_id, SUBENTRY_GAMING_VM), context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.subentries.async_configure(
        result["flow_id"], {CONF_DOMAIN_NAME: "gaming-2"}
    )
    await hass.async_block_till_done()
    assert (await submit())["type"] == "create_entry"
    assert sorted(sub.unique_id or "" for sub in entry.subentries.values()) == [
        "gaming-1",
        "gaming-2",
    ]
    assert hass.states.get("switch.gaming_station_2") is not None
