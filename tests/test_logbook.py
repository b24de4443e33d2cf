"""Logbook descriptions of the integration's events."""

from __future__ import annotations

from typing import Any

from homeassistant.core import Event, HomeAssistant
import pytest

from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)
from custom_components.gpu_handoff.logbook import async_describe_events


@pytest.mark.parametrize(
    ("event_type", "data", "message"),
    [
        (EVENT_HANDOFF_STARTED, {"kind": "handoff"}, "started the handoff to gaming-1"),
        (
            EVENT_HANDOFF_STEP,
            {"kind": "handoff", "step": "waiting_for_guest_agent_gpu_node"},
            "handoff to gaming-1: waiting for guest agent gpu node",
        ),
        (
            EVENT_HANDOFF_SUCCEEDED,
            {"kind": "stop"},
            "finished the shutdown of gaming-1",
        ),
        (
            EVENT_HANDOFF_FAILED,
            {"kind": "handoff", "error": "1 pod(s) still on gpu-node"},
            "the handoff to gaming-1 failed: 1 pod(s) still on gpu-node",
        ),
        (EVENT_CARDS_RETURNED, {}, "gave the cards back to the cluster"),
    ],
)
def test_descriptions(
    hass: HomeAssistant, event_type: str, data: dict[str, Any], message: str
) -> None:
    """Every event the controller fires reads as a sentence."""
    described: dict[str, Any] = {}

    def register(domain: str, event: str, describe: Any) -> None:
        assert domain == DOMAIN
        described[event] = describe

    async_describe_events(hass, register)
    entry = described[event_type](Event(event_type, {"vm": "gaming-1", **data}))
    assert entry == {"name": "GPU Handoff", "message": message}
