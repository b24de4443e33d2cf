"""The controller and the runner as the explorer drives them: every choice
is the product's own pure decision (``core``: reconcile, lends_after,
gpu_stopped_by_us, superseded_hook_requests, job_stopped_gpu_node,
start_by_hand_asks through reconcile), and the runner's steps follow
``runner.py`` branch by branch (one state per await where the world can
move: the drain, a tower job followed, the wait for the node, the settle of
a failed handoff); ``conformance.py`` checks that each operation, run
without interleaving, ends as the real runner's code leaves it. Home Assistant's parts (storage, the lock, events) are
what a restart keeps or loses: the stored records survive it, the memory
and the operation's place do not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from custom_components.gpu_handoff.cluster_model import CORDON_OWNER_US
from custom_components.gpu_handoff.core import (
    HookJobRead,
    JobFacts,
    Kind,
    Memory,
    Observed,
    Origin,
    Owned,
    PendingJob,
    Plan,
    Reconciled,
    Request,
    Settings,
    Settle,
    free_cards,
    gpu_stopped_by_us,
    hook_gpu_stop,
    hook_stopped_gpu_node,
    job_stopped_gpu_node,
    lends_after,
    reconcile,
    returns_after,
    returns_after_stop,
    settle_hook_job,
    start_by_hand_over,
    stop_names,
    stop_releases,
    stopped_by_jobs,
    superseded_hook_requests,
)
from custom_components.gpu_handoff.protocol import (
    RUNNING,
    SHUT_OFF,
    Job,
    JobKind,
    JobRecord,
    JobState,
    JobStep,
    StepName,
)

from .world import (
    CARDS,
    FAILED,
    GPU,
    OTHER,
    VMS,
    TowerJob,
    World,
    at,
    cached_hash,
    hook_time,
    replace,
)

# What every decision reads of the options (the defaults a user has).
BASE = Settings(
    drain_timeout=60.0,
    evict_unmanaged=False,
    handoff_when_cordoned=False,
    auto_return=True,
)


class InvariantError(Exception):
    """An invariant did not hold."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


@dataclass(frozen=True)
class Ctl:
    """The controller: its stored records, its memory, and where the
    operation it runs is (lost on a restart)."""

    __hash__ = cached_hash

    desired: frozenset[str] = frozenset()
    plan: Plan | None = None
    gpu_stopped_by_us: bool = False
    gpu_started_at: str | None = None
    queue: tuple[Request, ...] = ()
    memory: Memory = field(default_factory=Memory)
    running: Request | None = None
    stage: str | None = None
    facts: JobFacts = field(default_factory=JobFacts)
    succeeded: bool = False
    follow_up: bool = False
    old_boot: int | None = None
    errors: frozenset[str] = frozenset()
    dirty: bool = True
    booting: bool = True

    def owned(self) -> Owned:
        return Owned(
            desired=self.desired,
            plan=self.plan,
            queue=self.queue,
            gpu_stopped_by_us=self.gpu_stopped_by_us,
            gpu_started_at=self.gpu_started_at,
        )

    def busy_with(self, vm: str) -> bool:
        """A request for ``vm`` is accepted and not finished (the switch's
        ``already_in_progress``)."""
        return (self.running is not None and self.running.vm == vm) or any(
            request.vm == vm for request in self.queue
        )


@dataclass(frozen=True)
class State:
    world: World
    ctl: Ctl

    __hash__ = cached_hash


