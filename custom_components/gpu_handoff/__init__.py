"""The GPU Handoff integration: lends a libvirt tower's GPUs to a Kubernetes
cluster while nobody plays, and hands each player their card back on demand."""

from __future__ import annotations

import logging
from typing import Final

from homeassistant.config_entries import ConfigEntry, ConfigEntryState
from homeassistant.const import Platform
from homeassistant.core import HomeAssistant, callback
from homeassistant.helpers import (
    config_validation as cv,
    device_registry as dr,
    issue_registry as ir,
)
from homeassistant.helpers.typing import ConfigType

from .cluster_client import ClusterClient, ClusterError
from .const import (
    CONF_DOMAIN_NAME,
    CONF_GPU_NODE,
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    DOMAIN,
)
from .controller import HandoffController
from .coordinator import GpuHandoffCoordinator, tower_credentials
from .data import GpuHandoffConfigEntry, GpuHandoffData, signature_of
from .gaming_vms import GamingVmSync
from .models import domain_identifier, tower_identifier
from .owned import handoff_store
from .repair_sync import RepairSync
from .runner import lift_own_cordon_if_serving
from .services import async_setup_services
from .session import AgentSession
from .tower_client import TowerClient, TowerError, fingerprint

_LOGGER = logging.getLogger(__name__)

PLATFORMS = [Platform.BINARY_SENSOR, Platform.IMAGE, Platform.SENSOR, Platform.SWITCH]
CONFIG_SCHEMA = cv.config_entry_only_config_schema(DOMAIN)
ISSUE_DUPLICATE_TOWER: Final = "duplicate_tower"


async def async_setup(hass: HomeAssistant, config: ConfigType) -> bool:
    """Register the actions."""
    async_setup_services(hass)
    return True


async def async_setup_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Set up a tower from a config entry."""
    _claim_identity(hass, entry)
    coordinator = await GpuHandoffCoordinator.create(hass, entry)
    entry.async_on_unload(coordinator.async_shutdown)
    # Before the first refresh: its failure may be a repair, and its status
    # may remove a subentry before the platforms load.
    entry.async_on_unload(RepairSync(hass, entry, coordinator).async_start())
    entry.async_on_unload(GamingVmSync(hass, entry, coordinator).async_start())
    await coordinator.async_config_entry_first_refresh()
    tower_device = dr.async_get(hass).async_get_or_create(
        config_entry_id=entry.entry_id,
        identifiers={tower_identifier(entry.entry_id)},
        name=entry.title,
        manufacturer="GPU Handoff",
        model="libvirt tower",
    )
    controller = HandoffController(hass, entry, coordinator)
    session = AgentSession(
        hass,
        entry,
        coordinator.tower,
        coordinator,
        job_listener=controller.job_pushed,
        session_listener=controller.runner.jobs.wake,
    )
    entry.runtime_data = GpuHandoffData(
        coordinator=coordinator,
        controller=controller,
        session=session,
        tower_device_id=tower_device.id,
        setup_signature=signature_of(entry),
    )
    entry.async_on_unload(entry.add_update_listener(_async_reload_if_changed))
    await hass.config_entries.async_forward_entry_setups(entry, PLATFORMS)
    # The session's hello names the tower device after the tower: opened
    # once the entities are registered, so their ids never depend on which
    # came first.
    entry.async_create_background_task(
        hass, session.async_run(), f"{entry.title} agent session"
    )
    await controller.async_start()
    return True


async def async_unload_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Unload a config entry."""
    return await hass.config_entries.async_unload_platforms(entry, PLATFORMS)


async def async_migrate_entry(hass: HomeAssistant, entry: ConfigEntry) -> bool:
    """1.1 to 1.2: the unique id was "host:port", so the same tower by name
    and by IP address made two entries; it is now the pinned host key's
    fingerprint (see ``_claim_identity``). Home Assistant itself refuses an
    entry of a later major version; a later minor version needs nothing."""
    if entry.minor_version < 2:
        # An entry without a readable pinned key fails here (every entry
        # the flow made has one): Home Assistant shows a migration error.
        _claim_identity(hass, entry)
        hass.config_entries.async_update_entry(entry, minor_version=2)
    return True


