"""The controller's typed records and pure decisions (``core``): every case
of what an idle controller does after an update, when the free cards go
back after an operation, what a job record says it did, and the stored
records with their migration from the dicts 0.3.x stored (files written by
that code: tests/fixtures/store_v1). The stories around them run through
Home Assistant, the agent and the cluster emulator (tests/test_handoff.py,
tests/test_lending.py, tests/test_failed_handoff.py)."""

from __future__ import annotations

from dataclasses import replace
import datetime as dt
import json
from pathlib import Path
from typing import Any

from homeassistant.core import HomeAssistant
import pytest

from custom_components.gpu_handoff.cluster_model import CORDON_OWNER_US, NodeView
from custom_components.gpu_handoff.core import (
    STORE_VERSION,
    Hold,
    HoldEnd,
    HookJobRead,
    JobFacts,
    Kind,
    Memory,
    Observed,
    Origin,
    Owned,
    PendingJob,
    Plan,
    Request,
    Settings,
    Settle,
    gpu_stopped_by_us,
    hold_after,
    hold_ends,
    hook_stopped_gpu_node,
    job_stopped_gpu_node,
    known_desired,
    lends_after,
    migrate_store,
    reconcile,
    returns_after,
    returns_after_stop,
    settle_hook_job,
    start_by_hand_over,
    stop_names,
    stop_releases,
    superseded_hook_requests,
)
from custom_components.gpu_handoff.owned import handoff_store
from custom_components.gpu_handoff.protocol import (
    RUNNING,
    DomainState,
    HookRequest,
    Job,
    JobKind,
    JobRecord,
    JobState,
    JobStep,
    StepName,
    TowerStatus,
)
from tests.explorer.world import CARDS, VMS, World

FIXTURES = Path(__file__).parent / "fixtures" / "store_v1"
SETTINGS = Settings(
    drain_timeout=60,
    evict_unmanaged=False,
    handoff_when_cordoned=False,
    auto_return=True,
)
LENDING = replace(SETTINGS, lend_free=True)


def domain(name: str, state: str = "running", reason: str | None = None) -> DomainState:
    return DomainState(
        name=name,
        title=name,
        role="gpu_node" if name == "gpu-node" else "gaming",
        exists=True,
        state=state,
        reason=reason,
        agent_channel=True,
        agent_ready=None,
        hostdevs=(),
    )


def job(kind: JobKind, domain_name: str | None, job_id: str = "j1") -> Job:
    return Job(
        id=job_id,
        kind=kind,
        domain=domain_name,
        state=JobState.RUNNING,
        step=None,
        request_id=None,
        requested_by="hook",
        created="2026-12-02T05:00:00.000+00:00",
        finished=None,
        error=None,
    )


def tower(
    gpu: str = "running",
    g1: str = "shut_off",
    g2: str = "shut_off",
    *,
    hooks: tuple[HookRequest, ...] = (),
    jobs: tuple[Job, ...] = (),
) -> TowerStatus:
    return TowerStatus(
        uri="qemu:///system",
        gpu_node="gpu-node",
        gaming=("gaming-1", "gaming-2"),
        domains={
            "gpu-node": domain("gpu-node", gpu),
            "gaming-1": domain("gaming-1", g1, "failed" if g1 == "failed" else None),
            "gaming-2": domain("gaming-2", g2),
        },
        cards=(),
        findings=(),
        hook_requests=hooks,
        active_jobs=jobs,
        virsh_calls=1,
    )


def node(**changes: Any) -> NodeView:
    return replace(
        NodeView(
            name="gpu-node",
            ready=True,
            unschedulable=False,
            cordon_owner=None,
            lease_age=1.0,
            gpu_capacity=2,
            gpu_allocatable=2,
            gpu_requested=0,
            pods=0,
            evictable_pods=0,
        ),
        **changes,
    )


def observed(
    status: TowerStatus, view: NodeView | None = None, settings: Settings = SETTINGS
) -> Observed:
    return Observed(
        tower=status,
        node=view if view is not None else node(),
        configured=frozenset({"gaming-1", "gaming-2"}),
        settings=settings,
    )


def hook(
    vm: str = "gaming-1", time: str = "2026-12-02T05:00:00.000+00:00"
) -> HookRequest:
    return HookRequest(
        domain=vm, operation="prepare", addresses=(), time=time, job="j1", error=None
    )


# The hook's job j1 shut the GPU node down at this time (its record, read).
HOOK_STOPPED_AT = "2026-12-02T05:00:20.000+00:00"


def hook_read(*jobs: str, stopped: tuple[str, ...] = ()) -> frozenset[HookJobRead]:
    """The records read of the hook's ended jobs: those in ``stopped`` shut
    the GPU node down at HOOK_STOPPED_AT, the others did not."""
    return frozenset(
        HookJobRead(job, HOOK_STOPPED_AT if job in stopped else None) for job in jobs
    )


# --- an idle controller after an update -------------------------------------------


def test_nothing_to_do() -> None:
    result = reconcile(observed(tower()), Owned(), Memory())
    assert (result.run, result.changed, result.forget_stale_mark) == (
        None,
        False,
        False,
    )
    assert result.desired == frozenset()


def test_a_start_by_hand_that_failed_is_handed_over() -> None:
    """The start failed (the GPU node held the cards): a handoff for the hook."""
    start = hook()
    result = reconcile(
        observed(
            tower(g1="failed", jobs=(job(JobKind.STOP, "gpu-node"),), hooks=(start,))
        ),
        Owned(),
        Memory(),
    )
    assert result.run == Request(
        vm="gaming-1", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="j1"
    )
    assert result.desired == {"gaming-1"}
    assert start.key in result.memory.seen_hook_requests


def test_a_start_by_hand_with_its_cards_is_followed() -> None:
    """It plays with the GPU node off: followed once the hook's job record
    says whether the GPU node is off because of it (then it counts as GPU
    Handoff's: the session's end brings the cards back)."""
    start = hook()
    status = tower(gpu="shut_off", g1="running", hooks=(start,))
    first = reconcile(observed(status), Owned(), Memory())
    assert (first.run, first.followed, first.read_hook_jobs) == (None, (), ("j1",))
    assert first.memory.seen_hook_requests == frozenset()

    read = Memory(hook_jobs_read=hook_read("j1"))
    result = reconcile(observed(status), Owned(), read)
    assert (result.run, result.followed, result.changed) == (None, ("gaming-1",), True)
    assert result.desired == {"gaming-1"}
    assert not result.gpu_stopped_by_us

    stopped = replace(read, hook_jobs_read=hook_read("j1", stopped=("j1",)))
    result = reconcile(observed(status), Owned(), stopped)
    assert result.followed == ("gaming-1",)
    assert result.gpu_stopped_by_us

    # Its hook's job still runs (it finds the GPU node off: a no-op).
    running = replace(status, active_jobs=(job(JobKind.STOP, "gpu-node"),))
    result = reconcile(observed(running), Owned(), Memory())
    assert (result.followed, result.read_hook_jobs) == (("gaming-1",), ())