@dataclass(frozen=True)
class Model:
    """The options explored."""

    settings: Settings = BASE
    # The decisions, replaceable by a mutant that restores an old behaviour.
    reconcile: Callable[..., Reconciled] = field(default=reconcile, compare=False)
    lends_after: Callable[..., bool] = field(default=lends_after, compare=False)
    stop_releases: Callable[..., bool] = field(default=stop_releases, compare=False)
    stop_names: Callable[..., str | None] = field(default=stop_names, compare=False)
    returns_after: Callable[..., bool] = field(default=returns_after, compare=False)
    returns_after_stop: Callable[..., bool] = field(
        default=returns_after_stop, compare=False
    )
    superseded: Callable[..., set[str]] = field(
        default=superseded_hook_requests, compare=False
    )
    job_stopped_gpu_node: Callable[..., bool] = field(
        default=job_stopped_gpu_node, compare=False
    )
    # Whether a restart keeps the starts by hand dealt with (stored since
    # 0.4; before, every one the tower showed at the start counted as seen).
    seen_stored: bool = True

    @property
    def lend(self) -> bool:
        return self.settings.lend_free

    def observed(self, world: World) -> Observed:
        return Observed(
            tower=world.tower_status(),
            node=world.node_view(),
            configured=frozenset(VMS),
            settings=self.settings,
        )

    # --- what may happen next ------------------------------------------------------

    def free_steps(self, state: State) -> Iterator[tuple[str, State]]:
        """Steps that happen on their own: the controller's next step, a
        tower job's, the node's Ready or NotReady."""
        world, ctl = state.world, state.ctl
        if (nxt := self.controller_step(state)) is not None:
            yield "controller", nxt
        if world.job_runs_next():
            yield "tower_job", State(self.run_job(world), replace(ctl, dirty=True))
        if world.hook_runs_next():
            yield "hook_stop", State(_hook_stop(world), replace(ctl, dirty=True))
        if world.gpu != RUNNING and world.ready:
            yield (
                "node_not_ready",
                State(replace(world, ready_boot=None), replace(ctl, dirty=True)),
            )
        if world.gpu == RUNNING and world.ready_boot != world.boot:
            yield (
                "node_ready",
                State(replace(world, ready_boot=world.boot), replace(ctl, dirty=True)),
            )

    def events(self, state: State) -> Iterator[tuple[str, State]]:
        """What users, players, the operator and Home Assistant may do."""
        world, ctl = state.world, state.ctl
        for vm in VMS:
            if (after := self._request(state, vm, Kind.HANDOFF)) is not None:
                yield f"turn_on {vm}", after
            if (after := self._request(state, vm, Kind.STOP)) is not None:
                yield f"turn_off {vm}", after
            if world.state(vm) != RUNNING:
                yield f"start_by_hand {vm}", State(_start_by_hand(world, vm), ctl)
                if world.gpu == RUNNING and CARDS[vm] not in world.lent:
                    # The agent's record of the GPU node's cards (its last
                    # status) lacks the VM's: the hook does nothing.
                    yield (
                        f"start_by_hand_unseen_by_hook {vm}",
                        State(world.with_vm(vm, RUNNING), replace(ctl, dirty=True)),
                    )
            else:
                quit_world = world.with_vm(vm, SHUT_OFF)
                if vm in ctl.desired:
                    quit_world = _session_ends(quit_world)
                yield f"player_quits {vm}", State(quit_world, replace(ctl, dirty=True))
        yield (
            "return_cards",
            State(
                replace(world, operator_off=False, edge=True),
                replace(ctl, queue=(*ctl.queue, Request(vm=GPU, kind=Kind.RETURN))),
            ),
        )
        if world.gpu == RUNNING:
            yield (
                "operator_stops_gpu_node",
                State(
                    replace(
                        world,
                        gpu=SHUT_OFF,
                        operator_off=not _return_under_way(state),
                        off_by_operator=True,
                    ),
                    replace(ctl, dirty=True),
                ),
            )
        if world.cordon is None:
            yield (
                "operator_cordons",
                State(
                    replace(world, cordon=OTHER, stale_mark=False),
                    replace(ctl, dirty=True),
                ),
            )
        else:
            yield (
                "operator_uncordons",
                State(
                    replace(world, cordon=None, stale_mark=world.our_cordon()),
                    replace(ctl, dirty=True),
                ),
            )
        yield (
            "bare_pod" if not world.bare_pod else "bare_pod_gone",
            State(
                replace(world, bare_pod=not world.bare_pod), replace(ctl, dirty=True)
            ),
        )
        if not world.start_fails:
            yield "next_start_fails", State(replace(world, start_fails=True), ctl)
        if not world.ignores_shutdown:
            yield (
                "gpu_node_ignores_shutdown",
                State(replace(world, ignores_shutdown=True), ctl),
            )
        yield "home_assistant_restarts", State(world, _restarted(ctl))

    def _request(self, state: State, vm: str, kind: Kind) -> State | None:
        """A switch turned on or off (None: refused, nothing changes)."""
        world, ctl = state.world, state.ctl
        if ctl.booting or ctl.busy_with(vm):
            return None
        if kind is Kind.HANDOFF:
            if vm in ctl.desired and world.running(vm):
                return None  # plays already
            if (
                world.gpu_holds(vm)
                and world.cordon == OTHER
                and not self.settings.handoff_when_cordoned
            ):
                return None  # refused: cordoned by someone else
            desired = ctl.desired | {vm}
        else:
            desired = ctl.desired - {vm}
            if world.running(vm):
                world = _session_ends(world)
        request = Request(vm=vm, kind=kind)
        return State(world, replace(ctl, desired=desired, queue=(*ctl.queue, request)))

    # --- the controller ------------------------------------------------------------

    def controller_step(self, state: State) -> State | None:
        """The controller's next step, if it has one now."""
        world, ctl = state.world, state.ctl
        if ctl.booting:
            return State(world, self._start(world, ctl))
        if ctl.running is not None:
            return self._operation_step(state)
        if ctl.queue:
            request, *rest = ctl.queue
            return State(world, _begin(ctl, request, tuple(rest)))
        if ctl.dirty:
            return self._reconcile(world, ctl)
        return None

    def _start(self, world: World, ctl: Ctl) -> Ctl:
        """async_start: the stored records (the starts by hand dealt with
        among them)."""
        shown = frozenset(r.key for r in world.tower_status().hook_requests)
        seen = ctl.memory.seen_hook_requests & shown if self.seen_stored else shown
        ctl = replace(ctl, booting=False, memory=Memory(seen_hook_requests=seen))
        if ctl.plan is not None:
            queue = tuple(r for r in ctl.queue if r.vm != ctl.plan.vm)
            return replace(
                ctl,
                running=ctl.plan.request,
                stage="begin",
                facts=ctl.plan.facts.since(ctl.gpu_started_at),
                queue=queue,
            )
        return ctl

    def _reconcile(self, world: World, ctl: Ctl) -> State:
        result = self.reconcile(self.observed(world), ctl.owned(), ctl.memory)
        ctl = replace(
            ctl,
            desired=result.desired,
            memory=result.memory,
            gpu_stopped_by_us=result.gpu_stopped_by_us,
            dirty=False,
        )
        if result.read_hook_jobs and result.run is None:
            # _read_hook_jobs: an ended job's record never changes, so its
            # read is one step; the decision runs again on what it says.
            return State(world, _read_hook_jobs(world, ctl, result.read_hook_jobs))
        if result.run is not None:
            return State(world, replace(ctl, queue=(*ctl.queue, result.run)))
        return State(replace(world, edge=False), ctl)

    def _operation_step(self, state: State) -> State | None:
        world, ctl = state.world, state.ctl
        assert ctl.running is not None
        step: Callable[[World, Ctl, Request], State | None] = getattr(
            self, f"_stage_{ctl.stage}"
        )
        return step(world, ctl, ctl.running)

    def _stage_begin(self, world: World, ctl: Ctl, request: Request) -> State | None:
        plan = ctl.plan
        assert plan is not None
        if request.kind is Kind.RETURN:
            free = frozenset(free_cards(world.tower_status()))
            memory = replace(ctl.memory, lend_refused=(), lent_for=free)
            ctl = replace(ctl, memory=memory)
        ctl = replace(ctl, errors=ctl.errors - {request.vm})
        if plan.settle is not None:
            ctl = replace(ctl, desired=ctl.desired - {request.vm})
            return State(world, replace(ctl, stage="settle"))
        if plan.job is not None:
            return State(world, replace(ctl, stage="follow"))
        vm = request.vm
        if request.kind is Kind.HANDOFF:
            by_hand = request.hook_job is not None
            if world.running(vm) or (
                by_hand and start_by_hand_over(world.tower_status().domains[vm])
            ):
                return State(world, replace(ctl, stage="hook_record"))
            if world.gpu_holds(vm):
                return State(world, replace(ctl, stage="drain"))
            return _submit(world, ctl, JobKind.START, vm)
        if request.kind is Kind.STOP:
            facts = ctl.facts.stop_began(world.gpu == RUNNING)
            ctl = replace(ctl, facts=facts)
            releases = self.stop_releases(
                world.tower_status(),
                vm,
                self.settings,
                gpu_stopped_by_us=stopped_by_jobs(ctl.gpu_stopped_by_us, ctl.facts),
            )
            named = self.stop_names(world.tower_status(), vm)
            if releases:
                return _submit(world, ctl, JobKind.RELEASE, named)
            if named is not None:
                return _submit(world, ctl, JobKind.STOP, named)
            return self._after_stop(world, ctl, request)
        if self.lend:
            free = world.free()
            if world.gpu == RUNNING:
                if world.lent >= free:
                    return State(world, replace(ctl, stage="node_back", old_boot=None))
                return State(world, replace(ctl, stage="drain"))
            if request.if_running or not free:
                return State(world, _done(ctl, succeeded=True))
            return _submit(world, ctl, JobKind.LEND, None)
        if world.gpu == RUNNING:
            return State(world, replace(ctl, stage="node_back", old_boot=None))
        if request.if_running:
            return State(world, _done(ctl, succeeded=True))
        return _submit(world, ctl, JobKind.RELEASE, None)

    def _stage_drain(self, world: World, ctl: Ctl, request: Request) -> State | None:
        """Cordon (marked as ours unless someone else's), then drain."""
        if world.cordon is None:
            world = replace(world, cordon=CORDON_OWNER_US, stale_mark=False)
        if world.cordon == OTHER and not self.settings.handoff_when_cordoned:
            return self._fail(world, ctl, request, "operator_cordon")
        if world.bare_pod and not self.settings.evict_unmanaged:
            return self._fail(world, ctl, request, "unmanaged_pods")
        if request.if_running and world.gpu != RUNNING:
            # (runner._lend: shut down while it drained, it stays off.)
            return State(world, _done(ctl, succeeded=True))
        kind = JobKind.HANDOFF if request.kind is Kind.HANDOFF else JobKind.LEND
        return _submit(
            world, ctl, kind, request.vm if kind is JobKind.HANDOFF else None
        )

    def _stage_follow(self, world: World, ctl: Ctl, request: Request) -> State | None:
        """Follow the tower job to its end; its record says what it did."""
        job = world.job
        if job is None or not job.ran:
            return None  # it runs on the tower
        assert ctl.plan is not None
        facts = ctl.facts.with_record(_record(job), GPU)
        ctl = replace(ctl, facts=facts, plan=replace(ctl.plan, job=None, facts=facts))
        world = replace(world, job=None)
        if job.failed:
            return self._fail(world, ctl, request, "job_failed")
        if job.kind in (JobKind.HANDOFF, JobKind.START):
            return State(world, replace(ctl, stage="hook_record"))
        if job.kind is JobKind.STOP:
            return self._after_stop(world, ctl, request)
        # DoneJob.booted: only a Ready from a later boot counts after a job
        # that started the GPU node; after one that did not, any Ready.
        started = ctl.old_boot is not None and world.boot != ctl.old_boot
        return State(
            world,
            replace(ctl, stage="node_back", old_boot=ctl.old_boot if started else None),
        )

    def _after_stop(self, world: World, ctl: Ctl, request: Request) -> State:
        """_return_if_nobody_plays."""
        if self.returns_after_stop(
            world.tower_status(),
            request.vm,
            self.settings,
            facts=ctl.facts,
            gpu_stopped_by_us=stopped_by_jobs(ctl.gpu_stopped_by_us, ctl.facts),
        ):
            return _submit(world, ctl, JobKind.RELEASE, None)
        return State(world, _done(ctl, succeeded=True))

    def _stage_hook_record(
        self, world: World, ctl: Ctl, request: Request
    ) -> State | None:
        """A handoff for a start by hand reads the hook's job record (followed
        to its end): whether it shut the GPU node down."""
        if request.hook_job is not None:
            if not world.hook_job_done(request.hook_job):
                return None
            record = _hook_record(world, request.hook_job)
            ctl = replace(ctl, facts=ctl.facts.with_hook_record(record, GPU))
        return State(world, _done(ctl, succeeded=True))

    def _stage_node_back(
        self, world: World, ctl: Ctl, request: Request
    ) -> State | None:
        """Wait for a Ready from a later boot, then lift our own cordon unless
        a tower job stops the GPU node again (overtaken)."""
        fresh = world.ready and (
            ctl.old_boot is None or world.ready_boot != ctl.old_boot
        )
        if not fresh:
            if world.gpu != RUNNING and not world.job_on_gpu():
                return self._fail(world, ctl, request, "node_not_ready")
            return None
        if world.gpu != RUNNING or world.job_on_gpu():
            return State(world, _done(ctl, succeeded=True))  # overtaken
        world = _uncordon(world)
        return State(world, _done(ctl, succeeded=True))

    def _stage_settle(self, world: World, ctl: Ctl, request: Request) -> State | None:
        """settle_failed_handoff: follow the hook's stop, then leave the GPU
        node serving, or say the cards must go back."""
        plan = ctl.plan
        assert plan is not None
        assert plan.settle is not None
        settle = plan.settle
        if settle.hook_job is None and world.hook_stop:
            # (an operation stored before hook jobs were, or a button press
            # while the hook's stop runs): the hook job running now
            settle = replace(settle, hook_job=f"hook-{world.hook_pending[0]}")
            return State(world, replace(ctl, plan=replace(plan, settle=settle)))
        if settle.hook_job is not None and not world.hook_job_done(settle.hook_job):
            return None  # followed to its end
        hook_stopped = False
        if settle.hook_job is not None:
            record = _hook_record(world, settle.hook_job)
            hook_stopped = hook_stopped_gpu_node(
                record, GPU, since=ctl.facts.gpu_started_at
            )
            ctl = replace(ctl, facts=ctl.facts.with_hook_record(record, GPU))
        stopped = settle.stopped_by_us or hook_stopped
        if world.gpu == RUNNING:
            return State(
                _uncordon_if_serving(world),
                _done(ctl, succeeded=False, follow_up=False),
            )
        follow_up = (
            stopped
            and world.gpu == SHUT_OFF
            and not world.job_on_gpu()
            and (bool(world.free()) if self.lend else not _cards_in_play(world))
        )
        return State(world, _done(ctl, succeeded=False, follow_up=follow_up))

    def _stage_after(self, world: World, ctl: Ctl, request: Request) -> State | None:
        """_after: the starts by hand it supersedes (their hook's stops read
        from their records), what the jobs did, whether the cards go back
        (stored as the next plan), then the next request."""
        status = world.tower_status()
        if request.kind in (Kind.HANDOFF, Kind.STOP):
            seen = self.superseded(
                status.hook_requests,
                request,
                ctl.facts,
                succeeded=ctl.succeeded,
                running=frozenset(world.playing()),
            )
            jobs = {
                hook.job
                for hook in status.hook_requests
                if hook.key in seen - ctl.memory.seen_hook_requests
                and hook.job is not None
            }
            if not all(world.hook_job_done(job) for job in jobs):
                return None  # their records are read once they end
            for job in sorted(jobs):
                facts = ctl.facts.with_hook_record(_hook_record(world, job), GPU)
                ctl = replace(ctl, facts=facts)
            ctl = replace(
                ctl,
                memory=replace(
                    ctl.memory,
                    seen_hook_requests=ctl.memory.seen_hook_requests | seen,
                ),
            )
        stopped = gpu_stopped_by_us(ctl.owned(), ctl.facts, status, request)
        ctl = replace(
            ctl,
            gpu_stopped_by_us=stopped,
            gpu_started_at=ctl.facts.since(ctl.gpu_started_at).gpu_started_at,
        )
        decided = {
            "succeeded": ctl.succeeded,
            "facts": ctl.facts,
            "owned": ctl.owned(),
            "waiting": bool(ctl.queue),
            "observed": self.observed(world),
        }
        follow_up = (
            ctl.follow_up
            or self.lends_after(request, **decided)
            or self.returns_after(request, **decided)
        )
        if not follow_up:
            return State(world, _idle(ctl, plan=None))
        back = Request(vm=GPU, kind=Kind.RETURN, origin=Origin.GPU_HANDOFF)
        return State(
            world, _begin(_idle(ctl, plan=Plan(request=back)), back, ctl.queue)
        )

    def _fail(self, world: World, ctl: Ctl, request: Request, code: str) -> State:
        """_failed, then what each kind of operation does after a failure."""
        ctl = replace(ctl, errors=ctl.errors | {request.vm})
        if code == "unmanaged_pods" and request.kind is Kind.RETURN:
            memory = replace(ctl.memory, lend_refused=("default/debug",))
            ctl = replace(ctl, memory=memory)
        if request.kind is Kind.RETURN:
            world = _uncordon_if_serving(world)
        if request.kind is not Kind.HANDOFF:
            return State(world, _done(ctl, succeeded=False))
        assert ctl.plan is not None
        settle = Settle(
            stopped_by_us=self.job_stopped_gpu_node(
                ctl.facts,
                job_failed=code == "job_failed",
                job_pending=ctl.plan.job is not None,
            ),
            hook_job=settle_hook_job(
                request,
                world.tower_status().hook_requests,
                ctl.memory.seen_hook_requests,
            ),
        )
        ctl = replace(
            ctl,
            desired=ctl.desired - {request.vm},
            plan=replace(ctl.plan, job=None, settle=settle),
            stage="settle",
        )
        return State(world, ctl)

    # --- the tower ---------------------------------------------------------------------

    def run_job(self, world: World) -> World:
        """A tower job of GPU Handoff's runs (whatever Home Assistant does)."""
        job = world.job
        assert job is not None
        shut: set[str] = set()
        failed = started = False
        stops = job.kind in (JobKind.STOP, JobKind.RELEASE) and job.vm is not None
        if stops and job.vm is not None and world.running(job.vm):
            # A session ends on a user's request: the cards may go back.
            world = replace(world.with_vm(job.vm, SHUT_OFF), operator_off=False)
            shut.add(job.vm)
        if job.kind in (JobKind.HANDOFF, JobKind.LEND) and world.gpu == RUNNING:
            if world.ignores_shutdown:
                world = replace(world, ignores_shutdown=False)
                failed = True
            else:
                world = replace(world, gpu=SHUT_OFF)
                shut.add(GPU)
        if not failed and job.kind in (JobKind.HANDOFF, JobKind.START):
            assert job.vm is not None
            world, failed = _start_vm(world, job.vm)
        if not failed and job.kind in (JobKind.RELEASE, JobKind.LEND):
            cards = (
                world.free() if job.kind is JobKind.LEND else frozenset(CARDS.values())
            )
            if job.kind is JobKind.RELEASE and _cards_in_play(world):
                failed = world.gpu != RUNNING
            elif world.gpu != RUNNING and cards:
                world = _start_gpu(world, cards)
                started = True
        done = replace(
            job,
            ran=True,
            failed=failed,
            shut_down=frozenset(shut),
            started_gpu=started,
        )
        return replace(world, job=done)


