"""The handoff controller: the loop around the pure decisions of ``core``.

It accepts requests (a switch, an action, a voice command), reconciles after
each update (core.reconcile: starts by hand, ended sessions, automatic return,
lending, the leftover-cordon net), and runs one operation per tower at a time.
What it owns is owned.OwnedState's, stored so an operation interrupted by a
Home Assistant restart or a dropped SSH connection is resumed; an operation is
carried out by operations.Operations, its work done by runner.OperationRunner
and shown by progress.OperationProgress. Nothing here can destroy a VM: the
tower agent offers no such verb.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import replace
import datetime as dt
import logging
from typing import Any, Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import CALLBACK_TYPE, HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers.event import async_track_point_in_utc_time
from homeassistant.util import dt as dt_util

from .cluster_client import ClusterError
from .cluster_events import NodeEvents
from .const import (
    CONF_GPU_NODE,
    DOMAIN,
    EVENT_HOLD_EXPIRED,
)
from .coordinator import GpuHandoffCoordinator
from .core import (
    Hold,
    HoldEnd,
    HookJobRead,
    Kind,
    Memory,
    PendingJob,
    Plan,
    Request,
    hook_gpu_stop,
    reconcile,
)
from .operations import Operations
from .owned import OwnedState
from .progress import OperationProgress
from .protocol import RUNNING, JobRecord
from .report import Reporter
from .runner import (
    OperationRunner,
    RunnerError,
    check_operator_cordon,
    node_holds_cards_of,
)
from .tower_client import TowerClient, TowerError

_LOGGER = logging.getLogger(__name__)

# While cards are held: the time left is shown anew this often, and a hold
# that ended while an operation ran is looked at again this soon.
HOLD_TICK: Final = dt.timedelta(minutes=1)
HOLD_BUSY_RETRY: Final = dt.timedelta(seconds=1)


class HandoffController:
    """Drives handoffs and returns for one tower: the loop around the pure
    decisions of ``core`` (observe, decide, act, store)."""

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        coordinator: GpuHandoffCoordinator,
    ) -> None:
        """Nothing runs until ``async_start``."""
        self.hass = hass
        self.coordinator = coordinator
        self._entry = entry
        self._lock = asyncio.Lock()
        self.state = OwnedState(hass, entry, coordinator)
        self.report = Reporter(hass, entry, coordinator.k8s_node)
        self.progress = OperationProgress(
            coordinator,
            self.report,
            requests=lambda: self.state.requests,
            job=lambda: self.plan.job if self.plan is not None else None,
            save_job=self._save_job,
            hold=lambda: self.state.hold,
        )
        # What the operations do to the GPU node's Kubernetes node, told to
        # the cluster as Events (posted by a task of the entry's: async_start).
        self.events = NodeEvents(coordinator.cluster, coordinator.k8s_node)
        self.runner = OperationRunner(
            coordinator.tower,
            coordinator.cluster,
            gpu_node=entry.data[CONF_GPU_NODE],
            k8s_node=coordinator.k8s_node,
            host=self.progress,
            events=self.events,
        )
        self.operations = Operations(
            self.state,
            coordinator=coordinator,
            runner=self.runner,
            progress=self.progress,
            report=self.report,
            lock=self._lock,
        )
        # Work an update asked for besides an operation (removing a stale
        # mark, reading the hook's job records), one of each kind at a time.
        self._side: dict[str, asyncio.Task[None]] = {}
        # When to look at the cards held for a gaming VM again (_arm_hold);
        # none once the entry unloads (an operation ending as it is cancelled
        # would arm one on a controller nothing runs any more).
        self._hold_timer: CALLBACK_TYPE | None = None
        self._watch_holds = True

    async def _save_job(self, job: PendingJob | None) -> None:
        await self.operations.save_job(job)

    @property
    def desired(self) -> set[str]:
        """The gaming VMs that should play."""
        return self.state.desired

    @property
    def plan(self) -> Plan | None:
        """The operation in flight, as stored."""
        return self.state.plan

    @property
    def memory(self) -> Memory:
        """What is remembered between updates."""
        return self.state.memory

    @property
    def requests(self) -> dict[str, Kind]:
        """What each accepted, unfinished request asks for, by VM."""
        return {vm: request.kind for vm, request in self.state.requests.items()}

    # --- persistence ---------------------------------------------------------

    async def async_start(self) -> None:
        """Load the desired state and resume what an earlier run left."""
        self._entry.async_create_background_task(
            self.hass, self.events.run(), f"{DOMAIN} Kubernetes events"
        )
        owned = await self.state.load()
        if owned.hold is not None:
            self.progress.publish()  # the Handoff state shows it from the start
        status = self.coordinator.data.tower
        self.state.forget_unknown_vms()
        known = self.state.configured_vms | {status.gpu_node}
        if self.plan is not None:
            request = self.plan.request
            if request.vm in known:
                _LOGGER.info(
                    "Resuming the %s of %s after a restart", request.kind, request.vm
                )
                self._spawn(self._run(request, resume=True))
            else:
                # Its gaming VM was removed meanwhile: end it at a safe point.
                self._spawn(self.operations.abandon())
        # Requests that waited behind it, in the order they came.
        for request in owned.queue:
            if request.vm in self.state.requests:
                continue
            if request.vm not in known:
                # Removed from GPU Handoff while it waited: it will not run,
                # and the user is told so.
                message = self.report.dropped(request.vm, request.kind)
                self.progress.failed(request.vm, message)
                continue
            _LOGGER.info(
                "Carrying out the %s of %s asked for before a restart",
                request.kind,
                request.vm,
            )
            self.state.requests[request.vm] = request
            self._spawn(self._run(request))
        if owned.seen_hook_requests is None:
            # Stored now: a start by hand made while Home Assistant restarts
            # later is one it has not seen.
            await self.state.save()
        self._entry.async_on_unload(
            self.coordinator.async_add_listener(self._reconcile)
        )
        self._entry.async_on_unload(self._cancel_hold_timer)
        self._arm_hold()

    # --- requests ------------------------------------------------------------

    def _validate(self, vm: str) -> None:
        if vm not in self.coordinator.data.tower.gaming or vm not in (
            self.state.configured_vms
        ):
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="unknown_vm",
                translation_placeholders={"vm": vm},
            )
        if not self.coordinator.last_update_success:
            raise HomeAssistantError(
                translation_domain=DOMAIN, translation_key="tower_unreachable"
            )
        if vm in self.state.requests:
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="already_in_progress",
                translation_placeholders={"vm": vm},
            )

    async def async_turn_on(self, vm: str) -> asyncio.Task[bool]:
        """Accept a handoff to ``vm``; it runs in the background. A VM that
        plays already (GPU Handoff handed it its cards) is left as it is."""
        self._validate(vm)
        domain = self.coordinator.data.tower.domains.get(vm)
        if vm in self.desired and domain is not None and domain.state == RUNNING:
            return self._spawn(self._already_playing(vm))
        self._check_cordon(vm)
        return await self._accept(Request(vm=vm, kind=Kind.HANDOFF))

    async def async_prepare(self, vm: str, hold: float) -> asyncio.Task[bool]:
        """Free ``vm``'s cards without starting it (drain and shut the GPU
        node down as a handoff does) and hold them for it ``hold`` seconds:
        turning it on then only starts it. Refused for a VM that runs (it
        has its cards) and, as a handoff is, on top of someone else's
        cordon unless the user chose otherwise."""
        self._validate(vm)
        domain = self.coordinator.data.tower.domains.get(vm)
        if domain is not None and domain.state == RUNNING:
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="vm_plays",
                translation_placeholders={"vm": vm},
            )
        self._check_cordon(vm)
        return await self._accept(Request(vm=vm, kind=Kind.PREPARE, hold=hold))

    def _check_cordon(self, vm: str) -> None:
        """A request that would drain the GPU node for ``vm`` is refused at
        once on top of someone else's cordon (unless the user chose to hand
        off anyway)."""
        node = self.coordinator.data.node
        if not node_holds_cards_of(self.coordinator.data.tower, vm):
            return
        try:
            check_operator_cordon(
                node.cordon_owner if node else None,
                self.state.settings,
                self.coordinator.k8s_node,
            )
        except RunnerError as err:
            raise HomeAssistantError(
                translation_domain=DOMAIN,
                translation_key=err.key,
                translation_placeholders=err.placeholders,
            ) from err

    async def async_turn_off(self, vm: str) -> asyncio.Task[bool]:
        """Shut ``vm`` down gracefully; its cards then go back to the cluster."""
        self._validate(vm)
        return await self._accept(Request(vm=vm, kind=Kind.STOP))

    async def _accept(self, request: Request) -> asyncio.Task[bool]:
        """Record the request (the switch shows it at once), store the desired
        state, and run the operation in the background. A request that cannot
        be stored changes nothing and is not left showing."""
        before = set(self.desired)
        if request.kind is Kind.HANDOFF:
            self.state.desired.add(request.vm)
        elif request.kind is Kind.STOP:
            self.state.desired.discard(request.vm)
        self.state.requests[request.vm] = request
        self.progress.publish()
        try:
            await self.state.save()
        except BaseException:
            self.state.desired = before
            del self.state.requests[request.vm]
            self.progress.publish()
            raise
        return self._spawn(self._run(request))

    async def async_return_cards(self) -> asyncio.Task[bool]:
        """Start the GPU node (once no gaming VM holds its cards) and lift
        GPU Handoff's own cordon."""
        if not self.coordinator.last_update_success:
            raise HomeAssistantError(
                translation_domain=DOMAIN, translation_key="tower_unreachable"
            )
        gpu_node = self.coordinator.data.tower.gpu_node
        return self._spawn(self._run(Request(vm=gpu_node, kind=Kind.RETURN)))

    async def _already_playing(self, vm: str) -> bool:
        """Turning on a VM the last update showed playing: nothing to do if
        the tower says so now. Its player may have quit since (an update
        lags, and none comes while libvirtd restarts), or the tower may not
        answer: then it is handed over as any request is (tried again while
        the tower is away), unless another request for it came meanwhile."""
        try:
            domain = (await self.coordinator.tower.status()).domains.get(vm)
        except TowerError as err:
            _LOGGER.debug("Could not tell whether %s still plays: %s", vm, err)
        else:
            if domain is not None and domain.state == RUNNING:
                _LOGGER.debug("%s plays already", vm)
                return True
        if vm in self.state.requests:
            return True  # a later request decides
        _LOGGER.info("%s was to play already, but does not: handing over", vm)
        return await (await self._accept(Request(vm=vm, kind=Kind.HANDOFF)))

    def _spawn(self, coro: Any) -> asyncio.Task[bool]:
        """Run an operation in the background (cancelled when the entry unloads)."""
        return self._entry.async_create_background_task(
            self.hass, coro, f"{DOMAIN} operation"
        )

    # --- reconciling desired and observed state --------------------------------

    @callback
    def _reconcile(self) -> None:
        """After each update, with nothing running or waiting: act on what
        core.reconcile decides from the observation."""
        if self._lock.locked() or self.plan is not None or self.state.requests:
            return
        held = self.state.hold
        result = reconcile(self.state.observed(), self.state.owned(), self.memory)
        self.state.memory = result.memory
        self.state.hold = result.hold
        if held is not None and result.hold_ended is not None:
            self._hold_ended(held, result.hold_ended)
        self.state.gpu_stopped_by_us = result.gpu_stopped_by_us
        for vm in result.followed:
            _LOGGER.info("%s was started on the tower with its cards", vm)
        if gone := self.desired - result.desired - set(result.followed):
            _LOGGER.info("No longer playing: %s", ", ".join(sorted(gone)))
        self.state.desired = set(result.desired)
        if (request := result.run) is not None:
            if request.by_hook:
                _LOGGER.info(
                    "%s was started on the tower; handing its cards over", request.vm
                )
            # Recorded now: the next update finds the controller busy.
            self.state.requests[request.vm] = request
            self._spawn(self._persist_and_run(request))
            return
        if result.forget_stale_mark:
            self._side_task("forget stale mark", self._forget_stale_mark)
        if result.read_hook_jobs:
            jobs = result.read_hook_jobs
            self._side_task("read hook jobs", lambda: self._read_hook_jobs(jobs))
        if result.changed:
            self.hass.async_create_task(
                self.state.save_in_background(), f"{DOMAIN} save"
            )

    # --- cards held for a gaming VM (a prepare) ---------------------------------

    def _hold_ended(self, hold: Hold, why: HoldEnd) -> None:
        """Tell how a hold ended without an operation (core.hold_ends)."""
        if why is HoldEnd.PLAYS:
            _LOGGER.info("%s was started on the tower: its cards' hold ends", hold.vm)
        elif why is HoldEnd.GONE:
            _LOGGER.info("%s is no longer GPU Handoff's: its cards' hold ends", hold.vm)
        else:
            _LOGGER.info(
                "Nobody started %s by %s: its cards go back to the cluster",
                hold.vm,
                hold.until,
            )
            self.report.fire(EVENT_HOLD_EXPIRED, hold.vm, hold_ends=hold.until)
            self.events.normal(
                "HoldExpired",
                "Return",
                f"Nobody started the gaming VM {hold.vm} in the time its cards "
                "were held for it: they go back to the cluster",
            )
        self.progress.publish()

    def _arm_hold(self) -> None:
        """While cards are held: look again when the hold ends (and once a
        minute, for the time left the Handoff state shows)."""
        if self._hold_timer is not None:
            self._hold_timer()
            self._hold_timer = None
        hold = self.state.hold
        if hold is None or not self._watch_holds:
            return
        now = dt_util.utcnow()
        until = dt_util.parse_datetime(hold.until) or now
        at = min(until, now + HOLD_TICK)
        if until <= now:
            at = now + HOLD_BUSY_RETRY
        self._hold_timer = async_track_point_in_utc_time(self.hass, self._hold_due, at)

    @callback
    def _hold_due(self, _now: dt.datetime) -> None:
        """A hold's end (or a minute of it) came: decide again if nothing
        runs (else when the next look comes, soon), and show the time left."""
        self._hold_timer = None
        self._reconcile()
        self.progress.publish()
        self._arm_hold()

    @callback
    def _cancel_hold_timer(self) -> None:
        self._watch_holds = False
        if self._hold_timer is not None:
            self._hold_timer()
            self._hold_timer = None

    def _side_task(
        self, name: str, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """Run ``work`` in the background unless work of that name runs."""
        if name in self._side:
            return
        task = self.hass.async_create_task(work(), f"{DOMAIN} {name}")
        self._side[name] = task
        task.add_done_callback(lambda _: self._side.pop(name, None))

    async def _forget_stale_mark(self) -> None:
        """Someone lifted GPU Handoff's cordon and left its mark: remove the
        mark now (under the lock: an operation's own cordon is never touched
        while it runs), so a cordon placed later is not taken for ours."""
        async with self._lock:
            if await forget_stale_mark(self.coordinator):
                await self.coordinator.async_request_refresh()

    async def _read_hook_jobs(self, jobs: tuple[str, ...]) -> None:
        """Read the records of the hook's ended jobs the decision needs (what
        they did never changes), then decide again."""
        read = await read_hook_records(
            self.coordinator.tower, jobs, gpu_node=self.coordinator.data.tower.gpu_node
        )
        memory = self.state.memory
        self.state.memory = replace(memory, hook_jobs_read=memory.hook_jobs_read | read)
        if read:
            self._reconcile()

    async def _persist_and_run(self, request: Request) -> bool:
        self.state.requests.setdefault(request.vm, request)
        await self.state.save()
        return await self._run(request)

    # --- running operations ----------------------------------------------------

    async def _run(self, request: Request, resume: bool = False) -> bool:
        """One operation at a time; True when it succeeded."""
        self.state.requests.setdefault(request.vm, request)
        try:
            async with self._lock:
                succeeded, follow_up = await self.operations.operate(request, resume)
                if follow_up:
                    await self.operations.follow_up_return()
                return succeeded
        finally:
            self.state.request_done(request)
            self.progress.publish()
            self._arm_hold()

    @callback
    def job_pushed(self, record: JobRecord) -> None:
        """The session pushed a job's progress."""
        self.runner.jobs.pushed(record)


async def forget_stale_mark(coordinator: GpuHandoffCoordinator) -> bool:
    """Remove GPU Handoff's mark from a node nobody cordons; True if removed."""
    node = coordinator.k8s_node
    try:
        forgotten = await coordinator.cluster.forget_stale_mark(node)
    except ClusterError as err:
        _LOGGER.warning("Could not remove a stale cordon mark: %s", err)
        return False
    if forgotten:
        _LOGGER.info(
            "GPU Handoff's cordon on %s was lifted by someone else; its mark is "
            "removed",
            node,
        )
    return forgotten


async def read_hook_records(
    tower: TowerClient, jobs: tuple[str, ...], *, gpu_node: str
) -> frozenset[HookJobRead]:
    """The records of the hook's jobs ``jobs`` that ended: when each shut
    the GPU node down, if it did (core.hook_gpu_stop)."""
    read: set[HookJobRead] = set()
    for job_id in jobs:
        try:
            record = await tower.job(job_id)
        except TowerError as err:
            _LOGGER.warning("Could not read the hook's job %s: %s", job_id, err)
            continue
        if record.job.state.active:
            continue
        read.add(HookJobRead(job_id, hook_gpu_stop(record, gpu_node)))
    return frozenset(read)
