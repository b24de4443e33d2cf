"""A graceful stop as a real tower does it (tests/towersim/test_agent_shutdown.py).

1. ``virsh shutdown --mode agent`` blocks until the guest is off or libvirt's
   60 s pass (qemuAgentShutdown), then fails although the guest is still going
   down; meanwhile a ping of that domain waits for its agent job (30 s). A GPU
   node that needs longer than 60 s to power off is still handed off, and the
   status answers while the shutdown blocks.
2. A guest shutting itself down loses its guest agent seconds before the
   power-off: Home Assistant's stop arriving then is refused ("QEMU guest agent
   is not connected") while the domain runs; it is shut off seconds later, and
   the cards still come back.

Real parts: sshd forcing the real agent, the tower simulator, the Kubernetes
emulator with its kubelet stand-in.
"""

from __future__ import annotations

from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_CARDS_RETURNED,
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


async def test_a_gpu_node_slower_than_libvirts_60s_is_still_handed_off(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The GPU node needs 75 s to power off against libvirt's 60; libvirt's
    agent shutdown gives up first and the guest powers off anyway. The
    handoff succeeds, and while the shutdown blocks, a status (through sshd
    and the agent) answers without waiting for the GPU node's guest agent:
    it is shown as unknown, not pinged.

    The times are real-sized in simulated seconds (6000 and 7500 at this
    tower's scale of 0.01: a minute of block), and the test moves the clock
    past libvirt's timeout and then past the power-off once it has looked,
    so a slow machine cannot miss the block and a fast one waits for
    nothing."""
    sim.set_libvirt_waits(agent_shutdown_timeout=6000.0, job_wait=30000.0)
    sim.set_shutdown_duration("gpu-node", 7500.0)
    await setup_entry(hass, entry)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.agent_job_held("gpu-node"), BOUND)
    await entry.runtime_data.coordinator.async_refresh()
    # the status came back while libvirt still held the GPU node's agent
    assert sim.agent_job_held("gpu-node")
    gpu = entry.runtime_data.coordinator.data.tower.domains["gpu-node"]
    assert gpu.state == "running"
    assert gpu.agent_ready is None

    # libvirt's 60 s pass: the shutdown call gives up, the guest still runs
    sim.advance(61.0)
    await until(lambda: [c.rc for c in sim.calls("shutdown", "gpu-node")] == [1], BOUND)
    assert sim.is_running("gpu-node")
    assert not succeeded
    # and 15 s later the guest is off
    sim.advance(15.0)
    await until(lambda: bool(succeeded) or bool(failed), BOUND)
    assert failed == []
    await until(lambda: sim.is_running("gaming-1"), BOUND)
    await until(lambda: idle(entry), BOUND)
    shutdown = sim.calls("shutdown", "gpu-node")
    assert [c.rc for c in shutdown] == [1]  # libvirt gave up at 60 s
    assert not sim.is_running("gpu-node")
    assert sim.destroy_attempts() == []


async def test_a_stop_racing_the_players_own_shutdown_returns_the_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 1 plays. The player shuts Windows down from inside just
    as Home Assistant's stop arrives: the guest agent has left, the stop is
    refused, the VM still runs; it is shut off a second later. The stop
    counts, and the cards come back to the GPU node."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    sim.set_shutdown_duration("gaming-1", 100.0)
    sim.guest_shutdown_on_next_stop("gaming-1")

    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(returned), BOUND)
    await until(lambda: idle(entry), BOUND)

    shutdown = sim.calls("shutdown", "gaming-1")
    assert [c.rc for c in shutdown] == [1]  # the agent had left: refused
    assert not sim.is_running("gaming-1")
    assert sim.is_running("gpu-node")
    assert hass.states.get(SWITCH_1).state == "off"
    await until(lambda: not cordoned(cluster), BOUND)