def test_a_vm_playing_unannounced_is_followed_with_a_handoff_to_run() -> None:
    """Lending: gaming-2 plays though no start by hand was recorded for it
    (the hook let it start, its card not the GPU node's at the last status),
    and a failed start by hand of gaming-1 is to be handed over: gaming-2 is
    followed in the same look, so its end lends its card (found by the
    explorer: followed only at a look with nothing to hand over, it quit
    before one came)."""
    start = hook("gaming-1")
    status = tower(
        g1="failed", g2="running", hooks=(start,), jobs=(job(JobKind.STOP, "gpu-node"),)
    )
    result = reconcile(observed(status, settings=LENDING), Owned(), Memory())
    assert result.run == Request(
        vm="gaming-1", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="j1"
    )
    assert result.followed == ("gaming-2",)
    assert result.desired == {"gaming-1", "gaming-2"}


def test_a_start_by_hand_is_over_when_its_vm_is_off_but_not_refused() -> None:
    """A handoff for it, run only now, starts nothing once its player quit
    (or it crashed); a refused start is still the player's to retry."""
    status = tower(g1="shut_off", g2="failed")
    assert start_by_hand_over(status.domains["gaming-1"])
    assert not start_by_hand_over(replace(status.domains["gaming-2"], reason="failed"))
    assert not start_by_hand_over(tower(g1="running").domains["gaming-1"])


def test_a_start_by_hand_that_ended_with_the_gpu_node_serving_is_done_with() -> None:
    """The GPU node runs again: whatever the hook's stop did is over."""
    result = reconcile(observed(tower(hooks=(hook(),))), Owned(), Memory())
    assert (result.run, result.read_hook_jobs) == (None, ())
    assert result.memory.seen_hook_requests == {hook().key}
    assert result.changed


def test_a_start_by_hand_that_ended_while_its_hooks_stop_runs_stays_unseen() -> None:
    """Nothing to tell yet; a request for the VM supersedes it."""
    status = tower(
        gpu="in_shutdown", hooks=(hook(),), jobs=(job(JobKind.STOP, "gpu-node"),)
    )
    for gpu in ("in_shutdown", "shut_off"):
        result = reconcile(
            observed(
                replace(
                    status,
                    domains=status.domains | {"gpu-node": domain("gpu-node", gpu)},
                )
            ),
            Owned(),
            Memory(),
        )
        assert (result.run, result.read_hook_jobs) == (None, ())
        assert result.memory.seen_hook_requests == frozenset()


def test_a_start_by_hand_that_ended_before_home_assistant_looked() -> None:
    """Refused, retried, played and quit before Home Assistant looked, the
    GPU node off: the hook's job record decides (read first). It shut the
    GPU node down: the session's end returns the cards; it did nothing (the
    GPU node was off already): nothing happens."""
    status = tower(gpu="shut_off", hooks=(hook(),))
    first = reconcile(observed(status), Owned(), Memory())
    assert (first.run, first.read_hook_jobs) == (None, ("j1",))
    assert first.memory.seen_hook_requests == frozenset()

    read = replace(first.memory, hook_jobs_read=hook_read("j1"))
    stopped = replace(read, hook_jobs_read=hook_read("j1", stopped=("j1",)))
    result = reconcile(observed(status), Owned(), stopped)
    assert result.run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF
    )
    assert result.memory.seen_hook_requests == {hook().key}

    result = reconcile(observed(status), Owned(), read)
    assert (result.run, result.read_hook_jobs) == (None, ())
    assert result.memory.seen_hook_requests == {hook().key}

    # Someone else plays, or the cards go back only when asked: no return,
    # but the stop counts as GPU Handoff's (the end of that session, or a
    # lend after a handoff decided meanwhile, brings the cards back).
    playing = tower(gpu="shut_off", g2="running", hooks=(hook(),))
    quiet = reconcile(observed(playing), Owned(), stopped)
    assert (quiet.run, quiet.gpu_stopped_by_us) == (None, True)
    manual = replace(SETTINGS, auto_return=False)
    assert reconcile(observed(status, settings=manual), Owned(), stopped).run is None


def test_a_hook_stop_read_is_over_once_gpu_handoff_started_the_gpu_node() -> None:
    """The hook's record was read (it shut the GPU node down) and a job of
    GPU Handoff's started the GPU node after that; the operator has shut it
    down since. The stop is judged again at each look, against that start:
    it is over, so nothing starts the operator's GPU node (found by the
    explorer at depth 6), for an ended start by hand as for a followed one."""
    stopped = Memory(hook_jobs_read=hook_read("j1", stopped=("j1",)))
    ended = tower(gpu="shut_off", hooks=(hook(),))
    before = Owned(gpu_started_at="2026-12-02T05:00:10.000+00:00")
    after = Owned(gpu_started_at="2026-12-02T05:05:00.000+00:00")
    assert reconcile(observed(ended), before, stopped).run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF
    )
    result = reconcile(observed(ended), after, stopped)
    assert (result.run, result.gpu_stopped_by_us, result.read_hook_jobs) == (
        None,
        False,
        (),
    )
    assert result.memory.seen_hook_requests == {hook().key}

    playing = tower(gpu="shut_off", g1="running", hooks=(hook(),))
    assert reconcile(observed(playing), before, stopped).gpu_stopped_by_us
    followed = reconcile(observed(playing), after, stopped)
    assert (followed.followed, followed.gpu_stopped_by_us) == (("gaming-1",), False)


def test_lending_an_ended_start_by_hand_then_a_followed_one_lends_after() -> None:
    """Lending: Gaming station 1's start by hand was refused (the hook shut
    the GPU node down), retried and quit; Gaming station 2 was started by
    hand on the GPU node left off, all before Home Assistant looked. The
    second is handed over (its own hook's stop found the GPU node off), and
    the first's stop counts as GPU Handoff's, so the free card is lent
    after it (found by the explorer at depth 4)."""
    first = hook()
    second = HookRequest(
        domain="gaming-2",
        operation="prepare",
        addresses=(),
        time="2026-12-02T05:01:00.000+00:00",
        job="j2",
        error=None,
    )
    status = tower(gpu="shut_off", g2="running", hooks=(first, second))
    memory = Memory(hook_jobs_read=hook_read("j1", "j2", stopped=("j1",)))
    result = reconcile(observed(status, settings=LENDING), Owned(), memory)
    assert result.run == Request(
        vm="gaming-2", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="j2"
    )
    assert result.gpu_stopped_by_us


