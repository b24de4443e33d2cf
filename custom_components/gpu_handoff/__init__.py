"""The GPU Handoff integration: lends a libvirt tower's GPUs to a Kubernetes
cluster while nobody plays, and hands each player their card back on demand."""

from __future__ import annotations

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import HomeAssistant

type GpuHandoffConfigEntry = ConfigEntry[None]


async def async_setup_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Set up a tower from a config entry."""
    return True


async def async_unload_entry(hass: HomeAssistant, entry: GpuHandoffConfigEntry) -> bool:
    """Unload a config entry."""
    return True
