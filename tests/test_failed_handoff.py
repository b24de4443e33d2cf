"""What a failed handoff leaves, and requests that wait across a restart.

A handoff can fail after the GPU node went down: its own tower job stopped
the GPU node and then could not start the gaming VM, or libvirt's hook (a
gaming VM started by hand) stopped the GPU node while Home Assistant's drain
was refused. GPU Handoff stopped the GPU node then, so GPU Handoff starts it
again; a GPU node someone else shut down stays off (DESIGN.md: undo only what
you did). Each settling step is stored first, so a restart in the middle of
it finishes it. Requests that wait behind a running operation are stored too.

Real parts: sshd forcing the real agent, the tower simulator, the Kubernetes
emulator with its kubelet stand-in.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    EVENT_RETURN_SUCCEEDED,
    EVENT_STOP_SUCCEEDED,
)
from custom_components.gpu_handoff.owned import handoff_store
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.simtower import write_agent_config
from tests.support.stories import (
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    play,
    setup_entry,
    start_by_hand,
    switch,
    until,
)
from tests.towersim import Tower
from tests.towersim.tower import DomainSpec, Hostdev, realistic_domains

# A card outside the GPU node that Gaming station 1 is given too, held by a
# domain GPU Handoff does not manage: its start then waits for it in vain.
SPARE_CARD = "0000:0a:00.0"


@pytest.fixture
def agent_config(sim: Tower, tmp_path: Path) -> Path:
    """Short waits: the guest agent (3 s) and a gaming VM's cards (1 s)."""
    return write_agent_config(sim, tmp_path / "agent", agent=3.0, start=1.0)


def _give_gaming_1_a_busy_card(sim: Tower) -> None:
    """Gaming station 1 also wants SPARE_CARD, which a running domain holds."""
    spec = next(s for s in realistic_domains() if s.name == "gaming-1")
    spec.hostdevs.append(Hostdev(SPARE_CARD, rom_bar=None))
    sim.define(spec)
    sim.define(DomainSpec(name="spare", hostdevs=[Hostdev(SPARE_CARD)], running=True))


def _issue(hass: HomeAssistant, entry: MockConfigEntry, vm: str) -> ir.IssueEntry:
    issue = ir.async_get(hass).async_get_issue(
        DOMAIN, f"handoff_failed_{entry.entry_id}_{vm}"
    )
    assert issue is not None
    return issue


