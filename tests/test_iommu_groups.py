"""IOMMU groups: on a board without ACS the GPU node's own card shares a group
with a gaming VM's card, and the group, not the card, is what can be lent.

libvirt passes a VFIO group through whole: it refuses to start a domain while
another holds any function of the group of one of its functions, naming that
function even when the starting domain does not have it
(src/hypervisor/virhostdev.c, virHostdevPreparePCIDevicesImpl; the simulator
reproduces it, tests/towersim/test_iommu_groups.py). With lending on, a
player's handoff is followed by the GPU node's restart with the free cards:
the GPU node's own GTX 960 is not free while Gaming station 1 plays, since
they share a group. Home Assistant explains the board's limit in a repair.

Real parts: sshd forcing the real agent (which reads the groups from the
simulated tower's sysfs), the tower simulator, the Kubernetes emulator with
the kubelet stand-in.
"""

from __future__ import annotations

from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
)
from tests.k8semu import K8sEmulator
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    lend_free_cards,
    serving_with,
    switch,
    until,
)
from tests.towersim import Tower

GTX_960 = "0000:01:00"  # the GPU node's own
RTX_1 = "0000:03:00"  # Gaming station 1's
RTX_2 = "0000:04:00"  # Gaming station 2's
SHARED = 11  # the IOMMU group of the GTX 960 and Gaming station 1's card
BOUND = 60.0


def _rows(hass: HomeAssistant) -> dict[str, dict[str, object]]:
    return {row["card"]: row for row in hass.states.get(HANDOFF).attributes["cards"]}


@pytest.fixture
def no_acs(sim: Tower) -> None:
    """The GTX 960 and Gaming station 1's RTX 3050 in one IOMMU group."""
    sim.set_iommu_group(
        SHARED, [f"{GTX_960}.0", f"{GTX_960}.1", f"{RTX_1}.0", f"{RTX_1}.1"]
    )


@pytest.fixture
async def lending(
    hass: HomeAssistant, no_acs: None, entry: MockConfigEntry, no_pdb: None
) -> None:
    await lend_free_cards(hass, entry)


async def test_the_group_of_a_players_card_is_not_lent(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    lending: None,
) -> None:
    """Gaming station 1 plays: the GPU node comes back with Gaming station
    2's card alone (the GTX 960 shares Gaming station 1's group), the card
    table calls the GTX 960 blocked by gaming-1, and a repair explains ACS.
    When the player stops, the GPU node gets all three back."""
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(handed) or bool(failed), BOUND)
    assert sim.is_running("gaming-1")
    await serving_with(hass, entry, sim, cluster, {RTX_2})

    assert not failed
    assert sim.runs_live_definition("gpu-node")
    assert len(sim.calls("create")) == 1
    rows = _rows(hass)
    assert {card: row["use"] for card, row in rows.items()} == {
        GTX_960: "blocked",
        RTX_1: "player",
        RTX_2: "cluster",
    }
    assert rows[GTX_960]["blocked_by"] == "gaming-1"
    assert rows[GTX_960]["iommu_group"] == rows[RTX_1]["iommu_group"] == SHARED
    assert entry.runtime_data.controller.progress.last_error == {}
    issue_id = f"shared_iommu_group_{entry.entry_id}_gaming-1"
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_key == "shared_iommu_group"
    assert issue.translation_placeholders == {
        "domain": "gaming-1",
        "details": f"IOMMU group {SHARED} holds {RTX_1}.0, {RTX_1}.1 (gaming-1) "
        f"and {GTX_960}.0, {GTX_960}.1 (gpu-node): these cards can only be "
        "passed through together",
    }
    tower = entry.runtime_data.coordinator.data.tower
    assert {c.address: c.held_by for c in tower.cards if c.address[:10] == GTX_960} == {
        f"{GTX_960}.0": None,
        f"{GTX_960}.1": None,
    }

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: not sim.is_running("gaming-1"), BOUND)
    await serving_with(hass, entry, sim, cluster, {GTX_960, RTX_1, RTX_2})
    assert not sim.runs_live_definition("gpu-node")
    assert {row["use"] for row in _rows(hass).values()} == {"cluster"}
    # the board did not change: the repair stays
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
