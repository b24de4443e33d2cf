"""The chaos harness in the normal suite: a few seeds, and the harness tested.

The fixed seeds run 30 cycles in all (the soak of tests/chaos/chaos_soak.py
on a small scale). The harness is itself tested: a deliberately broken product
(a controller that never lifts its cordon, an agent that stops a guest before
its guest agent answers) must make it report exactly the invariant that the
breakage breaks. Bugs the soak found are kept as regression cases, each with
the seed and cycle that found it and a short plan that reproduces it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
import sys
import time
from typing import Any

from homeassistant.core import HomeAssistant
from kubernetes_asyncio.client import CoreV1Api, V1Eviction, V1ObjectMeta
import pytest

from custom_components.gpu_handoff.cluster_client import ClusterClient
from custom_components.gpu_handoff.cluster_model import DrainProgress
from custom_components.gpu_handoff.drain import NodeDrain
from custom_components.gpu_handoff.runner import OperationRunner
from tests.chaos import harness
from tests.chaos.harness import (
    DISABLED_FAULTS,
    EARLY_MOMENTS,
    FAULTS,
    FIXED_MOMENTS,
    FOLLOW_WITHIN,
    HOLD_LATE,
    HOLD_SECONDS,
    LIBVIRT_AGENT_WAIT,
    LIBVIRTD_DOWN,
    MOMENTS,
    MONITORING_NS,
    PREPARE_REQUESTS,
    REQUESTS,
    SLOW_STOP,
    TOLERANT,
    Fault,
    Plan,
    Violation,
    own_lags,
    plan_cycle,
    run_soak,
)
from tests.k8semu import K8sEmulator
from tests.k8semu.auth import PRODUCT_RULES, rule
from tests.support.agentbuild import agent_variant
from tests.support.simtower import install_hook
from tests.towersim import Tower, model as sim_model, realistic_tower

# (seed, cycles, lend): 30 cycles in all, about two minutes; two with the
# tower lending its free cards while someone plays. Each draws a player
# starting (the other gaming VM's switch turned on) while a return waits for
# the GPUs, at ``gpu_wait``: seed 73 in two returns of both players quitting,
# beside a libvirtd restart there and the operator's shutdown mid-drain;
# seed 58 in a return beside the PodDisruptionBudget refusing and a pod
# nothing recreates at ``gpu_wait`` (a guest's slow shutdown there in
# another), with two prepares (one failed, the PodDisruptionBudget refusing
# past the drain timeout; one turned on within its hold); with lending, seed
# 768 in the lend restarts after two handoffs (and an entry reload at
# ``gpu_wait`` of a ``return_cards``, a libvirtd restart mid-job, starts
# failing after the hook) and seed 122 in a return and a start by hand (the
# operator's shutdown mid-drain), after a prepare turned on within its hold
# (libvirt away mid-job, the GPU node slow to shut down); as they drew once
# prepare cycles joined (a prepare's boots shift the device plugin's delays,
# drawn boot after boot, for the cycles after it). Whether a return gets to
# ``gpu_wait`` depends on the device plugin's delay drawn at each boot
# against the product's pace (in the 200-cycle soak a third to a half of
# the returns do), so the fixed plans below pin the delay and make these
# faults strike, ``hand_start`` among them (a start by hand whose stop of
# the GPU node is over before its GPUs register: a product bug found this
# way, kept below as a regression case).
CI_SEEDS = ((73, 8, False), (58, 8, False), (768, 7, True), (122, 7, True))
# A correct product settles within seconds; a broken one need not be waited
# for as long as the soak waits (2 minutes).
SHORT_BOUND = 15.0


@pytest.fixture(autouse=True)
async def enable_event_loop_debug() -> None:
    """As in the soak: Home Assistant's loop without asyncio's debug mode."""
    asyncio.get_running_loop().set_debug(False)


def _invariants(summary: dict[str, Any]) -> list[tuple[int, str]]:
    return sorted({(v["cycle"], v["invariant"]) for v in summary["violations"]})


async def _replay(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    plans: list[Plan],
    settle_bound: float = SHORT_BOUND,
    **options: Any,
) -> dict[str, Any]:
    """Run these plans (seed 0) with the short settle bound unless told; the
    summary."""
    return await run_soak(
        hass,
        k8s_emulator,
        tmp_path / "chaos",
        seed=0,
        plans=plans,
        settle_bound=settle_bound,
        **options,
    )


def test_plans_are_seeded() -> None:
    """The same seed and cycle give the same plan; seeds differ; over many
    cycles every request kind, fault kind and moment is drawn."""
    assert plan_cycle(7, 3) == plan_cycle(7, 3)
    assert [plan_cycle(7, c) for c in range(1, 30)] != [
        plan_cycle(8, c) for c in range(1, 30)
    ]
    plans = [plan_cycle(1, cycle) for cycle in range(1, 201)]
    assert {plan.request for plan in plans} == set(REQUESTS) | set(PREPARE_REQUESTS)
    faults = [fault for plan in plans for fault in plan.faults]
    assert {fault.kind for fault in faults} == set(FAULTS) - DISABLED_FAULTS
    assert {fault.moment for fault in faults} == set(MOMENTS)
    assert all(len(plan.faults) <= 3 for plan in plans)
    assert all(
        len({fault.kind for fault in plan.faults}) == len(plan.faults) for plan in plans
    )
    assert all(
        fault.moment == FIXED_MOMENTS[fault.kind]
        for fault in faults
        if fault.kind in FIXED_MOMENTS
    )
    assert all(
        fault.moment in EARLY_MOMENTS[fault.kind]
        for fault in faults
        if fault.kind in EARLY_MOMENTS
    )


def test_prepares_are_drawn_apart_within_their_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A share of the cycles prepare a gaming VM, each follow-up drawn, with
    a hold of a few seconds and the follow-up within its first half (none
    for a hold left to expire); a start failing targets the VM the cycle
    starts. Drawn from a generator of their own: every other cycle is the
    plan it was before prepare joined the alphabet."""
    plans = [plan_cycle(seed, c) for seed in (1, 2) for c in range(1, 301)]
    prepares = [plan for plan in plans if plan.prepares]
    assert 0.15 < len(prepares) / len(plans) < 0.35
    assert {plan.request for plan in prepares} == set(PREPARE_REQUESTS)
    assert all(plan.vm in ("gaming-1", "gaming-2") for plan in prepares)
    assert all(HOLD_SECONDS[0] <= plan.hold <= HOLD_SECONDS[1] for plan in prepares)
    assert all(
        0.0 <= plan.then_after <= plan.hold * FOLLOW_WITHIN[1] + 0.05
        for plan in prepares
    )
    assert all(
        plan.then_after == 0.0 for plan in prepares if plan.follow_up == "expire"
    )
    assert {fault.moment for plan in prepares for fault in plan.faults} == set(MOMENTS)
    for plan in prepares:
        for fault in plan.faults:
            if fault.kind == "start_fails":
                other = plan.follow_up == "other_on"
                assert (fault.get("target") == plan.vm) is not other
    assert all(plan.as_json()["hold_s"] == plan.hold for plan in prepares)
    monkeypatch.setattr(harness, "PREPARE_ODDS", 0.0)
    assert [plan for plan in plans if not plan.prepares] == [
        plan_cycle(plan.seed, plan.cycle) for plan in plans if not plan.prepares
    ]


def test_the_new_faults_are_drawn_within_their_bounds() -> None:
    """A slow graceful stop lasts longer than libvirt's agent-shutdown wait
    (60 s at the rig's pace) and less than the agent's shutdown timeout; a
    race with the player targets the request's gaming VM; a libvirtd restart
    lasts a drawn while, socket-activated or not."""
    assert LIBVIRT_AGENT_WAIT < SLOW_STOP[0] < SLOW_STOP[1] < 3.0
    faults = [
        (plan, fault)
        for seed in (1, 2)
        for plan in (plan_cycle(seed, cycle) for cycle in range(1, 301))
        for fault in plan.faults
    ]
    slow = [fault for _, fault in faults if fault.kind == "slow_graceful_stop"]
    assert slow
    assert all(SLOW_STOP[0] <= fault.get("seconds") <= SLOW_STOP[1] for fault in slow)
    assert {fault.get("target") for fault in slow} == {
        "gpu-node",
        "gaming-1",
        "gaming-2",
    }
    races = [(p, f) for p, f in faults if f.kind == "guest_quits_racing_stop"]
    assert races
    assert all(fault.get("target") == plan.vm for plan, fault in races if plan.vm)
    restarts = [fault for _, fault in faults if fault.kind == "libvirtd_restart"]
    assert restarts
    assert all(
        LIBVIRTD_DOWN[0] <= fault.get("seconds") <= LIBVIRTD_DOWN[1]
        for fault in restarts
    )
    assert {fault.get("socket_activated") for fault in restarts} == {True, False}


