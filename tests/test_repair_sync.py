"""The repairs that follow the coordinator, at the moments a refresh, a
pushed status or a redraw comes, over stand-in clients (each failure on
demand). The end-to-end stories with the real sshd and agent are in
test_init.py, test_health.py and test_guided_install.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff import repair_sync
from custom_components.gpu_handoff.const import CONF_HOST_KEY, DOMAIN
from custom_components.gpu_handoff.coordinator import GpuHandoffCoordinator
from custom_components.gpu_handoff.protocol import PROTOCOL, Finding
from custom_components.gpu_handoff.repair_sync import RepairSync
from custom_components.gpu_handoff.tower_client import (
    AgentVersionError,
    TowerConnectionError,
    TowerHostKeyError,
    fingerprint,
    generate_key_pair,
)
from tests.support.fake_tower import (
    FakeTower,
    fake_coordinator,
    fake_entry,
    tower_status,
)

NEW_KEY = generate_key_pair()[1]


@pytest.fixture
def entry(hass: HomeAssistant) -> MockConfigEntry:
    return fake_entry(hass)


@pytest.fixture
def tower() -> FakeTower:
    return FakeTower()


@pytest.fixture
async def coordinator(
    hass: HomeAssistant, entry: MockConfigEntry, tower: FakeTower
) -> AsyncIterator[GpuHandoffCoordinator]:
    """The coordinator with the repairs following it, read once."""
    coordinator = fake_coordinator(hass, entry, tower)
    stop = RepairSync(hass, entry, coordinator).async_start()
    await coordinator.async_refresh()
    yield coordinator
    stop()
    await coordinator.async_shutdown()


@pytest.fixture
def new_host_key(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """The tower presents NEW_KEY once the returned event is set (set already)."""
    presented = asyncio.Event()
    presented.set()

    async def fetch_host_key(host: str, port: int) -> str:
        await presented.wait()
        return NEW_KEY

    monkeypatch.setattr(repair_sync, "fetch_host_key", fetch_host_key)
    return presented


def _issue(
    hass: HomeAssistant, name: str, entry: MockConfigEntry
) -> ir.IssueEntry | None:
    return ir.async_get(hass).async_get_issue(DOMAIN, f"{name}_{entry.entry_id}")


async def _refresh(hass: HomeAssistant, coordinator: GpuHandoffCoordinator) -> None:
    await coordinator.async_refresh()
    await hass.async_block_till_done()


async def test_a_new_host_key_in_a_run_of_failures(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
    new_host_key: asyncio.Event,
) -> None:
    """The tower is away, then comes back with another host key: the repair
    appears at that refresh (its listeners heard only the first failure),
    with both fingerprints, and goes at the next refresh that reads the
    tower."""
    tower.status_result = TowerConnectionError("away")
    await _refresh(hass, coordinator)
    assert _issue(hass, "host_key_mismatch", entry) is None
    tower.status_result = TowerHostKeyError("another key")
    await _refresh(hass, coordinator)
    issue = _issue(hass, "host_key_mismatch", entry)
    assert issue is not None
    assert (issue.severity, issue.is_fixable) == (ir.IssueSeverity.ERROR, True)
    assert issue.translation_placeholders == {
        "host": "tower.lan",
        "old": fingerprint(entry.data[CONF_HOST_KEY]),
        "new": fingerprint(NEW_KEY),
    }
    assert issue.data == {"entry_id": entry.entry_id, "host_key": NEW_KEY}
    tower.status_result = tower_status()
    await _refresh(hass, coordinator)
    assert _issue(hass, "host_key_mismatch", entry) is None


async def test_no_host_key_issue_without_the_new_key(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key cannot be read (the tower went away again): no issue, whose
    fix would have no key to pin."""

    async def fetch_host_key(host: str, port: int) -> str:
        raise TowerConnectionError("away again")

    monkeypatch.setattr(repair_sync, "fetch_host_key", fetch_host_key)
    tower.status_result = TowerHostKeyError("another key")
    await _refresh(hass, coordinator)
    assert _issue(hass, "host_key_mismatch", entry) is None


async def test_no_host_key_issue_once_the_tower_is_read_again(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
    new_host_key: asyncio.Event,
) -> None:
    """A refresh reads the tower while its key is being fetched: the issue
    it would raise is stale already."""
    new_host_key.clear()
    tower.status_result = TowerHostKeyError("another key")
    await coordinator.async_refresh()
    tower.status_result = tower_status()
    await coordinator.async_refresh()
    new_host_key.set()
    await hass.async_block_till_done()
    assert _issue(hass, "host_key_mismatch", entry) is None


async def test_an_agent_of_another_protocol(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
) -> None:
    """A refresh fails because the agent speaks another protocol: the repair
    that updates it, with both protocols."""
    tower.status_result = AgentVersionError(PROTOCOL - 1)
    await _refresh(hass, coordinator)
    issue = _issue(hass, "agent_outdated", entry)
    assert issue is not None
    assert (issue.severity, issue.is_fixable) == (ir.IssueSeverity.ERROR, True)
    assert issue.translation_placeholders == {
        "host": "tower.lan",
        "theirs": str(PROTOCOL - 1),
        "ours": str(PROTOCOL),
    }
    assert issue.data == {"entry_id": entry.entry_id, "update_agent": 1}


async def test_findings_follow_each_status_not_each_redraw(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
) -> None:
    """A finding is synced with every status, read or pushed; the redraws
    the controller asks for (its own progress) sync nothing."""
    finding = Finding(code="rom_bar_not_off", domain="gpu-node", detail="0000:03:00.1")
    issue_id = f"rom_bar_not_off_{entry.entry_id}_gpu-node"
    tower.status_result = tower_status(findings=(finding,))
    await _refresh(hass, coordinator)
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
    ir.async_delete_issue(hass, DOMAIN, issue_id)
    coordinator.async_update_listeners()
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None
    coordinator.async_set_tower(tower_status(findings=(finding,)))
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
    coordinator.async_set_tower(tower_status())
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None
