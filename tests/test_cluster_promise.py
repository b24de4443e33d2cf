"""The cluster is not ours: stories of what GPU Handoff must never do to it.

Each story runs the whole product (Home Assistant with the integration, sshd
forcing the real agent on the tower simulator, the Kubernetes API emulator
over HTTPS) and checks a promise: no pod lost that kubectl drain would keep
(k8s.io/kubectl pkg/drain/filters.go), no operator's cordon lifted, no GPU
node started that someone shut down on purpose, no operation left hanging
after an unexpected error, and a Handoff state that only moves forward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import datetime as dt
from typing import Any

import asyncssh
from homeassistant.config_entries import ConfigEntryState
from homeassistant.core import Event, EventStateChangedData, HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError
from homeassistant.helpers import issue_registry as ir
from homeassistant.helpers.event import async_track_state_change_event
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff import owned as owned_module
from custom_components.gpu_handoff.cluster_client import CORDON_ANNOTATION
from custom_components.gpu_handoff.const import (
    CONF_EVICT_UNMANAGED,
    CONF_HANDOFF_WHEN_CORDONED,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
)
from custom_components.gpu_handoff.drain import NodeDrain
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.sshd import Sshd
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    play,
    quit_game,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

CORDONED = "binary_sensor.gpu_node_cordoned"
PODS_LEFT = "sensor.gpu_node_pods_left_to_evict"


def _record_states(
    hass: HomeAssistant, entity_id: str, then: Callable[[], None] | None = None
) -> tuple[list[str], Callable[[], None]]:
    """Every state ``entity_id`` is written with, in order (repeats folded),
    and the call that stops recording. ``then`` runs once the writes of the
    same moment are done (the next turn of the loop)."""
    seen: list[str] = []

    @callback
    def record(event: Event[EventStateChangedData]) -> None:
        new = event.data["new_state"]
        if new is not None and (not seen or seen[-1] != new.state):
            seen.append(new.state)
        if then is not None:
            hass.loop.call_soon(then)

    return seen, async_track_state_change_event(hass, [entity_id], record)


def _mark(cluster: K8sEmulator) -> str | None:
    annotations = cluster.get("Node", GPU_NODE, "")["metadata"].get("annotations")
    return (annotations or {}).get(CORDON_ANNOTATION)


def _operator_cordon(cluster: K8sEmulator) -> None:
    """What `kubectl cordon gpu-node` does: spec.unschedulable, no mark."""
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )


async def _set_options(
    hass: HomeAssistant, entry: MockConfigEntry, **options: Any
) -> None:
    """Change options as the options flow does; the entry reloads."""
    hass.config_entries.async_update_entry(entry, options=entry.options | options)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED


async def _restart(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Home Assistant stops and starts again on the same storage."""
    assert await hass.config_entries.async_unload(entry.entry_id)
    await hass.async_block_till_done()
    await setup_entry(hass, entry)


def _managed_pod(cluster: K8sEmulator, name: str, **kwargs: Any) -> None:
    """A pod a ReplicaSet would recreate."""
    if cluster.get("ReplicaSet", "batch", "default") is None:
        cluster.add_replicaset("batch", "default", labels={"app": "batch"}, image="b")
    owner = cluster.owner_ref(cluster.get("ReplicaSet", "batch", "default"))
    cluster.add_pod(name, "default", node=GPU_NODE, owner=owner, **kwargs)


# --- pods that nothing recreates ----------------------------------------------


async def test_a_bare_pod_refuses_the_handoff_until_the_user_allows_it(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """`kubectl run debug` left a pod on the GPU node. kubectl drain refuses it
    without --force (filters.go unreplicatedFilter): the handoff fails before
    any eviction, the cordon is lifted, and the failure names the pod in the
    event, the switch and a repair. With the option on, it is evicted."""
    cluster.add_pod("debug", "default", node=GPU_NODE)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))

    assert failed[0].data["code"] == "unmanaged_pods"
    assert "default/debug" in failed[0].data["error"]
    assert cluster.requests_for(resource="pods/eviction") == []
    assert not cordoned(cluster)
    assert _mark(cluster) is None
    assert sim.calls("shutdown") == []
    assert sim.is_running("gpu-node")
    state = hass.states.get(SWITCH_1)
    assert state.state == "off"
    assert "default/debug" in state.attributes["last_error"]
    issue = ir.async_get(hass).async_get_issue(
        DOMAIN, f"unmanaged_pods_{entry.entry_id}"
    )
    assert issue is not None
    assert issue.translation_placeholders["pods"] == "default/debug"
    assert hass.states.get(HANDOFF).state == "serving"

    await _set_options(hass, entry, **{CONF_EVICT_UNMANAGED: True})
    await play(hass, entry, sim, 1)
    assert cluster.get("Pod", "debug", "default") is None
    assert (
        ir.async_get(hass).async_get_issue(DOMAIN, f"unmanaged_pods_{entry.entry_id}")
        is None
    )


