"""The explorer's runner against the product's: the model follows
``runner.py`` branch by branch as steps it can interleave, and this checks
that it does what the real ``OperationRunner`` does.

From each state the explorer reaches where an operation begins, the same
operation runs twice with nothing else happening: once as the model's steps
(its tower job run as soon as it is asked for, the node's Ready and NotReady
as soon as they are due), once as the real runner's code driven against the
same world through in-process stand-ins of the tower and cluster clients
(each call reads or changes the model's world: a job runs when the runner
first reads it, the node becomes Ready when the runner waits for it) and the
glue of ``operations.py`` (a failed handoff is settled with the same inputs).
Both must leave the same world, the same job facts, the same verdict and the
same follow-up. The drain is the one part stood in for: the real one is
proved against the Kubernetes emulator (tests/test_drain_like_kubectl.py);
here it refuses a pod nothing recreates unless forced, as kubectl does.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from unittest.mock import patch

from custom_components.gpu_handoff import runner as runner_module
from custom_components.gpu_handoff.cluster_client import UnmanagedPodsError
from custom_components.gpu_handoff.cluster_model import (
    CORDON_OWNER_US,
    DrainProgress,
    NodeView,
)
from custom_components.gpu_handoff.core import (
    JobFacts,
    Kind,
    PendingJob,
    Settle,
    job_stopped_gpu_node,
    settle_hook_job,
)
from custom_components.gpu_handoff.jobs import JobFailedError
from custom_components.gpu_handoff.protocol import (
    RUNNING,
    JobRecord,
    JobState,
    Submitted,
    TowerStatus,
)
from custom_components.gpu_handoff.runner import OperationRunner

from .model import Ctl, InvariantError, Model, State, _hook_record, _record
from .world import GPU, TowerJob, World, hook_time


@dataclass
class Outcome:
    """What one operation left: compared between the model and the product."""

    world: World
    facts: JobFacts
    failed: bool
    follow_up: bool

    def key(self) -> tuple[Any, ...]:
        facts = self.facts
        return (
            self.world,
            facts.stopped_gpu_node,
            facts.started_gpu_node,
            facts.shut_down,
            facts.gpu_started_at,
            facts.gpu_was_running,
            self.failed,
            self.follow_up,
        )


# --- the model's run -----------------------------------------------------------------

# The steps that happen on their own, in the order they are taken here: a
# job runs as soon as it is asked for, the node's Ready follows the GPU node.
_ORDER = ("tower_job", "node_not_ready", "node_ready", "controller")


def modelled(model: Model, state: State) -> Outcome:
    """The operation begun at ``state`` as the model's steps, to its end."""
    for _ in range(100):
        ctl = state.ctl
        if ctl.stage == "after":
            return Outcome(
                world=state.world,
                facts=ctl.facts,
                failed=not ctl.succeeded,
                follow_up=ctl.follow_up,
            )
        steps = dict(model.free_steps(state))
        label = next((name for name in _ORDER if name in steps), None)
        if label is None:
            raise AssertionError(f"the model's operation is stuck at {ctl.stage}")
        state = steps[label]
    raise AssertionError("the model's operation does not end")


# --- the product's run ---------------------------------------------------------------


@dataclass
class Stand:
    """The world the stand-ins read and change."""

    world: World

    def settle_node(self) -> None:
        """The node's Ready follows the GPU node at once: NotReady once it
        is off (the grace period over), Ready from its new boot once it runs
        (its kubelet posted), as the model's steps take them here."""
        world = self.world
        if world.gpu != RUNNING and world.ready:
            self.world = replace(world, ready_boot=None)
        elif world.gpu == RUNNING and world.ready_boot != world.boot:
            self.world = replace(world, ready_boot=world.boot)


