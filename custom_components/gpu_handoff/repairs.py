"""Repairs: accept a tower's new host key after the user checked it, add a
gaming VM the tower's agent started managing, show the screen of a GPU node
that reports Ready but does not work, and update an old agent on the tower."""

from __future__ import annotations

from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Final

from homeassistant.components.repairs import ConfirmRepairFlow, RepairsFlow
from homeassistant.components.repairs.models import RepairsFlowResult
from homeassistant.config_entries import ConfigEntryState, ConfigSubentry
from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import HomeAssistant
from homeassistant.helpers import entity_registry as er, issue_registry as ir
from homeassistant.util import dt as dt_util
import probatio

from .config_flow import (
    admin_login,
    admin_schema,
    entry_with_host_key,
    install_error_placeholders,
    public_fields,
    tower_admin_session,
    vm_subentry,
)
from .const import (
    CONF_ADMIN_PASSWORD,
    CONF_HOST_KEY,
    CONF_HOST_KEY_PINNED_AT,
    CONF_SUDO_PASSWORD,
    DOMAIN,
)
from .data import GpuHandoffConfigEntry
from .installer import InstallError
from .tower_client import fingerprint

# After a host key was pinned (at setup, or a changed one accepted), the
# update repair takes no password for this long: a man in the middle whose
# key was pinned could fake an old agent to be asked for one.
PASSWORDS_AFTER_PIN: Final = timedelta(hours=24)


def password_refused_for(
    data: MappingProxyType[str, Any] | dict[str, Any], now: datetime
) -> timedelta | None:
    """How long the update repair still refuses passwords for this entry's
    tower (None: it takes them)."""
    pinned = dt_util.parse_datetime(str(data.get(CONF_HOST_KEY_PINNED_AT) or ""))
    if pinned is None:
        return None
    left = pinned + PASSWORDS_AFTER_PIN - now
    return left if left > timedelta(0) else None


class _IssueFlow(RepairsFlow):
    """A fix flow whose texts take the issue's placeholders, as they were
    when it opened (the issue may be gone by the time the user answers)."""

    _texts: dict[str, str] | None = None

    def _placeholders(self) -> dict[str, str]:
        if self._texts is None:
            issue = ir.async_get(self.hass).async_get_issue(DOMAIN, self.issue_id)
            self._texts = (
                dict(issue.translation_placeholders or {}) if issue is not None else {}
            )
        return self._texts


class HostKeyRepairFlow(_IssueFlow):
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
        """Store the new key, which is the tower's identity from now on, and
        reload the entry; refused if that key is another set-up tower's."""
        if user_input is not None:
            entry = self.hass.config_entries.async_get_entry(self._entry_id)
            if entry is None:
                return self.async_abort(reason="entry_removed")
            entries = self.hass.config_entries.async_entries(DOMAIN)
            if entry_with_host_key(entries, self._host_key, entry) is not None:
                return self.async_abort(reason="other_tower_configured")
            self.hass.config_entries.async_update_entry(
                entry,
                unique_id=fingerprint(self._host_key),
                data=entry.data
                | {
                    CONF_HOST_KEY: self._host_key,
                    CONF_HOST_KEY_PINNED_AT: dt_util.utcnow().isoformat(),
                },
            )
            self.hass.config_entries.async_schedule_reload(entry.entry_id)
            return self.async_create_entry(data={})
        return self.async_show_form(
            step_id="confirm",
            data_schema=probatio.Schema({}),
            description_placeholders=self._placeholders(),
        )