# --- the operator's cordon ----------------------------------------------------


async def test_an_operator_cordon_is_left_on_every_path(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """An administrator cordoned the GPU node. It is shown as theirs, the
    safety net and a restart leave it, the switch refuses (translated) by
    default, and with the option the handoff and the return both leave it."""
    _operator_cordon(cluster)
    await setup_entry(hass, entry)
    state = hass.states.get(HANDOFF)
    assert state.state == "cordoned"
    assert state.attributes["cordoned_by"] == "other"
    assert hass.states.get(CORDONED).state == "on"

    # The safety net sees a Ready, cordoned GPU node with nothing pending.
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await asyncio.sleep(0.5)
    assert cordoned(cluster)
    assert cluster.requests_for(verb="patch", resource="nodes") == []

    with pytest.raises(HomeAssistantError) as err:
        await switch(hass, "turn_on", SWITCH_1)
    assert err.value.translation_key == "cordoned_by_operator"
    assert hass.states.get(SWITCH_1).state == "off"
    assert entry.runtime_data.controller.desired == set()
    assert cluster.requests_for(resource="pods/eviction") == []

    await _restart(hass, entry)
    await asyncio.sleep(0.5)
    assert cordoned(cluster)

    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _set_options(hass, entry, **{CONF_HANDOFF_WHEN_CORDONED: True})
    await play(hass, entry, sim, 1)
    assert cordoned(cluster)
    assert _mark(cluster) is None  # never claimed
    await quit_game(hass, entry, sim, 1)
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))
    assert sim.is_running("gpu-node")
    assert cordoned(cluster)
    assert _mark(cluster) is None
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    assert hass.states.get(HANDOFF).state == "cordoned"
    assert hass.states.get(HANDOFF).attributes["cordoned_by"] == "other"
    assert not any(
        request.body
        and (request.body.get("spec") or {}).get("unschedulable") is None
        and "unschedulable" in (request.body.get("spec") or {})
        for request in cluster.requests_for(verb="patch", resource="nodes")
    )


async def test_a_cordon_placed_during_a_handoff_is_kept_by_the_return(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Our cordon is marked; when the cards come back only that mark's cordon
    is lifted. The node's mark is gone afterwards, the node schedulable."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    assert cordoned(cluster)
    assert _mark(cluster) == "handoff to gaming-1"
    assert hass.states.get(HANDOFF).attributes["cordoned_by"] in ("gpu_handoff", None)
    await quit_game(hass, entry, sim, 1)
    await until(lambda: not cordoned(cluster))
    assert _mark(cluster) is None


async def test_an_operator_cordon_after_an_operator_uncordon_is_not_taken_for_ours(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Found by ``scripts/chaos --cycles 200 --seed 1`` (cycle 191): while a
    player plays, an operator lifts GPU Handoff's cordon (`kubectl uncordon`
    changes spec.unschedulable only, so the mark stays) and later cordons the
    node again (`kubectl cordon`, no mark either). The mark seen on a node
    nobody cordons is removed at once, so the operator's later cordon is
    theirs, and the return leaves it."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    assert _mark(cluster) == "handoff to gaming-1"
    cluster.modify(  # kubectl uncordon gpu-node
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=False),
    )
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: _mark(cluster) is None)
    _operator_cordon(cluster)
    await quit_game(hass, entry, sim, 1)
    await until(lambda: sim.is_running("gpu-node"))
    await until(lambda: idle(entry))
    assert cordoned(cluster)
    assert _mark(cluster) is None
    assert hass.states.get(HANDOFF).attributes["cordoned_by"] == "other"


# --- a GPU node shut down on purpose --------------------------------------------