def test_a_violation_replays_with_every_option_of_its_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replay line of a violation carries the run's options: ``--lend``
    for a lending run, the loop lag limit when it is not the default."""
    monkeypatch.delenv("GPU_HANDOFF_CHAOS_LAG_LIMIT", raising=False)
    plain = Violation(3, 7, "half_state", "detail")
    assert plain.as_json()["replay"] == "scripts/chaos --cycles 7 --seed 3"
    # The replay line gives the cycle's plan again: its faults, drawn from
    # the seed and the cycle alone, the new ones with their parameters.
    plan = plan_cycle(3, 7)
    assert plan == plan_cycle(3, 7)
    faulty = Violation(
        3, 7, "half_state", "detail", request=plan.request, faults=plan.faults
    )
    assert faulty.as_json()["faults"] == [fault.as_json() for fault in plan.faults]
    lending = Violation(3, 7, "cards_not_lent", "detail", lend=True)
    assert lending.as_json()["replay"] == "scripts/chaos --lend --cycles 7 --seed 3"
    monkeypatch.setenv("GPU_HANDOFF_CHAOS_LAG_LIMIT", "2")
    assert lending.as_json()["replay"] == (
        "GPU_HANDOFF_CHAOS_LAG_LIMIT=2 scripts/chaos --lend --cycles 7 --seed 3"
    )


@pytest.mark.early
@pytest.mark.parametrize(("seed", "cycles", "lend"), CI_SEEDS)
async def test_fixed_seeds(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    seed: int,
    cycles: int,
    lend: bool,
) -> None:
    """A few seeded cycles of the soak: no invariant breaks."""
    summary = await run_soak(
        hass, k8s_emulator, tmp_path / "chaos", seed=seed, cycles=cycles, lend=lend
    )
    assert summary["cycles"] == cycles
    assert summary["violations"] == []


# --- the harness notices a broken product ---------------------------------------


async def test_a_controller_that_skips_the_uncordon_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU Handoff never lifts its own cordon: after the return the GPU node
    serves, still cordoned by GPU Handoff."""

    async def skip(self: ClusterClient, name: str) -> bool:
        return False

    monkeypatch.setattr(ClusterClient, "uncordon", skip)
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(0, 2, "off", "gaming-1"),
    ]
    summary = await _replay(
        hass, k8s_emulator, tmp_path, plans, cordon_bound=3.0, recover=False
    )
    assert (2, "own_cordon_outlives") in _invariants(summary)
    assert {cycle for cycle, _ in _invariants(summary)} == {2}


async def test_a_shutdown_right_after_an_answered_ping_is_cleared_by_it(
    tmp_path: Path,
) -> None:
    """``stop_before_guest_agent``: a shutdown sent just after a guest-ping
    answered, the guest having let its agent go in between (found by
    ``scripts/chaos --lend --cycles 60 --seed 4711``: a player quitting, the
    operator's shutdown from inside), is the race libvirt settles; one sent
    later, or without such a ping, or after a ping of an earlier boot, is
    not cleared."""
    sim = realistic_tower(tmp_path / "sim", time_scale=harness.TIME_SCALE)
    sim.set_shutdown_duration(harness.GPU, 500.0)  # going down for 5 s

    def state() -> dict[str, Any]:
        with sim_model.locked(sim.state_dir, exclusive=False):
            return sim_model.load(sim.state_dir)

    def connected() -> bool:
        data = state()
        return (
            sim_model.world(data, at=sim_model.now(data))
            .doms[harness.GPU]
            .agent_connected
        )

    deadline = time.monotonic() + 10
    while not connected():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    data = state()
    pinged = sim_model.now(data)
    sim.guest_shutdown(harness.GPU)  # the agent goes at once; the domain runs on
    data = state()
    gone = sim_model.now(data)
    soon = gone + 0.05
    assert sim_model.world(data, at=soon).doms[harness.GPU].running
    assert not sim_model.world(data, at=soon).doms[harness.GPU].agent_connected
    assert harness.cleared_by_ping(data, [pinged], harness.GPU, soon)
    late = pinged + harness.PING_TO_SHUTDOWN + 0.5
    assert sim_model.world(data, at=late).doms[harness.GPU].running
    assert not harness.cleared_by_ping(data, [pinged], harness.GPU, late)
    assert not harness.cleared_by_ping(data, [], harness.GPU, soon)
    # a ping that answered before the agent had connected cannot have
    assert not harness.cleared_by_ping(data, [pinged - 100.0], harness.GPU, soon)
    # nor one answered after the agent was gone (impossible; the replay says so)
    assert not harness.cleared_by_ping(data, [gone + 0.01], harness.GPU, soon)


def test_a_lag_the_canary_shared_is_the_machines_not_the_loops() -> None:
    """own_lags: a loop sample keeps only the part of its lag that no
    overlapping canary sleep had; a sample the canary did not overlap keeps
    it all; canary sleeps that ended before it began or began after it
    woke do not count."""
    period = 0.01
    samples = [
        (0.0, 0.6),  # 0.00-0.61: the canary was 0.55 late within it
        (1.0, 0.7),  # 1.00-1.71: the canary on time
        (3.0, 0.4),  # 3.00-3.41: no canary sleep overlaps it
    ]
    canary = [
        (0.0, 0.55),  # 0.00-0.56
        (0.56, 0.0),
        (0.9, 0.8),  # 0.90-1.71: woke after 1.00: overlaps the second
        (1.2, 0.001),
        (2.0, 0.9),  # 2.00-2.91: ended before the third began
        (3.5, 0.9),  # began after the third woke
    ]
    own = own_lags(samples, canary, period)
    assert own == pytest.approx([0.05, 0.0, 0.4])
    canary[2] = (0.9, 0.05)  # 0.90-0.96: ended before the second began
    own = own_lags(samples, canary, period)
    assert own == pytest.approx([0.05, 0.7 - 0.001, 0.4])
    assert own_lags(samples, [], period) == pytest.approx([0.6, 0.7, 0.4])


async def test_a_product_that_blocks_the_loop_is_caught_on_a_busy_machine(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cordon holds the event loop for 0.8 s (a blocking call in a
    coroutine) while two processes keep both cores busy: the canary thread,
    free while the loop thread sleeps, tells the loop's own lag from the
    machine's, and loop_blocked is reported."""
    cordon = ClusterClient.cordon

    async def blocking_cordon(self: ClusterClient, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.8)  # noqa: ASYNC251 - the bug this test plants
        return await cordon(self, *args, **kwargs)

    monkeypatch.setattr(ClusterClient, "cordon", blocking_cordon)
    hogs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", "while True: pass"
        )
        for _ in range(2)
    ]
    try:
        summary = await _replay(
            hass, k8s_emulator, tmp_path, [Plan(0, 1, "on", "gaming-1")], recover=False
        )
    finally:
        for hog in hogs:
            hog.kill()
            await hog.wait()
    assert (1, "loop_blocked") in _invariants(summary)
    assert summary["loop_lag_own_max_ms"] >= 500


def _agent_without_wait(directory: Path) -> Path:
    """A copy of the agent whose stop does not wait for the guest agent."""
    waits = "            if self.agent_ready(domain):\n"
    return agent_variant(directory, replace=[(waits, "            if True:\n")])