def test_a_start_by_hand_that_ended_after_gpu_handoff_stopped_the_gpu_node() -> None:
    """The GPU node is off because of GPU Handoff: the session's end returns
    the cards, whatever the hook's stop did (nothing to read)."""
    status = tower(gpu="shut_off", hooks=(hook(),))
    result = reconcile(observed(status), Owned(gpu_stopped_by_us=True), Memory())
    assert result.run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF
    )
    assert result.read_hook_jobs == ()


def test_a_start_by_hand_of_a_vm_gpu_handoff_does_not_manage_is_ignored() -> None:
    status = tower(g1="failed", hooks=(hook(),))
    result = reconcile(
        replace(observed(status), configured=frozenset({"gaming-2"})), Owned(), Memory()
    )
    assert result.run is None
    assert hook().key in result.memory.seen_hook_requests


def test_the_session_ends_and_the_cards_go_back() -> None:
    result = reconcile(
        observed(tower(gpu="shut_off")),
        Owned(desired=frozenset({"gaming-1"})),
        Memory(),
    )
    assert result.run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF
    )
    assert not result.run.if_running  # a session's end starts it
    assert result.desired == frozenset()


def test_without_automatic_return_the_session_end_is_only_noted() -> None:
    result = reconcile(
        observed(tower(gpu="shut_off"), settings=replace(SETTINGS, auto_return=False)),
        Owned(desired=frozenset({"gaming-1"})),
        Memory(),
    )
    assert (result.run, result.changed, result.desired) == (None, True, frozenset())


def test_one_player_quits_while_another_plays() -> None:
    """No return (someone plays); lending, the freed cards go back."""
    owned = Owned(desired=frozenset({"gaming-1", "gaming-2"}))
    status = tower(gpu="shut_off", g2="running")
    assert reconcile(observed(status), owned, Memory()).run is None
    lend = reconcile(observed(status, settings=LENDING), owned, Memory())
    assert lend.run is not None
    assert lend.run.kind is Kind.RETURN


def test_a_gpu_node_seen_off_is_never_a_reason_to_return() -> None:
    """Someone may have shut it down on purpose."""
    assert reconcile(observed(tower(gpu="shut_off")), Owned(), Memory()).run is None


def test_our_cordon_left_on_a_serving_gpu_node_is_lifted_by_a_return() -> None:
    ours = node(unschedulable=True, cordon_owner=CORDON_OWNER_US)
    # Decided because the GPU node runs: if it is off when the return acts,
    # it stays off.
    assert reconcile(observed(tower(), ours), Owned(), Memory()).run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF, if_running=True
    )
    # Not while a tower job may still stop it, nor before it is Ready.
    busy = tower(jobs=(job(JobKind.HANDOFF, "gaming-1"),))
    assert reconcile(observed(busy, ours), Owned(), Memory()).run is None
    unready = replace(ours, ready=False)
    assert reconcile(observed(tower(), unready), Owned(), Memory()).run is None


def test_a_refused_lend_is_tried_again_once_its_pods_are_gone() -> None:
    memory = Memory(lend_refused=("default/debug",))
    still = node(unmanaged=("default/debug",))
    assert reconcile(observed(tower(), still, LENDING), Owned(), memory).run is None
    retry = reconcile(observed(tower(), node(), LENDING), Owned(), memory).run
    assert retry is not None
    assert retry.if_running  # its act looks again (a poll, a push may lag)


def test_a_refused_lend_is_not_tried_on_a_gpu_node_shut_down_since() -> None:
    """The lend drained a GPU node that ran; its operator shut it down while
    the pod was in the way: it stays off (found by the explorer at depth 5)."""
    memory = Memory(lend_refused=("default/debug",))
    off = observed(tower(gpu="shut_off"), node(), LENDING)
    assert reconcile(off, Owned(), memory).run is None


def _lending_tower(gpu: str, lent: frozenset[str], **vms: str) -> TowerStatus:
    """The explorer's tower (two gaming VMs with a card each, the GPU node
    defined with both), as the agent reports it."""
    playing = tuple(RUNNING if vms.get(vm) == RUNNING else "shut_off" for vm in VMS)
    return World(gpu=gpu, lent=lent, vms=(playing[0], playing[1])).tower_status()


def test_lending_a_card_freed_unseen_is_lent() -> None:
    """Gaming station 1 was started on the tower while an operation ran and
    its player quit before any look: its card is free and the GPU node GPU
    Handoff shut down for Gaming station 2 does not run with it. The free
    cards changed since the last return began: it lends (found by the
    explorer at depth 5)."""
    status = _lending_tower("shut_off", frozenset(), **{"gaming-2": RUNNING})
    ours = Owned(desired=frozenset({"gaming-2"}), gpu_stopped_by_us=True)
    nothing_was_free = Memory(lent_for=frozenset())
    result = reconcile(observed(status, settings=LENDING), ours, nothing_was_free)
    assert result.run == Request(
        vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF
    )
    # A GPU node that runs with fewer cards than are free is lent to as well,
    # as long as it runs when the lend acts.
    running = _lending_tower("running", frozenset({CARDS["gaming-2"]}))
    lend = reconcile(observed(running, settings=LENDING), Owned(), Memory()).run
    assert lend is not None
    assert lend.if_running
    # Not again for the same free cards (the last lend failed: reported).
    tried = Memory(lent_for=frozenset({CARDS["gaming-1"]}))
    assert reconcile(observed(status, settings=LENDING), ours, tried).run is None
    # Not to a GPU node someone else shut down, nor without lending.
    theirs = replace(ours, gpu_stopped_by_us=False)
    assert reconcile(observed(status, settings=LENDING), theirs, Memory()).run is None
    assert reconcile(observed(status), ours, Memory()).run is None
    # Not while a tower job acts on the GPU node.
    busy = replace(status, active_jobs=(job(JobKind.STOP, "gpu-node"),))
    assert reconcile(observed(busy, settings=LENDING), ours, Memory()).run is None
    # At rest, the GPU node serving exactly the free cards, nothing to do.
    rest = _lending_tower(
        "running", frozenset({CARDS["gaming-1"]}), **{"gaming-2": RUNNING}
    )
    assert reconcile(observed(rest, settings=LENDING), Owned(), Memory()).run is None


