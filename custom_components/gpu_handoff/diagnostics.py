"""Diagnostics: the entry and the last snapshot, with secrets redacted."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Final
from urllib.parse import urlsplit

from homeassistant.components.diagnostics import REDACTED, async_redact_data
from homeassistant.const import CONF_HOST, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.helpers import device_registry as dr

from .const import CONF_HOST_KEY, CONF_KUBECONFIG, CONF_PASSPHRASE, CONF_PRIVATE_KEY
from .data import GpuHandoffConfigEntry
from .models import tower_identifier

TO_REDACT: Final = {
    CONF_HOST,
    CONF_USERNAME,
    CONF_PRIVATE_KEY,
    CONF_PASSPHRASE,
    CONF_HOST_KEY,
    CONF_KUBECONFIG,
    "unique_id",
    "title",
}


async def async_get_config_entry_diagnostics(
    hass: HomeAssistant, entry: GpuHandoffConfigEntry
) -> dict[str, Any]:
    """The entry (redacted), its gaming VMs and the last snapshot."""
    coordinator = entry.runtime_data.coordinator
    snapshot = asdict(coordinator.data)
    snapshot["tower"]["uri"] = redacted_uri(snapshot["tower"]["uri"])
    return {
        "entry": async_redact_data(entry.as_dict(), TO_REDACT),
        "session_connected": entry.runtime_data.session.connected,
        "last_update_success": coordinator.last_update_success,
        "snapshot": snapshot,
    }


def redacted_uri(uri: str) -> str:
    """The tower's libvirt URI without what it may say of another machine or
    of secrets: its user, host and port (``qemu+ssh://user@host/system``),
    and its parameters (a keyfile, a command, a socket's path)."""
    parts = urlsplit(uri)
    if not parts.scheme:
        return REDACTED if uri else uri
    host = REDACTED if parts.netloc else ""
    query = f"?{REDACTED}" if parts.query else ""
    return f"{parts.scheme}://{host}{parts.path}{query}"


async def async_get_device_diagnostics(
    hass: HomeAssistant, entry: GpuHandoffConfigEntry, device: dr.DeviceEntry
) -> dict[str, Any]:
    """The device and what the snapshot says about its VM."""
    coordinator = entry.runtime_data.coordinator
    names = {identifier[1] for identifier in device.identifiers}
    # The tower device is named after the tower's host name, as telling as
    # its address (redacted like the entry's title).
    is_tower = tower_identifier(entry.entry_id) in device.identifiers
    domains = {
        name: asdict(state)
        for name, state in coordinator.data.tower.domains.items()
        if f"{entry.entry_id}_{name}" in names
    }
    return {
        "device": {
            "name": REDACTED if is_tower else device.name,
            "model": device.model,
        },
        "domains": domains,
        "cards": [
            asdict(card)
            for card in coordinator.data.tower.cards
            if card.held_by in domains or set(card.claimed_by) & set(domains)
        ],
    }