class FakeTower:
    """The tower client's calls the runner makes, on the model's world."""

    session = None

    def __init__(self, stand: Stand, model: Model) -> None:
        self.stand = stand
        self.model = model

    async def status(self) -> TowerStatus:
        return self.stand.world.tower_status()

    async def submit(self, kind: Any, domain: str | None, request_id: str) -> Any:
        world = self.stand.world
        assert world.job is None or world.job.ran, "a second job asked for"
        job = TowerJob(kind=kind, vm=domain, created=world.clock)
        self.stand.world = replace(world, job=job, clock=world.clock + 1)
        return Submitted(id="j", kind=kind, state=JobState.QUEUED, existing=False)

    async def find_request(self, request_id: str) -> JobRecord | None:
        raise AssertionError("no reply is lost here")

    async def job(self, job_id: str) -> JobRecord:
        if job_id.startswith("hook-"):
            world = self.stand.world
            assert hook_time(job_id) not in world.hook_pending
            return _hook_record(world, job_id)
        world = self.stand.world
        assert world.job is not None
        if not world.job.ran:
            world = self.model.run_job(world)
        self.stand.world = world
        self.stand.settle_node()
        assert self.stand.world.job is not None
        return _record(self.stand.world.job)


class FakeCluster:
    """The cluster client's calls the runner makes, on the model's world."""

    def __init__(self, stand: Stand) -> None:
        self.stand = stand

    async def cordon(self, name: str, mark: str) -> str:
        world = self.stand.world
        if world.cordon is None:
            world = replace(world, cordon=CORDON_OWNER_US, stale_mark=False)
            self.stand.world = world
        assert world.cordon is not None
        return world.cordon

    async def uncordon(self, name: str) -> bool:
        world = self.stand.world
        if not world.our_cordon():
            return False
        if world.job_on_gpu():
            raise InvariantError(
                "rollback_under_running_job",
                "GPU Handoff lifted its cordon while a tower job may stop it",
            )
        self.stand.world = replace(world, cordon=None)
        return True

    async def boot_id(self, name: str) -> str | None:
        return str(self.stand.world.boot)

    async def node_view(self, name: str) -> NodeView:
        return self.stand.world.node_view()

    async def wait_ready(
        self, name: str, timeout: float, *, not_boot: str | None = None
    ) -> NodeView:
        world = self.stand.world
        if world.ready and (not_boot is None or str(world.ready_boot) != not_boot):
            return world.node_view()
        raise TimeoutError("not Ready")

    async def wait_gpus(self, *args: Any, **kwargs: Any) -> NodeView:
        raise AssertionError("the model's node advertises its GPUs with Ready")


@dataclass
class FakeHost:
    """The runner's host: the stored job, and nothing shown."""

    job: PendingJob | None = None
    steps: list[str] = field(default_factory=list)

    @property
    def pending_job(self) -> PendingJob | None:
        return self.job

    async def save_job(self, job: PendingJob | None) -> None:
        self.job = job

    def step(self, step: str) -> None:
        self.steps.append(step)

    def phase(self, phase: str) -> None:
        pass

    def show_tower(self, status: TowerStatus) -> None:
        pass

    def show_node(self, view: NodeView) -> None:
        pass

    def show_cordon(self, owner: str | None) -> None:
        pass

    def drain_progress(self, progress: DrainProgress) -> None:
        pass


def _drain_of(stand: Stand) -> Callable[[Any], Any]:
    """kubectl drain as the model has it: a pod nothing recreates is refused
    unless forced; anything else is evicted at once."""

    class Drain:
        def __init__(self, cluster: Any, events: Any = None) -> None:
            pass

        async def run(self, name: str, timeout: float, progress: Any, **kw: Any) -> Any:
            done = DrainProgress(pods_left=0, evictions_refused=0, evicted=0)
            if stand.world.bare_pod and not kw.get("force"):
                raise UnmanagedPodsError(name, ("default/debug",), done)
            return done

    return Drain