async def test_a_gpu_node_shut_down_by_hand_stays_off(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, cluster: K8sEmulator
) -> None:
    """Nobody plays and someone shuts the GPU node down for maintenance: it
    stays off (shown as off) through refreshes and a restart, until the
    return_cards action brings it back."""
    started = async_capture_events(hass, EVENT_HANDOFF_STARTED)
    await setup_entry(hass, entry)
    sim.guest_shutdown("gpu-node")
    await until(lambda: not sim.is_running("gpu-node"))
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await until(lambda: hass.states.get(HANDOFF).state == "off")
    await asyncio.sleep(0.5)
    await _restart(hass, entry)
    await asyncio.sleep(0.5)
    assert not sim.is_running("gpu-node")
    assert started == []
    assert hass.states.get(HANDOFF).state == "off"
    assert sim.calls("start", "gpu-node") == []

    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await hass.services.async_call(
        DOMAIN, "return_cards", {"config_entry_id": entry.entry_id}, blocking=True
    )
    await until(lambda: bool(returned))
    assert sim.is_running("gpu-node")


async def test_a_game_session_ending_returns_the_cards_once(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The edge: the player shuts the game down from inside; the cards come
    back once. Shutting the GPU node down afterwards by hand is then left."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    sim.guest_shutdown("gaming-1")
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))
    assert sim.is_running("gpu-node")
    sim.guest_shutdown("gpu-node")
    await until(lambda: not sim.is_running("gpu-node"))
    await entry.runtime_data.coordinator.async_refresh()
    await asyncio.sleep(0.5)
    assert not sim.is_running("gpu-node")
    assert len(returned) == 1


# --- a cluster having a bad moment -------------------------------------------


