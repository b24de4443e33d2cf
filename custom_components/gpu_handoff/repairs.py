"""Repairs: accept a tower's new host key after the user checked it."""

from __future__ import annotations

from typing import Any

from homeassistant.components.repairs import ConfirmRepairFlow, RepairsFlow
from homeassistant.components.repairs.models import RepairsFlowResult
from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir
import probatio

from .const import CONF_HOST_KEY, DOMAIN


class HostKeyRepairFlow(RepairsFlow):
    """Pin the host key the tower presents now."""

    def __init__(self, entry_id: str, host_key: str) -> None:
        """Remember which entry and which key."""
        self._entry_id = entry_id
        self._host_key = host_key

    async def async_step_init(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Show both fingerprints (in the issue's text) and ask to confirm."""
        return await self.async_step_confirm()

    async def async_step_confirm(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Store the new key and reload the entry."""
        if user_input is not None:
            entry = self.hass.config_entries.async_get_entry(self._entry_id)
            if entry is None:
                return self.async_abort(reason="entry_removed")
            self.hass.config_entries.async_update_entry(
                entry, data=entry.data | {CONF_HOST_KEY: self._host_key}
            )
            self.hass.config_entries.async_schedule_reload(entry.entry_id)
            return self.async_create_entry(data={})
        return self.async_show_form(
            step_id="confirm",
            data_schema=probatio.Schema({}),
            description_placeholders=self._placeholders(),
        )

    def _placeholders(self) -> dict[str, str]:
        issue = ir.async_get(self.hass).async_get_issue(DOMAIN, self.issue_id)
        return dict(issue.translation_placeholders or {}) if issue is not None else {}


async def async_create_fix_flow(
    hass: HomeAssistant, issue_id: str, data: dict[str, str | int | float | None] | None
) -> RepairsFlow:
    """The fix flow of a repair issue."""
    if data is not None and "host_key" in data:
        return HostKeyRepairFlow(str(data["entry_id"]), str(data["host_key"]))
    return ConfirmRepairFlow()