async def produced(model: Model, state: State) -> Outcome:
    """The operation begun at ``state`` as the real runner does it."""
    ctl = state.ctl
    request = ctl.running
    assert request is not None
    assert ctl.plan is not None
    stand = Stand(state.world)
    stand.settle_node()
    host = FakeHost()
    runner = OperationRunner(
        FakeTower(stand, model),  # type: ignore[arg-type]
        FakeCluster(stand),  # type: ignore[arg-type]
        gpu_node=GPU,
        k8s_node=GPU,
        host=host,
    )
    runner.facts = ctl.facts
    host.job = ctl.plan.job  # resumed: the stored job
    settings = model.settings
    failed = follow_up = False
    with patch.object(runner_module, "NodeDrain", _drain_of(stand)):
        try:
            if ctl.plan.settle is not None:
                # Resumed after a restart: what the failed handoff left.
                failed = True
                settle = ctl.plan.settle
                follow_up = await runner.settle_failed_handoff(
                    settle.stopped_by_us, settings, settle.hook_job
                )
            elif request.kind is Kind.HANDOFF:
                await runner.handoff(request.vm, settings, hook_job=request.hook_job)
            elif request.kind is Kind.STOP:
                await runner.stop(
                    request.vm, settings, gpu_stopped_by_us=ctl.gpu_stopped_by_us
                )
            else:
                await runner.return_cards(settings, if_running=request.if_running)
        except InvariantError:
            raise
        except Exception as err:  # noqa: BLE001 - as operations._attempt
            failed = True
            if request.kind is Kind.RETURN:
                await runner.uncordon_if_serving()
            if request.kind is Kind.HANDOFF:
                settle = Settle(
                    stopped_by_us=job_stopped_gpu_node(
                        runner.facts,
                        job_failed=isinstance(err, JobFailedError),
                        job_pending=host.job is not None,
                    ),
                    hook_job=settle_hook_job(
                        request,
                        stand.world.tower_status().hook_requests,
                        ctl.memory.seen_hook_requests,
                    ),
                )
                follow_up = await runner.settle_failed_handoff(
                    settle.stopped_by_us, settings, settle.hook_job
                )
    world = stand.world
    if world.job is not None and world.job.ran:
        world = replace(world, job=None)  # followed: as the model leaves it
    return Outcome(world=world, facts=runner.facts, failed=failed, follow_up=follow_up)


# --- where operations begin -----------------------------------------------------------


def beginnings(model: Model, depth: int) -> Iterator[State]:
    """Every state within ``depth`` events where an operation begins, afresh
    or resumed after a restart (its stored job, or what a failed handoff
    left to settle), with no stop of libvirt's hook waiting to run (it
    would interleave)."""
    root = State(World(), Ctl(booting=False))
    seen = {root}
    queue: deque[tuple[State, int]] = deque([(root, 0)])
    while queue:
        state, used = queue.popleft()
        ctl = state.ctl
        if (
            ctl.stage == "begin"
            and ctl.plan is not None
            and not state.world.hook_pending
        ):
            yield state
        steps: list[tuple[State, int]] = []
        try:
            steps.extend((nxt, used) for _, nxt in model.free_steps(state))
            if used < depth:
                steps.extend((nxt, used + 1) for _, nxt in model.events(state))
        except InvariantError:
            continue
        for nxt, cost in steps:
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, cost))


def compare(model: Model, depth: int) -> tuple[int, list[str]]:
    """How many operations were compared, and how each that differs did."""
    differences: list[str] = []
    compared = 0
    loop = asyncio.new_event_loop()
    try:
        for state in beginnings(model, depth):
            try:
                expected = modelled(model, state)
            except InvariantError:
                continue  # the explorer reports it
            actual = loop.run_until_complete(produced(model, state))
            compared += 1
            if actual.key() != expected.key():
                differences.append(_difference(state, expected, actual))
    finally:
        loop.close()
    return compared, differences


def _difference(state: State, expected: Outcome, actual: Outcome) -> str:
    request = state.ctl.running
    return (
        f"{request}\n  from  {state.world}\n  model {expected.key()}\n"
        f"  real  {actual.key()}"
    )