def test_a_stale_mark_is_forgotten() -> None:
    result = reconcile(observed(tower(), node(stale_mark=True)), Owned(), Memory())
    assert result.forget_stale_mark


def test_a_vm_gone_from_the_tower_leaves_the_desired_set() -> None:
    status = tower(g1="running")
    status = replace(
        status,
        domains={
            **status.domains,
            "gaming-1": replace(status.domains["gaming-1"], exists=False),
        },
    )
    result = reconcile(
        observed(status), Owned(desired=frozenset({"gaming-1"})), Memory()
    )
    assert (result.desired, result.changed) == (frozenset(), True)


# --- after an operation -----------------------------------------------------------------


STOP = Request(vm="gaming-2", kind=Kind.STOP)
HANDOFF = Request(vm="gaming-2", kind=Kind.HANDOFF)
HOOK_HANDOFF = replace(HANDOFF, origin=Origin.HOOK, hook_job="h")


@pytest.mark.parametrize(
    ("request_", "succeeded", "facts", "owned", "gpu", "lends"),
    [
        # A stop that ended a session frees its cards: the GPU node GPU
        # Handoff stopped takes them...
        (
            STOP,
            True,
            JobFacts(shut_down=frozenset({"gaming-2"})),
            Owned(gpu_stopped_by_us=True),
            "shut_off",
            True,
        ),
        # ...and so does one that was off as the stop began (a session's
        # end brings the cards back, as without lending)...
        (
            STOP,
            True,
            JobFacts(shut_down=frozenset({"gaming-2"})),
            Owned(),
            "shut_off",
            True,
        ),
        # ...but one someone else shut down while the stop ran, after it
        # began with the GPU node serving, stays off (found by the explorer).
        (
            STOP,
            True,
            JobFacts(shut_down=frozenset({"gaming-2"}), gpu_was_running=True),
            Owned(),
            "shut_off",
            False,
        ),
        # A failed stop: the requests merged into it changed what is free.
        (STOP, False, JobFacts(), Owned(gpu_stopped_by_us=True), "shut_off", True),
        (STOP, False, JobFacts(), Owned(), "shut_off", False),
        (STOP, False, JobFacts(), Owned(), "running", True),
        # A stop of a VM that did not run ends no session: a GPU node
        # someone else shut down stays off...
        (STOP, True, JobFacts(), Owned(), "shut_off", False),
        # ...one GPU Handoff stopped, or one that runs, takes the free cards.
        (STOP, True, JobFacts(), Owned(gpu_stopped_by_us=True), "shut_off", True),
        (STOP, True, JobFacts(), Owned(), "running", True),
        # A handoff lends when GPU Handoff stopped the GPU node for it.
        (HANDOFF, True, JobFacts(stopped_gpu_node=True), Owned(), "shut_off", True),
        # A start by hand: the hook's job record says whether it shut the
        # GPU node down (the operator may have, before it).
        (
            HOOK_HANDOFF,
            True,
            JobFacts(stopped_gpu_node=True),
            Owned(),
            "shut_off",
            True,
        ),
        (HOOK_HANDOFF, True, JobFacts(), Owned(), "shut_off", False),
        (HANDOFF, True, JobFacts(), Owned(), "shut_off", False),
        (HANDOFF, False, JobFacts(stopped_gpu_node=True), Owned(), "shut_off", False),
        # A failed handoff: a GPU node GPU Handoff stopped gets the free
        # cards (a handoff before it left them for this one's end; or a start
        # by hand it supersedes had the hook stop it).
        (HANDOFF, False, JobFacts(), Owned(gpu_stopped_by_us=True), "shut_off", True),
        (
            HANDOFF,
            False,
            JobFacts(stopped_gpu_node=True),
            Owned(gpu_stopped_by_us=True),
            "shut_off",
            True,
        ),
        (HANDOFF, False, JobFacts(), Owned(gpu_stopped_by_us=True), "running", False),
        (
            Request(vm="gpu-node", kind=Kind.RETURN),
            True,
            JobFacts(),
            Owned(),
            "running",
            False,
        ),
    ],
)
def test_when_the_free_cards_go_back(
    request_: Request,
    succeeded: bool,
    facts: JobFacts,
    owned: Owned,
    gpu: str,
    lends: bool,
) -> None:
    seen = observed(tower(gpu=gpu), settings=LENDING)
    assert (
        lends_after(
            request_,
            succeeded=succeeded,
            facts=facts,
            owned=owned,
            waiting=False,
            observed=seen,
        )
        is lends
    )
    # Never while another request waits (its own end does it), nor without
    # lending.
    assert not lends_after(
        request_,
        succeeded=succeeded,
        facts=facts,
        owned=owned,
        waiting=True,
        observed=seen,
    )
    assert not lends_after(
        request_,
        succeeded=succeeded,
        facts=facts,
        owned=owned,
        waiting=False,
        observed=observed(tower(gpu=gpu)),
    )


def _record(*steps: tuple[StepName, str, str]) -> JobRecord:
    return JobRecord(
        job=replace(
            job(JobKind.HANDOFF, "gaming-1"), created="2026-12-02T05:00:00.000+00:00"
        ),
        steps=tuple(
            JobStep(
                name=name,
                domain=name_of,
                started="s",
                finished="f",
                result=result,
                detail=None,
            )
            for name, name_of, result in steps
        ),
    )


def test_what_a_job_record_says_it_did() -> None:
    """A shutdown step skipped (the domain was off already) did nothing."""
    did = JobFacts().with_record(
        _record(
            (StepName.SHUTDOWN, "gpu-node", "ok"), (StepName.START, "gaming-1", "ok")
        ),
        "gpu-node",
    )
    assert did.stopped_gpu_node
    assert did.shut_down == {"gpu-node"}
    assert did.first_created == "2026-12-02T05:00:00.000+00:00"
    skipped = JobFacts().with_record(
        _record((StepName.SHUTDOWN, "gpu-node", "skipped")), "gpu-node"
    )
    assert not skipped.stopped_gpu_node
    assert skipped.shut_down == frozenset()


