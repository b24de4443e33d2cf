"""Carrying out one operation: its work (the runner's), what follows it, and
what a failed or abandoned one leaves; no decisions of its own beyond calling
those of ``core`` with what the operation's jobs did."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
import datetime as dt
import logging
from typing import Final

from homeassistant.util import dt as dt_util

from .cluster_client import ClusterError, UnmanagedPodsError
from .const import EVENT_HANDOFF_STARTED
from .coordinator import GpuHandoffCoordinator
from .core import (
    Hold,
    Kind,
    PendingJob,
    Plan,
    Request,
    Settle,
    free_cards,
    hold_after,
    job_stopped_gpu_node,
    lends_after,
    returns_after,
    returns_after_stop,
    settle_hook_job,
    stopped_by_jobs,
    superseded_hook_requests,
)
from .jobs import JobFailedError
from .owned import OwnedState
from .progress import OperationProgress
from .protocol import RUNNING
from .report import Reporter, transient
from .runner import OperationRunner
from .tower_client import AgentCommandError, TowerConnectionError

_LOGGER = logging.getLogger(__name__)

# Retries of a passing failure: the first after this many seconds, then
# twice as long each time, at most RETRY_MAX apart.
RETRY_START: Final = 0.5
RETRY_MAX: Final = 10.0
# The step an operation shows while it waits to try again (translated).
STEP_RETRYING: Final = "retrying"


class Retry:
    """An operation's retries of failures the world heals by itself
    (report.transient: the SSH connection, the agent's session, the API
    server or libvirt away for a moment): with backoff, until ``bound``
    seconds (the drain timeout) after the first one; the last try is made
    at the bound, so an outage that ends within it is always seen ended."""

    def __init__(self, bound: float) -> None:
        """Nothing is tried again until a failure is."""
        self.bound = bound
        self.deadline: float | None = None
        self.delay = RETRY_START
        self.tries = 0

    async def again(
        self, request: Request, err: Exception, waiting: Callable[[], None]
    ) -> bool:
        """After ``err``: wait and say True when the work should be tried
        again (``waiting`` is told first), or say False at once (not
        transient, or the bound passed)."""
        if not transient(err):
            return False
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.deadline is None:
            self.deadline = now + self.bound
        if now >= self.deadline:
            # (The failure itself is logged as a warning where it is reported.)
            _LOGGER.info(
                "The %s of %s still fails after %d tries in %.0f s: %s",
                request.kind,
                request.vm,
                self.tries + 1,
                self.bound,
                err,
            )
            return False
        wait = min(self.delay, self.deadline - now)
        _LOGGER.info(
            "The %s of %s met a passing failure (%s); trying again in %.1f s",
            request.kind,
            request.vm,
            err,
            wait,
        )
        waiting()
        await asyncio.sleep(wait)
        self.delay = min(self.delay * 2, RETRY_MAX)
        self.tries += 1
        return True


class Operations:
    """Runs operations for one tower, one at a time (the controller holds
    the lock), with the records of ``state`` stored at each step."""

    def __init__(
        self,
        state: OwnedState,
        *,
        coordinator: GpuHandoffCoordinator,
        runner: OperationRunner,
        progress: OperationProgress,
        report: Reporter,
        lock: asyncio.Lock,
    ) -> None:
        """Nothing runs until an operation is asked for."""
        self.state = state
        self.coordinator = coordinator
        self.runner = runner
        self.progress = progress
        self.report = report
        self._lock = lock

    async def operate(self, request: Request, resume: bool) -> tuple[bool, bool]:
        """Run one operation (the lock held): whether it succeeded, and whether
        the cards must go back to the cluster after it (a return, already
        stored as the next operation)."""
        if not resume or self.state.plan is None:
            self.state.plan = Plan(request=request)
            # (What it does to cards held for a gaming VM: core.hold_after.)
            self.state.hold = hold_after(self.state.hold, request)
            await self.state.save()
        plan = self.state.plan
        request, vm, kind = plan.request, plan.vm, plan.kind
        # A return lends again after a refused lend, or says why not.
        relend = kind is Kind.RETURN and bool(self.state.memory.lend_refused)
        if kind is Kind.RETURN:
            free = frozenset(
                free_cards(self.coordinator.data.tower, self.state.held_vm)
            )
            self.state.memory = replace(
                self.state.memory, lend_refused=(), lent_for=free
            )
        self.progress.begin(vm, kind)
        if plan.settle is None:
            self.report.fire(EVENT_HANDOFF_STARTED, vm, kind=kind)
        self.progress.publish()
        returned = follow_up = False
        # What its jobs did so far (stored: a resumed operation keeps them).
        self.runner.facts = plan.facts.since(self.state.gpu_started_at)
        try:
            if plan.settle is not None:
                # It failed before a restart; what it left is settled now.
                self.state.desired.discard(vm)
                succeeded, follow_up = False, await self._settle(request, plan.settle)
            else:
                succeeded, returned, follow_up = await self._attempt(request)
        except asyncio.CancelledError:
            # Home Assistant stops or the entry unloads: keep the plan so the
            # next start resumes the operation.
            self.progress.end()
            raise
        follow_up = await self._after(request, succeeded=succeeded, follow_up=follow_up)
        if not succeeded:
            return False, follow_up
        # A return succeeds only when the cluster has its cards back.
        unhealthy = self.runner.returned_unhealthy if returned else None
        if unhealthy is not None:
            self.progress.last_error[vm] = unhealthy.message
        self.report.succeeded(
            request,
            gpu_node=self.coordinator.data.tower.gpu_node,
            returned=returned,
            relend=relend,
            unhealthy=unhealthy,
            came_back=self.runner.facts.pods_came_back,
            hold=self.state.hold if kind is Kind.PREPARE else None,
        )
        return True, follow_up

    async def _after(
        self, request: Request, *, succeeded: bool, follow_up: bool
    ) -> bool:
        """After an operation's work: observe afresh, record what its jobs
        did, decide whether the cards go back (stored as the next plan), and
        store. True when a return follows."""
        # Fresh state before anything reconciles again: a stale snapshot
        # (say, the cordon just lifted) would start the same work twice.
        await self.coordinator.async_refresh()
        if request.kind in (Kind.HANDOFF, Kind.STOP):
            await self._supersede(request, succeeded=succeeded)
        facts = self.runner.facts
        self.state.record_facts(facts, request)
        self.progress.end()
        self.state.requests.pop(request.vm, None)
        # Lending: the free cards go back after the last of a burst of
        # requests (core.lends_after); not lending, after a stop that left
        # the GPU node GPU Handoff stopped off with nobody playing.
        owned, waiting, observed = (
            self.state.owned(),
            bool(self.state.requests),
            self.state.observed(),
        )
        follow_up = (
            follow_up
            or lends_after(
                request,
                succeeded=succeeded,
                facts=facts,
                owned=owned,
                waiting=waiting,
                observed=observed,
            )
            or returns_after(
                request,
                succeeded=succeeded,
                facts=facts,
                owned=owned,
                waiting=waiting,
                observed=observed,
            )
        )
        self.state.plan = self.state.return_plan() if follow_up else None
        await self.state.save()
        return follow_up

    async def _supersede(self, request: Request, *, succeeded: bool) -> None:
        """The starts by hand a handoff or stop supersedes are dealt with;
        what their hook's stops of the GPU node did counts as GPU Handoff's
        (read from their records)."""
        status = self.coordinator.data.tower
        seen = superseded_hook_requests(
            status.hook_requests,
            request,
            self.runner.facts,
            succeeded=succeeded,
            running=frozenset(
                vm for vm, domain in status.domains.items() if domain.state == RUNNING
            ),
        )
        # (A stop of theirs before a job of GPU Handoff's started the GPU
        # node does not count: JobFacts.with_hook_record.)
        await self.runner.read_hook_jobs(
            hook.job
            for hook in status.hook_requests
            if hook.key in seen - self.state.memory.seen_hook_requests
            and hook.job is not None
        )
        self.state.memory = replace(
            self.state.memory,
            seen_hook_requests=self.state.memory.seen_hook_requests | seen,
        )

    async def _attempt(self, request: Request) -> tuple[bool, bool, bool]:
        """Do the operation's work: whether it succeeded, whether the cards
        went back to the cluster, and whether they must go back after it.
        A failure the world heals by itself is tried again (``Retry``)."""
        vm, kind = request.vm, request.kind
        retry = Retry(self.state.settings.drain_timeout)
        while True:
            try:
                returned = await self._work(request)
            except Exception as err:  # noqa: BLE001 - every failure must end the operation
                if self._wanted(request) and await retry.again(
                    request, err, lambda: self.progress.step(STEP_RETRYING)
                ):
                    continue
                await self.failed(vm, kind, err)
                if kind is Kind.RETURN:
                    # A return that drained a lending GPU node and then failed:
                    # our cordon goes if the GPU node still serves.
                    await self.runner.uncordon_if_serving()
                if not kind.hands_over:
                    return False, False, False
                self.state.desired.discard(vm)
                return False, False, await self._settle(request, None, err)
            if kind is Kind.PREPARE:
                self._hold(request)
            return True, returned, False

    def _hold(self, request: Request) -> None:
        """A prepare is done: its VM's cards are held for it from now on,
        unless it runs already (its player started it meanwhile)."""
        domain = self.coordinator.data.tower.domains.get(request.vm)
        if domain is None or domain.state == RUNNING:
            return
        until = dt_util.utcnow() + dt.timedelta(seconds=request.hold)
        self.state.hold = Hold(vm=request.vm, until=until.isoformat())
        _LOGGER.info(
            "The cards of %s are held for it until %s", request.vm, until.isoformat()
        )

    async def _work(self, request: Request) -> bool:
        """The runner's part of the operation (resumed from the stored plan
        when tried again: a tower job already asked for is followed, not
        asked for twice); whether the cards went back to the cluster."""
        settings = self.state.settings
        if request.kind is Kind.HANDOFF:
            await self.runner.handoff(request.vm, settings, hook_job=request.hook_job)
            return False
        if request.kind is Kind.PREPARE:
            await self.runner.prepare(request.vm, settings)
            return False
        if request.kind is Kind.STOP:
            return await self.runner.stop(
                request.vm,
                settings,
                gpu_stopped_by_us=self.state.gpu_stopped_by_us,
                held=self.state.hold is not None,
            )
        return await self.runner.return_cards(
            settings, if_running=request.if_running, keep=self.state.held_vm
        )

    def _wanted(self, request: Request) -> bool:
        """Whether the request still stands: its gaming VM is still one of
        GPU Handoff's (a return always is). No other request for the VM can
        be accepted while it runs."""
        return request.kind is Kind.RETURN or request.vm in self.state.configured_vms

    async def _settle(
        self, request: Request, settle: Settle | None, err: Exception | None = None
    ) -> bool:
        """Leave what a failed handoff left safe (see the runner's
        ``settle_failed_handoff``), stored first so a restart finishes it.
        True when a return must follow."""
        if settle is None:
            settle = Settle(
                stopped_by_us=job_stopped_gpu_node(
                    self.runner.facts,
                    job_failed=isinstance(err, JobFailedError),
                    job_pending=self.state.plan is not None
                    and self.state.plan.job is not None,
                ),
                hook_job=settle_hook_job(
                    request,
                    self.coordinator.data.tower.hook_requests,
                    self.state.memory.seen_hook_requests,
                ),
            )
            if self.state.plan is not None:
                self.state.plan = replace(self.state.plan, job=None, settle=settle)
                await self.state.save()
        retry = Retry(self.state.settings.drain_timeout)
        while True:
            try:
                return await self.runner.settle_failed_handoff(
                    settle.stopped_by_us, self.state.settings, settle.hook_job
                )
            except (TowerConnectionError, AgentCommandError, ClusterError) as failed:
                # libvirt or the tower away for a moment: tried again, for
                # what the hook's stop did decides whether the cards go back
                # (chaos seed 2718, cycle 46: given up at once, the GPU node
                # the hook shut down stayed off with nobody playing).
                if await retry.again(
                    request, failed, lambda: self.progress.step(STEP_RETRYING)
                ):
                    continue
                # The tower still cannot tell: when GPU Handoff's own job
                # stopped the GPU node, the return decides (it reads the
                # tower again, and fails with a report if it is still away).
                _LOGGER.warning("Could not settle the failed handoff: %s", failed)
                return settle.stopped_by_us

    async def save_job(self, job: PendingJob | None) -> None:
        """Store the operation's tower job (before it is asked for), and
        what its jobs did so far (once one has ended)."""
        if self.state.plan is not None:
            self.state.plan = replace(self.state.plan, job=job, facts=self.runner.facts)
            await self.state.save()

    async def abandon(self) -> None:
        """End an operation whose gaming VM is no longer configured: follow a
        tower job it asked for to its end, then leave things as a finished
        operation would. A handoff that gave the VM its cards keeps its
        session (the cards go back when the VM stops); one that did not is
        settled as a failed handoff (the cards go back if GPU Handoff stopped
        the GPU node); anything else lifts our own cordon if the GPU node
        still serves."""
        async with self._lock:
            plan = self.state.plan
            if plan is None:
                return
            self.runner.facts = plan.facts.since(self.state.gpu_started_at)
            err: Exception | None = None
            if plan.settle is None:
                try:
                    await self.runner.finish_job()
                except Exception as failed:  # noqa: BLE001 - settled below
                    err = failed
                    # Reported as any failed operation is: the request the
                    # user made before the removal did not happen.
                    await self.failed(plan.vm, plan.kind, err)
                if plan.request.hook_job is not None:
                    # As a handoff for a start by hand does once its job
                    # ended: what the hook's stop did counts as its own (a
                    # stored settle reads it itself).
                    await self.runner.read_hook_jobs((plan.request.hook_job,))
            await self.coordinator.async_refresh()
            follow_up = await self._left_behind(plan, err)
            self.state.plan = self.state.return_plan() if follow_up else None
            await self.state.save()
            if follow_up:
                await self.follow_up_return()
                self.progress.publish()

    async def _left_behind(self, plan: Plan, err: Exception | None) -> bool:
        """Leave what the abandoned operation left as a finished one would:
        True when a return must follow."""
        request, vm, kind = plan.request, plan.vm, plan.kind
        facts = self.runner.facts
        self.state.record_facts(facts, request)
        status = self.coordinator.data.tower
        domain = status.domains.get(vm)
        kept = err is None and domain is not None and domain.state == RUNNING
        if kind is Kind.PREPARE or (kind is Kind.HANDOFF and not kept):
            # (A prepare whose VM is no longer GPU Handoff's holds nothing.)
            self.state.desired.discard(vm)
            return await self._settle(request, plan.settle, err)
        if kind is Kind.HANDOFF:
            self.state.desired.add(vm)
        else:
            await self.runner.uncordon_if_serving()
        if kind is Kind.STOP and returns_after_stop(
            status,
            vm,
            self.state.settings,
            facts=facts,
            gpu_stopped_by_us=stopped_by_jobs(self.state.gpu_stopped_by_us, facts),
            held=self.state.hold is not None,
        ):
            # As the stop would have at its end (the runner's
            # _return_if_nobody_plays): it shut its VM down and nobody plays
            # any more (the other player quit meanwhile), so the cards go
            # back (chaos seed 2718, cycle 30).
            return True
        # Lending: a handoff that gave the VM its cards, or a stop that freed
        # them (or, failed, was merged with requests that changed what is
        # free).
        return kind is not Kind.RETURN and lends_after(
            request,
            succeeded=err is None,
            facts=facts,
            owned=self.state.owned(),
            waiting=bool(self.state.requests),
            observed=self.state.observed(),
        )

    async def follow_up_return(self) -> None:
        """The cards go back after an operation that left the GPU node off
        (GPU Handoff stopped it), as a return of its own, stored before that
        operation ended (so a restart resumes it). The lock is held."""
        request = self.state.plan.request if self.state.plan is not None else None
        if request is None:
            return
        self.state.requests.setdefault(request.vm, request)
        try:
            await self.operate(request, resume=True)
        finally:
            self.state.request_done(request)

    async def failed(self, vm: str, kind: Kind, err: Exception) -> None:
        """Report a failure every way a user may look (report.Reporter), and
        show it on the switch and the sensor (``last_error``)."""
        if isinstance(err, UnmanagedPodsError) and kind is Kind.RETURN:
            self.state.memory = replace(self.state.memory, lend_refused=err.pods)
        self.progress.failed(vm, self.report.failed(vm, kind, err))
