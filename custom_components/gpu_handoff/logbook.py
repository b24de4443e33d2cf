"""Logbook lines for the integration's events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from homeassistant.components.logbook.const import (
    LOGBOOK_ENTRY_MESSAGE,
    LOGBOOK_ENTRY_NAME,
)
from homeassistant.core import Event, HomeAssistant, callback

from .const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)

KIND_WORDS = {
    "handoff": "handoff to",
    "stop": "shutdown of",
    "return": "card return to",
}


def describe(event: Event) -> str:
    """One line for one event."""
    data = event.data
    what = f"{KIND_WORDS.get(data.get('kind', ''), 'operation on')} {data['vm']}"
    match event.event_type:
        case "gpu_handoff_handoff_started":
            return f"started the {what}"
        case "gpu_handoff_handoff_step":
            return f"{what}: {str(data.get('step', '')).replace('_', ' ')}"
        case "gpu_handoff_handoff_succeeded":
            return f"finished the {what}"
        case "gpu_handoff_handoff_failed":
            return f"the {what} failed: {data.get('error')}"
        case _:
            return "gave the cards back to the cluster"


@callback
def async_describe_events(
    hass: HomeAssistant,
    async_describe_event: Callable[[str, str, Callable[[Event], dict[str, Any]]], None],
) -> None:
    """Describe every event the controller fires."""

    @callback
    def async_describe(event: Event) -> dict[str, Any]:
        return {
            LOGBOOK_ENTRY_NAME: "GPU Handoff",
            LOGBOOK_ENTRY_MESSAGE: describe(event),
        }

    for event_type in (
        EVENT_HANDOFF_STARTED,
        EVENT_HANDOFF_STEP,
        EVENT_HANDOFF_SUCCEEDED,
        EVENT_HANDOFF_FAILED,
        EVENT_CARDS_RETURNED,
    ):
        async_describe_event(DOMAIN, event_type, async_describe)
