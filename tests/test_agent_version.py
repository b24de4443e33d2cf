"""The agent's version against the one this integration ships.

Same protocol, another version: an older agent works but lacks what came
since, and a repair says how to update it; a newer one is reported, never
guessed at. The tower runs a copy of the real agent whose VERSION alone is
changed, behind the real sshd.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import sys

from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import DOMAIN
from custom_components.gpu_handoff.protocol import version_key
from custom_components.gpu_handoff.session import AGENT_VERSION
from custom_components.gpu_handoff.tower.gpu_handoff import wire
from tests.conftest import add_tower_entry
from tests.k8semu import K8sEmulator
from tests.support.agentbuild import agent_variant
from tests.support.sshd import Sshd
from tests.support.stories import setup_entry, until


def _agent_of_version(directory: Path, version: str) -> Path:
    assert wire.VERSION == AGENT_VERSION
    return agent_variant(directory, version=version)


@pytest.fixture
def tower_of_version(
    request: pytest.FixtureRequest,
    agent_config: Path,
    tmp_path: Path,
    socket_enabled: None,
) -> Iterator[Sshd]:
    """sshd forcing a copy of the agent that says it is ``request.param``."""
    copy = _agent_of_version(tmp_path / "agent-copy", request.param)
    server = Sshd(
        tmp_path / "sshd-version",
        [sys.executable, str(copy), "--config", str(agent_config), "serve"],
    ).start()
    yield server
    server.stop()


def _issue(hass: HomeAssistant, entry_id: str) -> ir.IssueEntry | None:
    return ir.async_get(hass).async_get_issue(DOMAIN, f"agent_version_{entry_id}")


@pytest.mark.parametrize(
    ("tower_of_version", "key"),
    [("0.2.0", "agent_older"), ("99.0.0", "agent_newer")],
    indirect=["tower_of_version"],
)
async def test_another_agent_version_is_reported(
    hass: HomeAssistant,
    tower_of_version: Sshd,
    cluster: K8sEmulator,
    kubelet: object,
    key: str,
) -> None:
    """The session's hello names the agent's version: an older or a newer
    one than this integration ships raises a repair that says both."""
    entry = add_tower_entry(hass, tower_of_version, cluster)
    await setup_entry(hass, entry)
    await until(lambda: _issue(hass, entry.entry_id) is not None)
    issue = _issue(hass, entry.entry_id)
    assert issue is not None
    assert issue.translation_key == key
    assert issue.translation_placeholders is not None
    assert issue.translation_placeholders["ours"] == AGENT_VERSION
    assert issue.translation_placeholders["theirs"] != AGENT_VERSION
    assert entry.runtime_data.session.connected


async def test_the_agent_this_integration_ships_raises_nothing(
    hass: HomeAssistant, entry: object, sim_sshd: Sshd
) -> None:
    """The agent of this release: no version repair."""

    assert isinstance(entry, MockConfigEntry)
    await setup_entry(hass, entry)
    await until(lambda: entry.runtime_data.session.connected)
    assert _issue(hass, entry.entry_id) is None


def test_versions_compare_as_numbers() -> None:
    """0.10.0 is newer than 0.9.0; a version that is not dotted numbers is
    compared with nothing."""
    assert version_key("0.10.0") > version_key("0.9.0")  # type: ignore[operator]
    assert version_key("0.3.0") == (0, 3, 0)
    assert version_key("0.3.0-dev") is None
