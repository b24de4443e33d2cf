"""One switch per gaming VM: on means this VM plays and holds its cards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from homeassistant.components.switch import SwitchEntity, SwitchEntityDescription
from homeassistant.core import HomeAssistant
from homeassistant.helpers import entity_registry as er
from homeassistant.helpers.entity_platform import AddConfigEntryEntitiesCallback

from .assist import async_offer_voice_aliases, is_english, spoken_forms
from .data import GpuHandoffConfigEntry
from .entity import GpuHandoffEntity, gaming_vms
from .protocol import SHUT_OFF

# Requests go to the controller, which serialises them per tower.
PARALLEL_UPDATES = 0

# The step shown while no operation runs on the VM (never "unknown").
STEP_IDLE = "idle"

GAMING_VM = SwitchEntityDescription(key="gaming_vm", translation_key="gaming_vm")


async def async_setup_entry(
    hass: HomeAssistant,
    entry: GpuHandoffConfigEntry,
    async_add_entities: AddConfigEntryEntitiesCallback,
) -> None:
    """A switch for each gaming VM, on its device."""
    for subentry_id, domain in gaming_vms(entry):
        async_add_entities(
            [GamingVmSwitch(entry.runtime_data, GAMING_VM, domain)],
            config_subentry_id=subentry_id,
        )


# Domain states in which a VM is off (no_state: libvirt could not tell).
OFF_STATES: Final = frozenset({SHUT_OFF, "no_state"})


class GamingVmSwitch(GpuHandoffEntity, SwitchEntity):
    """The device's main feature: it takes the VM's name, which voice
    assistants match ("turn on gaming station one")."""

    _attr_name = None

    async def async_added_to_hass(self) -> None:
        """Offer the spoken form of the name as an alias: Assist matches names
        word for word, and "Gaming station 1" is said "gaming station one"."""
        await super().async_added_to_hass()
        if (entry := self.registry_entry) is not None:
            name = er.async_get_full_entity_name(self.hass, entry)
            async_offer_voice_aliases(
                self.hass,
                self.entity_id,
                spoken_forms(name, english=is_english(self.hass)),
            )

    @property
    def is_on(self) -> bool:
        """The requested state from the moment a request is accepted (queued
        behind another operation too) until it ends; else the VM's."""
        requested = self.coordinator.data.operation.requests.get(self.domain or "")
        if requested is not None:
            return requested == "handoff"
        vm = self.vm
        # A paused, crashed (kept) or suspended VM is still on: it holds its
        # card, and turning it off says why it cannot be shut down.
        return vm is not None and vm.state not in OFF_STATES

    @property
    def extra_state_attributes(self) -> Mapping[str, Any]:
        """The current step of an operation on this VM, and the last error."""
        operation = self.coordinator.data.operation
        return {
            "step": operation.step
            if operation.step is not None and operation.vm == self.domain
            else STEP_IDLE,
            "last_error": operation.last_error.get(self.domain or ""),
        }

    async def async_turn_on(self, **kwargs: Any) -> None:
        """Hand the cards to this VM; returns once the handoff is accepted."""
        await self.controller.async_turn_on(self.domain or "")
        self.async_write_ha_state()

    async def async_turn_off(self, **kwargs: Any) -> None:
        """Shut this VM down gracefully; its cards then return to the cluster."""
        await self.controller.async_turn_off(self.domain or "")
        self.async_write_ha_state()
