"""The handoff controller: Home Assistant's bookkeeping around operations.

It keeps the desired state (which gaming VMs should play) and the operation in
flight with its tower job in storage, so an operation interrupted by a Home
Assistant restart or a dropped SSH connection is resumed; it fires events,
raises and clears repair issues, and reconciles what it wants with what the
tower and cluster report. The work itself (drain, tower job, node back) is the
runner's. One operation runs per tower at a time. Nothing here can destroy a
VM: the tower agent offers no such verb.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
import logging
from typing import Any

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers.storage import Store

from .cluster_client import ClusterError, UnmanagedPodsError
from .cluster_model import SKIP_WAIT_FOR_DELETE
from .const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_GPU_NODE,
    CONF_HANDOFF_WHEN_CORDONED,
    CONF_LEND_FREE_CARDS,
    DEFAULT_AUTO_RETURN,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_EVICT_UNMANAGED,
    DEFAULT_HANDOFF_WHEN_CORDONED,
    DEFAULT_LEND_FREE_CARDS,
    DOMAIN,
    EVENT_HANDOFF_STARTED,
)
from .coordinator import GpuHandoffCoordinator
from .core import (
    STORE_VERSION,
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
    job_stopped_gpu_node,
    known_desired,
    lends_after,
    migrate_store,
    reconcile,
    returns_after,
    settle_hook_job,
    superseded_hook_requests,
)
from .jobs import JobFailedError
from .progress import OperationProgress
from .protocol import RUNNING, JobRecord
from .report import Reporter
from .runner import (
    OperationRunner,
    RunnerError,
    check_operator_cordon,
    node_holds_cards_of,
)

_LOGGER = logging.getLogger(__name__)

# How long a pod may sit terminating past its deletion time before the drain
# stops waiting for it (its kubelet is not reporting): kubectl's
# --skip-wait-for-delete-timeout.
SKIP_WAIT: float = SKIP_WAIT_FOR_DELETE


class HandoffStore(Store[dict[str, Any]]):
    """A tower's owned records (core.Owned), migrated from earlier versions."""

    async def _async_migrate_func(
        self, old_major_version: int, old_minor_version: int, old_data: dict[str, Any]
    ) -> dict[str, Any]:
        return migrate_store(old_major_version, old_data)