async def test_the_product_reports_no_passing_failure_at_libvirts_blip(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """libvirt is away for a second just as Gaming station 1's stop is
    asked for: no passing failure is reported, and the stop is carried out
    (unless the switch was already unavailable when the harness pressed: the
    session's error can reach Home Assistant first, and then nothing is
    pressed)."""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(
            0,
            2,
            "off",
            "gaming-1",
            (Fault("libvirt_down", "before", (("seconds", 1.0),)),),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    ended = summary["requests_ended"]
    assert _invariants(summary) == []
    assert "failed_transient" not in ended
    assert ended in ({"fulfilled": 2}, {"fulfilled": 1, "unavailable": 1})


@pytest.mark.parametrize(
    ("outages", "violated"),
    [
        ((("libvirt_down", 1.0),), True),
        ((("ssh_cut", None), ("api_down", 3.0)), True),
        ((("libvirt_down", 4.0), ("api_down", 2.0)), False),
    ],
    ids=["one_short_outage", "two_short_outages", "longer_than_the_bound"],
)
def test_a_passing_failure_within_the_retries_bound_is_a_violation(
    outages: tuple[tuple[str, float | None], ...], violated: bool
) -> None:
    """passing_failure_reported, judged on its own (the end-to-end moment is
    a race the harness cannot order): a stop reported failed with
    libvirt_unreachable after outages of 1 s (3 s with the reconnect), or of
    an SSH cut and 3 s of the API server away (7 s), is a violation within
    the drain timeout of 8 s; after 4 s and 2 s of outages (10 s) it is a
    transient failure the product may report. Either way the ask says
    "transient"."""
    faults = tuple(
        Fault(kind, "before", (("seconds", seconds),) if seconds else ())
        for kind, seconds in outages
    )
    rig = harness.ChaosRig.__new__(harness.ChaosRig)
    found: list[str] = []
    rig._events = [
        harness.Seen(
            0.0,
            harness.EVENT_HANDOFF_FAILED,
            {"vm": "gaming-1", "code": "libvirt_unreachable", "error": "down"},
        )
    ]
    rig.records = [
        harness.CycleRecord(
            plan=Plan(0, 2, "off", "gaming-1", faults),
            fired=[fault.kind for fault in faults],
        )
    ]
    rig._violate = lambda invariant, detail, cycle=None: found.append(invariant)
    ask = harness.Ask(
        "gaming-1", "off", "off", status="accepted", detail="failed, reported"
    )
    rig._judge_passing(ask)
    assert found == (["passing_failure_reported"] if violated else [])
    assert ask.detail.endswith("transient")


# --- cards held for a gaming VM (prepare): the invariants judged ------------------

GTX_960, RTX_1, RTX_2 = "0000:01:00", "0000:03:00", "0000:04:00"
UNTIL = 1000.0  # the hold's time, as an epoch


def _hold(
    samples: list[tuple[float, bool]] = (),  # type: ignore[assignment]
    *,
    ended: float | None = None,
    why: str = "expired",
) -> harness.HoldSeen:
    return harness.HoldSeen(
        vm="gaming-1",
        until_text="2026-12-05T10:00:00+00:00",
        until=UNTIL,
        began=UNTIL - 3.0,
        cycle=2,
        ended=ended,
        why=why,
        samples=list(samples),
    )


def _samples(begin: float, end: float, busy: Any = lambda at: False) -> list:
    """GPU Handoff sampled every HOLD_SAMPLE from ``begin`` to ``end``
    (relative to the hold's time), busy where ``busy(at)`` says so."""
    step = harness.HOLD_SAMPLE
    count = round((end - begin) / step)
    return [
        (UNTIL + begin + i * step, bool(busy(begin + i * step)))
        for i in range(count + 1)
    ]


def _judging_rig(found: list[str], *, lend: bool = False) -> harness.ChaosRig:
    """A rig with only what the judges read: nothing seen yet, no operator's
    shutdown, one cycle's record; violations noted in ``found``."""
    rig = harness.ChaosRig.__new__(harness.ChaosRig)
    rig.lend = lend
    rig._events = []
    rig._operator_stops = []
    rig.records = [harness.CycleRecord(plan=Plan(0, 2, "prepare_expire", "gaming-1"))]
    rig._violate = lambda invariant, detail, cycle=None: found.append(invariant)
    return rig


@pytest.mark.parametrize(
    ("hold", "now", "violated"),
    [
        (_hold(_samples(-3.0, 0.3), ended=UNTIL + 0.3), UNTIL + 5, False),
        (_hold(_samples(-3.0, 1.5), ended=UNTIL + 1.5), UNTIL + 5, False),
        (_hold(_samples(-3.0, 3.0), ended=UNTIL + 3.0), UNTIL + 5, True),
        # An operation in flight at the hold's end (a drain under faults):
        # the hold ends soon after it, however long it ran.
        (
            _hold(_samples(-3.0, 5.8, lambda at: at < 5.0), ended=UNTIL + 5.8),
            UNTIL + 9,
            False,
        ),
        (
            _hold(_samples(-3.0, 8.0, lambda at: at < 5.0), ended=UNTIL + 8.0),
            UNTIL + 9,
            True,
        ),
        # Idle for long before its time, busy across it: no overstay.
        (
            _hold(_samples(-3.0, 1.0, lambda at: -0.5 < at < 0.5), ended=UNTIL + 1.0),
            UNTIL + 5,
            False,
        ),
        # Busy and idle by turns, never idle a whole look's period.
        (
            _hold(_samples(-1.0, 6.0, lambda at: at % 1.2 >= 0.9), ended=UNTIL + 6.0),
            UNTIL + 9,
            False,
        ),
        # Still held at the cycle's end, GPU Handoff idle.
        (_hold(_samples(-3.0, 4.0)), UNTIL + 4.0, True),
        (_hold(_samples(-3.0, 1.0)), UNTIL + 1.0, False),
    ],
    ids=[
        "on_time",
        "within_the_bound",
        "late_while_idle",
        "late_behind_an_operation",
        "late_after_the_operation",
        "busy_across_its_time",
        "busy_by_turns",
        "still_held_idle",
        "still_held_within_the_bound",
    ],
)
def test_a_hold_that_outlives_its_time_while_idle_is_a_violation(
    hold: harness.HoldSeen, now: float, violated: bool
) -> None:
    """hold_outlived, judged on its own: once its time is over, a hold ends
    within HOLD_LATE (1.6 s: the controller's look every second, the loop's
    lateness, the sampling) of GPU Handoff being idle; an operation in
    flight at its end delays it by what is left of that operation."""
    found: list[str] = []
    _judging_rig(found)._judge_hold_time(hold, now)
    assert found == (["hold_outlived"] if violated else [])
    assert (harness.hold_overstay(hold, now) > HOLD_LATE) is violated


def _returned(at: float) -> harness.Seen:
    return harness.Seen(0.0, harness.EVENT_CARDS_RETURNED, {"vm": "gpu-node"}, at)


def _failed(at: float) -> harness.Seen:
    return harness.Seen(
        0.0,
        harness.EVENT_HANDOFF_FAILED,
        {"vm": "gpu-node", "kind": "return", "code": "start_failed"},
        at,
    )


EVERY_CARD = {GTX_960, RTX_1, RTX_2}


@pytest.mark.parametrize(
    ("facts", "events", "violated"),
    [
        ({}, [_returned(UNTIL + 2)], False),
        ({"running": set(), "gpu_cards": set()}, [_returned(UNTIL + 2)], True),
        ({"gpu_cards": {GTX_960, RTX_2}}, [_returned(UNTIL + 2)], True),
        ({"ready": False}, [_returned(UNTIL + 2)], True),
        ({"cordon": "gpu-handoff"}, [_returned(UNTIL + 2)], True),
        ({}, [], True),
        ({}, [_returned(UNTIL - 5)], True),
        # Excused: someone plays (the cards went on to them), the return
        # failed and said so.
        ({"running": {"gaming-2"}, "gpu_cards": set()}, [], False),
        ({"running": set(), "gpu_cards": set()}, [_failed(UNTIL + 1)], False),
        # A failure before the hold's end excuses nothing after it.
        ({"running": set(), "gpu_cards": set()}, [_failed(UNTIL - 5)], True),
    ],
    ids=[
        "back",
        "gpu_node_off",
        "without_the_held_card",
        "not_ready",
        "cordon_left",
        "no_cards_returned",
        "cards_returned_before_the_end",
        "someone_plays",
        "return_failed_reported",
        "failure_before_the_end",
    ],
)
def test_cards_not_back_after_an_expired_hold_is_a_violation(
    facts: dict[str, Any], events: list[harness.Seen], violated: bool
) -> None:
    """cards_not_back_after_hold, judged on its own: the hold for Gaming
    station 1 expired (at its time); by the cycle's end the GPU node runs
    with every card, Ready, GPU Handoff's cordon gone, cards_returned fired
    after the hold's end; else a violation, unless someone plays or a
    failure was reported after it."""
    found: list[str] = []
    rig = _judging_rig(found)
    rig._events = events
    world = {
        "running": {"gpu-node"},
        "gpu_cards": EVERY_CARD,
        "held": {RTX_1},
        "ready": True,
        "cordon": None,
    } | facts
    rig._judge_cards_back(_hold(ended=UNTIL), **world)
    assert found == (["cards_not_back_after_hold"] if violated else [])


def test_the_operators_shutdown_excuses_the_cards_after_a_hold() -> None:
    """The operator shut the GPU node down after the hold ended unused (a
    shutdown still standing): it stays off, no violation; once the cards
    were asked back since, it is one."""
    found: list[str] = []
    rig = _judging_rig(found)
    stop = harness.OperatorStop(cycle=2, at=UNTIL + 1)
    rig._operator_stops = [stop]
    off = {"running": set(), "gpu_cards": set(), "held": {RTX_1}}
    rig._judge_cards_back(_hold(ended=UNTIL), ready=False, cordon=None, **off)
    assert found == []
    stop.ended = UNTIL + 2
    rig._judge_cards_back(_hold(ended=UNTIL), ready=False, cordon=None, **off)
    assert found == ["cards_not_back_after_hold"]


@pytest.mark.parametrize(
    ("lend", "runs", "violated"),
    [
        (False, [], False),
        (False, [(UNTIL - 1, EVERY_CARD)], True),
        (True, [(UNTIL - 1, {GTX_960, RTX_2})], False),
        (True, [(UNTIL - 2, {GTX_960, RTX_2}), (UNTIL - 1, {GTX_960, RTX_1})], True),
        (True, [(UNTIL - 1, {RTX_1})], True),
    ],
    ids=[
        "off_while_held",
        "started_with_every_card",
        "lent_the_free_cards",
        "lent_the_held_card",
        "the_held_card_alone",
    ],
)
def test_the_gpu_node_running_with_a_held_card_is_a_violation(
    lend: bool, runs: list[tuple[float, set[str]]], violated: bool
) -> None:
    """held_card_taken, judged on its own: while Gaming station 1's card is
    held, each instant the GPU node ran (the hold's beginning, each start)
    with that card is a violation; lending, the other free cards are its
    to run with."""
    found: list[str] = []
    _judging_rig(found, lend=lend)._judge_held_cards(_hold(ended=UNTIL), {RTX_1}, runs)
    assert found == (["held_card_taken"] if violated else [])


@pytest.mark.parametrize(
    ("follow_up_at", "reported"),
    [(UNTIL + 2, True), (UNTIL - 1, False), (None, False)],
    ids=["follow_up_after_the_failure", "follow_up_before_it", "no_follow_up"],
)
def test_a_failed_prepare_stays_reported_when_its_follow_up_clears_last_error(
    follow_up_at: float | None, reported: bool
) -> None:
    """Found by ``scripts/chaos --cycles 8 --seed 58`` (cycle 5, a harness
    bug): Gaming station 2's prepare failed (the PodDisruptionBudget refused
    past the drain timeout), reported; its follow-up, the switch off, began
    a stop of Gaming station 2, which clears its last_error and repair as
    any new request does. The prepare's handoff_failed event before the
    follow-up counts as its report; without a follow-up after it, the
    failure must still be on report at the end."""
    found: list[str] = []
    rig = _judging_rig(found)
    rig._events = [
        harness.Seen(
            0.0,
            harness.EVENT_HANDOFF_FAILED,
            {"vm": "gaming-2", "kind": "prepare", "code": "DrainError"},
            UNTIL,
        )
    ]
    prepare = harness.Ask("gaming-2", "prepare", "prepare", sent_at=UNTIL - 9)
    asks = [prepare]
    if follow_up_at is not None:
        asks.append(harness.Ask("gaming-2", "off", "off", sent_at=follow_up_at))
    why = rig._prepare_reported(prepare, asks, "no last_error")
    assert (why is None) is reported


def _defined(name: str, *cards: str, t: float = 0.0) -> dict[str, Any]:
    return {
        "op": "define",
        "name": name,
        "t": t,
        "spec": {"name": name, "hostdevs": [{"address": f"{c}.0"} for c in cards]},
    }


@pytest.mark.parametrize(
    ("actions", "violated"),
    [
        ([], False),
        ([{"op": "start", "name": "gpu-node", "t": UNTIL - 1}], True),
        # After the hold's end: the cards went back.
        ([{"op": "start", "name": "gpu-node", "t": UNTIL + 1}], False),
        (
            [
                {
                    "op": "create",
                    "name": "gpu-node",
                    "t": UNTIL - 1,
                    "hostdevs": [
                        {"address": f"{GTX_960}.0"},
                        {"address": f"{RTX_2}.0"},
                    ],
                }
            ],
            False,
        ),
    ],
    ids=["off", "started_while_held", "started_after", "created_without_it"],
)
async def test_held_cards_are_read_from_the_towers_replay(
    actions: list[dict[str, Any]], violated: bool
) -> None:
    """held_card_taken as the rig observes it: the simulator's replay at the
    hold's beginning and at each start (or create) of the GPU node while it
    lasted, with the held VM's cards from its definition."""
    found: list[str] = []
    rig = _judging_rig(found)
    hold = _hold(ended=UNTIL + 0.5)
    hold.checked_until = hold.began
    rig._holds = [hold]
    data = {
        "time_scale": 0.01,
        "actions": [
            _defined("gpu-node", GTX_960, RTX_1, RTX_2),
            _defined("gaming-1", RTX_1),
            _defined("gaming-2", RTX_2),
            *actions,
        ],
    }
    await rig._check_held_cards(data, UNTIL + 5)
    assert found == (["held_card_taken"] if violated else [])
    assert hold.checked_until == UNTIL + 0.5


def _prepare(request: str, vm: str, cycle: int, *faults: Fault, **hold: float) -> Plan:
    """A prepare's cycle (seed 0): a hold of 3 s, the follow-up 0.5 s after
    the cards are held, unless told."""
    times = {"hold": 3.0, "then_after": 0.5} | hold
    return Plan(0, cycle, request, vm, faults, **times)


async def test_prepares_leave_a_sound_product_sound(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Each follow-up of a prepare once: Gaming station 1 prepared and
    turned on within its hold (one start), turned off; Gaming station 2
    prepared and left to expire (the cards come back, hold_expired fired);
    Gaming station 1 prepared and Gaming station 2 turned on instead; a
    prepare of Gaming station 2, which plays, mirrored: Gaming station 1
    prepared (nothing to drain) and turned off; Gaming station 2 turned off;
    Gaming station 2 prepared and the cards returned. Every hold ends as its follow-up says, within its
    bound, and no invariant breaks."""
    plans = [
        _prepare("prepare_on", "gaming-1", 1),
        Plan(0, 2, "off", "gaming-1"),
        _prepare("prepare_expire", "gaming-2", 3, hold=2.0, then_after=0.0),
        _prepare("prepare_other_on", "gaming-1", 4),
        _prepare("prepare_off", "gaming-2", 5),
        Plan(0, 6, "off", "gaming-2"),
        _prepare("prepare_return_cards", "gaming-2", 7),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["violations"] == []
    assert summary["holds"]["ended"] == {
        "expired": 1,
        "handoff of gaming-1 began": 1,
        "handoff of gaming-2 began": 1,
        "return of gpu-node began": 1,
        "stop of gaming-1 began": 1,
    }
    assert summary["holds"]["overstay_idle_max_s"] <= HOLD_LATE
    assert summary["outcomes"] == {"playing": 3, "serving": 4}
    observed = summary["observed"]
    assert observed["prepare_then_on_within_hold"] == 1
    assert observed["prepare_left_to_expire"] == 1
    assert observed["prepare_mirrored"] == 1


async def test_lending_prepares_leave_a_sound_product_sound(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Lending: Gaming station 1 prepared (the GPU node comes back with the
    free cards but its own) and left to expire (then with every card);
    both play; Gaming station 1 prepared again (its player quits first) and
    turned on within its hold."""
    plans = [
        _prepare("prepare_expire", "gaming-1", 1, hold=2.0, then_after=0.0),
        Plan(0, 2, "both_on"),
        _prepare("prepare_on", "gaming-1", 3),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["violations"] == []
    assert summary["holds"]["count"] == 2
    assert summary["holds"]["ended"]["expired"] == 1
    assert summary["outcomes"] == {"playing_and_lending": 2, "serving": 1}
    assert summary["observed"]["prepare_after_quit"] == 1


async def test_a_product_whose_holds_never_expire_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A controller that never sees a hold's time is over: the cards stay
    held for Gaming station 2 past its time with GPU Handoff idle, reported
    as that (the cycle never settles, and ends with the GPU node off)."""
    monkeypatch.setattr(
        "custom_components.gpu_handoff.core.Hold.expired", lambda self, now: False
    )
    plans = [_prepare("prepare_expire", "gaming-2", 1, hold=2.0, then_after=0.0)]
    summary = await _replay(
        hass, k8s_emulator, tmp_path, plans, settle_bound=8.0, recover=False
    )
    assert _invariants(summary) == [
        (1, "half_state"),
        (1, "hold_outlived"),
        (1, "unsettled"),
    ]


async def test_a_lend_that_takes_the_held_card_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lending, a product whose lend forgets the held VM (the lend job does
    not name it): after Gaming station 1's prepare the GPU node comes back
    with Gaming station 1's card too, reported as exactly that."""
    lend = OperationRunner.return_cards

    async def forgetful(
        self: OperationRunner, settings: Any, *, if_running: bool, keep: Any = None
    ) -> bool:
        return await lend(self, settings, if_running=if_running, keep=None)

    monkeypatch.setattr(OperationRunner, "return_cards", forgetful)
    plans = [_prepare("prepare_expire", "gaming-1", 1, hold=2.0, then_after=0.0)]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert _invariants(summary) == [(1, "held_card_taken")]


async def test_an_agent_that_stops_before_the_guest_agent_answers_is_caught(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Gaming station 1 boots with a guest agent that never comes up; the
    player turns it off: the broken agent sends the shutdown at once."""
    plans = [
        Plan(
            0,
            1,
            "on",
            "gaming-1",
            (
                Fault(
                    "guest_agent", "before", (("mode", "never"), ("target", "gaming-1"))
                ),
            ),
        ),
        Plan(0, 2, "off", "gaming-1"),
    ]
    summary = await _replay(
        hass,
        k8s_emulator,
        tmp_path,
        plans,
        agent=_agent_without_wait(tmp_path / "broken-agent"),
    )
    assert _invariants(summary) == [(2, "stop_before_guest_agent")]


async def test_no_rollback_under_the_hooks_stop_job(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Someone starts Gaming station 2 on the tower; libvirt's hook starts a
    stop of the GPU node (slow here), and the handoff Home Assistant then
    makes fails (a pod nothing recreates). GPU Handoff's cordon must not be
    lifted while that stop job runs (the GPU node is going down)."""
    plans = [
        Plan(
            0,
            1,
            "hand",
            "gaming-2",
            (
                Fault("unmanaged_pod", "before"),
                Fault(
                    "guest_shutdown",
                    "before",
                    (("mode", "slow"), ("seconds", 2.5), ("target", "gpu-node")),
                ),
            ),
        )
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"guest_shutdown": 1, "unmanaged_pod": 1}
    assert "rollback_under_running_job" not in {
        invariant for _, invariant in _invariants(summary)
    }


async def test_a_gpu_node_the_operator_stopped_and_gpu_handoff_started_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator shuts the GPU node down while GPU Handoff drains it; the
    handoff's job finds it off (its stop skipped) and Gaming station 1's start
    fails after the hook. A product that counts the skipped stop as its own
    starts the GPU node again: reported as exactly that."""
    monkeypatch.setattr(
        "custom_components.gpu_handoff.operations.job_stopped_gpu_node",
        lambda facts, **kwargs: True,
    )
    plans = [
        Plan(
            0,
            1,
            "on",
            "gaming-1",
            (
                Fault(
                    "start_fails",
                    "before",
                    (("reason", "vfio"), ("target", "gaming-1")),
                ),
                Fault("operator_stop", "draining"),
            ),
        )
    ]
    # (The return it makes waits for a whole boot of the GPU node and its
    # GPUs: on a busy machine that took longer than the short bound, and the
    # cycle was reported unsettled too. A sound cycle ends long before.)
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, settle_bound=60.0)
    assert summary["faults"]["fired"] == {"operator_stop": 1, "start_fails": 1}
    assert _invariants(summary) == [(1, "operator_stop_undone")]


@pytest.mark.early
async def test_the_new_faults_leave_a_sound_product_sound(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Each new fault once, where it matters: a handoff whose start fails
    after the hook, a start by hand that fails so, a player quitting from
    inside while the other's stop runs, the operator shutting the GPU node
    down mid-drain (the handoff goes on; the GPU node stays off until the
    player quits), a gaming VM removed while its job runs (added back
    after the cycle)."""
    plans = [
        Plan(
            0,
            1,
            "on",
            "gaming-1",
            (
                Fault(
                    "start_fails",
                    "before",
                    (("reason", "vfio"), ("target", "gaming-1")),
                ),
            ),
        ),
        Plan(
            0,
            2,
            "hand",
            "gaming-2",
            (
                Fault(
                    "start_fails",
                    "before",
                    (("reason", "disk"), ("target", "gaming-2")),
                ),
            ),
        ),
        Plan(0, 3, "both_on"),
        Plan(
            0,
            4,
            "off",
            "gaming-1",
            (Fault("player_quits", "mid_job", (("target", "gaming-2"),)),),
        ),
        Plan(0, 5, "on", "gaming-1", (Fault("operator_stop", "draining"),)),
        Plan(0, 6, "off", "gaming-1"),
        Plan(
            0,
            7,
            "on",
            "gaming-2",
            (Fault("vm_removed", "mid_job", (("target", "gaming-2"),)),),
        ),
        Plan(0, 8, "off", "gaming-2"),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {
        "operator_stop": 1,
        "player_quits": 1,
        "start_fails": 2,
        "vm_removed": 1,
    }
    assert summary["violations"] == []


# --- the faults of slow stops, racing players and libvirtd restarts ----------------


def _broken_agent(directory: Path, old: str, new: str) -> Path:
    """A copy of the agent with one line of it replaced."""
    return agent_variant(directory, replace=[(old, new)])


def _slow(target: str, seconds: float, moment: str = "before") -> Fault:
    return Fault(
        "slow_graceful_stop", moment, (("seconds", seconds), ("target", target))
    )


def _race(target: str, moment: str = "before") -> Fault:
    return Fault("guest_quits_racing_stop", moment, (("target", target),))


def _restart(seconds: float, moment: str, *, socket_activated: bool) -> Fault:
    return Fault(
        "libvirtd_restart",
        moment,
        (("seconds", seconds), ("socket_activated", socket_activated)),
    )


async def test_a_graceful_stop_slower_than_libvirts_wait_succeeds(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """The GPU node takes 1.5 s (150 s simulated) to power off in a handoff,
    Gaming station 1 2.4 s in its stop. The GPU node's guest agent answers
    until the power-off: libvirt's ``shutdown --mode agent`` gives up after
    its 60 s (0.6 s) with "Guest agent is not responding" and the agent
    waits for the power-off within its shutdown timeout (3 s). A guest
    whose agent stops first (Windows, as the simulator's gaming VMs) has
    libvirt accept at once, and the agent waits for the power-off as well.
    Both succeed."""
    plans = [
        Plan(0, 1, "on", "gaming-1", (_slow("gpu-node", 1.5),)),
        Plan(0, 2, "off", "gaming-1", (_slow("gaming-1", 2.4, "job"),)),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"slow_graceful_stop": 2}
    assert summary["violations"] == []
    observed = summary["observed"]
    assert observed.get("slow_stop_outlasted_libvirt", 0) >= 1  # the GPU node
    assert (
        observed.get("slow_stop_outlasted_libvirt", 0)
        + observed.get("slow_stop_accepted", 0)
        == 2
    )
    assert "slow_stop_failed" not in observed
    assert summary["outcomes"] == {"playing": 1, "serving": 1}


async def test_an_agent_that_gives_up_on_a_slow_stop_is_caught(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """An agent that takes libvirt's "Guest agent is not responding" for a
    refusal (it does not wait for the power-off under way): the handoff
    whose GPU node powers off slowly fails with shutdown_refused, reported
    as exactly that."""
    agent = _broken_agent(
        tmp_path / "broken-agent",
        "        if going_down and self.shut_off_within(domain, self.cfg.timeout_shutdown):\n",
        "        if False:\n",
    )
    plans = [Plan(0, 1, "on", "gaming-1", (_slow("gpu-node", 1.5),))]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, agent=agent)
    assert (1, "slow_stop_refused") in _invariants(summary)
    violation = next(
        v for v in summary["violations"] if v["invariant"] == "slow_stop_refused"
    )
    assert violation["faults"] == [_slow("gpu-node", 1.5).as_json()]
    assert violation["replay"] == "scripts/chaos --cycles 1 --seed 0"


async def test_a_player_quitting_as_the_stop_arrives_changes_nothing(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Gaming station 1's player shuts it down from inside at the instant
    Home Assistant's stop arrives (its guest agent gone, the domain still
    running): the stop succeeds, the GPU node gets its cards back. Then both
    play and both quit, Gaming station 2 racing its stop and taking 1.5 s to
    power off ("QEMU guest agent is not connected" meanwhile): the same."""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(0, 2, "off", "gaming-1", (_race("gaming-1"),)),
        Plan(0, 3, "both_on"),
        Plan(
            0,
            4,
            "both_off",
            None,
            (_race("gaming-2", "job"), _slow("gaming-2", 1.5)),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {
        "guest_quits_racing_stop": 2,
        "slow_graceful_stop": 1,
    }
    assert summary["observed"].get("race_happened") == 2
    assert summary["violations"] == []


async def test_a_press_as_its_player_quits_is_overridden_by_the_player(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Both play; Gaming station 2's player shuts it down from inside just
    before both switches are pressed on again, libvirtd restarting meanwhile
    (seed 44, cycle 26). libvirt says ``running`` at the press, so it does
    nothing; the player's quit, first, ends the session: no silent failure,
    the press superseded, the cards back.

    The seed's guest took 1.5 s to power off and libvirtd was away 2.9 s.
    On loaded machines GPU Handoff's look at the tower came after the
    power-off (it waited for libvirtd, or the faults themselves took that
    long to strike), found the VM off and (rightly) started it again, so
    the case did not reach the press that does nothing, which it is here
    for. Here the guest takes 6 s and libvirtd is away 1 s."""
    quits = Fault("player_quits", "before", (("seconds", 6.0), ("target", "gaming-2")))
    plans = [
        Plan(0, 1, "both_on"),
        Plan(
            0,
            2,
            "both_on",
            None,
            (quits, _restart(1.0, "before", socket_activated=True)),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"libvirtd_restart": 1, "player_quits": 1}
    assert summary["violations"] == []
    assert summary["requests_ended"] == {"fulfilled": 3, "superseded": 1}


async def test_a_failed_handoff_settled_while_libvirt_is_away_returns_the_cards(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Gaming station 2 started by hand on the tower (refused: the GPU node
    holds its card; libvirt's hook shuts the GPU node down); the handoff for
    it fails on an unmanaged pod, and libvirt is away for 1.6 s as it
    drains, so the first look at what the hook's stop did fails. It is tried
    again, the hook's stop is seen, and the cards go back (seed 2718, cycle
    46: given up at once, the GPU node stayed off with nobody playing).
    The GPU node takes 2 s to power off: GPU Handoff looks while it still
    runs, and drains (on a loaded machine it once looked after the hook's
    quick stop had ended, found the card free and started the VM: no drain,
    no moment for libvirt to go away)."""
    plans = [
        Plan(
            0,
            1,
            "hand",
            "gaming-2",
            (
                Fault("unmanaged_pod", "before"),
                _slow("gpu-node", 2.0),
                Fault("libvirt_down", "draining", (("seconds", 1.6),)),
            ),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {
        "libvirt_down": 1,
        "slow_graceful_stop": 1,
        "unmanaged_pod": 1,
    }
    assert summary["violations"] == []
    assert summary["outcomes"] == {"serving": 1}


async def test_an_agent_that_refuses_a_raced_stop_is_caught(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """An agent that takes "QEMU guest agent is not connected" for a refusal
    although the guest is going down (here for 1.5 s): the stop that raced
    the player fails, reported as exactly that."""
    agent = _broken_agent(
        tmp_path / "broken-agent",
        "            going_down = going_down or may_be_going_down(result)\n",
        "            going_down = False\n",
    )
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(0, 2, "off", "gaming-1", (_race("gaming-1"), _slow("gaming-1", 1.5))),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, agent=agent)
    assert (2, "race_stop_failed") in _invariants(summary)
    assert {cycle for cycle, _ in _invariants(summary)} == {2}


NO_LIBVIRTD_RESTART = pytest.mark.skipif(
    not hasattr(Tower, "restart_libvirtd"),
    reason="the tower simulator cannot restart libvirtd yet",
)


@NO_LIBVIRTD_RESTART
async def test_libvirtd_restarts_leave_a_sound_product_sound(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """libvirtd restarts while a handoff's job runs (virsh calls fail for
    1 s), then before a stop, socket-activated (they wait): the event streams
    end, the reconnect hooks run, nothing is killed, both succeed, and Home
    Assistant's entities are available again soon after libvirtd is back
    (the time is measured and kept)."""
    plans = [
        Plan(
            0,
            1,
            "on",
            "gaming-1",
            (_restart(1.0, "mid_job", socket_activated=False),),
        ),
        Plan(
            0,
            2,
            "off",
            "gaming-1",
            (_restart(1.0, "before", socket_activated=True),),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"libvirtd_restart": 2}
    restarts = summary["libvirtd_restarts"]
    assert restarts["count"] == 2
    assert set(restarts["by_cycle"]) == {"1", "2"}
    # one per domain running when libvirtd is back: gaming-1 in cycle 2; in
    # cycle 1 the GPU node may be off and gaming-1 not started yet
    assert summary["observed"].get("reconnect_hooks", 0) >= 1
    assert summary["violations"] == []


@NO_LIBVIRTD_RESTART
async def test_a_hook_that_fails_on_reconnect_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A qemu hook script (the one the agent's install writes) that fails on
    ``reconnect``: libvirtd, back from its restart, kills every running
    domain it takes back (qemuProcessReconnect), reported as exactly that.
    The script answers reconnect itself (only prepare begin reaches the
    agent), so the script is what is broken here."""
    passes = '[ "$2 $3" = "prepare begin" ] || exit 0\n'

    def broken_hook(tower: Tower, directory: Path, agent: Path, config: Path) -> None:
        install_hook(tower, directory, agent, config)
        script = directory / "qemu-hook"
        text = script.read_text(encoding="utf-8")
        assert text.count(passes) == 1
        script.write_text(
            text.replace(passes, f'[ "$2" = reconnect ] && exit 1\n{passes}'),
            encoding="utf-8",
        )

    monkeypatch.setattr(harness, "install_hook", broken_hook)
    plans = [
        Plan(
            0,
            1,
            "return_cards",
            None,
            (_restart(0.5, "before", socket_activated=False),),
        )
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert (1, "killed_on_reconnect") in _invariants(summary)


# --- while a return waits for the GPUs, in a world with pods back on the cordon ---------

# The device plugin registers the GPUs 1 s (100 s simulated) after each
# boot: every return waits for them long enough for its faults to strike.
LATE_GPUS = (100.0, 100.0)


def _starts(kind: str, target: str) -> Fault:
    return Fault(kind, "gpu_wait", (("target", target),))


def test_starts_while_the_gpus_come_back_are_drawn_at_gpu_wait() -> None:
    """A player starting by the switch or by hand strikes while a return
    waits for the GPUs, on the gaming VM the request did not name; the
    other faults may strike there too, in a return."""
    plans = [plan_cycle(seed, cycle) for seed in (1, 2) for cycle in range(1, 301)]
    starts = [
        (plan, fault)
        for plan in plans
        for fault in plan.faults
        if fault.kind in ("player_starts", "hand_start")
    ]
    assert {fault.kind for _, fault in starts} == {"player_starts", "hand_start"}
    assert all(fault.moment == "gpu_wait" for _, fault in starts)
    assert all(fault.get("target") != plan.vm for plan, fault in starts)
    others = {
        fault.kind
        for plan in plans
        for fault in plan.faults
        if fault.moment == "gpu_wait" and fault.kind not in FIXED_MOMENTS
    }
    assert {"ha_reload", "ha_restart", "ssh_cut", "api_down"} <= others
    assert not others & set(EARLY_MOMENTS)


async def test_a_player_starting_while_the_return_waits_for_the_gpus(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Gaming station 1's player quits; while the cards go back and the
    return waits for the device plugin under GPU Handoff's cordon, Gaming
    station 2's switch is turned on: it gets its cards once the return is
    done. Then the entry reloads while the next return waits for the GPUs:
    the return ends after the reload. The pod tolerating the cordon comes
    back to the cordoned node in each handoff's drain and is left there."""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(0, 2, "off", "gaming-1", (_starts("player_starts", "gaming-2"),)),
        Plan(0, 3, "off", "gaming-2", (Fault("ha_reload", "gpu_wait"),)),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, plugin_after=LATE_GPUS)
    assert summary["faults"]["fired"] == {"ha_reload": 1, "player_starts": 1}
    assert summary["faults"]["by_moment"] == {"gpu_wait": 2}
    assert summary["violations"] == []
    assert summary["outcomes"] == {"playing": 2, "serving": 1}
    assert summary["observed"]["pods_came_back"] >= 2


async def test_a_player_who_starts_again_the_vm_whose_stop_raced_their_quit(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Lending on, both play; both switches are turned off, Gaming station
    1's player shutting it down from inside as GPU Handoff's stop arrives;
    while the cards come back, the same player turns its switch on again
    (seed 4247, cycle 28). The press overrides the stop: Gaming station 1
    plays again, which is no failure of the raced stop."""
    plans = [
        Plan(0, 1, "both_on"),
        Plan(
            0,
            2,
            "both_off",
            None,
            (_race("gaming-1"), _starts("player_starts", "gaming-1")),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {
        "guest_quits_racing_stop": 1,
        "player_starts": 1,
    }
    assert summary["observed"].get("race_happened") == 1
    assert summary["violations"] == []
    assert summary["requests_ended"] == {"fulfilled": 4, "superseded": 1}


async def test_a_lend_restart_waits_for_the_gpus_too(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Lending on: the handoff to Gaming station 1 restarts the GPU node with
    the free cards, a return of its own that waits for the GPUs; Gaming
    station 2's switch is turned on meanwhile. Both play, the GPU node lends
    the last free card."""
    plans = [Plan(0, 1, "on", "gaming-1", (_starts("player_starts", "gaming-2"),))]
    summary = await _replay(
        hass, k8s_emulator, tmp_path, plans, lend=True, plugin_after=LATE_GPUS
    )
    assert summary["faults"]["fired"] == {"player_starts": 1}
    assert summary["faults"]["by_moment"] == {"gpu_wait": 1}
    assert summary["violations"] == []
    assert summary["outcomes"] == {"playing_and_lending": 1}


async def test_a_drain_that_evicts_a_pod_it_left_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A product whose drain names a pod that came back to the cordoned node
    tolerating its cordon as left, and evicts it all the same: reported as
    exactly that."""

    run = NodeDrain.run

    async def evicting(self: NodeDrain, *args: Any, **kwargs: Any) -> DrainProgress:
        progress = await run(self, *args, **kwargs)
        for label in progress.came_back:
            namespace, _, name = label.partition("/")
            await self.client.core.create_namespaced_pod_eviction(
                name,
                namespace,
                V1Eviction(metadata=V1ObjectMeta(name=name, namespace=namespace)),
            )
        return progress

    monkeypatch.setattr(NodeDrain, "run", evicting)
    summary = await _replay(
        hass, k8s_emulator, tmp_path, [Plan(0, 1, "on", "gaming-1")]
    )
    assert _invariants(summary) == [(1, "came_back_evicted")]
    assert f"{MONITORING_NS}/{TOLERANT}-" in summary["violations"][0]["detail"]


async def test_a_drain_that_deletes_instead_of_evicting_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A product whose drain deletes the pods instead of evicting them (its
    ServiceAccount granted the delete the documented ClusterRole leaves out):
    the pods the cluster deletes itself (the taint eviction controller's, on
    the unreachable node) are not held against it, these are."""
    k8s_emulator.set_rules((*PRODUCT_RULES, rule(["delete"], ["pods"])))

    async def delete(
        self: CoreV1Api, name: str, namespace: str, body: Any, **kwargs: Any
    ) -> Any:
        return await self.delete_namespaced_pod(name, namespace, **kwargs)

    monkeypatch.setattr(CoreV1Api, "create_namespaced_pod_eviction", delete)
    summary = await _replay(
        hass, k8s_emulator, tmp_path, [Plan(0, 1, "on", "gaming-1")]
    )
    assert (1, "pod_left_without_eviction") in _invariants(summary)


# A start by hand while a return waits for the GPUs: libvirt runs the
# agent's hook, which asks for a stop of the GPU node (it holds the VM's
# cards) and returns; Home Assistant takes the hook's request up only once
# the return is done.


async def test_a_start_by_hand_while_the_gpus_come_back_waits_for_the_hooks_stop(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 122 --seed 1``, ``scripts/chaos
    --cycles 8 --seed 101`` and ``scripts/chaos --cycles 2 --seed 65``:
    Gaming station 1's player quits; while the return waits for the GPUs,
    Gaming station 2 is started by hand on the tower. The hook's stop of the
    GPU node runs a while (its guest agent is up 2.8 s after the boot, the
    power-off takes 2.5 s); its GPUs register 2 s after the first post,
    meanwhile. GPU Handoff's cordon must stay until that stop is over, and
    the cards are not returned to a GPU node going down. (Fixed: the return
    ends without the cards when the GPU node no longer runs undisturbed.)"""
    gpu_node = (("target", "gpu-node"),)
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(
            0,
            2,
            "off",
            "gaming-1",
            (
                Fault(
                    "guest_agent",
                    "before",
                    (("mode", "late"), ("seconds", 2.8), *gpu_node),
                ),
                Fault(
                    "guest_shutdown",
                    "before",
                    (("mode", "slow"), ("seconds", 2.5), *gpu_node),
                ),
                _starts("hand_start", "gaming-2"),
            ),
        ),
    ]
    summary = await _replay(
        hass, k8s_emulator, tmp_path, plans, plugin_after=(200.0, 200.0)
    )
    assert summary["faults"]["fired"] == {
        "guest_agent": 1,
        "guest_shutdown": 1,
        "hand_start": 1,
    }
    assert summary["violations"] == []


async def test_a_start_by_hand_before_the_gpus_come_back_is_handed_over_at_once(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found while replaying the case above with the GPUs later: Gaming
    station 1's player quits; while the return waits for the GPUs (3 s
    here), Gaming station 2 is started by hand on the tower. The hook's stop
    shuts the GPU node down before its GPUs register: the return must not
    wait for them (they cannot come) and Gaming station 2 must get its
    cards within the settle bound. (Fixed: the return stops waiting for the
    GPUs as soon as a tower job stops the GPU node.)"""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(0, 2, "off", "gaming-1", (_starts("hand_start", "gaming-2"),)),
    ]
    summary = await _replay(
        hass,
        k8s_emulator,
        tmp_path,
        plans,
        plugin_after=(300.0, 300.0),
        recover=False,
    )
    assert summary["faults"]["fired"] == {"hand_start": 1}
    assert summary["violations"] == []


# --- bugs the soak found in the faithful world, kept as regression cases -------------


async def test_lending_leaves_a_gpu_node_the_operator_stopped_mid_drain_off(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 38 --seed 1``: lending on,
    the operator shuts the GPU node down while the handoff to Gaming station
    1 drains it; the handoff goes on (its stop is skipped). No request asked
    for the cards back: the GPU node stays off (the lend after a handoff
    restarted it)."""
    plans = [Plan(0, 1, "on", "gaming-1", (Fault("operator_stop", "draining"),))]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {"operator_stop": 1}
    assert summary["violations"] == []


async def test_lending_a_session_ended_behind_another_stop_still_returns_the_cards(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 60 --seed 2468`` (cycle 60):
    lending on, the operator shuts the GPU node down while the handoff to
    Gaming station 1 drains it, and it stays off. Then both switches are
    turned off. Station 1's stop ends its session, which asks for the cards
    back, but station 2's stop waits behind it, so the return is left to the
    end of the burst; station 2's stop shut nothing down, and the return
    owed was lost: the GPU node stayed off with nobody playing and nothing
    reported. Whether station 2's request waits behind station 1's stop or
    goes first comes and goes with the machine's load (station 1's graceful
    stop takes its time here to make it likelier);
    ``tests/test_lending.py::test_a_sessions_end_behind_another_stop_returns_the_cards``
    pins that order."""
    plans = [
        Plan(0, 1, "start_handoff", "gaming-1", (Fault("operator_stop", "draining"),)),
        Plan(
            0,
            2,
            "both_off",
            None,
            (
                Fault(
                    "slow_graceful_stop",
                    "before",
                    (("seconds", 1.4), ("target", "gaming-1")),
                ),
            ),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {"operator_stop": 1, "slow_graceful_stop": 1}
    assert summary["outcomes"] == {"playing": 1, "serving": 1}
    assert summary["violations"] == []


async def test_lending_a_stop_of_a_vm_that_never_ran_leaves_the_operators_shutdown(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 126 --seed 1``: lending on,
    Gaming station 1 plays and the GPU node lends the free cards. The
    handoff to Gaming station 2 fails (the operator cordoned the GPU node),
    and the operator shuts the GPU node down while it drains. The user turns
    Gaming station 2 off (it never ran: its stop job finds it shut off): no
    session ended, no request asked for the cards back, so the GPU node
    stays off as the operator left it."""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(
            0,
            2,
            "on",
            "gaming-2",
            (
                Fault("operator_cordon", "before", (("action", "place"),)),
                Fault("operator_stop", "draining"),
            ),
        ),
        Plan(0, 3, "off", "gaming-2"),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {"operator_cordon": 1, "operator_stop": 1}
    assert summary["violations"] == []


async def test_lending_a_vm_removed_mid_job_still_lends_the_free_cards(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 18 --seed 1``: lending on,
    Gaming station 1 is removed from GPU Handoff while its handoff's job
    runs. It plays on; the GPU node serves the two free cards (the abandoned
    operation never lent them)."""
    plans = [
        Plan(
            0,
            1,
            "on",
            "gaming-1",
            (Fault("vm_removed", "mid_job", (("target", "gaming-1"),)),),
        )
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {"vm_removed": 1}
    assert summary["violations"] == []


# --- bugs the soak found, kept as regression cases -----------------------------------


async def test_a_job_that_ends_while_the_session_is_down_is_followed_to_its_end(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 11 --seed 2``: both play; Gaming
    station 2 is turned off and the agent session is ended (SIGTERM) while its
    stop job runs. The job succeeds on the tower meanwhile; the stop must end.
    (Fixed: a fresh read of the job now wins over a record pushed before it.)"""
    plans = [
        Plan(0, 1, "both_on"),
        Plan(
            0,
            2,
            "off",
            "gaming-2",
            (Fault("agent_killed", "mid_job", (("signal", "TERM"),)),),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["violations"] == []


async def test_a_vm_started_by_hand_whose_handoff_fails_leaves_a_serving_node(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 5 --seed 12``: a pod nothing
    recreates is on the GPU node and someone starts Gaming station 2 on the
    tower. The handoff must fail (reported), and the GPU node keep serving.
    (Fixed: a failed handoff follows the hook's stop of the GPU node to its end
    and, GPU Handoff having stopped it, starts it again.)"""
    plans = [Plan(0, 1, "hand", "gaming-2", (Fault("unmanaged_pod", "before"),))]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["violations"] == []


async def test_a_request_queued_across_a_restart_is_carried_out(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 6 --seed 23``: both play and both
    quit; Home Assistant restarts while the first stop runs, the second
    queued behind it. Both must end (done, or reported). (Fixed: requests
    waiting for their turn are stored, and carried out after a restart.)"""
    plans = [
        Plan(0, 1, "both_on"),
        Plan(
            0, 2, "both_off", None, (Fault("ha_restart", "mid_job", (("down", 0.2),)),)
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["violations"] == []


async def test_an_operator_cordon_placed_after_an_operator_uncordon_is_kept(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 200 --seed 1`` (cycle 191): an
    operator lifts GPU Handoff's cordon while a player plays (the mark stays:
    `kubectl uncordon` changes spec.unschedulable only), cordons the node
    again later, and the return must keep that cordon. (Fixed: a mark on a
    node nobody cordons is removed as soon as it is seen.)"""
    plans = [
        Plan(0, 1, "on", "gaming-1"),
        Plan(
            0,
            2,
            "on",
            "gaming-2",
            (Fault("operator_cordon", "before", (("action", "remove"),)),),
        ),
        Plan(
            0,
            3,
            "both_off",
            None,
            (Fault("operator_cordon", "before", (("action", "place"),)),),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"operator_cordon": 2}
    assert summary["violations"] == []


async def test_a_tower_that_stops_lending_is_caught(
    hass: HomeAssistant,
    k8s_emulator: K8sEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lending on, a product that never restarts the GPU node with the free
    cards after a handoff (neither with it nor on the level at a later
    update): the GPU node stays off while a player uses one card, reported
    as exactly that."""
    monkeypatch.setattr(
        "custom_components.gpu_handoff.operations.lends_after",
        lambda request, **kwargs: False,
    )
    monkeypatch.setattr(
        "custom_components.gpu_handoff.core._lend_falls_short",
        lambda observed, found: False,
    )
    plans = [Plan(0, 1, "on", "gaming-1")]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert _invariants(summary) == [(1, "cards_not_lent")]
    assert summary["violations"][0]["replay"] == (
        "scripts/chaos --lend --cycles 1 --seed 0"
    )


async def test_a_lending_gpu_node_loses_a_cordon_left_by_a_failed_handoff(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 100 --seed 1`` (cycle 21):
    Gaming station 2 plays, the GPU node serves the free cards; the handoff
    to Gaming station 1 fails while libvirt is away after the drain, and its
    rollback cannot reach the tower. The cordon must still go once the GPU
    node serves. (Fixed: the safety net lifts GPU Handoff's own cordon on a
    serving GPU node whoever plays.)"""
    plans = [
        Plan(0, 1, "on", "gaming-2"),
        Plan(
            0,
            2,
            "on",
            "gaming-1",
            (
                Fault("eviction_error", "job", (("count", 1), ("status", 504))),
                Fault("libvirt_down", "draining", (("seconds", 0.7),)),
            ),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"].get("libvirt_down") == 1
    assert summary["violations"] == []


async def test_a_failed_stop_after_a_merged_one_still_lends_the_free_cards(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --lend --cycles 100 --seed 1`` (cycle 79):
    both play and both quit; the first stop leaves the GPU node's restart to
    the second (merged), and the second fails (its guest ignores the
    shutdown). The first one's card must still go back to the cluster.
    (Fixed: the lending restart follows the last request of a burst even
    when that one was a stop that failed.)"""
    plans = [
        Plan(0, 1, "both_on"),
        Plan(
            0,
            2,
            "both_off",
            None,
            (
                Fault(
                    "guest_shutdown",
                    "before",
                    (("mode", "ignored"), ("seconds", 1.9), ("target", "gaming-2")),
                ),
            ),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans, lend=True)
    assert summary["faults"]["fired"] == {"guest_shutdown": 1}
    assert summary["violations"] == []


async def test_a_stop_supersedes_an_earlier_start_by_hand(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 99 --seed 1``: Gaming station 2
    plays; Gaming station 1 is started by hand (the SSH connection cut just
    before); then the user turns it off. The hook's record of that start,
    not yet taken up, must not hand the cards to it again after the stop.
    (Fixed: a request for a VM supersedes its starts by hand recorded before
    that request ends.)"""
    plans = [
        Plan(0, 1, "on", "gaming-2"),
        Plan(0, 2, "hand", "gaming-1", (Fault("ssh_cut", "before"),)),
        Plan(0, 3, "off", "gaming-1"),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["violations"] == []


async def test_a_stop_that_fails_after_its_vm_was_removed_is_reported(
    hass: HomeAssistant, k8s_emulator: K8sEmulator, tmp_path: Path
) -> None:
    """Found by ``scripts/chaos --cycles 139 --seed 1``: Gaming station 1's
    guest ignores shutdowns; the user turns it off and removes it from GPU
    Handoff while the stop job runs. The job fails: that is reported, as any
    failed stop is. (Fixed: the abandoned operation's failed job is reported.)"""
    ignored = (("mode", "ignored"), ("seconds", 30.0), ("target", "gaming-1"))
    plans = [
        Plan(0, 1, "both_on"),
        Plan(0, 2, "off", "gaming-2"),
        Plan(
            0,
            3,
            "off",
            "gaming-1",
            (
                Fault("guest_shutdown", "before", ignored),
                Fault("vm_removed", "mid_job", (("target", "gaming-1"),)),
            ),
        ),
    ]
    summary = await _replay(hass, k8s_emulator, tmp_path, plans)
    assert summary["faults"]["fired"] == {"guest_shutdown": 1, "vm_removed": 1}
    assert summary["violations"] == []