def test_whether_the_gpu_node_is_off_because_of_gpu_handoff() -> None:
    handoff = Request(vm="gaming-1", kind=Kind.HANDOFF)
    stopped = JobFacts(stopped_gpu_node=True)
    assert gpu_stopped_by_us(Owned(), stopped, tower(gpu="shut_off"), handoff)
    assert gpu_stopped_by_us(
        Owned(gpu_stopped_by_us=True), JobFacts(), tower(gpu="shut_off"), handoff
    )
    # Cleared once it runs again.
    assert not gpu_stopped_by_us(
        Owned(gpu_stopped_by_us=True), stopped, tower(), handoff
    )
    # Or once the operation started it: off again, someone else stopped it.
    started = JobFacts(started_gpu_node=True)
    assert not gpu_stopped_by_us(
        Owned(gpu_stopped_by_us=True), started, tower(gpu="shut_off"), handoff
    )


def test_a_sessions_end_makes_the_gpu_node_gpu_handoffs_to_start() -> None:
    """A stop that shut its VM down while the GPU node was off (the
    operator's shutdown, say) owes the cards back: the GPU node is GPU
    Handoff's to start from then on, so a later request of the same burst
    returns them (chaos seed 2468, cycle 60, lending)."""
    stop = Request(vm="gaming-1", kind=Kind.STOP)
    ended = JobFacts(shut_down=frozenset({"gaming-1"}), gpu_was_running=False)
    assert gpu_stopped_by_us(Owned(), ended, tower(gpu="shut_off"), stop)
    # Not when the GPU node ran as the stop began (someone shut it down
    # while the stop ran), nor when the stop shut nothing down (its VM was
    # off already), nor for another VM's stop, nor a handoff.
    ran = JobFacts(shut_down=frozenset({"gaming-1"}), gpu_was_running=True)
    assert not gpu_stopped_by_us(Owned(), ran, tower(gpu="shut_off"), stop)
    assert not gpu_stopped_by_us(Owned(), JobFacts(), tower(gpu="shut_off"), stop)
    other = Request(vm="gaming-2", kind=Kind.STOP)
    assert not gpu_stopped_by_us(Owned(), ended, tower(gpu="shut_off"), other)
    handoff = Request(vm="gaming-1", kind=Kind.HANDOFF)
    assert not gpu_stopped_by_us(Owned(), ended, tower(gpu="shut_off"), handoff)
    # Nor once the stop started the GPU node (the return it owed is paid: a
    # shutdown since is someone else's), nor while the GPU node runs.
    paid = JobFacts(
        shut_down=frozenset({"gaming-1"}), gpu_was_running=False, started_gpu_node=True
    )
    assert not gpu_stopped_by_us(Owned(), paid, tower(gpu="shut_off"), stop)
    assert not gpu_stopped_by_us(Owned(), ended, tower(), stop)


def test_whether_a_failed_handoffs_job_stopped_the_gpu_node() -> None:
    stopped = JobFacts(stopped_gpu_node=True)
    assert job_stopped_gpu_node(stopped, job_failed=True, job_pending=False)
    assert not job_stopped_gpu_node(JobFacts(), job_failed=True, job_pending=True)
    # A job not followed to its end may have.
    assert job_stopped_gpu_node(JobFacts(), job_failed=False, job_pending=True)
    assert not job_stopped_gpu_node(JobFacts(), job_failed=False, job_pending=False)


def test_which_starts_by_hand_a_request_supersedes() -> None:
    before = hook("gaming-1", "2026-12-02T04:59:00.000+00:00")
    after = hook("gaming-1", "2026-12-02T05:01:00.000+00:00")
    other = hook("gaming-2", "2026-12-02T04:59:00.000+00:00")
    facts = JobFacts(first_created="2026-12-02T05:00:00.000+00:00")
    stop = Request(vm="gaming-1", kind=Kind.STOP)
    # A start by hand recorded after a stop's first job is the newer request.
    assert superseded_hook_requests((before, after, other), stop, facts) == {before.key}
    handoff = Request(vm="gaming-1", kind=Kind.HANDOFF)
    assert superseded_hook_requests((before, after, other), handoff, facts) == {
        before.key,
        after.key,
    }
    unreadable = hook("gaming-1", "yesterday")
    assert superseded_hook_requests((unreadable,), stop, facts) == {unreadable.key}
    # While the VM runs, a stop or a failed handoff supersedes none: a
    # player started it on the tower since.
    running = frozenset({"gaming-1"})
    assert not superseded_hook_requests((before,), stop, facts, running=running)
    assert not superseded_hook_requests(
        (before,), handoff, facts, succeeded=False, running=running
    )
    # One whose VM does not run after a failed handoff goes all the same.
    assert superseded_hook_requests((before,), handoff, facts, succeeded=False) == {
        before.key
    }


def test_which_start_by_hand_a_failed_handoff_settles_after() -> None:
    started = replace(hook("gaming-1", "2026-12-02T05:00:00.000+00:00"), job="h2")
    seen = replace(hook("gaming-1", "2026-12-02T04:00:00.000+00:00"), job="h1")
    user = Request(vm="gaming-1", kind=Kind.HANDOFF)
    assert settle_hook_job(user, (seen, started), frozenset({seen.key})) == "h2"
    assert settle_hook_job(user, (seen,), frozenset({seen.key})) is None
    by_hook = replace(user, origin=Origin.HOOK, hook_job="h0")
    assert settle_hook_job(by_hook, (started,), frozenset()) == "h0"


def test_what_a_stop_names() -> None:
    """A VM shut off when the stop begins is not named: the job would shut a
    later start by hand down."""
    assert stop_names(tower(g1="running"), "gaming-1") == "gaming-1"
    assert stop_names(tower(), "gaming-1") is None
    assert stop_names(tower(g1="paused"), "gaming-1") == "gaming-1"


def test_when_a_stop_releases() -> None:
    seen = tower(gpu="shut_off", g1="running")
    assert stop_releases(seen, "gaming-1", SETTINGS, gpu_stopped_by_us=True)
    # A VM that runs on a GPU node someone else shut down (a player started
    # it by hand after the operator's shutdown): a plain stop, the cards
    # going back after it only if its job ended the session.
    assert not stop_releases(seen, "gaming-1", SETTINGS, gpu_stopped_by_us=False)
    # A VM that does not run ends no session: an operator's shutdown stays.
    off = tower(gpu="shut_off")
    assert not stop_releases(off, "gaming-1", SETTINGS, gpu_stopped_by_us=False)
    assert stop_releases(off, "gaming-1", SETTINGS, gpu_stopped_by_us=True)
    assert stop_releases(tower(), "gaming-1", SETTINGS, gpu_stopped_by_us=False)
    # Someone else plays, no automatic return, or lending: a plain stop.
    both = tower(gpu="shut_off", g1="running", g2="running")
    assert not stop_releases(both, "gaming-1", SETTINGS, gpu_stopped_by_us=True)
    manual = replace(SETTINGS, auto_return=False)
    assert not stop_releases(seen, "gaming-1", manual, gpu_stopped_by_us=True)
    assert not stop_releases(seen, "gaming-1", LENDING, gpu_stopped_by_us=True)


