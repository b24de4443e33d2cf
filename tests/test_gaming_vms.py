"""The gaming VMs that follow the agent, at the moments a status or a redraw
comes, over stand-in clients. The end-to-end stories (subentries removed,
offers fixed) are in test_init.py."""

from __future__ import annotations

from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir

from custom_components.gpu_handoff.const import CONF_KNOWN_VMS, DOMAIN
from custom_components.gpu_handoff.gaming_vms import GamingVmSync
from tests.support.fake_tower import (
    FakeTower,
    fake_coordinator,
    fake_entry,
    tower_status,
)


async def test_an_offer_follows_each_status_not_each_redraw(
    hass: HomeAssistant,
) -> None:
    """A VM the agent manages and the entry does not know is offered with
    every status, read or pushed (by its name while the status lists no
    domain of it); the redraws the controller asks for offer nothing."""
    entry = fake_entry(hass)
    hass.config_entries.async_update_entry(
        entry, data=entry.data | {CONF_KNOWN_VMS: []}
    )
    tower = FakeTower()
    tower.status_result = tower_status(gaming=("gaming-1",))
    coordinator = fake_coordinator(hass, entry, tower)
    stop = GamingVmSync(hass, entry, coordinator).async_start()
    issue_id = f"new_gaming_vm_{entry.entry_id}_gaming-1"
    await coordinator.async_refresh()
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_placeholders == {"name": "gaming-1", "domain": "gaming-1"}
    ir.async_delete_issue(hass, DOMAIN, issue_id)
    coordinator.async_update_listeners()
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None
    coordinator.async_set_tower(tower_status(gaming=("gaming-1",)))
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
    coordinator.async_set_tower(tower_status())
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None
    assert entry.data[CONF_KNOWN_VMS] == []
    stop()
    await coordinator.async_shutdown()
