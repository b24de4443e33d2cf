"""Exposure to Assist, the cases the voice stories do not reach: an entity
first seen while its tower is loaded, or before its switches are; a tower
without gaming VMs; names asked of entities Home Assistant does not know.

The stories in tests/test_conversation.py run the whole integration; here a
registry entry stands for each entity, so the order in which the platforms
add them is the test's to choose.
"""

from __future__ import annotations

from homeassistant.components.homeassistant.exposed_entities import (
    async_expose_entity,
    async_get_entity_settings,
    async_should_expose,
)
from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import HomeAssistant
from homeassistant.helpers import entity_registry as er
from homeassistant.setup import async_setup_component
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.assist import (
    ASSIST,
    async_expose_to_assist_once,
    async_offer_voice_aliases,
    device_name,
)
from custom_components.gpu_handoff.const import DOMAIN


def _tower(hass: HomeAssistant, state: ConfigEntryState) -> MockConfigEntry:
    entry = MockConfigEntry(domain=DOMAIN, state=state)
    entry.add_to_hass(hass)
    return entry


def _register(
    hass: HomeAssistant, entry: MockConfigEntry | None, domain: str, key: str
) -> str:
    return (
        er.async_get(hass)
        .async_get_or_create(domain, DOMAIN, key, config_entry=entry)
        .entity_id
    )


def _stored(hass: HomeAssistant, entity_id: str) -> bool | None:
    """The exposure choice stored for Assist, None if there is none yet."""
    settings = async_get_entity_settings(hass, entity_id).get(ASSIST, {})
    return settings.get("should_expose")


async def test_the_handoff_state_waits_for_the_switches(hass: HomeAssistant) -> None:
    """Seen before the tower's switch is registered: exposed once the tower
    has loaded, with the switch Home Assistant exposes."""
    assert await async_setup_component(hass, "homeassistant", {})
    tower = _tower(hass, ConfigEntryState.SETUP_IN_PROGRESS)
    handoff = _register(hass, tower, "sensor", "handoff")
    async_expose_to_assist_once(hass, handoff)
    switch = _register(hass, tower, "switch", "gaming_vm")
    assert _stored(hass, handoff) is None

    tower.mock_state(hass, ConfigEntryState.LOADED)
    assert _stored(hass, handoff) is True
    assert async_should_expose(hass, ASSIST, switch)


async def test_seen_while_the_tower_is_loaded(hass: HomeAssistant) -> None:
    """An entity first seen on a loaded tower is judged at once; a stored
    choice, the user's un-exposing included, is never changed."""
    assert await async_setup_component(hass, "homeassistant", {})
    tower = _tower(hass, ConfigEntryState.LOADED)
    _register(hass, tower, "switch", "gaming_vm")
    handoff = _register(hass, tower, "sensor", "handoff")
    async_expose_to_assist_once(hass, handoff)
    assert _stored(hass, handoff) is True

    async_expose_entity(hass, ASSIST, handoff, False)
    async_expose_to_assist_once(hass, handoff)
    assert _stored(hass, handoff) is False


async def test_a_tower_without_gaming_vms_exposes_nothing(
    hass: HomeAssistant,
) -> None:
    """No switch, no verdict on "Expose new entities" to follow: the Handoff
    state is left to Home Assistant, which does not expose such a sensor."""
    assert await async_setup_component(hass, "homeassistant", {})
    tower = _tower(hass, ConfigEntryState.LOADED)
    handoff = _register(hass, tower, "sensor", "handoff")
    async_expose_to_assist_once(hass, handoff)
    assert _stored(hass, handoff) is None
    assert not async_should_expose(hass, ASSIST, handoff)


async def test_entities_it_cannot_place(hass: HomeAssistant) -> None:
    """Without Home Assistant's exposure settings, for an entity the registry
    does not know or that has no tower, and for a name without a device,
    nothing is written and nothing fails."""
    orphan = _register(hass, None, "sensor", "orphan")
    async_expose_to_assist_once(hass, orphan)
    assert await async_setup_component(hass, "homeassistant", {})
    async_expose_to_assist_once(hass, orphan)
    async_expose_to_assist_once(hass, "sensor.unknown")
    async_offer_voice_aliases(hass, "sensor.unknown", ["Unknown one"])
    assert _stored(hass, orphan) is None
    assert er.async_get(hass).async_get("sensor.unknown") is None

    entry = er.async_get(hass).async_get(orphan)
    assert entry is not None
    assert device_name(hass, entry) is None