def test_when_the_cards_go_back_after_a_stop_that_began_while_another_played() -> None:
    ended = JobFacts(shut_down=frozenset({"gaming-1"}))
    off = tower(gpu="shut_off")
    assert returns_after_stop(
        off, "gaming-1", SETTINGS, facts=ended, gpu_stopped_by_us=False
    )
    assert returns_after_stop(
        off, "gaming-1", SETTINGS, facts=JobFacts(), gpu_stopped_by_us=True
    )
    assert not returns_after_stop(
        off, "gaming-1", SETTINGS, facts=JobFacts(), gpu_stopped_by_us=False
    )
    assert not returns_after_stop(
        tower(gpu="shut_off", g2="running"),
        "gaming-1",
        SETTINGS,
        facts=ended,
        gpu_stopped_by_us=True,
    )
    assert not returns_after_stop(
        off, "gaming-1", LENDING, facts=ended, gpu_stopped_by_us=True
    )
    # A stop resumed after a restart whose release ran already: the GPU
    # node off again was shut down by someone else since (found by the
    # explorer at depth 5).
    released = replace(ended, started_gpu_node=True)
    assert not returns_after_stop(
        off, "gaming-1", SETTINGS, facts=released, gpu_stopped_by_us=True
    )


@pytest.mark.parametrize(
    ("request_", "succeeded", "stopped", "gpu", "g2", "back"),
    [
        # A stop, not lending: the GPU node GPU Handoff (or the hook for a
        # start by hand it superseded) stopped comes back.
        (STOP, True, True, "shut_off", "shut_off", True),
        (STOP, True, False, "shut_off", "shut_off", False),
        (STOP, False, True, "shut_off", "shut_off", False),
        # A failed handoff likewise.
        (HANDOFF, False, True, "shut_off", "shut_off", True),
        (HANDOFF, True, True, "shut_off", "shut_off", False),
        # Not while someone plays, nor when the GPU node runs.
        (STOP, True, True, "shut_off", "running", False),
        (STOP, True, True, "running", "shut_off", False),
    ],
)
def test_when_the_cards_go_back_after_a_request(
    request_: Request, succeeded: bool, stopped: bool, gpu: str, g2: str, back: bool
) -> None:
    seen = observed(tower(gpu=gpu, g2=g2))
    facts = JobFacts(stopped_gpu_node=stopped)
    decided = {"succeeded": succeeded, "facts": facts, "owned": Owned()}
    assert returns_after(request_, waiting=False, observed=seen, **decided) is back
    assert not returns_after(request_, waiting=True, observed=seen, **decided)


def test_lending_a_start_by_hand_followed_with_the_gpu_node_off_is_handed_over() -> (
    None
):
    """The VM plays already; the hook's record decides about the GPU node."""
    start = hook()
    status = tower(gpu="shut_off", g1="running", hooks=(start,))
    result = reconcile(observed(status, settings=LENDING), Owned(), Memory())
    assert result.run == Request(
        vm="gaming-1", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="j1"
    )


def test_lending_a_session_begun_again_by_hand_is_handed_over_once_its_stop_ran() -> (
    None
):
    """Lending, the VM GPU Handoff gave its cards to quit and was started
    again by hand before Home Assistant looked: the hook's stop of the
    lending GPU node (its definition holds every card) is still to run, so
    the start stays unseen; once it ran, the GPU node off, it is handed over
    (a no-op start) so its record decides whether the free cards are lent
    again."""
    start = hook()
    owned = Owned(desired=frozenset({"gaming-1"}))
    stop = job(JobKind.STOP, "gpu-node")
    under_way = tower(g1="running", hooks=(start,), jobs=(stop,))
    for settings in (SETTINGS, LENDING):
        result = reconcile(observed(under_way, settings=settings), owned, Memory())
        assert (result.run, result.read_hook_jobs) == (None, ())
        assert result.memory.seen_hook_requests == frozenset()
    ran = tower(gpu="shut_off", g1="running", hooks=(start,))
    result = reconcile(observed(ran, settings=LENDING), owned, Memory())
    assert result.run == Request(
        vm="gaming-1", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="j1"
    )
    assert start.key in result.memory.seen_hook_requests
    # Not lending: followed, once its record says whether the stop was ours.
    assert reconcile(observed(ran), owned, Memory()).read_hook_jobs == ("j1",)


def test_lending_a_vm_that_plays_without_a_start_by_hand_recorded_is_followed() -> None:
    """Lending, a player started Gaming station 1 on the tower while the
    GPU node ran without its card, and the agent's record of the GPU node's
    cards (its last status) said so: libvirt's hook recorded nothing. Its
    session is followed all the same (its end lends the freed card); not one
    whose start by hand is still being looked at, nor one not configured."""
    playing = tower(g1="running")
    result = reconcile(observed(playing, settings=LENDING), Owned(), Memory())
    assert (result.run, result.followed, result.changed) == (None, ("gaming-1",), True)
    assert result.desired == {"gaming-1"}
    # One whose start by hand's record is still to be read is left to it.
    to_read = tower(gpu="shut_off", g1="running", hooks=(hook(),))
    unread = reconcile(observed(to_read), Owned(), Memory())
    assert (unread.desired, unread.read_hook_jobs) == (frozenset(), ("j1",))
    unconfigured = replace(observed(playing), configured=frozenset({"gaming-2"}))
    assert reconcile(unconfigured, Owned(), Memory()).desired == frozenset()


def _hook_record(finished: str | None, result: str = "ok") -> JobRecord:
    return JobRecord(
        job=replace(
            job(JobKind.STOP, "gpu-node"), state=JobState.SUCCEEDED, finished=finished
        ),
        steps=(
            JobStep(
                name=StepName.SHUTDOWN,
                domain="gpu-node",
                started=finished,
                finished=finished,
                result=result,
                detail=None,
            ),
        ),
    )


