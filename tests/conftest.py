"""Fixtures shared by the Home Assistant tests."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import DOMAIN


@pytest.fixture(autouse=True)
def auto_enable_custom_integrations(
    enable_custom_integrations: None,
) -> Generator[None]:
    """Let Home Assistant load the integration from custom_components/."""
    return


@pytest.fixture
def entry_data() -> dict[str, Any]:
    """Data of a config entry for a tower."""
    return {CONF_HOST: "127.0.0.1", CONF_PORT: 2222, CONF_USERNAME: "hass"}


@pytest.fixture
def mock_config_entry(entry_data: dict[str, Any]) -> MockConfigEntry:
    """A config entry for a tower."""
    return MockConfigEntry(
        domain=DOMAIN,
        title="127.0.0.1",
        unique_id="127.0.0.1:2222",
        data=entry_data,
    )
