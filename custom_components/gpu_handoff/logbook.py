"""Logbook lines for the integration's events: the device's name and a
sentence, never a code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from homeassistant.components.logbook.const import (
    LOGBOOK_ENTRY_MESSAGE,
    LOGBOOK_ENTRY_NAME,
)
from homeassistant.core import Event, HomeAssistant, callback
from homeassistant.helpers import device_registry as dr

from .const import DOMAIN, EVENTS

OPERATIONS: Final = {
    "handoff": "the handoff of the cards",
    "stop": "the shutdown",
    "return": "the return of the cards to the cluster",
    "prepare": "preparing the cards",
}
# What each step of an operation reads as (the same words as the switch's
# translated step attribute).
STEPS: Final = {
    "preparing": "preparing",
    "draining": "draining the GPU node",
    "waiting_for_guest_agent_gpu_node": "waiting for the GPU node's guest agent",
    "stopping_gpu_node": "shutting the GPU node down",
    "waiting_for_cards_gpu_node": "waiting for the GPU node's cards",
    "starting_gpu_node": "starting the GPU node",
    "waiting_for_guest_agent_vm": "waiting for the VM's guest agent",
    "stopping_vm": "shutting the VM down",
    "waiting_for_cards_vm": "waiting for the VM's cards",
    "starting_vm": "starting the VM",
    "waiting_for_node": "waiting for the GPU node to join the cluster",
    "waiting_for_gpus": "waiting for the GPU node's GPUs",
    "uncordoning": "giving the GPU node back to the cluster",
    "retrying": "waiting to try again: the tower or the cluster did not answer",
}


def describe(event: Event) -> str:
    """One sentence for one event (the device's name stands before it)."""
    data = event.data
    operation = OPERATIONS.get(str(data.get("kind")), "an operation")
    match event.event_type:
        case "gpu_handoff_handoff_started":
            return f"{operation} started"
        case "gpu_handoff_handoff_step":
            step = str(data.get("step", ""))
            return STEPS.get(step, step.replace("_", " "))
        case "gpu_handoff_handoff_succeeded":
            came_back = data.get("pods_came_back") or []
            if came_back:
                return (
                    f"has its cards and runs; {len(came_back)} pod(s) came back to "
                    "the cordoned GPU node (they tolerate its cordon) and "
                    f"stopped with it: {', '.join(map(str, came_back))}"
                )
            return "has its cards and runs"
        case "gpu_handoff_stop_succeeded":
            return "shut down"
        case "gpu_handoff_return_succeeded":
            return "the cards are back with the cluster"
        case "gpu_handoff_handoff_failed":
            return f"{operation} failed: {data.get('error')}"
        case "gpu_handoff_prepare_succeeded":
            ends = data.get("hold_ends")
            if ends:
                return f"has its cards held for it until {ends}: turn it on to play"
            return "runs already: nothing is held"
        case "gpu_handoff_hold_expired":
            return "was not started while its cards were held: they go back"
        case "gpu_handoff_return_unhealthy":
            return f"is back, but unhealthy: {data.get('error')}"
        case _:
            return "serves the cluster again with every card"


@callback
def async_describe_events(
    hass: HomeAssistant,
    async_describe_event: Callable[[str, str, Callable[[Event], dict[str, Any]]], None],
) -> None:
    """Describe every event the controller fires."""

    @callback
    def async_describe(event: Event) -> dict[str, Any]:
        device = None
        if device_id := event.data.get("device_id"):
            device = dr.async_get(hass).async_get(device_id)
        name = (
            (device.name_by_user or device.name)
            if device is not None
            else event.data.get("vm", "GPU Handoff")
        )
        return {
            LOGBOOK_ENTRY_NAME: name,
            LOGBOOK_ENTRY_MESSAGE: describe(event),
        }

    for event_type in EVENTS:
        async_describe_event(DOMAIN, event_type, async_describe)
