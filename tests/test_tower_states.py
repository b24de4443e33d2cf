"""The rest of a real tower's state model (tests/towersim/test_libvirt_states.py).

1. A paused (or crashed and kept) GPU node answers neither its guest agent nor
   a shutdown: the handoff fails at once saying so, instead of waiting for the
   guest agent until its timeout; nothing is forced, the node is uncordoned.
2. libvirtd restarts under a session: its event stream ends ("Disconnected
   ... due to end of file"), running domains stay up (the agent's qemu hook
   answers libvirt's ``reconnect`` with success: a failing one would make
   libvirtd kill them), and Home Assistant sees libvirt back at once, not
   after the agent's old 5 s pause before it tried the stream again.
3. Just after the GPU node stopped, the gaming VM's start may find the VFIO
   group still busy (QEMU: "Device or resource busy"): the start is tried
   again and the handoff succeeds.

Real parts: sshd forcing the real agent, the tower simulator with the agent as
its live qemu hook, the Kubernetes emulator with its kubelet stand-in.
"""

from __future__ import annotations

import time

from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
)
from tests.k8semu import K8sEmulator
from tests.support.stories import (
    SWITCH_1,
    cordoned,
    idle,
    play,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

BOUND = 60.0
# How soon after libvirtd is back Home Assistant must show the tower again:
# the agent's status refresh (5 s) and its old pause before it tried the
# event stream again (5 s) are both longer.
BACK_BOUND = 2.5


async def test_a_paused_gpu_node_fails_the_handoff_at_once_saying_why(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Someone paused the GPU node (virsh suspend). The handoff drains it,
    then the tower job fails on its first look: "paused", not a guest agent
    that "did not answer within 3 s". The GPU node stays paused (nothing
    forced, no shutdown sent), the gaming VM stays off, and GPU Handoff's
    cordon goes once the GPU node runs again."""
    await setup_entry(hass, entry)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    sim.pause("gpu-node")

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed), BOUND)
    await until(lambda: idle(entry), BOUND)

    error = str(failed[0].data.get("error"))
    assert "'gpu-node' is paused" in error, error
    assert "did not answer" not in error
    assert sim.domstate("gpu-node") == "paused (user)"
    assert sim.calls("shutdown", "gpu-node") == []
    assert not sim.is_running("gaming-1")
    sensor = hass.states.get("sensor.gpu_node_vm_state")
    assert sensor is not None
    assert sensor.state == "paused"
    # A paused node serves nothing: GPU Handoff's cordon stays until it runs
    # again, and goes then.
    assert cordoned(cluster)
    sim.resume("gpu-node")
    await until(lambda: not cordoned(cluster), BOUND)


async def test_libvirtd_restart_is_seen_through_and_back_at_once(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 1 plays; libvirtd restarts and is away for 1.5 s.
    Home Assistant shows the tower unavailable meanwhile, and available again
    within BACK_BOUND of libvirtd's return; the playing VM and the GPU node
    were never touched (the agent's hook answered ``reconnect`` with 0)."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    assert hass.states.get(SWITCH_1).state == "on"
    events_before = len(sim.calls("event"))

    sim.restart_libvirtd(150.0)  # 1.5 s here
    back_at = time.monotonic() + 1.5
    await until(lambda: hass.states.get(SWITCH_1).state == STATE_UNAVAILABLE, 10)
    await until(lambda: time.monotonic() >= back_at, 10)
    await until(lambda: hass.states.get(SWITCH_1).state == "on", BACK_BOUND)

    assert sim.is_running("gaming-1")
    assert sim.domstate("gaming-1") == "running (booted)"
    reconnects = [r for r in sim.hook_runs() if r["args"][1] == "reconnect"]
    assert {r["args"][0] for r in reconnects} == {"gaming-1"}
    assert all(r["status"] == "exit status 0" for r in reconnects)
    # the session's event stream ended and was started again
    assert len(sim.calls("event")) > events_before


async def test_a_start_finding_the_vfio_group_still_busy_is_tried_again(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The GPU node stopped; the gaming VM's first start dies on the VFIO
    group the old QEMU has not closed yet ("Device or resource busy"). The
    agent tries again a second later and the handoff succeeds."""
    await setup_entry(hass, entry)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    sim.fail_next_start("gaming-1", "vfio")

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(succeeded) or bool(failed), BOUND)
    assert failed == []
    await until(lambda: idle(entry), BOUND)
    starts = sim.calls("start", "gaming-1")
    assert [c.rc for c in starts] == [1, 0]
    assert sim.is_running("gaming-1")
    assert hass.states.get(SWITCH_1).state == "on"


async def test_a_paused_gaming_vm_stays_on_and_its_stop_says_why(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 1 plays and its player pauses it: the switch stays on
    (the VM holds its card), its state sensor says paused, and turning it off
    fails at once saying it is paused; nothing is forced and the cards stay."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    sim.pause("gaming-1")
    await entry.runtime_data.coordinator.async_refresh()
    await until(
        lambda: hass.states.get("sensor.gaming_station_1_vm_state").state == "paused"
    )
    assert hass.states.get(SWITCH_1).state == "on"

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: idle(entry), BOUND)
    assert sim.domstate("gaming-1") == "paused (user)"
    assert sim.calls("shutdown", "gaming-1") == []
    assert hass.states.get(SWITCH_1).state == "on"
    assert "paused" in str(hass.states.get(SWITCH_1).attributes.get("last_error"))
    assert not sim.is_running("gpu-node")