def _session_ends(world: World) -> World:
    """A session GPU Handoff follows ends (the switch turned off, the player
    quitting): a start of the GPU node after it is not held against GPU
    Handoff. (An operator's shutdown before it still excuses a GPU node
    left off: GPU Handoff cannot tell from one look whether the shutdown
    came before or after the session's end.)"""
    return replace(world, operator_off=False, edge=True)


def _return_under_way(state: State) -> bool:
    """The operator shuts down a GPU node a request asks back already (a
    return, or a tower job that starts it): as the chaos soak does, the start
    that follows is not held against GPU Handoff."""
    job, ctl = state.world.job, state.ctl
    if state.world.edge:
        return True
    if job is not None and not job.ran and job.kind in (JobKind.RELEASE, JobKind.LEND):
        return True
    requests = (
        *ctl.queue,
        *((ctl.running,) if ctl.running is not None else ()),
        *((ctl.plan.request,) if ctl.plan is not None else ()),
    )
    # (Not one decided because the GPU node was seen running: its act looks
    # again, and one found off stays off.)
    return any(
        request.kind is Kind.RETURN and not request.if_running for request in requests
    )


def _begin(ctl: Ctl, request: Request, queue: tuple[Request, ...]) -> Ctl:
    plan = ctl.plan if ctl.plan is not None and ctl.plan.request == request else None
    return replace(
        ctl,
        running=request,
        stage="begin",
        queue=queue,
        plan=plan or Plan(request=request),
        facts=(plan.facts if plan is not None else JobFacts()).since(
            ctl.gpu_started_at
        ),
        succeeded=False,
        follow_up=False,
        old_boot=None,
    )


