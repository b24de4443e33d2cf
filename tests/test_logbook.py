"""Logbook lines of the integration's events: the device's name, a sentence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from homeassistant.core import Event, HomeAssistant
from homeassistant.helpers import device_registry as dr
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    EVENT_STOP_SUCCEEDED,
)
from custom_components.gpu_handoff.logbook import STEPS, async_describe_events

STRINGS = Path(__file__).resolve().parent.parent / (
    "custom_components/gpu_handoff/strings.json"
)


def _describers(hass: HomeAssistant) -> dict[str, Any]:
    described: dict[str, Any] = {}

    def register(domain: str, event: str, describe: Any) -> None:
        assert domain == DOMAIN
        described[event] = describe

    async_describe_events(hass, register)
    return described


@pytest.mark.parametrize(
    ("event_type", "data", "message"),
    [
        (
            EVENT_HANDOFF_STARTED,
            {"kind": "handoff"},
            "the handoff of the cards started",
        ),
        (
            EVENT_HANDOFF_STEP,
            {"kind": "handoff", "step": "waiting_for_guest_agent_gpu_node"},
            "waiting for the GPU node's guest agent",
        ),
        (EVENT_HANDOFF_SUCCEEDED, {"kind": "handoff"}, "has its cards and runs"),
        (
            EVENT_HANDOFF_SUCCEEDED,
            {"kind": "handoff", "pods_came_back": ["monitoring/agent-x2"]},
            (
                "has its cards and runs; 1 pod(s) came back to the cordoned GPU node "
                "(they tolerate its cordon) and stopped with it: monitoring/agent-x2"
            ),
        ),
        (EVENT_STOP_SUCCEEDED, {"kind": "stop"}, "shut down"),
        (
            EVENT_RETURN_SUCCEEDED,
            {"kind": "return"},
            "the cards are back with the cluster",
        ),
        (
            EVENT_HANDOFF_FAILED,
            {"kind": "handoff", "error": "1 pod(s) still on gpu-node"},
            "the handoff of the cards failed: 1 pod(s) still on gpu-node",
        ),
        (EVENT_CARDS_RETURNED, {}, "serves the cluster again with every card"),
    ],
)
async def test_sentences_under_the_devices_name(
    hass: HomeAssistant, event_type: str, data: dict[str, Any], message: str
) -> None:
    """Every event reads as a sentence under the device's name (the name the
    user gave it wins); without a device, under the VM's name."""
    entry = MockConfigEntry(domain=DOMAIN)
    entry.add_to_hass(hass)
    registry = dr.async_get(hass)
    device = registry.async_get_or_create(
        config_entry_id=entry.entry_id,
        identifiers={(DOMAIN, "x_gaming-1")},
        name="Gaming station 1",
    )
    describe = _describers(hass)[event_type]
    line = describe(
        Event(event_type, {"vm": "gaming-1", "device_id": device.id, **data})
    )
    assert line == {"name": "Gaming station 1", "message": message}
    registry.async_update_device(device.id, name_by_user="Living room PC")
    line = describe(
        Event(event_type, {"vm": "gaming-1", "device_id": device.id, **data})
    )
    assert line["name"] == "Living room PC"
    line = describe(Event(event_type, {"vm": "gaming-1", "device_id": None, **data}))
    assert line["name"] == "gaming-1"


def test_every_step_has_a_sentence() -> None:
    """The logbook words each step the switch can show (idle is no event)."""
    strings = json.loads(STRINGS.read_text(encoding="utf-8"))
    shown = strings["entity"]["switch"]["gaming_vm"]["state_attributes"]["step"][
        "state"
    ]
    assert set(STEPS) == set(shown) - {"idle"}
