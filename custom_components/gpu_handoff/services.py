"""Actions: return the cards now; start a handoff, optionally waiting for it;
prepare one (the cards freed and held for a VM that starts soon); capture a
VM's screen into a file."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import (
    HomeAssistant,
    ServiceCall,
    ServiceResponse,
    SupportsResponse,
    callback,
)
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import config_validation as cv
import probatio

from .const import (
    ATTR_CONFIG_ENTRY_ID,
    ATTR_HOLD_MINUTES,
    ATTR_VM,
    ATTR_WAIT,
    DEFAULT_HOLD_MINUTES,
    DOMAIN,
    MAX_HOLD_MINUTES,
    SERVICE_PREPARE,
    SERVICE_RETURN_CARDS,
    SERVICE_START_HANDOFF,
)
from .data import GpuHandoffConfigEntry
from .protocol import RUNNING
from .screen import ScreenError, async_capture, screen_vms

SERVICE_CAPTURE_SCREEN: Final = "capture_screen"
ATTR_FILENAME: Final = "filename"

RETURN_SCHEMA = probatio.Schema({probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string})
HANDOFF_SCHEMA = probatio.Schema(
    {
        probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string,
        probatio.Required(ATTR_VM): cv.string,
        probatio.Optional(ATTR_WAIT, default=False): cv.boolean,
    }
)
PREPARE_SCHEMA = probatio.Schema(
    {
        probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string,
        probatio.Required(ATTR_VM): cv.string,
        probatio.Optional(
            ATTR_HOLD_MINUTES, default=DEFAULT_HOLD_MINUTES
        ): probatio.All(
            probatio.Coerce(float), probatio.Range(min=1, max=MAX_HOLD_MINUTES)
        ),
    }
)
CAPTURE_SCHEMA = probatio.Schema(
    {
        probatio.Required(ATTR_CONFIG_ENTRY_ID): cv.string,
        probatio.Required(ATTR_VM): cv.string,
        probatio.Required(ATTR_FILENAME): cv.string,
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
        "error": None if succeeded else controller.progress.last_error.get(vm),
    }


async def _async_prepare(call: ServiceCall) -> None:
    """Free a gaming VM's cards and hold them for it: turning it on within
    the hold only starts it."""
    controller = _entry(call.hass, call).runtime_data.controller
    await controller.async_prepare(
        call.data[ATTR_VM], hold=call.data[ATTR_HOLD_MINUTES] * 60.0
    )


def _check_capture(
    hass: HomeAssistant, entry: GpuHandoffConfigEntry, vm: str, filename: str
) -> None:
    """Refuse a capture of a screen that is not offered, to a path Home
    Assistant may not write, or of a VM that is not running."""
    if vm not in screen_vms(entry):
        raise ServiceValidationError(
            translation_domain=DOMAIN,
            translation_key="unknown_screen",
            translation_placeholders={"vm": vm},
        )
    if not hass.config.is_allowed_path(filename):
        raise ServiceValidationError(
            translation_domain=DOMAIN,
            translation_key="path_not_allowed",
            translation_placeholders={"filename": filename},
        )
    state = entry.runtime_data.coordinator.data.tower.domains.get(vm)
    if state is None or state.state != RUNNING:
        raise HomeAssistantError(
            translation_domain=DOMAIN,
            translation_key="vm_not_running",
            translation_placeholders={"vm": vm},
        )


async def _async_capture_screen(call: ServiceCall) -> ServiceResponse:
    """Save a VM's screen (a PNG) where Home Assistant may write, for an
    automation to attach to a notification."""
    hass = call.hass
    entry = _entry(hass, call)
    vm: str = call.data[ATTR_VM]
    filename: str = call.data[ATTR_FILENAME]
    _check_capture(hass, entry, vm, filename)
    coordinator = entry.runtime_data.coordinator
    try:
        capture = await async_capture(coordinator.tower, vm)
    except ScreenError as err:
        raise HomeAssistantError(
            translation_domain=DOMAIN,
            translation_key=err.key,
            translation_placeholders=err.placeholders,
        ) from err
    try:
        await hass.async_add_executor_job(_write_file, filename, capture.content)
    except OSError as err:
        raise HomeAssistantError(
            translation_domain=DOMAIN,
            translation_key="screenshot_not_written",
            translation_placeholders={
                "vm": vm,
                "filename": filename,
                "error": err.strerror or str(err),
            },
        ) from err
    if not call.return_response:
        return None
    size = capture.size
    return {
        "vm": vm,
        "filename": filename,
        "content_type": capture.content_type,
        "bytes": len(capture.content),
        "width": size[0] if size is not None else None,
        "height": size[1] if size is not None else None,
    }


def _write_file(filename: str, content: bytes) -> None:
    """Write the screen, creating its folder (in the executor)."""
    path = Path(filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


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
    hass.services.async_register(
        DOMAIN, SERVICE_PREPARE, _async_prepare, schema=PREPARE_SCHEMA
    )
    hass.services.async_register(
        DOMAIN,
        SERVICE_CAPTURE_SCREEN,
        _async_capture_screen,
        schema=CAPTURE_SCHEMA,
        supports_response=SupportsResponse.OPTIONAL,
    )