class NodeScreenRepairFlow(_IssueFlow):
    """Show the GPU node's screen beside what was seen: the console tells
    what a node that reports Ready but does nothing is stuck on."""

    def __init__(self, entry_id: str, gpu_node: str) -> None:
        """Remember which entry and which VM's screen."""
        self._entry_id = entry_id
        self._gpu_node = gpu_node

    async def async_step_init(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """The issue's text and the screen, fetched when the user looks."""
        return await self.async_step_screen()

    async def async_step_screen(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Closing the notice changes nothing on the node: it comes back
        while the problem lasts."""
        if user_input is not None:
            return self.async_create_entry(data={})
        return self.async_show_form(
            step_id="screen",
            data_schema=probatio.Schema({}),
            description_placeholders=self._placeholders()
            | {"screen": self._screen_markdown()},
        )

    def _screen_markdown(self) -> str:
        """The Screen entity's picture (its URL carries a short-lived access
        token), or why there is none."""
        registry = er.async_get(self.hass)
        entity_id = registry.async_get_entity_id(
            "image", DOMAIN, f"{self._entry_id}_{self._gpu_node}_screen"
        )
        state = self.hass.states.get(entity_id) if entity_id else None
        picture = state.attributes.get("entity_picture") if state else None
        if state is None or state.state == STATE_UNAVAILABLE or not picture:
            return "—"
        return f"![{state.name}]({picture})"


class NewGamingVmRepairFlow(_IssueFlow):
    """Give a gaming VM the tower's agent now manages its switch: the same
    subentry the integration's "Add gaming VM" makes."""

    def __init__(self, entry_id: str, name: str) -> None:
        """Remember which entry and which VM."""
        self._entry_id = entry_id
        self._name = name

    async def async_step_init(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Say which VM (in the issue's text) and ask to confirm."""
        return await self.async_step_confirm()

    async def async_step_confirm(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Add the subentry (the entry reloads with the VM's device), if the
        agent still manages the VM as the tower's last state says."""
        if user_input is None:
            return self.async_show_form(
                step_id="confirm",
                data_schema=probatio.Schema({}),
                description_placeholders=self._placeholders(),
            )
        entry: GpuHandoffConfigEntry | None = self.hass.config_entries.async_get_entry(
            self._entry_id
        )
        if entry is None:
            return self.async_abort(reason="entry_removed")
        if entry.state is not ConfigEntryState.LOADED:
            return self.async_abort(reason="tower_not_loaded")
        tower = entry.runtime_data.coordinator.data.tower
        domain = tower.domains.get(self._name)
        if self._name not in tower.gaming or domain is None:
            return self.async_abort(
                reason="vm_gone", description_placeholders=self._placeholders()
            )
        if any(sub.unique_id == self._name for sub in entry.subentries.values()):
            return self.async_create_entry(data={})  # added meanwhile
        vm = vm_subentry(domain)
        self.hass.config_entries.async_add_subentry(
            entry,
            ConfigSubentry(
                data=MappingProxyType(dict(vm["data"])),
                subentry_type=vm["subentry_type"],
                title=vm["title"],
                unique_id=vm["unique_id"],
            ),
        )
        return self.async_create_entry(data={})


class AgentUpdateRepairFlow(_IssueFlow):
    """Put the agent this integration ships on the tower: the guided
    install's path (an administrator login, used for this step only, then the
    agent's own ``update``), or the command to run by hand."""

    def __init__(self, entry_id: str) -> None:
        """Remember which entry."""
        self._entry_id = entry_id

    async def async_step_init(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Update from here, or by hand."""
        return self.async_show_menu(
            step_id="init",
            menu_options=["update_login", "update_by_hand"],
            description_placeholders=self._placeholders(),
        )

    async def async_step_update_login(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """Log in as an administrator, replace the agent, reload the entry
        (which reads the new version and closes this repair)."""
        entry = self.hass.config_entries.async_get_entry(self._entry_id)
        if entry is None:
            return self.async_abort(reason="entry_removed")
        errors: dict[str, str] = {}
        placeholders = self._placeholders() | {
            "detail": "-",
            "left": "-",
            "fingerprint": fingerprint(entry.data[CONF_HOST_KEY]),
        }
        refused = password_refused_for(entry.data, dt_util.utcnow())
        if user_input is not None and refused is not None and _has_password(user_input):
            errors["base"] = "password_after_pin"
            placeholders["hours"] = str(int(refused.total_seconds() // 3600) + 1)
        elif user_input is not None:
            try:
                async with tower_admin_session(
                    entry.data, admin_login(user_input)
                ) as session:
                    report = await session.update()
            except InstallError as err:
                errors["base"] = err.key
                placeholders |= install_error_placeholders(err)
            else:
                self.hass.config_entries.async_schedule_reload(entry.entry_id)
                return self.async_create_entry(
                    data={"previous": report.previous, "version": report.version}
                )
        return self.async_show_form(
            step_id="update_login",
            data_schema=self.add_suggested_values_to_schema(
                admin_schema(), public_fields(user_input)
            ),
            description_placeholders=placeholders,
            errors=errors,
        )

    async def async_step_update_by_hand(
        self, user_input: dict[str, Any] | None = None
    ) -> RepairsFlowResult:
        """The commands to run; the repair stays until the tower runs the new
        agent."""
        return self.async_abort(
            reason="update_by_hand", description_placeholders=self._placeholders()
        )


def _has_password(user_input: dict[str, Any]) -> bool:
    """Whether a login sends a password (its own, or sudo's inside the
    session): a key login with sudo that asks for none sends none."""
    return bool(
        user_input.get(CONF_ADMIN_PASSWORD) or user_input.get(CONF_SUDO_PASSWORD)
    )


async def async_create_fix_flow(
    hass: HomeAssistant, issue_id: str, data: dict[str, str | int | float | None] | None
) -> RepairsFlow:
    """The fix flow of a repair issue."""
    if data is not None and "host_key" in data:
        return HostKeyRepairFlow(str(data["entry_id"]), str(data["host_key"]))
    if data is not None and "gaming_vm" in data:
        return NewGamingVmRepairFlow(str(data["entry_id"]), str(data["gaming_vm"]))
    if data is not None and "update_agent" in data:
        return AgentUpdateRepairFlow(str(data["entry_id"]))
    if data is not None and "screen_of" in data:
        return NodeScreenRepairFlow(str(data["entry_id"]), str(data["screen_of"]))
    return ConfirmRepairFlow()