@callback
def _claim_identity(hass: HomeAssistant, entry: ConfigEntry) -> None:
    """Make the entry's unique id its pinned host key's fingerprint, unless
    another entry of the same tower holds it already (two entries from before
    the host key was the identity): then a repair issue says to remove one,
    until one is removed and this one is set up again."""
    identity = fingerprint(entry.data[CONF_HOST_KEY])
    issue_id = f"{ISSUE_DUPLICATE_TOWER}_{entry.entry_id}"
    other = hass.config_entries.async_entry_for_domain_unique_id(DOMAIN, identity)
    if other is None or other is entry:
        if entry.unique_id != identity:
            hass.config_entries.async_update_entry(entry, unique_id=identity)
        ir.async_delete_issue(hass, DOMAIN, issue_id)
        return
    _LOGGER.warning(
        "%s and %s are the same tower (host key %s); remove one of them",
        entry.title,
        other.title,
        identity,
    )
    ir.async_create_issue(
        hass,
        DOMAIN,
        issue_id,
        is_fixable=False,
        severity=ir.IssueSeverity.WARNING,
        translation_key=ISSUE_DUPLICATE_TOWER,
        translation_placeholders={
            "title": entry.title,
            "other": other.title,
            "fingerprint": identity,
        },
    )


async def async_remove_config_entry_device(
    hass: HomeAssistant, entry: GpuHandoffConfigEntry, device: dr.DeviceEntry
) -> bool:
    """Let the user delete a VM's device once the tower's agent no longer
    manages that VM. The tower and its GPU node belong to the entry, a gaming
    VM with a subentry goes with its subentry (removed there, or when the
    agent drops it: gaming_vms.py), and while the entry is not loaded
    nothing says what the tower still has: all of those are refused."""
    if entry.state is not ConfigEntryState.LOADED:
        return False
    tower = entry.runtime_data.coordinator.data.tower
    kept = {entry.data[CONF_GPU_NODE], *tower.domains, *tower.gaming}
    kept.update(str(sub.data[CONF_DOMAIN_NAME]) for sub in entry.subentries.values())
    held = {tower_identifier(entry.entry_id)} | {
        domain_identifier(entry.entry_id, name) for name in kept
    }
    return not device.identifiers & held


async def async_remove_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> None:
    """Forget the tower. Unloading stopped any operation at its next await;
    if that left GPU Handoff's own cordon on a GPU node that still serves, it
    is lifted (an operator's cordon is never touched). The stored desired
    state and operation are deleted, and so are its repair issues."""
    await handoff_store(hass, entry.entry_id).async_remove()
    for domain, issue_id in list(ir.async_get(hass).issues):
        if domain == DOMAIN and entry.entry_id in issue_id:
            ir.async_delete_issue(hass, DOMAIN, issue_id)
    try:
        cluster = await ClusterClient.create(entry.data[CONF_KUBECONFIG])
    except ClusterError:
        return
    tower = TowerClient(tower_credentials(entry))
    try:
        await lift_own_cordon_if_serving(tower, cluster, entry.data[CONF_K8S_NODE])
    except (TowerError, ClusterError) as err:
        _LOGGER.warning("Could not lift GPU Handoff's cordon on removal: %s", err)
    finally:
        await tower.close()
        await cluster.close()


async def _async_reload_if_changed(
    hass: HomeAssistant, entry: GpuHandoffConfigEntry
) -> None:
    """Reload when options changed or a gaming VM was added or removed."""
    if entry.runtime_data.setup_signature != signature_of(entry):
        hass.config_entries.async_schedule_reload(entry.entry_id)
