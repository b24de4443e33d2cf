"""The gaming VMs follow the agent: with every status (read or pushed), a VM
it no longer manages loses its subentry, and one it started managing is
offered by a repair.

A listener of the coordinator, so that the coordinator only reads and the
entry and its subentries change outside its refresh. Registered before the
first refresh, it acts on that refresh's status before the platforms load:
a subentry removed then never gets entities.
"""

from __future__ import annotations

import logging
from typing import Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import CALLBACK_TYPE, HomeAssistant, callback
from homeassistant.helpers import issue_registry as ir

from .const import CONF_DOMAIN_NAME, CONF_KNOWN_VMS, DOMAIN
from .coordinator import GpuHandoffCoordinator
from .protocol import TowerStatus

_LOGGER = logging.getLogger(__name__)

ISSUE_NEW_GAMING_VM: Final = "new_gaming_vm"


class GamingVmSync:
    """Keeps one tower's gaming VM subentries and offers in step with the
    gaming VMs its agent manages."""

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        coordinator: GpuHandoffCoordinator,
    ) -> None:
        """Nothing is followed until ``async_start``."""
        self._hass = hass
        self._entry = entry
        self._coordinator = coordinator
        # The status last followed (a new status is a new object).
        self._tower: TowerStatus | None = None

    @callback
    def async_start(self) -> CALLBACK_TYPE:
        """Follow the coordinator; returns what stops it."""
        return self._coordinator.async_add_listener(self._data_changed)

    @callback
    def _data_changed(self) -> None:
        # A failed refresh read nothing new (the first one, nothing at all).
        if not self._coordinator.last_update_success:
            return
        tower = self._coordinator.data.tower
        if tower is not self._tower:
            self._tower = tower
            self._follow(tower)

    def _follow(self, status: TowerStatus) -> None:
        """One that appears later is offered: a fixable repair adds its
        subentry (its switch and device) once the user agrees; those the
        user left out at setup are no news. One the agent no longer manages
        loses its subentry, and with it its entities and device: the agent
        refuses every request for it."""
        managed = set(status.gaming)
        configured = {
            str(subentry.data[CONF_DOMAIN_NAME]): subentry_id
            for subentry_id, subentry in self._entry.subentries.items()
        }
        self._remove_dropped(managed, configured)
        known = self._update_known(managed, set(configured))
        self._offer_new(status, sorted(managed - known))

    def _remove_dropped(self, managed: set[str], configured: dict[str, str]) -> None:
        """Remove the subentries of the VMs the agent no longer manages."""
        for name, subentry_id in configured.items():
            if name not in managed:
                _LOGGER.info(
                    "The tower's agent no longer manages %s: its switch and "
                    "device are removed",
                    name,
                )
                self._hass.config_entries.async_remove_subentry(
                    self._entry, subentry_id
                )

    def _update_known(self, managed: set[str], configured: set[str]) -> set[str]:
        """The VMs that are no news (stored), still managed."""
        entry = self._entry
        stored = entry.data.get(CONF_KNOWN_VMS)
        # An entry from before this was stored takes what the agent manages
        # now as known: nothing it already had is news.
        known = set(managed if stored is None else [*stored, *configured])
        known &= managed
        if stored != sorted(known):
            self._hass.config_entries.async_update_entry(
                entry, data={**entry.data, CONF_KNOWN_VMS: sorted(known)}
            )
        return known

    def _offer_new(self, status: TowerStatus, new: list[str]) -> None:
        """A fixable repair per new VM; the offers of others are withdrawn."""
        entry_id = self._entry.entry_id
        prefix = f"{ISSUE_NEW_GAMING_VM}_{entry_id}_"
        for name in new:
            domain = status.domains.get(name)
            ir.async_create_issue(
                self._hass,
                DOMAIN,
                prefix + name,
                is_fixable=True,
                is_persistent=False,
                severity=ir.IssueSeverity.WARNING,
                translation_key=ISSUE_NEW_GAMING_VM,
                translation_placeholders={
                    "name": domain.title if domain is not None else name,
                    "domain": name,
                },
                data={"entry_id": entry_id, "gaming_vm": name},
            )
        wanted = {prefix + name for name in new}
        for domain_key, issue_id in list(ir.async_get(self._hass).issues):
            if (
                domain_key == DOMAIN
                and issue_id.startswith(prefix)
                and issue_id not in wanted
            ):
                ir.async_delete_issue(self._hass, DOMAIN, issue_id)
