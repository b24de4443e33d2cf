"""Actions: return the cards now; start a handoff, optionally waiting for it."""

from __future__ import annotations

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import (
    HomeAssistant,
    ServiceCall,
    ServiceResponse,
    SupportsResponse,
    callback,
)
from homeassistant.exceptions import ServiceValidationError
from homeassistant.helpers import config_validation as cv
import probatio

from .const import (
    ATTR_CONFIG_ENTRY_ID,
    ATTR_VM,
    ATTR_WAIT,
    DOMAIN,
    SERVICE_RETURN_CARDS,
    SERVICE_START_HANDOFF,
)
from .data import GpuHandoffConfigEntry

RETURN_SCHEMA = probatio.Schema({probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string})
HANDOFF_SCHEMA = probatio.Schema(
    {
        probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string,
        probatio.Required(ATTR_VM): cv.string,
        probatio.Optional(ATTR_WAIT, default=False): cv.boolean,
    }
)


def _entry(hass: HomeAssistant, call: ServiceCall) -> GpuHandoffConfigEntry:
    entry_id = call.data[ATTR_CONFIG_ENTRY_ID]
    entry: GpuHandoffConfigEntry | None = hass.config_entries.async_get_entry(entry_id)
    if entry is None or entry.domain != DOMAIN:
        raise ServiceValidationError(
            translation_domain=DOMAIN,
            translation_key="unknown_entry",
            translation_placeholders={"entry_id": entry_id},
        )
    if entry.state is not ConfigEntryState.LOADED:
        raise ServiceValidationError(
            translation_domain=DOMAIN,
            translation_key="entry_not_loaded",
            translation_placeholders={"entry_id": entry_id},
        )
    return entry


async def _async_return_cards(call: ServiceCall) -> None:
    await _entry(call.hass, call).runtime_data.controller.async_return_cards()


async def _async_start_handoff(call: ServiceCall) -> ServiceResponse:
    controller = _entry(call.hass, call).runtime_data.controller
    vm = call.data[ATTR_VM]
    task = await controller.async_turn_on(vm)
    if not call.data[ATTR_WAIT]:
        return None
    succeeded = await task
    return {
        "vm": vm,
        "succeeded": succeeded,
        "error": None if succeeded else controller.last_error.get(vm),
    }


@callback
def async_setup_services(hass: HomeAssistant) -> None:
    """Register the integration's actions."""
    hass.services.async_register(
        DOMAIN, SERVICE_RETURN_CARDS, _async_return_cards, schema=RETURN_SCHEMA
    )
    hass.services.async_register(
        DOMAIN,
        SERVICE_START_HANDOFF,
        _async_start_handoff,
        schema=HANDOFF_SCHEMA,
        supports_response=SupportsResponse.OPTIONAL,
    )