def _done(ctl: Ctl, *, succeeded: bool, follow_up: bool = False) -> Ctl:
    return replace(ctl, stage="after", succeeded=succeeded, follow_up=follow_up)


def _idle(ctl: Ctl, *, plan: Plan | None) -> Ctl:
    return replace(ctl, running=None, stage=None, plan=plan, dirty=True)


def _restarted(ctl: Ctl) -> Ctl:
    """Home Assistant restarts: the stored records stay, nothing else."""
    queue = tuple(r for r in ctl.queue if ctl.plan is None or r.vm != ctl.plan.vm)
    return Ctl(
        desired=ctl.desired,
        plan=ctl.plan,
        gpu_stopped_by_us=ctl.gpu_stopped_by_us,
        gpu_started_at=ctl.gpu_started_at,
        queue=queue,
        memory=Memory(seen_hook_requests=ctl.memory.seen_hook_requests),
    )


def _submit(world: World, ctl: Ctl, kind: JobKind, vm: str | None) -> State:
    """Store the job, then ask the tower for it."""
    assert ctl.plan is not None
    job = PendingJob(kind=kind, domain=vm, request_id="r", job_id="j")
    starts = kind in (JobKind.RELEASE, JobKind.LEND)
    ctl = replace(
        ctl,
        # (Stored with what its jobs did so far, as save_job does.)
        plan=replace(ctl.plan, job=job, facts=ctl.facts),
        stage="follow",
        old_boot=world.boot if starts else None,
    )
    job_on_tower = TowerJob(kind=kind, vm=vm, created=world.clock)
    return State(replace(world, job=job_on_tower, clock=world.clock + 1), ctl)


