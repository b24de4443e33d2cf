"""A press is not lost to a blip: an operation that meets a failure the world
heals by itself (libvirt away for a moment, the SSH connection or the agent's
session dropped, the API server unreachable) tries again under its stored
plan, until the drain timeout; past it, it fails and is reported as before.

Real parts: Home Assistant with the integration, sshd forcing the real agent,
the simulated tower (libvirtd restarting as the real one does: virsh calls
fail with "failed to connect to the hypervisor" while it is away), the
Kubernetes API emulator. The request waits behind the controller's lock, as
it does behind another operation, while libvirtd goes away: its first look
at the tower is the one that fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
import contextlib
import logging

from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import Event, HomeAssistant
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff import operations
from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_STOP_SUCCEEDED,
)
from custom_components.gpu_handoff.operations import STEP_RETRYING
from custom_components.gpu_handoff.report import TRANSIENT_CODES
from tests.k8semu import K8sEmulator
from tests.support.sshd import Sshd
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


async def _playing(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> tuple[list[Event], list[Event]]:
    """Gaming station 1 plays; the failed and the stop-succeeded events
    from now on."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    stopped = async_capture_events(hass, EVENT_STOP_SUCCEEDED)
    return failed, stopped


@contextlib.asynccontextmanager
async def behind_another_operation(entry: MockConfigEntry) -> AsyncIterator[None]:
    """Hold the controller's lock, as an operation ahead of the next one
    does: a request accepted meanwhile waits to begin."""
    lock = entry.runtime_data.controller.operations._lock
    async with lock:
        yield


async def test_a_stop_that_meets_libvirt_away_is_tried_again_and_done(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Gaming station 1 plays; its switch is turned off while another
    operation runs; libvirtd restarts and is away for 1.5 s just as the stop
    begins. The stop's first look at the tower fails ("libvirt_unreachable"),
    is tried again, and the stop is carried out once libvirt is back: no
    failure reported, the cards back in the cluster."""
    failed, stopped = await _playing(hass, entry, sim)
    caplog.set_level(logging.INFO, logger=operations.__name__)
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)

    async with behind_another_operation(entry):
        await switch(hass, "turn_off", SWITCH_1)  # accepted
        sim.restart_libvirtd(150.0)  # 1.5 s here
        await until(lambda: hass.states.get(SWITCH_1).state == STATE_UNAVAILABLE, 10)
    await until(lambda: bool(stopped) or bool(failed))
    await until(lambda: idle(entry))

    assert failed == []
    assert [e.data["vm"] for e in stopped] == ["gaming-1"]
    assert "met a passing failure" in caplog.text
    assert "libvirt_unreachable" in caplog.text
    # The switch showed the wait ("Waiting to try again"), then the stop's
    # own steps.
    shown = [e.data["step"] for e in steps]
    assert shown[0] == STEP_RETRYING
    assert shown[-1] == "uncordoning"
    assert not sim.is_running("gaming-1")
    assert sim.is_running("gpu-node")
    await until(lambda: not cordoned(cluster))
    await until(lambda: hass.states.get(SWITCH_1).state == "off")


async def test_a_stop_that_finds_the_tower_away_is_tried_again_and_done(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The same moment with the SSH server gone instead (the tower's network
    down, sshd restarting): every connection refused for 1.5 s. The stop
    tries again until the tower answers, and is carried out."""
    failed, stopped = await _playing(hass, entry, sim)

    async with behind_another_operation(entry):
        await switch(hass, "turn_off", SWITCH_1)
        await asyncio.to_thread(sim_sshd.stop)
        await until(lambda: hass.states.get(SWITCH_1).state == STATE_UNAVAILABLE, 10)
    await asyncio.sleep(1.5)  # the outage, while the stop tries
    await asyncio.to_thread(sim_sshd.start_again)
    await until(lambda: bool(stopped) or bool(failed))
    await until(lambda: idle(entry))

    assert failed == []
    assert [e.data["vm"] for e in stopped] == ["gaming-1"]
    assert not sim.is_running("gaming-1")
    assert sim.is_running("gpu-node")
    await until(lambda: not cordoned(cluster))


async def test_an_outage_longer_than_the_drain_timeout_fails_and_is_reported(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The same stop, with libvirtd away for 9 s: longer than the drain
    timeout (5 s here), the bound of the retries. The stop fails, reported
    with its transient code, and nothing was stopped; once libvirt is back,
    turning the switch off again works."""
    failed, stopped = await _playing(hass, entry, sim)

    async with behind_another_operation(entry):
        await switch(hass, "turn_off", SWITCH_1)
        sim.restart_libvirtd(900.0)  # 9 s here
        await until(lambda: hass.states.get(SWITCH_1).state == STATE_UNAVAILABLE, 10)
    await until(lambda: bool(failed), 15)
    await until(lambda: idle(entry))

    [event] = failed
    assert event.data["kind"] == "stop"
    assert event.data["code"] in TRANSIENT_CODES
    assert stopped == []
    assert sim.is_running("gaming-1")
    assert sim.calls("shutdown", "gaming-1") == []

    await until(lambda: hass.states.get(SWITCH_1).state == "on", 15)
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(stopped))
    await until(lambda: idle(entry))
    assert not sim.is_running("gaming-1")


async def test_turned_on_after_its_player_quit_unseen_it_plays_again(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 1 plays; libvirtd restarts under systemd's socket
    activation (away 1.5 s: virsh calls wait for it instead of failing, so
    the switch stays available), and meanwhile its player shuts it down from
    inside: no event reaches Home Assistant, whose last update still shows
    it playing. Its switch is turned on then: the tower is asked afresh
    (the answer waits for libvirtd), the VM is found off, and the handoff
    starts it. Taking the stale update's word would have done nothing, and
    the cards would then have gone back."""
    failed, _ = await _playing(hass, entry, sim)
    handed = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    controller = entry.runtime_data.controller
    sim.restart_libvirtd(150.0, socket_activated=True)  # 1.5 s here
    sim.guest_shutdown("gaming-1")
    await until(lambda: not sim.is_running("gaming-1"))
    assert hass.states.get(SWITCH_1).state == "on"  # the last update's word
    assert controller.desired == {"gaming-1"}

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(handed) or bool(failed), 10)
    await until(lambda: idle(entry) and not controller.requests)
    assert failed == []
    assert sim.is_running("gaming-1")
    assert not sim.is_running("gpu-node")
    assert controller.desired == {"gaming-1"}