def handoff_store(hass: HomeAssistant, entry_id: str) -> HandoffStore:
    """Where a tower's desired state and operation in flight are kept."""
    return HandoffStore(hass, STORE_VERSION, f"{DOMAIN}.{entry_id}")


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
        self._store = handoff_store(hass, entry.entry_id)
        self._lock = asyncio.Lock()
        self.report = Reporter(hass, entry, coordinator.k8s_node)
        self.progress = OperationProgress(
            coordinator,
            self.report,
            requests=lambda: self._requests,
            job=lambda: self.plan.job if self.plan is not None else None,
            save_job=self._save_job,
        )
        self.runner = OperationRunner(
            coordinator.tower,
            coordinator.cluster,
            gpu_node=entry.data[CONF_GPU_NODE],
            k8s_node=coordinator.k8s_node,
            host=self.progress,
        )
        # What is owned and stored (core.Owned): the desired set, the
        # operation in flight, and whether the GPU node is off because a
        # tower job of GPU Handoff's shut it down. The requests waiting are
        # those of ``_requests`` that are not the plan's.
        self.desired: set[str] = set()
        self.plan: Plan | None = None
        self.gpu_stopped_by_us = False
        # Requests accepted and not finished (queued or running), by VM. The
        # switch shows them at once, before any step has run.
        self._requests: dict[str, Request] = {}
        self.memory = Memory()
        self._forgetting = False

    @property
    def requests(self) -> dict[str, Kind]:
        """What each accepted, unfinished request asks for, by VM."""
        return {vm: request.kind for vm, request in self._requests.items()}

    def owned(self) -> Owned:
        """What the controller owns now, as it is stored."""
        running = self.plan.vm if self.plan is not None else None
        # Only those the tower still keeps (it forgets them after a while).
        shown = {request.key for request in self.coordinator.data.tower.hook_requests}
        return Owned(
            desired=frozenset(self.desired),
            plan=self.plan,
            queue=tuple(r for vm, r in self._requests.items() if vm != running),
            gpu_stopped_by_us=self.gpu_stopped_by_us,
            seen_hook_requests=self.memory.seen_hook_requests & shown,
        )

    def observed(self) -> Observed:
        """The tower and cluster as the last update showed them."""
        data = self.coordinator.data
        return Observed(
            tower=data.tower,
            node=data.node,
            configured=frozenset(self.configured_vms),
            settings=self.settings,
        )

    # --- persistence ---------------------------------------------------------

    async def async_start(self) -> None:
        """Load the desired state and resume what an earlier run left."""
        stored = await self._store.async_load()
        owned = Owned.from_dict(stored) if stored is not None else Owned()
        self.desired = set(owned.desired)
        self.plan = owned.plan
        self.gpu_stopped_by_us = owned.gpu_stopped_by_us
        status = self.coordinator.data.tower
        seen = owned.seen_hook_requests
        if seen is None:  # stored by 0.3.x: what the tower shows counts as seen
            seen = frozenset(request.key for request in status.hook_requests)
        self.memory = Memory(seen_hook_requests=seen)
        self._forget_unknown_vms()
        known = self.configured_vms | {status.gpu_node}
        if self.plan is not None:
            request = self.plan.request
            if request.vm in known:
                _LOGGER.info(
                    "Resuming the %s of %s after a restart", request.kind, request.vm
                )
                self._spawn(self._run(request, resume=True))
            else:
                # Its gaming VM was removed meanwhile: end it at a safe point.
                self._spawn(self._abandon())
        # Requests that waited behind it, in the order they came.
        for request in owned.queue:
            if request.vm in self._requests or request.vm not in known:
                continue
            _LOGGER.info(
                "Carrying out the %s of %s asked for before a restart",
                request.kind,
                request.vm,
            )
            self._requests[request.vm] = request
            self._spawn(self._run(request))
        self._entry.async_on_unload(
            self.coordinator.async_add_listener(self._reconcile)
        )

    @property
    def configured_vms(self) -> set[str]:
        """The gaming VMs the user added to this tower (one subentry each)."""
        return {
            str(sub.data[CONF_DOMAIN_NAME]) for sub in self._entry.subentries.values()
        }

    def _forget_unknown_vms(self) -> None:
        """Drop VMs no longer defined on the tower, or no longer configured
        and not running, from the desired set (core.known_desired)."""
        known = known_desired(
            frozenset(self.desired),
            self.coordinator.data.tower.domains,
            self.configured_vms,
        )
        if known != self.desired:
            _LOGGER.info("Forgetting %s", ", ".join(sorted(self.desired - known)))
            self.desired = set(known)

    async def _save(self) -> None:
        await self._store.async_save(self.owned().as_dict())

    async def _save_in_background(self) -> None:
        """Save what reconciling learned; a failed write is logged (the next
        change writes it again), not left as an unretrieved task error."""
        try:
            await self._save()
        except (OSError, HomeAssistantError) as err:
            _LOGGER.warning("Could not store GPU Handoff's state: %s", err)

    # --- requests ------------------------------------------------------------

    def _validate(self, vm: str) -> None:
        if vm not in self.coordinator.data.tower.gaming or vm not in (
            self.configured_vms
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
        if vm in self._requests:
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="already_in_progress",
                translation_placeholders={"vm": vm},
            )

    @property
    def settings(self) -> Settings:
        """What the options say an operation follows."""
        options = self._entry.options
        return Settings(
            drain_timeout=float(options.get(CONF_DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT)),
            evict_unmanaged=bool(
                options.get(CONF_EVICT_UNMANAGED, DEFAULT_EVICT_UNMANAGED)
            ),
            handoff_when_cordoned=bool(
                options.get(CONF_HANDOFF_WHEN_CORDONED, DEFAULT_HANDOFF_WHEN_CORDONED)
            ),
            auto_return=bool(options.get(CONF_AUTO_RETURN, DEFAULT_AUTO_RETURN)),
            skip_wait=SKIP_WAIT,
            lend_free=bool(options.get(CONF_LEND_FREE_CARDS, DEFAULT_LEND_FREE_CARDS)),
        )

    async def async_turn_on(self, vm: str) -> asyncio.Task[bool]:
        """Accept a handoff to ``vm``; it runs in the background. A VM that
        plays already (GPU Handoff handed it its cards) is left as it is."""
        self._validate(vm)
        domain = self.coordinator.data.tower.domains.get(vm)
        if vm in self.desired and domain is not None and domain.state == RUNNING:
            return self._spawn(self._already_playing(vm))
        node = self.coordinator.data.node
        if node_holds_cards_of(self.coordinator.data.tower, vm):
            try:
                check_operator_cordon(
                    node.cordon_owner if node else None,
                    self.settings,
                    self.coordinator.k8s_node,
                )
            except RunnerError as err:
                raise HomeAssistantError(
                    translation_domain=DOMAIN,
                    translation_key=err.key,
                    translation_placeholders=err.placeholders,
                ) from err
        return await self._accept(Request(vm=vm, kind=Kind.HANDOFF))

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
            self.desired.add(request.vm)
        else:
            self.desired.discard(request.vm)
        self._requests[request.vm] = request
        self.progress.publish()
        try:
            await self._save()
        except BaseException:
            self.desired = before
            del self._requests[request.vm]
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
        """Turning on a VM that plays: nothing to do."""
        _LOGGER.debug("%s plays already", vm)
        return True

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
        if self._lock.locked() or self.plan is not None or self._requests:
            return
        result = reconcile(self.observed(), self.owned(), self.memory)
        self.memory = result.memory
        for vm in result.followed:
            _LOGGER.info("%s was started on the tower with its cards", vm)
        if gone := self.desired - result.desired - set(result.followed):
            _LOGGER.info("No longer playing: %s", ", ".join(sorted(gone)))
        self.desired = set(result.desired)
        if (request := result.run) is not None:
            if request.by_hook:
                _LOGGER.info(
                    "%s was started on the tower; handing its cards over", request.vm
                )
            # Recorded now: the next update finds the controller busy.
            self._requests[request.vm] = request
            self._spawn(self._persist_and_run(request))
            return
        if result.forget_stale_mark and not self._forgetting:
            self._forgetting = True
            self.hass.async_create_task(
                self._forget_stale_mark(), f"{DOMAIN} forget stale mark"
            )
        if result.changed:
            self.hass.async_create_task(self._save_in_background(), f"{DOMAIN} save")

    async def _forget_stale_mark(self) -> None:
        """Someone lifted GPU Handoff's cordon and left its mark: remove the
        mark now (under the lock: an operation's own cordon is never touched
        while it runs), so a cordon placed later is not taken for ours."""
        try:
            async with self._lock:
                if await self.coordinator.cluster.forget_stale_mark(
                    self.coordinator.k8s_node
                ):
                    _LOGGER.info(
                        "GPU Handoff's cordon on %s was lifted by someone else; "
                        "its mark is removed",
                        self.coordinator.k8s_node,
                    )
                    await self.coordinator.async_request_refresh()
        except ClusterError as err:
            _LOGGER.warning("Could not remove a stale cordon mark: %s", err)
        finally:
            self._forgetting = False

    async def _persist_and_run(self, request: Request) -> bool:
        self._requests.setdefault(request.vm, request)
        await self._save()
        return await self._run(request)

    # --- running operations ----------------------------------------------------

    async def _run(self, request: Request, resume: bool = False) -> bool:
        """One operation at a time; True when it succeeded."""
        self._requests.setdefault(request.vm, request)
        try:
            async with self._lock:
                succeeded, follow_up = await self._operate(request, resume)
                if follow_up:
                    await self._follow_up_return()
                return succeeded
        finally:
            self._request_done(request)
            self.progress.publish()

    def _request_done(self, request: Request) -> None:
        """``request`` ended (another for the same VM may wait behind it)."""
        current = self._requests.get(request.vm)
        if current is not None and current.kind is request.kind:
            del self._requests[request.vm]

    async def _operate(self, request: Request, resume: bool) -> tuple[bool, bool]:
        """Run one operation (the lock held): whether it succeeded, and whether
        the cards must go back to the cluster after it (a return, already
        stored as the next operation)."""
        if not resume or self.plan is None:
            self.plan = Plan(request=request)
            await self._save()
        plan = self.plan
        request, vm, kind = plan.request, plan.vm, plan.kind
        # A return lends again after a refused lend, or says why not.
        relend = kind is Kind.RETURN and bool(self.memory.lend_refused)
        if kind is Kind.RETURN:
            self.memory = replace(self.memory, lend_refused=())
        self.progress.begin(vm, kind)
        if plan.settle is None:
            self.report.fire(EVENT_HANDOFF_STARTED, vm, kind=kind)
        self.progress.publish()
        returned = follow_up = False
        # What its jobs did so far (stored: a resumed operation keeps them).
        self.runner.facts = plan.facts
        try:
            if plan.settle is not None:
                # It failed before a restart; what it left is settled now.
                self.desired.discard(vm)
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
        status = self.coordinator.data.tower
        self.gpu_stopped_by_us = gpu_stopped_by_us(self.owned(), facts, status)
        self.progress.end()
        self._requests.pop(request.vm, None)
        # Lending: the free cards go back after the last of a burst of
        # requests (core.lends_after); not lending, after a stop that left
        # the GPU node GPU Handoff stopped off with nobody playing.
        owned, waiting, observed = self.owned(), bool(self._requests), self.observed()
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
        self.plan = self._return_plan() if follow_up else None
        await self._save()
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
        if not self.runner.facts.started_gpu_node:
            # (A job of the operation's that started the GPU node came after
            # them: a later stop was not theirs.)
            await self.runner.read_hook_jobs(
                hook.job
                for hook in status.hook_requests
                if hook.key in seen - self.memory.seen_hook_requests
                and hook.job is not None
            )
        self.memory = replace(
            self.memory, seen_hook_requests=self.memory.seen_hook_requests | seen
        )

    def _return_plan(self) -> Plan:
        """The return GPU Handoff decides on after an operation."""
        gpu_node = self.coordinator.data.tower.gpu_node
        return Plan(
            request=Request(vm=gpu_node, kind=Kind.RETURN, origin=Origin.GPU_HANDOFF)
        )

    async def _attempt(self, request: Request) -> tuple[bool, bool, bool]:
        """Do the operation's work: whether it succeeded, whether the cards
        went back to the cluster, and whether they must go back after it."""
        vm, kind = request.vm, request.kind
        returned = False
        try:
            settings = self.settings
            if kind is Kind.HANDOFF:
                await self.runner.handoff(vm, settings, hook_job=request.hook_job)
            elif kind is Kind.STOP:
                returned = await self.runner.stop(
                    vm, settings, gpu_stopped_by_us=self.gpu_stopped_by_us
                )
            else:
                returned = await self.runner.return_cards(settings)
        except Exception as err:  # noqa: BLE001 - every failure must end the operation
            await self._failed(vm, kind, err)
            if kind is Kind.RETURN:
                # A return that drained a lending GPU node and then failed:
                # our cordon goes if the GPU node still serves.
                await self.runner.uncordon_if_serving()
            if kind is not Kind.HANDOFF:
                return False, False, False
            self.desired.discard(vm)
            return False, False, await self._settle(request, None, err)
        return True, returned, False

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
                    job_pending=self.plan is not None and self.plan.job is not None,
                ),
                hook_job=settle_hook_job(
                    request,
                    self.coordinator.data.tower.hook_requests,
                    self.memory.seen_hook_requests,
                ),
            )
            if self.plan is not None:
                self.plan = replace(self.plan, job=None, settle=settle)
                await self._save()
        return await self.runner.settle_failed_handoff(
            settle.stopped_by_us, self.settings, settle.hook_job
        )

    async def _save_job(self, job: PendingJob | None) -> None:
        """Store the operation's tower job (before it is asked for), and
        what its jobs did so far (once one has ended)."""
        if self.plan is not None:
            self.plan = replace(self.plan, job=job, facts=self.runner.facts)
            await self._save()

    @callback
    def job_pushed(self, record: JobRecord) -> None:
        """The session pushed a job's progress."""
        self.runner.jobs.pushed(record)

    async def _abandon(self) -> None:
        """End an operation whose gaming VM is no longer configured: follow a
        tower job it asked for to its end, then leave things as a finished
        operation would. A handoff that gave the VM its cards keeps its
        session (the cards go back when the VM stops); one that did not is
        settled as a failed handoff (the cards go back if GPU Handoff stopped
        the GPU node); anything else lifts our own cordon if the GPU node
        still serves."""
        async with self._lock:
            if self.plan is None:
                return
            plan = self.plan
            request, vm, kind = plan.request, plan.vm, plan.kind
            self.runner.facts = plan.facts
            err: Exception | None = None
            follow_up = False
            if plan.settle is None:
                try:
                    await self.runner.finish_job()
                except Exception as failed:  # noqa: BLE001 - settled below
                    err = failed
                    # Reported as any failed operation is: the request the
                    # user made before the removal did not happen.
                    await self._failed(vm, kind, err)
            await self.coordinator.async_refresh()
            facts = self.runner.facts
            status = self.coordinator.data.tower
            self.gpu_stopped_by_us = gpu_stopped_by_us(self.owned(), facts, status)
            domain = status.domains.get(vm)
            kept = err is None and domain is not None and domain.state == RUNNING
            if kind is Kind.HANDOFF and kept:
                self.desired.add(vm)
            elif kind is Kind.HANDOFF:
                self.desired.discard(vm)
                follow_up = await self._settle(request, plan.settle, err)
            else:
                await self.runner.uncordon_if_serving()
            if kind is not Kind.HANDOFF or kept:
                # Lending: a handoff that gave the VM its cards, or a stop
                # that freed them (or, failed, was merged with requests that
                # changed what is free).
                follow_up = kind is not Kind.RETURN and lends_after(
                    request,
                    succeeded=err is None,
                    facts=facts,
                    owned=self.owned(),
                    waiting=bool(self._requests),
                    observed=self.observed(),
                )
            self.plan = self._return_plan() if follow_up else None
            await self._save()
            if follow_up:
                await self._follow_up_return()
                self.progress.publish()

    async def _follow_up_return(self) -> None:
        """The cards go back after an operation that left the GPU node off
        (GPU Handoff stopped it), as a return of its own, stored before that
        operation ended (so a restart resumes it). The lock is held."""
        request = self.plan.request if self.plan is not None else None
        if request is None:
            return
        self._requests.setdefault(request.vm, request)
        try:
            await self._operate(request, resume=True)
        finally:
            self._request_done(request)

    async def _failed(self, vm: str, kind: Kind, err: Exception) -> None:
        """Report a failure every way a user may look (report.Reporter), and
        show it on the switch and the sensor (``last_error``)."""
        if isinstance(err, UnmanagedPodsError) and kind is Kind.RETURN:
            self.memory = replace(self.memory, lend_refused=err.pods)
        self.progress.failed(vm, self.report.failed(vm, kind, err))