async def test_a_cluster_having_a_bad_moment_does_not_abort_the_handoff(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
    no_pdb: None,
) -> None:
    """Throttled node reads (APF 429), a 504 on the cordon that was applied
    anyway, 500 and 503 on evictions, a 503 while waiting for a pod: all
    retried inside the drain timeout; the handoff completes and our cordon is
    still recognised as ours when the cards come back."""
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1,), drain_timeout=30)
    await setup_entry(hass, entry)
    cluster.throttle(1, verb="get", resource="nodes", retry_after=0)
    cluster.throttle(1, verb="patch", resource="nodes", status=504, applied=True)
    cluster.fail_next(1, 500, resource="pods/eviction")
    cluster.fail_next(1, 503, resource="pods/eviction")
    cluster.fail_next(1, 503, verb="get", resource="pods")
    await play(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert _mark(cluster) == "handoff to gaming-1"
    await quit_game(hass, entry, sim, 1)
    await until(lambda: not cordoned(cluster))


# --- kubelet gone -------------------------------------------------------------


async def test_a_dead_kubelet_does_not_fail_the_handoff(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node's kubelet stopped reporting: an evicted pod stays
    Terminating for ever. As with kubectl's --skip-wait-for-delete-timeout, a
    pod whose deletion is overdue by the bound counts as gone."""
    monkeypatch.setattr(owned_module, "SKIP_WAIT", 0.5)
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1,), drain_timeout=20)
    await setup_entry(hass, entry)
    _managed_pod(cluster, "stuck-1")
    # The API server sets deletionTimestamp to now + the pod's grace period;
    # the bound counts from then. Short grace periods keep the story short.
    for pod in cluster.list_objects("Pod"):
        if pod["spec"].get("nodeName") == GPU_NODE:
            cluster.modify(
                "Pod",
                pod["metadata"]["name"],
                pod["metadata"]["namespace"],
                mutate=lambda pod: pod["spec"].update(terminationGracePeriodSeconds=1),
            )
    # The kubelet dies: evicted pods stay Terminating (the emulator follows
    # the API server here: only a kubelet finishes a scheduled pod).
    cluster.set_node_up(GPU_NODE, up=False)
    await play(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")
    assert cluster.get("Pod", "stuck-1", "default")["metadata"]["deletionTimestamp"]


# --- never stuck --------------------------------------------------------------


class _UnexpectedError(Exception):
    """An error of a type no step expects."""


def _fail_once(
    target: Any, name: str, error: BaseException, verb: str | None = None
) -> list[bool]:
    """Make ``target.name`` raise ``error`` on its next call only (with
    ``verb``: its next call whose first argument is ``verb``)."""
    original = getattr(target, name)
    hit: list[bool] = []

    async def failing(*args: Any, **kwargs: Any) -> Any:
        if not hit and (verb is None or (args and args[0] == verb)):
            hit.append(True)
            raise error
        return await original(*args, **kwargs)

    setattr(target, name, failing)
    return hit


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("cordon", _UnexpectedError("cordon")),
        (
            "drain",
            ExceptionGroup("evictions", [ValueError("a"), KeyError("b")]),
        ),
        # The tower job's submission meets an error no step expects.
        ("request", asyncssh.ProtocolError("a disconnect of a kind nobody listed")),
        ("request", KeyError("job")),
    ],
)
async def test_an_unexpected_error_ends_the_handoff_cleanly(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    where: str,
    error: BaseException,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception of any type at a step ends the operation: failed event,
    last_error, repair, nothing pending, the switch back to the truth, our
    cordon lifted; the next request works."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    coordinator = entry.runtime_data.coordinator
    target: Any = coordinator.tower if where == "request" else coordinator.cluster
    name = where
    if where == "drain":
        # The drain's own run (restored after the test).
        monkeypatch.setattr(NodeDrain, "run", NodeDrain.run)
        target, name = NodeDrain, "run"
    hit = _fail_once(target, name, error, "handoff" if where == "request" else None)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))
    assert hit
    controller = entry.runtime_data.controller
    assert controller.requests == {}
    assert controller.plan is None
    assert hass.states.get(SWITCH_1).state == "off"
    assert hass.states.get(SWITCH_1).attributes["last_error"]
    assert ir.async_get(hass).async_get_issue(
        DOMAIN, f"handoff_failed_{entry.entry_id}_gaming-1"
    )
    await until(lambda: not cordoned(cluster))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")

    await play(hass, entry, sim, 1)
    assert not sim.is_running("gpu-node")


async def test_an_unexpected_error_during_the_return_is_caught_by_the_net(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The uncordon after a return raises something odd: the return fails
    cleanly, and the safety net lifts our own cordon afterwards."""
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    _fail_once(
        entry.runtime_data.coordinator.cluster, "uncordon", _UnexpectedError("uncordon")
    )
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: sim.is_running("gpu-node"))
    await until(lambda: not cordoned(cluster))
    await until(lambda: idle(entry))
    assert _mark(cluster) is None
    assert entry.runtime_data.controller.requests == {}


async def test_the_session_survives_an_unexpected_error(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever ends the agent session, it comes back (with backoff) and
    diagnostics says whether it is connected."""
    monkeypatch.setattr(
        "custom_components.gpu_handoff.session.WATCH_BACKOFF_START", 0.05
    )
    await setup_entry(hass, entry)
    coordinator = entry.runtime_data.coordinator
    await until(lambda: entry.runtime_data.session.connected)
    original = coordinator.tower.open_session
    calls: list[int] = []

    async def open_session(on_push: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise _UnexpectedError("a bug in the session")
        return await original(on_push)

    coordinator.tower.open_session = open_session  # type: ignore[method-assign]
    # End the running session: the next one fails, the one after works.
    await coordinator.tower.close()
    await until(lambda: len(calls) >= 2 and entry.runtime_data.session.connected)
    sim.guest_shutdown("gpu-node")
    await until(lambda: hass.states.get(HANDOFF).state == "off")


# --- removal ------------------------------------------------------------------


async def test_removing_the_entry_mid_handoff(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
    hass_storage: dict[str, Any],
) -> None:
    """The entry is removed while the drain waits on a budget: the operation
    stops, our cordon is lifted (the GPU node still serves) and the stored
    state is deleted. Nothing on the tower was stopped."""
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1,), drain_timeout=60)
    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller
    await switch(hass, "turn_on", SWITCH_1)
    await until(
        lambda: (
            controller.progress.drain is not None
            and controller.progress.drain.evictions_refused > 0
        )
    )
    assert cordoned(cluster)
    assert f"{DOMAIN}.{entry.entry_id}" in hass_storage
    assert await hass.config_entries.async_remove(entry.entry_id)
    await hass.async_block_till_done()
    assert not cordoned(cluster)
    assert _mark(cluster) is None
    assert f"{DOMAIN}.{entry.entry_id}" not in hass_storage
    assert sim.is_running("gpu-node")
    assert sim.calls("shutdown") == []


async def test_removing_the_entry_while_its_job_stops_the_gpu_node(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
    no_pdb: None,
) -> None:
    """The entry is removed while the handoff's tower job shuts the GPU node
    down (the guest takes its time): the GPU node still runs, but the job
    will stop it, so GPU Handoff's cordon stays (lifting it would send pods
    to a node going down). The job goes on without Home Assistant."""
    # Ten minutes at the tests' time scale: it cannot end while the test looks.
    sim.set_shutdown_duration("gpu-node", 60000.0)
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1,))
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(sim.calls("shutdown", "gpu-node")))
    assert sim.is_running("gpu-node")
    assert cordoned(cluster)
    assert await hass.config_entries.async_remove(entry.entry_id)
    await hass.async_block_till_done()
    assert sim.is_running("gpu-node")  # still shutting down, its job running
    assert cordoned(cluster)
    assert _mark(cluster) is not None
    sim.advance(600.0)  # the job ends as it would without Home Assistant
    await until(lambda: sim.is_running("gaming-1"))


async def _both_play_then_gaming_2_is_removed(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    """Both play; Gaming station 2 is removed from Home Assistant (its VM
    keeps running)."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await play(hass, entry, sim, 2)
    subentry = next(
        sub_id
        for sub_id, sub in entry.subentries.items()
        if sub.unique_id == "gaming-2"
    )
    assert hass.config_entries.async_remove_subentry(entry, subentry)
    await hass.async_block_till_done()


async def test_a_removed_gaming_vm_leaves_the_desired_set(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Both play; Gaming station 2 is removed from Home Assistant (its VM
    keeps running: its session goes on until it stops) and later stops. It
    leaves the desired set then, and does not block the return when Gaming
    station 1's session ends."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _both_play_then_gaming_2_is_removed(hass, entry, sim)
    assert entry.state is ConfigEntryState.LOADED
    controller = entry.runtime_data.controller
    assert controller.desired == {"gaming-1", "gaming-2"}
    sim.guest_shutdown("gaming-2")
    await until(lambda: not sim.is_running("gaming-2"))
    await entry.runtime_data.coordinator.async_refresh()
    await until(lambda: controller.desired == {"gaming-1"})
    await quit_game(hass, entry, sim, 1)
    await until(lambda: bool(returned))
    assert sim.is_running("gpu-node")


async def test_a_stop_that_outlives_the_other_player_returns_the_cards(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Both play, and Gaming station 2 is no longer in Home Assistant. Gaming
    station 1 is turned off while Gaming station 2 still runs (so its stop is
    a plain stop), and Gaming station 2 shuts down while that stop runs. The
    session GPU Handoff knew of ended with nobody playing: the cards go back.
    (Found as a rare timeout of the test above: the stop had begun from a
    view in which Gaming station 2 still ran.)"""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await _both_play_then_gaming_2_is_removed(hass, entry, sim)
    sim.set_shutdown_duration("gaming-1", 300.0)  # 3 s here
    await switch(hass, "turn_off", SWITCH_1)
    controller = entry.runtime_data.controller
    await until(lambda: controller.progress.pending_job is not None)
    sim.guest_shutdown("gaming-2")
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert not sim.is_running("gaming-2")
    await until(lambda: not cordoned(cluster))


async def test_removing_a_gaming_vm_mid_handoff_ends_it_safely(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
) -> None:
    """Gaming station 2 is removed while its handoff drains (a budget refuses):
    the reload stops the operation; the new start does not resume it for a VM
    that is gone but ends it at that safe point: our cordon lifted (the GPU
    node still serves), nothing pending or desired, nothing stopped."""
    entry = add_tower_entry(hass, sim_sshd, cluster, vms=(1, 2), drain_timeout=60)
    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller
    await switch(hass, "turn_on", SWITCH_2)
    await until(
        lambda: (
            controller.progress.drain is not None
            and controller.progress.drain.evictions_refused > 0
        )
    )
    assert _mark(cluster) == "handoff to gaming-2"
    subentry = next(
        sub_id
        for sub_id, sub in entry.subentries.items()
        if sub.unique_id == "gaming-2"
    )
    assert hass.config_entries.async_remove_subentry(entry, subentry)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    controller = entry.runtime_data.controller
    await until(lambda: controller.plan is None and not cordoned(cluster))
    assert _mark(cluster) is None
    assert controller.desired == set()
    assert sim.is_running("gpu-node")
    assert sim.calls("shutdown") == []
    assert hass.states.get(SWITCH_2) is None or hass.states.get(SWITCH_2).state in (
        "unavailable",
        "off",
    )


async def test_a_request_that_cannot_be_stored_is_not_left_showing(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    """The desired state cannot be written (a full disk): the request fails,
    the switch does not keep showing it, and nothing was started."""
    await setup_entry(hass, entry)
    controller = entry.runtime_data.controller

    async def full_disk(data: Any) -> None:
        raise OSError(28, "No space left on device")

    controller.state._store.async_save = full_disk  # type: ignore[method-assign]
    with pytest.raises(OSError, match="No space"):
        await switch(hass, "turn_on", SWITCH_1)
    await hass.async_block_till_done()
    assert controller.requests == {}
    assert hass.states.get(SWITCH_1).state == "off"
    assert sim.calls("shutdown") == []


# --- what the user sees --------------------------------------------------------


async def test_every_handoff_state_in_order_and_in_agreement(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The Handoff state through a handoff is exactly serving, draining,
    stopping, off; through a return off, starting, joining, serving (never
    back). After each write, Cordoned and Pods left agree with its attributes."""
    await setup_entry(hass, entry)
    disagreements: list[str] = []

    def check() -> None:
        state = hass.states.get(HANDOFF)
        cordon = hass.states.get(CORDONED)
        pods = hass.states.get(PODS_LEFT)
        if state is None or cordon is None or pods is None:
            return
        if (
            state.attributes["cordoned"] is not None
            and (cordon.state == "on") != (state.attributes["cordoned"])
        ):
            disagreements.append(f"cordoned {cordon.state} vs {state.attributes}")
        if state.attributes["pods_left"] is not None and pods.state != str(
            state.attributes["pods_left"]
        ):
            disagreements.append(f"pods {pods.state} vs {state.attributes}")

    seen, unsubscribe = _record_states(hass, HANDOFF, check)
    try:
        assert hass.states.get(HANDOFF).state == "serving"
        await play(hass, entry, sim, 1)
        await until(lambda: bool(seen) and seen[-1] == "off")
        assert seen == ["draining", "stopping", "off"]
        seen.clear()
        await quit_game(hass, entry, sim, 1)
        await until(lambda: bool(seen) and seen[-1] == "serving")
        assert seen == ["starting", "joining", "serving"]
    finally:
        unsubscribe()
    assert disagreements == []


async def test_the_lease_age_is_its_real_age(
    hass: HomeAssistant, entry: MockConfigEntry, cluster: K8sEmulator
) -> None:
    """A lease renewed 20 s ago reads as about 20 s (not clamped, not negative)."""
    await setup_entry(hass, entry)
    cluster.set_node_up(GPU_NODE, up=False)  # renewals stop
    renewed = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=20)
    cluster.modify(
        "Lease",
        GPU_NODE,
        "kube-node-lease",
        mutate=lambda lease: lease["spec"].update(
            renewTime=renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        ),
    )
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    age = hass.states.get(HANDOFF).attributes["lease_age"]
    assert 19.5 <= age <= 25


async def test_a_queued_request_shows_at_once(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    no_pdb: None,
) -> None:
    """A second gaming VM asked for while the first handoff runs: its switch
    shows on at once, before its operation has taken a step."""
    await setup_entry(hass, entry)
    await switch(hass, "turn_on", SWITCH_1)
    await switch(hass, "turn_on", SWITCH_2)
    assert hass.states.get(SWITCH_2).state == "on"
    operation = entry.runtime_data.controller.progress.operation
    assert operation is None or operation.vm == "gaming-1"
    await until(lambda: sim.is_running("gaming-2") and sim.is_running("gaming-1"))
    await until(lambda: idle(entry))


async def test_a_stop_started_on_the_tower_shows_stopping_and_stays(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower
) -> None:
    """Someone asks the agent on the tower to stop the GPU node while nobody
    plays: Home Assistant shows `stopping` while the job runs (the agent's
    job arguments are read as it sends them), then `off`, and leaves it off."""
    sim.set_shutdown_duration("gpu-node", 300.0)  # 3 s at the sim's pace
    started = async_capture_events(hass, EVENT_HANDOFF_STARTED)
    await setup_entry(hass, entry)
    seen, unsubscribe = _record_states(hass, HANDOFF)
    try:
        await entry.runtime_data.coordinator.tower.call("stop", "gpu-node")
        await until(lambda: "off" in seen)
    finally:
        unsubscribe()
    assert "stopping" in seen
    assert seen.index("stopping") < seen.index("off")
    await asyncio.sleep(0.5)
    assert not sim.is_running("gpu-node")
    assert started == []