def _record(job: TowerJob) -> JobRecord:
    # The agent runs one job at a time, in the order they were asked for:
    # the time a job was asked for orders its steps among all jobs.
    when = at(job.created)
    steps = [
        JobStep(
            name=StepName.SHUTDOWN,
            domain=domain,
            started=when,
            finished=when,
            result="ok",
            detail=None,
        )
        for domain in sorted(job.shut_down)
    ]
    if job.started_gpu:
        steps.append(
            JobStep(
                name=StepName.START,
                domain=GPU,
                started=when,
                finished=when,
                result="ok",
                detail="started",
            )
        )
    return JobRecord(
        job=Job(
            id="j",
            kind=job.kind,
            domain=job.vm,
            state=JobState.FAILED if job.failed else JobState.SUCCEEDED,
            step=None,
            request_id="r",
            requested_by="ssh",
            created=at(job.created),
            finished=None,
            error=None,
        ),
        steps=tuple(steps),
    )


def _hook_record(world: World, job_id: str) -> JobRecord:
    """The record of a job of the hook's that ended: its stop of the GPU
    node, skipped if the GPU node was off already."""
    when = at(hook_time(job_id))
    stopped = world.hook_job_stopped(job_id)
    step = JobStep(
        name=StepName.SHUTDOWN,
        domain=GPU,
        started=when,
        finished=when,
        result="ok" if stopped else "skipped",
        detail=None if stopped else "already shut off",
    )
    return JobRecord(
        job=Job(
            id=job_id,
            kind=JobKind.STOP,
            domain=GPU,
            state=JobState.SUCCEEDED,
            step=None,
            request_id=None,
            requested_by="hook",
            created=when,
            finished=when,
            error=None,
        ),
        steps=(step,),
    )