async def test_a_handoff_that_fails_after_the_gpu_node_stopped_returns_the_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The handoff job stops the GPU node, then Gaming station 1 cannot start
    (a card it wants stays busy). The failure is reported, and the GPU node
    that GPU Handoff stopped is started again and uncordoned."""
    _give_gaming_1_a_busy_card(sim)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    await setup_entry(hass, entry)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))

    assert [(e.data["vm"], e.data["code"]) for e in failed] == [
        ("gaming-1", "devices_busy")
    ]
    issue = _issue(hass, entry, "gaming-1")
    assert issue.translation_key == "handoff_failed"
    assert issue.translation_placeholders is not None
    assert issue.translation_placeholders["vm"] == "Gaming station 1"
    controller = entry.runtime_data.controller
    assert controller.progress.last_error["gaming-1"]
    assert controller.desired == set()
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    await until(lambda: not cordoned(cluster))
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    assert hass.states.get(SWITCH_1).state == "off"
    # The issue stays until the next successful operation of Gaming station 1.
    assert _issue(hass, entry, "gaming-1") is not None


async def test_a_gpu_node_someone_else_shut_down_stays_off_after_a_failed_handoff(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    no_pdb: None,
) -> None:
    """The GPU node was off already (the operator's doing): the handoff asks
    only for Gaming station 1's start, which fails. Nothing starts the GPU
    node: it was not GPU Handoff that stopped it."""
    _give_gaming_1_a_busy_card(sim)
    sim.guest_shutdown("gpu-node")
    sim.wait_until(lambda: not sim.is_running("gpu-node"), timeout=30, what="off")
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))

    assert failed[0].data["code"] == "devices_busy"
    assert _issue(hass, entry, "gaming-1").translation_key == "handoff_failed"
    assert not sim.is_running("gpu-node")
    assert sim.calls("start", "gpu-node") == []
    assert entry.runtime_data.controller.requests == {}


async def test_a_restart_while_a_failed_handoff_settles_finishes_it(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    agent_config: Path,
    no_pdb: None,
) -> None:
    """Someone starts Gaming station 2 on the tower: libvirt's hook starts a
    (slow) stop of the GPU node, and the handoff Home Assistant then makes is
    refused (a pod nothing recreates). Home Assistant restarts while it waits
    for that stop; afterwards it still starts the GPU node again, once, and
    reports the failure once."""
    cluster.add_pod("debug", node=GPU_NODE)  # no controller: kubectl refuses
    # a minute at the tests' time scale: the test moves the clock on once it
    # has looked (a slow machine cannot miss the moment)
    sim.set_shutdown_duration("gpu-node", 6000.0)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller

    refused = start_by_hand(sim, "gaming-2")
    assert "is in use" in refused.stderr, refused.stderr
    await entry.runtime_data.coordinator.async_refresh()
    await until(
        lambda: controller.plan is not None and controller.plan.settle is not None
    )
    stored = await handoff_store(hass, entry.entry_id).async_load()
    assert stored is not None
    # The handoff's own job never ran; the hook's stop is what stopped the
    # GPU node, and its record decides (followed after the restart).
    [record] = (agent_config.parent / "agent-state/requests").glob("*-gaming-2.json")
    hook_job = json.loads(record.read_text(encoding="utf-8"))["job"]
    assert hook_job is not None
    assert stored["plan"]["settle"] == {
        "stopped_by_us": False,
        "hook_job": hook_job,
    }
    assert stored["plan"]["origin"] == "hook"
    assert sim.is_running("gpu-node")  # the hook's stop is still under way

    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    await setup_entry(hass, entry)
    sim.advance(60.0)  # the hook's stop ends
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))

    assert [e.data["code"] for e in failed] == ["unmanaged_pods"]
    assert len(returned) == 1
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-2")
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    await until(lambda: not cordoned(cluster))
    # The pod nothing recreates was left where it was.
    assert cluster.get("Pod", "debug", "default")["spec"]["nodeName"] == GPU_NODE
    issue = ir.async_get(hass).async_get_issue(
        DOMAIN, f"unmanaged_pods_{entry.entry_id}"
    )
    assert issue is not None


async def test_a_request_waiting_behind_a_restart_is_carried_out(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Both play and both quit; the second request waits behind the first,
    and Home Assistant restarts while the first one's stop runs. The waiting
    request was stored: after the restart both gaming VMs end off and the
    cards go back to the cluster."""
    stopped = async_capture_events(hass, EVENT_STOP_SUCCEEDED)
    returned = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await play(hass, entry, sim, 2)
    assert len(handed) == 2
    sim.set_shutdown_duration("gaming-1", 400.0)
    controller = entry.runtime_data.controller

    await switch(hass, "turn_off", SWITCH_1)
    await switch(hass, "turn_off", SWITCH_2)
    await until(
        lambda: (
            controller.plan is not None
            and controller.plan.job is not None
            and controller.requests.get("gaming-2") == "stop"
        )
    )
    stored = await handoff_store(hass, entry.entry_id).async_load()
    assert stored is not None
    assert stored["plan"]["vm"] == "gaming-1"
    assert stored["queue"] == [
        {"vm": "gaming-2", "kind": "stop", "origin": "user", "hook_job": None}
    ]

    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    await setup_entry(hass, entry)
    await until(lambda: not sim.is_running("gaming-1"))
    await until(lambda: not sim.is_running("gaming-2"))
    await until(lambda: sim.is_running("gpu-node"))
    await until(lambda: idle(entry) and not entry.runtime_data.controller.requests)
    await until(lambda: not cordoned(cluster))

    assert sorted(e.data["vm"] for e in stopped) == ["gaming-1", "gaming-2"]
    assert len(returned) == 0  # a stop that returns the cards ends as a stop
    stored = await handoff_store(hass, entry.entry_id).async_load()
    assert stored is not None
    assert stored["queue"] == []
    assert stored["plan"] is None
