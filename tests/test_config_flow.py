"""Tests of the config flow."""

from __future__ import annotations

from homeassistant.config_entries import SOURCE_USER
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import DOMAIN


async def test_user_flow_creates_entry(hass: HomeAssistant) -> None:
    """A tower address and user create one entry, trimmed."""
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    assert result["type"] is FlowResultType.FORM
    assert result["step_id"] == "user"
    assert result["errors"] == {}

    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: " tower.lan ", CONF_PORT: 2222, CONF_USERNAME: "hass"},
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    assert result["title"] == "tower.lan"
    assert result["data"] == {
        CONF_HOST: "tower.lan",
        CONF_PORT: 2222,
        CONF_USERNAME: "hass",
    }
    assert result["result"].unique_id == "tower.lan:2222"


@pytest.mark.parametrize(
    ("user_input", "errors"),
    [
        (
            {CONF_HOST: "tower lan", CONF_PORT: 22, CONF_USERNAME: "hass"},
            {CONF_HOST: "invalid_host"},
        ),
        (
            {CONF_HOST: "   ", CONF_PORT: 22, CONF_USERNAME: "hass"},
            {CONF_HOST: "invalid_host"},
        ),
        (
            {CONF_HOST: "tower", CONF_PORT: 22, CONF_USERNAME: "h ass"},
            {CONF_USERNAME: "invalid_username"},
        ),
    ],
)
async def test_user_flow_rejects_bad_input(
    hass: HomeAssistant, user_input: dict[str, object], errors: dict[str, str]
) -> None:
    """Bad input shows the form again with a translated error and creates nothing."""
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], user_input
    )
    assert result["type"] is FlowResultType.FORM
    assert result["errors"] == errors
    assert hass.config_entries.async_entries(DOMAIN) == []

    # The user corrects the input and the same flow finishes.
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_HOST: "tower", CONF_PORT: 22, CONF_USERNAME: "hass"}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY


async def test_user_flow_aborts_for_a_configured_tower(
    hass: HomeAssistant, mock_config_entry: MockConfigEntry
) -> None:
    """A second entry for the same tower is refused."""
    mock_config_entry.add_to_hass(hass)
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: 2222, CONF_USERNAME: "other"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "already_configured"
    assert len(hass.config_entries.async_entries(DOMAIN)) == 1