def test_a_hooks_stop_counts_only_until_gpu_handoff_starts_the_gpu_node() -> None:
    """A stop of the GPU node libvirt's hook made before a job of GPU
    Handoff's last started it is over (the GPU node ran again since: off
    now, someone else shut it down). The tower's clock orders them (one job
    at a time); a time that cannot be read counts as after."""
    started = "2026-12-02T05:10:00.000+00:00"
    before = _hook_record("2026-12-02T05:05:00.000+00:00")
    after = _hook_record("2026-12-02T05:15:00.000+00:00")
    assert hook_stopped_gpu_node(after, "gpu-node", since=started)
    assert not hook_stopped_gpu_node(before, "gpu-node", since=started)
    assert hook_stopped_gpu_node(before, "gpu-node", since=None)
    assert hook_stopped_gpu_node(before, "gpu-node", since="garbled")
    assert hook_stopped_gpu_node(_hook_record(None), "gpu-node", since=started)
    skipped = _hook_record("2026-12-02T05:15:00.000+00:00", result="skipped")
    assert not hook_stopped_gpu_node(skipped, "gpu-node", since=None)

    # An operation's facts carry the last start from the owned records,
    # unless they know a later one.
    facts = JobFacts().since(started)
    assert facts.gpu_started_at == started
    assert not facts.with_hook_record(before, "gpu-node").stopped_gpu_node
    assert facts.with_hook_record(after, "gpu-node").stopped_gpu_node
    assert facts.since("2026-12-02T05:01:00.000+00:00") == facts
    assert facts.since(None) == facts
    # A start step of the GPU node sets it (from the step's end).
    restarted = JobFacts().with_record(
        JobRecord(
            job=job(JobKind.RELEASE, None),
            steps=(
                JobStep(
                    name=StepName.START,
                    domain="gpu-node",
                    started=started,
                    finished=started,
                    result="ok",
                    detail="started",
                ),
            ),
        ),
        "gpu-node",
    )
    assert restarted.gpu_started_at == started
    assert JobFacts.from_dict(restarted.as_dict()) == restarted


def test_a_failed_start_by_hand_of_a_vm_gpu_handoff_wants_is_handed_over() -> None:
    """Still in the desired set (its session's end not seen yet), the VM's
    new start by hand failed: a player wants it, the handoff follows."""
    start = hook()
    status = tower(g1="failed", jobs=(job(JobKind.STOP, "gpu-node"),), hooks=(start,))
    result = reconcile(
        observed(status), Owned(desired=frozenset({"gaming-1"})), Memory()
    )
    assert result.run is not None
    assert result.run.kind is Kind.HANDOFF
    # One that plays is followed already: nothing to do but read whether
    # its hook's stop took the GPU node down (then it counts as ours).
    playing = tower(gpu="shut_off", g1="running", hooks=(start,))
    owned = Owned(desired=frozenset({"gaming-1"}))
    asks = reconcile(observed(playing), owned, Memory())
    assert (asks.run, asks.read_hook_jobs) == (None, ("j1",))
    read = Memory(hook_jobs_read=hook_read("j1", stopped=("j1",)))
    quiet = reconcile(observed(playing), owned, read)
    assert (quiet.run, quiet.followed, quiet.gpu_stopped_by_us) == (None, (), True)
    assert start.key in quiet.memory.seen_hook_requests


def test_job_records_in_order() -> None:
    """A start of the GPU node after a stop undoes it: a GPU node off after
    that was shut down by someone else."""
    facts = JobFacts().with_record(
        _record(
            (StepName.SHUTDOWN, "gpu-node", "ok"), (StepName.START, "gpu-node", "ok")
        ),
        "gpu-node",
    )
    assert not facts.stopped_gpu_node
    assert facts.started_gpu_node
    assert JobFacts.from_dict(facts.as_dict()) == facts
    assert JobFacts.from_dict(None) == JobFacts()


# --- stored records --------------------------------------------------------------------


def test_the_records_round_trip() -> None:
    owned = Owned(
        desired=frozenset({"gaming-1"}),
        plan=Plan(
            request=Request(
                vm="gaming-2", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job="h"
            ),
            job=PendingJob(kind=JobKind.HANDOFF, domain="gaming-2", request_id="ha-1"),
            settle=Settle(stopped_by_us=True, hook_job="h"),
        ),
        queue=(Request(vm="gaming-1", kind=Kind.STOP),),
        gpu_stopped_by_us=True,
        gpu_started_at="2026-12-02T05:10:00.000+00:00",
    )
    assert Owned.from_dict(json.loads(json.dumps(owned.as_dict()))) == owned
    level = replace(
        owned,
        plan=Plan(
            request=Request(
                vm="gpu-node",
                kind=Kind.RETURN,
                origin=Origin.GPU_HANDOFF,
                if_running=True,
            )
        ),
    )
    assert Owned.from_dict(json.loads(json.dumps(level.as_dict()))) == level


def _v1(name: str) -> dict[str, Any]:
    stored: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    assert stored["version"] == 1
    return stored


def test_a_failed_handoff_stored_by_0_3_is_migrated() -> None:
    stored = _v1("settle")
    owned = Owned.from_dict(migrate_store(1, stored["data"]))
    hook_job = stored["data"]["pending"]["hook_job"]
    assert owned.plan == Plan(
        request=Request(
            vm="gaming-2", kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job=hook_job
        ),
        settle=Settle(stopped_by_us=False, hook_job=hook_job),
    )
    assert (owned.desired, owned.queue, owned.gpu_stopped_by_us) == (
        frozenset(),
        (),
        False,
    )


def test_a_stop_with_a_request_waiting_stored_by_0_3_is_migrated() -> None:
    stored = _v1("queued")
    owned = Owned.from_dict(migrate_store(1, stored["data"]))
    assert owned.plan is not None
    assert owned.plan.job is not None
    assert owned.plan.request == Request(vm="gaming-1", kind=Kind.STOP)
    assert owned.plan.job.job_id == stored["data"]["pending"]["job"]["job_id"]
    assert owned.queue == (Request(vm="gaming-2", kind=Kind.STOP),)
    assert owned.gpu_stopped_by_us


def test_a_lend_stored_by_0_3_is_migrated() -> None:
    stored = _v1("return")
    owned = Owned.from_dict(migrate_store(1, stored["data"]))
    assert owned.plan is not None
    assert owned.plan.job is not None
    assert owned.plan.kind is Kind.RETURN
    assert owned.plan.job.kind is JobKind.LEND
    assert owned.plan.job.boot_id == stored["data"]["pending"]["job"]["boot_id"]
    assert owned.desired == {"gaming-1"}


async def test_home_assistant_migrates_the_stored_file(
    hass: HomeAssistant, hass_storage: dict[str, Any]
) -> None:
    """The store written by 0.3.x loads as the current records, through
    Home Assistant's own storage (which keeps the migrated version)."""
    stored = _v1("queued")
    hass_storage["gpu_handoff.ENTRY_ID"] = stored
    store = handoff_store(hass, "ENTRY_ID")
    data = await store.async_load()
    assert data is not None
    assert Owned.from_dict(data) == Owned.from_dict(migrate_store(1, stored["data"]))
    await store.async_save(data)
    assert hass_storage["gpu_handoff.ENTRY_ID"]["version"] == STORE_VERSION
    # A current store is read as it is.
    assert migrate_store(STORE_VERSION, data) == data


