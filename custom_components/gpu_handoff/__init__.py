"""The GPU Handoff integration: lends a libvirt tower's GPUs to a Kubernetes
cluster while nobody plays, and hands each player their card back on demand."""

from __future__ import annotations

import logging

from homeassistant.const import Platform
from homeassistant.core import HomeAssistant
from homeassistant.helpers import config_validation as cv, device_registry as dr
from homeassistant.helpers.typing import ConfigType

from .cluster_client import ClusterClient, ClusterError
from .const import CONF_K8S_NODE, CONF_KUBECONFIG, DOMAIN
from .controller import HandoffController, handoff_store
from .coordinator import GpuHandoffCoordinator, tower_credentials
from .data import GpuHandoffConfigEntry, GpuHandoffData, signature_of
from .models import tower_identifier
from .runner import lift_own_cordon_if_serving
from .services import async_setup_services
from .tower_client import TowerClient, TowerError

_LOGGER = logging.getLogger(__name__)

PLATFORMS = [Platform.BINARY_SENSOR, Platform.SENSOR, Platform.SWITCH]
CONFIG_SCHEMA = cv.config_entry_only_config_schema(DOMAIN)


async def async_setup(hass: HomeAssistant, config: ConfigType) -> bool:
    """Register the actions."""
    async_setup_services(hass)
    return True


async def async_setup_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Set up a tower from a config entry."""
    coordinator = await GpuHandoffCoordinator.create(hass, entry)
    entry.async_on_unload(coordinator.async_shutdown)
    await coordinator.async_config_entry_first_refresh()
    tower_device = dr.async_get(hass).async_get_or_create(
        config_entry_id=entry.entry_id,
        identifiers={tower_identifier(entry.entry_id)},
        name=entry.title,
        manufacturer="GPU Handoff",
        model="libvirt tower",
    )
    controller = HandoffController(hass, entry, coordinator)
    coordinator.job_listener = controller.job_pushed
    coordinator.session_listener = controller.runner.wake
    entry.runtime_data = GpuHandoffData(
        coordinator=coordinator,
        controller=controller,
        tower_device_id=tower_device.id,
        setup_signature=signature_of(entry),
    )
    entry.async_create_background_task(
        hass, coordinator.async_run_session(), f"{entry.title} agent session"
    )
    entry.async_on_unload(entry.add_update_listener(_async_reload_if_changed))
    await hass.config_entries.async_forward_entry_setups(entry, PLATFORMS)
    await controller.async_start()
    return True


async def async_unload_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Unload a config entry."""
    return await hass.config_entries.async_unload_platforms(entry, PLATFORMS)


async def async_remove_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> None:
    """Forget the tower. Unloading stopped any operation at its next await;
    if that left GPU Handoff's own cordon on a GPU node that still serves, it
    is lifted (an operator's cordon is never touched). The stored desired
    state and operation are deleted."""
    await handoff_store(hass, entry.entry_id).async_remove()
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