def _cards_in_play(world: World) -> bool:
    return bool(world.playing())


def _start_vm(world: World, vm: str) -> tuple[World, bool]:
    """Start a gaming VM (libvirt's hook runs; a card in use refuses it)."""
    if world.running(vm):
        return world, False
    if world.gpu_holds(vm) or world.start_fails:
        return replace(world.with_vm(vm, FAILED), start_fails=False), True
    return world.with_vm(vm, RUNNING), False


def _start_gpu(world: World, cards: frozenset[str]) -> World:
    """The GPU node starts (a new boot; Ready only once its kubelet posts)."""
    if world.operator_off:
        raise InvariantError(
            "operator_stop_undone",
            "a tower job of GPU Handoff's started the GPU node the operator had "
            "shut down, and no request asked for the cards back since",
        )
    return replace(
        world,
        gpu=RUNNING,
        lent=cards,
        boot=world.boot + 1,
        ready_boot=None,
        off_by_operator=False,
    )


def _start_by_hand(world: World, vm: str) -> World:
    """``virsh start`` on the tower: the hook records it and submits a stop
    of the GPU node; the start fails while the GPU node holds the card."""
    world = replace(
        world,
        hooks=(*world.hooks, (vm, world.clock)),
        clock=world.clock + 1,
        hook_pending=(*world.hook_pending, world.clock),
    )
    if world.gpu_holds(vm) or world.start_fails:
        return replace(world.with_vm(vm, FAILED), start_fails=False)
    return world.with_vm(vm, RUNNING)


