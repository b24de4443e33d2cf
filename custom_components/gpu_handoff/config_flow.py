"""Config flow for GPU Handoff: one entry per tower."""

from __future__ import annotations

from typing import Any, override

from homeassistant.config_entries import ConfigFlow, ConfigFlowResult
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.helpers import selector
import probatio

from .const import DEFAULT_SSH_PORT, DOMAIN

STEP_USER_SCHEMA = probatio.Schema(
    {
        probatio.Required(CONF_HOST): selector.TextSelector(),
        probatio.Required(CONF_PORT, default=DEFAULT_SSH_PORT): selector.NumberSelector(
            selector.NumberSelectorConfig(
                min=1, max=65535, mode=selector.NumberSelectorMode.BOX
            )
        ),
        probatio.Required(CONF_USERNAME): selector.TextSelector(),
    }
)


class GpuHandoffConfigFlow(ConfigFlow, domain=DOMAIN):
    """Handle a config flow for a tower."""

    VERSION = 1

    @override
    async def async_step_user(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Ask for the tower's SSH address and user."""
        errors: dict[str, str] = {}
        if user_input is not None:
            host = user_input[CONF_HOST].strip()
            username = user_input[CONF_USERNAME].strip()
            port = int(user_input[CONF_PORT])
            if not host or any(c.isspace() for c in host):
                errors[CONF_HOST] = "invalid_host"
            elif not username or any(c.isspace() for c in username):
                errors[CONF_USERNAME] = "invalid_username"
            else:
                await self.async_set_unique_id(f"{host}:{port}")
                self._abort_if_unique_id_configured()
                return self.async_create_entry(
                    title=host,
                    data={CONF_HOST: host, CONF_PORT: port, CONF_USERNAME: username},
                )
        return self.async_show_form(
            step_id="user",
            data_schema=self.add_suggested_values_to_schema(
                STEP_USER_SCHEMA, user_input
            ),
            errors=errors,
        )