def test_a_stop_reads_whether_the_gpu_node_ran_once_before_its_first_job() -> None:
    """Whether the GPU node ran when a stop began is read as it begins and
    kept once a job of it was created: a stop begun again after a restart
    (its job done) keeps what it found, and the operator's shutdown of the
    GPU node since is not taken for it (the depth-6 lending race)."""
    fresh = JobFacts()
    assert fresh.stop_began(gpu_running=True).gpu_was_running is True
    assert fresh.stop_began(gpu_running=False).gpu_was_running is False
    began = fresh.stop_began(gpu_running=True)
    # Before any job, a new beginning reads it again (nothing was done yet).
    assert began.stop_began(gpu_running=False).gpu_was_running is False
    ran = replace(
        began, first_created="2026-12-02T05:03:00.000+00:00", shut_down=frozenset({"g"})
    )
    assert ran.stop_began(gpu_running=False) == ran
    stored = JobFacts.from_dict(json.loads(json.dumps(ran.as_dict())))
    assert stored.stop_began(gpu_running=False).gpu_was_running is True


# --- a hold (gpu_handoff.prepare) ------------------------------------------------

HOLD = Hold(vm="gaming-1", until="2026-12-04T12:15:00+00:00")
BEFORE = dt.datetime(2026, 12, 4, 12, 14, 59, tzinfo=dt.UTC)
AFTER = dt.datetime(2026, 12, 4, 12, 15, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("status", "configured", "now", "ends"),
    [
        (tower("shut_off"), {"gaming-1", "gaming-2"}, BEFORE, None),
        (tower("shut_off"), {"gaming-1", "gaming-2"}, None, None),
        (tower("shut_off"), {"gaming-1", "gaming-2"}, AFTER, HoldEnd.EXPIRED),
        (tower("shut_off", g1="running"), {"gaming-1"}, AFTER, HoldEnd.PLAYS),
        (tower("shut_off"), {"gaming-2"}, BEFORE, HoldEnd.GONE),
        (tower("shut_off", g1="paused"), {"gaming-1"}, BEFORE, None),
    ],
    ids=[
        "waiting",
        "no_clock",
        "time_over",
        "started_on_the_tower",
        "removed",
        "paused",
    ],
)
def test_what_ends_a_hold(
    status: TowerStatus,
    configured: set[str],
    now: dt.datetime | None,
    ends: HoldEnd | None,
) -> None:
    """The VM playing ends it first (its session is followed), then the VM
    no longer GPU Handoff's, then its time; an update with no clock never
    ends it by time."""
    seen = replace(observed(status), configured=frozenset(configured), now=now)
    assert hold_ends(seen, HOLD) is ends
    assert hold_ends(seen, None) is None


def test_a_hold_whose_end_cannot_be_read_is_over() -> None:
    assert Hold(vm="gaming-1", until="soon").expired(BEFORE)
    assert Hold.from_dict({"vm": "gaming-1"}) is None
    assert Hold.from_dict(HOLD.as_dict()) == HOLD


@pytest.mark.parametrize(
    ("request_", "kept"),
    [
        (Request(vm="gaming-1", kind=Kind.HANDOFF), False),
        (Request(vm="gaming-2", kind=Kind.HANDOFF), False),
        (Request(vm="gaming-2", kind=Kind.PREPARE), False),
        (Request(vm="gaming-1", kind=Kind.STOP), False),
        (Request(vm="gaming-2", kind=Kind.STOP), True),
        (Request(vm="gpu-node", kind=Kind.RETURN), False),
        (
            Request(vm="gpu-node", kind=Kind.RETURN, origin=Origin.GPU_HANDOFF),
            True,
        ),
    ],
    ids=[
        "its_handoff",
        "another_handoff",
        "another_prepare",
        "its_stop",
        "another_stop",
        "return_asked",
        "return_decided",
    ],
)
def test_what_an_operation_does_to_a_hold(request_: Request, kept: bool) -> None:
    assert hold_after(HOLD, request_) == (HOLD if kept else None)
    assert hold_after(None, request_) is None


def test_an_expired_hold_returns_the_cards_and_a_waiting_one_nothing() -> None:
    """Nobody plays, the GPU node off for the hold: while it waits an update
    asks nothing; once its time is over, the cards go back."""
    owned = Owned(hold=HOLD, gpu_stopped_by_us=True)
    waiting = reconcile(
        replace(observed(tower("shut_off")), now=BEFORE), owned, Memory()
    )
    assert waiting.run is None
    assert waiting.hold == HOLD
    assert waiting.hold_ended is None
    over = reconcile(replace(observed(tower("shut_off")), now=AFTER), owned, Memory())
    assert over.hold_ended is HoldEnd.EXPIRED
    assert over.run is not None
    assert over.run.kind is Kind.RETURN


def test_a_session_that_ends_while_cards_are_held_returns_nothing() -> None:
    """Gaming station 2 played and quit while gaming station 1's cards are
    held: the GPU node stays off (it would take the held card)."""
    owned = Owned(desired=frozenset({"gaming-2"}), hold=HOLD, gpu_stopped_by_us=True)
    seen = replace(observed(tower("shut_off")), now=BEFORE)
    assert reconcile(seen, owned, Memory()).run is None
    released = reconcile(seen, replace(owned, hold=None), Memory())
    assert released.run is not None
    assert released.run.kind is Kind.RETURN


@pytest.mark.parametrize(
    ("state", "kept"),
    [("running", True), ("paused", True), ("in_shutdown", True), ("shut_off", False)],
)
def test_a_vm_removed_while_it_plays_keeps_its_session_until_it_is_off(
    state: str, kept: bool
) -> None:
    """No longer configured: it stays desired while it holds its cards
    (also paused, or in shutdown between the guest's power-off and QEMU's
    exit), and is forgotten once off (its end is an edge of reconcile)."""
    domains = tower("shut_off", g1=state).domains
    assert known_desired(frozenset({"gaming-1"}), domains, {"gaming-2"}) == (
        frozenset({"gaming-1"}) if kept else frozenset()
    )
    assert known_desired(frozenset({"gaming-1"}), domains, {"gaming-1"}) == frozenset(
        {"gaming-1"}
    )