def _hook_stop(world: World) -> World:
    """The first of the hook's stops runs (the agent runs one job at a time)."""
    first, *rest = world.hook_pending
    stopped = world.hook_stopped | ({first} if world.gpu == RUNNING else set())
    return replace(world, gpu=SHUT_OFF, hook_pending=tuple(rest), hook_stopped=stopped)


def _uncordon(world: World) -> World:
    """Lift our own cordon (an operator's stays)."""
    if not world.our_cordon():
        return world
    if world.job_on_gpu():
        raise InvariantError(
            "rollback_under_running_job",
            "GPU Handoff lifted its cordon while a tower job may stop the GPU node",
        )
    return replace(world, cordon=None)


def _uncordon_if_serving(world: World) -> World:
    if world.gpu == RUNNING and not world.job_on_gpu():
        return _uncordon(world)
    return world


def _read_hook_jobs(world: World, ctl: Ctl, jobs: tuple[str, ...]) -> Ctl:
    """What the hook's ended jobs did, remembered; then reconcile again."""
    read = frozenset(
        HookJobRead(job, hook_gpu_stop(_hook_record(world, job), GPU))
        for job in jobs
        if world.hook_job_done(job)
    )
    memory = ctl.memory
    return replace(
        ctl,
        memory=replace(memory, hook_jobs_read=memory.hook_jobs_read | read),
        dirty=bool(read),
    )
