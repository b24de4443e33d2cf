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
from dataclasses import dataclass, replace
import datetime as dt
from enum import StrEnum
import logging
from typing import Any, Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import device_registry as dr, issue_registry as ir
from homeassistant.helpers.storage import Store
from homeassistant.util import dt as dt_util

from .cluster_client import (
    CORDON_OWNER_US,
    SKIP_WAIT_FOR_DELETE,
    ClusterError,
    DrainProgress,
    NodeView,
    UnmanagedPodsError,
)
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
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
    EVENT_STOP_SUCCEEDED,
)
from .coordinator import GpuHandoffCoordinator
from .models import domain_identifier
from .protocol import (
    RUNNING,
    SHUT_OFF,
    START_FAILED,
    DomainState,
    HookRequest,
    JobRecord,
    TowerStatus,
)
from .runner import (
    JobFailedError,
    OperationRunner,
    PendingJob,
    RunnerError,
    Settings,
    check_operator_cordon,
    node_holds_cards_of,
)
from .tower_client import TowerError

_LOGGER = logging.getLogger(__name__)

STORAGE_VERSION: Final = 1
# A stored request that libvirt's hook made (a gaming VM started by hand).
ORIGIN_HOOK: Final = "hook"
ISSUE_HANDOFF_FAILED: Final = "handoff_failed"
ISSUE_UNMANAGED_PODS: Final = "unmanaged_pods"
# The repair each kind of operation raises when it fails (one issue id per VM).
FAILED_ISSUES: Final = {
    "handoff": ISSUE_HANDOFF_FAILED,
    "stop": "stop_failed",
    "return": "return_failed",
}
# The event each kind of operation ends with when it succeeds.
SUCCEEDED_EVENTS: Final = {
    "handoff": EVENT_HANDOFF_SUCCEEDED,
    "stop": EVENT_STOP_SUCCEEDED,
    "return": EVENT_RETURN_SUCCEEDED,
}
# How long a pod may sit terminating past its deletion time before the drain
# stops waiting for it (its kubelet is not reporting): kubectl's
# --skip-wait-for-delete-timeout.
SKIP_WAIT: float = SKIP_WAIT_FOR_DELETE


class StartByHand(StrEnum):
    """What a gaming VM started by hand, as libvirt's hook recorded it, asks
    of GPU Handoff (see start_by_hand_asks)."""

    HAND_OFF = "hand_off"
    FOLLOW = "follow"
    ENDED = "ended"


def start_by_hand_asks(
    vm: DomainState | None, gpu_node: DomainState | None, *, hook_job_running: bool
) -> StartByHand:
    """Decide from the first status that shows the hook's record.

    The hook writes the record at "prepare begin" and submits a stop of the
    GPU node (which does nothing to one that is off); libvirt keeps the
    domain locked until that start has failed or its QEMU runs
    (qemuProcessStart), so the status shows the start's outcome, or what
    came after it:

    - the start failed (``shut off (failed)``: the GPU node held the cards):
      HAND_OFF, properly (drain, follow the hook's stop, start the VM), so
      the player's retry works;
    - the VM runs while the hook's stop takes a running GPU node down:
      HAND_OFF too (the node is drained, the stop followed; the VM's start
      step finds it running);
    - the VM runs, the GPU node off: it got its cards, nothing is to be
      handed over; its session is GPU Handoff's to follow (the cards return
      when it ends): FOLLOW. A handoff job here would start the VM again
      should it stop before the job's start step;
    - the VM is off for any other reason, or gone: it ran and ended since:
      ENDED, nothing to do.
    """
    if vm is None or not vm.exists:
        return StartByHand.ENDED
    if vm.state == SHUT_OFF:
        return StartByHand.HAND_OFF if vm.reason == START_FAILED else StartByHand.ENDED
    gpu_node_up = gpu_node is not None and gpu_node.state not in (SHUT_OFF, None)
    if hook_job_running and gpu_node_up:
        return StartByHand.HAND_OFF
    return StartByHand.FOLLOW


def _recorded_after(request: HookRequest, moment: dt.datetime | None) -> bool:
    """Whether the tower recorded the start by hand after ``moment`` (its
    own clock; an unreadable time counts as before)."""
    recorded = dt_util.parse_datetime(request.time)
    return moment is not None and recorded is not None and recorded > moment


def handoff_store(hass: HomeAssistant, entry_id: str) -> Store[dict[str, Any]]:
    """Where a tower's desired state and operation in flight are kept."""
    return Store(hass, STORAGE_VERSION, f"{DOMAIN}.{entry_id}")


@dataclass
class Operation:
    """What the controller is doing now for one gaming VM (or the GPU node)."""

    vm: str
    kind: str  # handoff | stop | return
    step: str
    started: str
    phase: str | None = None  # PHASE_*: where the GPU node is in it


class HandoffController:
    """Drives handoffs and returns for one tower."""

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
        self.runner = OperationRunner(
            coordinator.tower,
            coordinator.cluster,
            gpu_node=entry.data[CONF_GPU_NODE],
            k8s_node=coordinator.k8s_node,
            host=self,
        )
        self.desired: set[str] = set()
        self.pending: dict[str, Any] | None = None
        self.operation: Operation | None = None
        self.drain: DrainProgress | None = None
        self.last_error: dict[str, str] = {}
        self._seen_hook_requests: set[str] = set()
        self._returning = False
        self._forgetting = False
        # Requests accepted and not finished (queued or running): VM -> kind.
        # The switch shows them at once, before any step has run. Those not
        # running yet are stored too, so a restart carries them out.
        self.requests: dict[str, str] = {}
        # The gaming VMs whose handoff libvirt's hook asked for (started by
        # hand), and the stop of the GPU node the hook asked for with it
        # (None: not known, a store written before hook jobs were kept).
        self._by_hook: dict[str, str | None] = {}
        # The pods that refused the last lend (a drain refuses pods nothing
        # recreates): the lend is tried again once they are gone.
        self.lend_refused: tuple[str, ...] = ()
        # Whether the GPU node is off because a tower job of GPU Handoff's
        # shut it down (stored; cleared whenever it is seen running): lending
        # restarts only such a GPU node after a handoff, never one someone
        # else shut down.
        self.gpu_stopped_by_us = False

    # --- persistence ---------------------------------------------------------

    async def async_start(self) -> None:
        """Load the desired state and resume what an earlier run left."""
        stored = await self._store.async_load() or {}
        self.desired = set(stored.get("desired", []))
        self.pending = stored.get("pending")
        self.gpu_stopped_by_us = bool(stored.get("gpu_stopped_by_us", False))
        status = self.coordinator.data.tower
        self._seen_hook_requests = {request.key for request in status.hook_requests}
        self._forget_unknown_vms()
        if self.pending is not None:
            vm, kind = self.pending["vm"], self.pending["kind"]
            if self.pending.get("origin") == ORIGIN_HOOK:
                self._by_hook[vm] = self.pending.get("hook_job")
            if vm == status.gpu_node or vm in self.configured_vms:
                _LOGGER.info("Resuming the %s of %s after a restart", kind, vm)
                self._spawn(self._run(vm, kind, resume=True))
            else:
                # Its gaming VM was removed meanwhile: end it at a safe point.
                self._spawn(self._abandon())
        # Requests that waited behind it, in the order they came.
        for queued in stored.get("queued", []):
            vm, kind = queued["vm"], queued["kind"]
            if vm in self.requests or not (
                vm == status.gpu_node or vm in self.configured_vms
            ):
                continue
            _LOGGER.info(
                "Carrying out the %s of %s asked for before a restart", kind, vm
            )
            if queued.get("origin") == ORIGIN_HOOK:
                self._by_hook[vm] = queued.get("hook_job")
            self.requests[vm] = kind
            self._spawn(self._run(vm, kind))
        self._entry.async_on_unload(
            self.coordinator.async_add_listener(self._reconcile)
        )

    @property
    def configured_vms(self) -> set[str]:
        """The gaming VMs the user added to this tower (one subentry each)."""
        return {
            str(sub.data[CONF_DOMAIN_NAME]) for sub in self._entry.subentries.values()
        }

    def _forget_unknown_vms(self) -> bool:
        """Drop VMs no longer defined on the tower, or no longer configured
        and not running, from the desired set (they would block the automatic
        return forever). A VM removed from GPU Handoff while it plays keeps
        its session until it stops: then its cards go back."""
        domains = self.coordinator.data.tower.domains
        known = {
            vm
            for vm in self.desired
            if (state := domains.get(vm)) is not None
            and state.exists
            and (vm in self.configured_vms or state.state == RUNNING)
        }
        if known == self.desired:
            return False
        _LOGGER.info("Forgetting %s", ", ".join(sorted(self.desired - known)))
        self.desired = known
        return True

    async def _save(self) -> None:
        running = (self.pending or {}).get("vm")
        queued: list[dict[str, str | None]] = []
        for vm, kind in self.requests.items():
            if vm == running:
                continue
            item: dict[str, str | None] = {"vm": vm, "kind": kind}
            if vm in self._by_hook:
                item |= {"origin": ORIGIN_HOOK, "hook_job": self._by_hook[vm]}
            queued.append(item)
        await self._store.async_save(
            {
                "desired": sorted(self.desired),
                "pending": self.pending,
                "queued": queued,
                "gpu_stopped_by_us": self.gpu_stopped_by_us,
            }
        )

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
        if vm in self.requests:
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
        return await self._accept(vm, "handoff")

    async def async_turn_off(self, vm: str) -> asyncio.Task[bool]:
        """Shut ``vm`` down gracefully; its cards then go back to the cluster."""
        self._validate(vm)
        return await self._accept(vm, "stop")

    async def _accept(self, vm: str, kind: str) -> asyncio.Task[bool]:
        """Record the request (the switch shows it at once), store the desired
        state, and run the operation in the background. A request that cannot
        be stored changes nothing and is not left showing."""
        before = set(self.desired)
        if kind == "handoff":
            self.desired.add(vm)
        else:
            self.desired.discard(vm)
        self.requests[vm] = kind
        self.coordinator.async_update_listeners()
        try:
            await self._save()
        except BaseException:
            self.desired = before
            del self.requests[vm]
            self.coordinator.async_update_listeners()
            raise
        return self._spawn(self._run(vm, kind))

    async def async_return_cards(self) -> asyncio.Task[bool]:
        """Start the GPU node (once no gaming VM holds its cards) and lift
        GPU Handoff's own cordon."""
        if not self.coordinator.last_update_success:
            raise HomeAssistantError(
                translation_domain=DOMAIN, translation_key="tower_unreachable"
            )
        return self._spawn(self._run(self.coordinator.data.tower.gpu_node, "return"))

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
        """After each update: notice what happened on the tower. Cards return
        on an edge (a gaming session GPU Handoff knows of ends), never because
        the GPU node is seen off: someone may have shut it down on purpose."""
        if self._lock.locked() or self.pending is not None or self.requests:
            return
        data = self.coordinator.data
        status = data.tower
        followed = False
        for request in status.hook_requests:
            if request.key in self._seen_hook_requests:
                continue
            vm = request.domain
            if (
                vm not in status.gaming
                or vm not in self.configured_vms
                or vm in self.desired
            ):
                self._seen_hook_requests.add(request.key)
                continue
            asks = start_by_hand_asks(
                status.domains.get(vm),
                status.domains.get(status.gpu_node),
                hook_job_running=any(
                    job.id == request.job for job in status.active_jobs
                ),
            )
            if asks is StartByHand.ENDED:
                # Kept unseen: nothing to do as long as the VM stays off;
                # a request for the VM supersedes it (_run).
                continue
            self._seen_hook_requests.add(request.key)
            self.desired.add(vm)
            if asks is StartByHand.FOLLOW:
                _LOGGER.info("%s was started on the tower with its cards", vm)
                followed = True
                continue
            _LOGGER.info("%s was started on the tower; handing its cards over", vm)
            self._by_hook[vm] = request.job
            self._spawn(self._persist_and_run(vm, "handoff"))
            return
        ended = [
            vm
            for vm in sorted(self.desired)
            if (domain := status.domains.get(vm)) is not None
            and domain.state == SHUT_OFF
        ]
        # The player shut the game down from inside (a VM removed from GPU
        # Handoff while it played too: its session ends all the same).
        self.desired.difference_update(ended)
        changed = self._forget_unknown_vms() or bool(ended) or followed
        playing = [
            vm
            for vm in status.gaming
            if (d := status.domains.get(vm)) is not None and d.state == RUNNING
        ]
        gpu = status.domains.get(status.gpu_node)
        settings = self.settings
        auto = settings.auto_return
        session_ended = bool(ended) and not playing and not self.desired
        node = data.node
        # Lending: a player quit while another plays; their cards are free
        # now, so the GPU node takes them (the return restarts it with every
        # free card). A lend refused by pods nothing recreates is tried again
        # once they are gone.
        lend_again = (
            settings.lend_free
            and auto
            and gpu is not None
            and (
                bool(ended)
                or (
                    bool(self.lend_refused)
                    and node is not None
                    and not set(self.lend_refused) & set(node.unmanaged)
                )
            )
        )
        # The safety net: our own cordon on a GPU node that serves again (an
        # operation interrupted between the node's return and the uncordon, a
        # failed handoff whose rollback could not reach the tower). Whoever
        # plays: a lending GPU node serves while they do.
        leftover = (
            gpu is not None
            and gpu.state == RUNNING
            and node is not None
            and node.ready is True
            and node.cordon_owner == CORDON_OWNER_US
            and status.job_for(status.gpu_node) is None
        )
        if (session_ended and auto and gpu is not None) or leftover or lend_again:
            if not self._returning:
                self._returning = True
                self._spawn(self._persist_and_run(status.gpu_node, "return"))
            return
        if node is not None and node.stale_mark and not self._forgetting:
            self._forgetting = True
            self.hass.async_create_task(
                self._forget_stale_mark(), f"{DOMAIN} forget stale mark"
            )
        if changed:
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

    async def _persist_and_run(self, vm: str, kind: str) -> bool:
        self.requests.setdefault(vm, kind)
        await self._save()
        return await self._run(vm, kind)

    # --- running operations ----------------------------------------------------

    async def _run(self, vm: str, kind: str, resume: bool = False) -> bool:
        """One operation at a time; True when it succeeded."""
        self.requests.setdefault(vm, kind)
        try:
            async with self._lock:
                succeeded, follow_up = await self._operate(vm, kind, resume)
                if follow_up:
                    await self._follow_up_return()
                return succeeded
        finally:
            self._by_hook.pop(vm, None)
            if self.requests.get(vm) == kind:
                del self.requests[vm]
            if kind == "return":
                self._returning = False
            self.coordinator.async_update_listeners()

    async def _operate(self, vm: str, kind: str, resume: bool) -> tuple[bool, bool]:
        """Run one operation (the lock held): whether it succeeded, and whether
        the cards must go back to the cluster after it (a return, already
        stored as the next operation)."""
        if not resume or self.pending is None:
            self.pending = {"vm": vm, "kind": kind, "job": None}
            if vm in self._by_hook:
                self.pending["origin"] = ORIGIN_HOOK
                self.pending["hook_job"] = self._by_hook[vm]
            await self._save()
        settle = self.pending.get("settle")
        # A return lends again after a refused lend, or says why not.
        relend = kind == "return" and bool(self.lend_refused)
        if kind == "return":
            self.lend_refused = ()
        self.operation = Operation(vm, kind, "preparing", dt_util.utcnow().isoformat())
        self.last_error.pop(vm, None)
        if settle is None:
            self._fire(EVENT_HANDOFF_STARTED, vm, kind=kind)
        self.coordinator.async_update_listeners()
        returned = follow_up = False
        self.runner.stopped_gpu_node = False
        self.runner.pods_came_back = ()
        self.runner.first_job_created = None
        try:
            if settle is not None:
                # It failed before a restart; what it left is settled now.
                self.desired.discard(vm)
                succeeded, follow_up = False, await self._settle(vm, settle)
            else:
                succeeded, returned, follow_up = await self._attempt(vm, kind)
        except asyncio.CancelledError:
            # Home Assistant stops or the entry unloads: keep ``pending`` so
            # the next start resumes the operation.
            self.operation = None
            self.drain = None
            raise
        # Fresh state before anything reconciles again: a stale snapshot
        # (say, the cordon just lifted) would start the same work twice.
        await self.coordinator.async_refresh()
        self._note_gpu_node_stop()
        if kind in ("handoff", "stop"):
            # A request for the VM supersedes its starts by hand recorded
            # before it ends (the user turned it off since; or it was the
            # start this handoff made, which libvirtd runs the qemu hook for
            # too, and an agent older than 0.3.1 recorded as a start by
            # hand): none of them is a request any more. But a start by hand
            # the tower recorded after it made a stop's first job came after
            # that stop: it is the newer request, and stays one.
            after = (
                dt_util.parse_datetime(self.runner.first_job_created)
                if kind == "stop" and self.runner.first_job_created
                else None
            )
            self._seen_hook_requests.update(
                request.key
                for request in self.coordinator.data.tower.hook_requests
                if request.domain == vm and not _recorded_after(request, after)
            )
        self.operation = None
        self.drain = None
        self.requests.pop(vm, None)
        # Lending: the free cards go back after the last of a burst of
        # requests, even when that one was a stop that failed (the requests
        # before it, merged into it, changed what is free).
        follow_up = follow_up or (
            (succeeded or kind == "stop") and self._lends_after(vm, kind)
        )
        self.pending = (
            {"vm": self.coordinator.data.tower.gpu_node, "kind": "return", "job": None}
            if follow_up
            else None
        )
        await self._save()
        if not succeeded:
            return False, follow_up
        # A return succeeds only when the cluster has its cards back: a GPU
        # node that came back without advertising them is reported apart.
        unhealthy = self.runner.returned_unhealthy if returned else None
        if unhealthy is None or kind != "return":
            # Pods that came back to the cordoned node are told, by name.
            came_back: list[str] = list(self.runner.pods_came_back)
            self._fire(
                SUCCEEDED_EVENTS[kind],
                vm,
                kind=kind,
                **({"pods_came_back": came_back} if came_back else {}),
            )
        if unhealthy is not None:
            self.last_error[vm] = unhealthy.message
            self._fire(
                EVENT_RETURN_UNHEALTHY,
                self.coordinator.data.tower.gpu_node,
                kind=kind,
                reason=unhealthy.reason,
                error=unhealthy.message,
                gpus_expected=unhealthy.expected,
                gpus_allocatable=unhealthy.allocatable,
            )
        elif returned:
            self._fire(EVENT_CARDS_RETURNED, self.coordinator.data.tower.gpu_node)
        ir.async_delete_issue(self.hass, DOMAIN, self._issue_id(vm))
        if kind == "handoff" or relend:
            # The pods that refused a handoff or a lend are gone (or were
            # evicted).
            ir.async_delete_issue(self.hass, DOMAIN, self._unmanaged_issue_id)
        return True, follow_up

    def _lends_after(self, vm: str, kind: str) -> bool:
        """Whether the free cards go back to the cluster after a handoff or a
        stop (lending): not while another request waits, whose own end does
        it (two requests close together cost one GPU node restart). After a
        handoff only when GPU Handoff stopped the GPU node for it (its job,
        or libvirt's hook for a start by hand) or the GPU node runs: a GPU
        node someone else shut down stays off (a stop is a session's end,
        the edge the cards go back on)."""
        settings = self.settings
        if not (
            kind in ("handoff", "stop")
            and settings.lend_free
            and settings.auto_return
            and not self.requests
        ):
            return False
        if kind == "stop":
            return True
        status = self.coordinator.data.tower
        gpu = status.domains.get(status.gpu_node)
        return (
            self.gpu_stopped_by_us
            or vm in self._by_hook
            or (gpu is not None and gpu.state == RUNNING)
        )

    def _note_gpu_node_stop(self) -> None:
        """After an operation: whether the GPU node is off because one of our
        tower jobs shut it down (its job records), or runs again."""
        status = self.coordinator.data.tower
        gpu = status.domains.get(status.gpu_node)
        if self.runner.stopped_gpu_node:
            self.gpu_stopped_by_us = True
        if gpu is not None and gpu.state == RUNNING:
            self.gpu_stopped_by_us = False

    async def _attempt(self, vm: str, kind: str) -> tuple[bool, bool, bool]:
        """Do the operation's work: whether it succeeded, whether the cards
        went back to the cluster, and whether they must go back after it."""
        returned = False
        try:
            settings = self.settings
            if kind == "handoff":
                await self.runner.handoff(vm, settings)
            elif kind == "stop":
                returned = await self.runner.stop(vm, settings)
            else:
                returned = await self.runner.return_cards(settings)
        except Exception as err:  # noqa: BLE001 - every failure must end the operation
            await self._failed(vm, kind, err)
            if kind == "return":
                # A return that drained a lending GPU node and then failed:
                # our cordon goes if the GPU node still serves.
                await self.runner.uncordon_if_serving()
            if kind != "handoff":
                return False, False, False
            self.desired.discard(vm)
            return False, False, await self._settle(vm, None, err)
        return True, returned, False

    def _job_stopped_gpu_node(self, err: Exception | None) -> bool:
        """Whether the failed handoff's own tower job shut the GPU node down:
        the runner read it from the records of the jobs it followed to their
        end (a shutdown step skipped because the GPU node was off already did
        nothing); a job not followed to its end may have (the return that
        follows reads the tower again)."""
        if self.runner.stopped_gpu_node or isinstance(err, JobFailedError):
            return self.runner.stopped_gpu_node
        return self.pending_job is not None

    async def _settle(
        self, vm: str, settle: dict[str, Any] | None, err: Exception | None = None
    ) -> bool:
        """Leave what a failed handoff left safe (see the runner's
        ``settle_failed_handoff``), stored first so a restart finishes it.
        True when a return must follow."""
        if settle is None:
            settle = {
                "stopped_by_us": self._job_stopped_gpu_node(err),
                "hook_job": self._by_hook.get(vm),
            }
            if self.pending is not None:
                self.pending = {**self.pending, "job": None, "settle": settle}
                await self._save()
        return await self.runner.settle_failed_handoff(
            bool(settle["stopped_by_us"]), self.settings, settle.get("hook_job")
        )

    @property
    def current_phase(self) -> str | None:
        """Where the GPU node is in the running operation (PHASE_*), if any."""
        return self.operation.phase if self.operation is not None else None

    # --- the runner's host -------------------------------------------------------

    def phase(self, phase: str) -> None:
        """The GPU node is at ``phase`` of the running operation."""
        if self.operation is not None and self.operation.phase != phase:
            self.operation.phase = phase
            self.coordinator.async_update_listeners()

    def step(self, step: str) -> None:
        """The running operation is at ``step``: an event, and the entities."""
        operation = self.operation
        if operation is None or operation.step == step:
            return
        operation.step = step
        self._fire(EVENT_HANDOFF_STEP, operation.vm, kind=operation.kind, step=step)
        self.coordinator.async_update_listeners()

    def drain_progress(self, progress: DrainProgress) -> None:
        """How far the drain is, shown live."""
        self.drain = progress
        self.coordinator.async_update_listeners()

    def show_node(self, view: NodeView) -> None:
        """Show what the runner just learned or did to the node at once, so
        every entity agrees with the Handoff state at every write."""
        self.coordinator.async_set_node(view)

    def show_cordon(self, owner: str | None) -> None:
        """The cordon as the runner just left it."""
        node = self.coordinator.data.node
        if node is not None:
            self.show_node(
                replace(node, unschedulable=owner is not None, cordon_owner=owner)
            )

    def show_tower(self, status: TowerStatus) -> None:
        """The tower as the runner just read it."""
        self.coordinator.async_set_tower(status)

    @property
    def pending_job(self) -> PendingJob | None:
        """The tower job the stored operation asked for, if any."""
        if self.pending is None:
            return None
        return PendingJob.from_dict(self.pending.get("job"))

    async def save_job(self, job: PendingJob | None) -> None:
        """Store the operation's tower job (before it is asked for)."""
        if self.pending is not None:
            self.pending["job"] = job.as_dict() if job is not None else None
            await self._save()

    @callback
    def job_pushed(self, record: JobRecord) -> None:
        """The session pushed a job's progress."""
        self.runner.job_pushed(record)

    async def _abandon(self) -> None:
        """End an operation whose gaming VM is no longer configured: follow a
        tower job it asked for to its end, then leave things as a finished
        operation would. A handoff that gave the VM its cards keeps its
        session (the cards go back when the VM stops); one that did not is
        settled as a failed handoff (the cards go back if GPU Handoff stopped
        the GPU node); anything else lifts our own cordon if the GPU node
        still serves."""
        async with self._lock:
            pending = self.pending or {}
            vm, kind = str(pending.get("vm")), pending.get("kind")
            self.runner.stopped_gpu_node = False
            settle = pending.get("settle")
            err: Exception | None = None
            if settle is None:
                try:
                    await self.runner.finish_job()
                except Exception as failed:  # noqa: BLE001 - settled below
                    err = failed
                    # Reported as any failed operation is: the request the
                    # user made before the removal did not happen.
                    await self._failed(vm, str(kind), err)
            follow_up = False
            await self.coordinator.async_refresh()
            self._note_gpu_node_stop()
            if kind == "handoff":
                domain = self.coordinator.data.tower.domains.get(vm)
                if err is None and domain is not None and domain.state == RUNNING:
                    self.desired.add(vm)
                    follow_up = self._lends_after(vm, kind)
                else:
                    self.desired.discard(vm)
                    follow_up = await self._settle(vm, settle, err)
            else:
                await self.runner.uncordon_if_serving()
                # Lending: the stop freed the VM's cards (or, failed, was
                # merged with requests that changed what is free).
                follow_up = kind == "stop" and self._lends_after(vm, kind)
            gpu = self.coordinator.data.tower.gpu_node
            self.pending = (
                {"vm": gpu, "kind": "return", "job": None} if follow_up else None
            )
            await self._save()
            if follow_up:
                await self._follow_up_return()
                self.coordinator.async_update_listeners()

    async def _follow_up_return(self) -> None:
        """The cards go back after an operation that left the GPU node off
        (GPU Handoff stopped it), as a return of its own, stored before that
        operation ended (so a restart resumes it). The lock is held."""
        gpu = self.coordinator.data.tower.gpu_node
        self.requests.setdefault(gpu, "return")
        self._returning = True
        try:
            await self._operate(gpu, "return", resume=True)
        finally:
            self._returning = False
            if self.requests.get(gpu) == "return":
                del self.requests[gpu]

    async def _failed(self, vm: str, kind: str, err: Exception) -> None:
        """Report a failure every way a user may look: the event (automations,
        the logbook), ``last_error`` (the switch and the sensor), and a repair
        issue (the notification a user sees without the dashboard: a request
        made by voice or by an automation fails long after it was accepted)."""
        code = getattr(err, "code", None) or type(err).__name__
        message = str(err) or type(err).__name__
        expected = (
            HomeAssistantError,
            TowerError,
            ClusterError,
            RunnerError,
            JobFailedError,
        )
        if isinstance(err, expected):
            _LOGGER.warning("The %s of %s failed: %s", kind, vm, message)
        else:
            _LOGGER.error("The %s of %s failed unexpectedly", kind, vm, exc_info=err)
        if isinstance(err, UnmanagedPodsError):
            code = ISSUE_UNMANAGED_PODS
            if kind == "return":
                self.lend_refused = err.pods
        self.last_error[vm] = message
        self._fire(EVENT_HANDOFF_FAILED, vm, kind=kind, error=message, code=code)
        name = self._device_name(vm)
        if isinstance(err, UnmanagedPodsError):
            ir.async_create_issue(
                self.hass,
                DOMAIN,
                self._unmanaged_issue_id,
                is_fixable=False,
                is_persistent=False,
                severity=ir.IssueSeverity.ERROR,
                translation_key=ISSUE_UNMANAGED_PODS,
                translation_placeholders={
                    "vm": name,
                    "node": self.coordinator.k8s_node,
                    "pods": ", ".join(err.pods),
                },
            )
            return
        ir.async_create_issue(
            self.hass,
            DOMAIN,
            self._issue_id(vm),
            is_fixable=False,
            is_persistent=False,
            severity=ir.IssueSeverity.ERROR,
            translation_key=FAILED_ISSUES[kind],
            translation_placeholders={"vm": name, "error": message},
        )

    def _device(self, vm: str) -> dr.DeviceEntry | None:
        """``vm``'s device (the GPU node's or a gaming VM's), if registered."""
        return dr.async_get(self.hass).async_get_device_by_identifier(
            domain_identifier(self._entry.entry_id, vm), self._entry.entry_id
        )

    def _device_name(self, vm: str) -> str:
        """What the user calls ``vm`` (its device's name, theirs if they
        renamed it), else its libvirt name."""
        device = self._device(vm)
        if device is None:
            return vm
        return device.name_by_user or device.name or vm

    @property
    def _unmanaged_issue_id(self) -> str:
        return f"{ISSUE_UNMANAGED_PODS}_{self._entry.entry_id}"

    def _issue_id(self, vm: str) -> str:
        return f"{ISSUE_HANDOFF_FAILED}_{self._entry.entry_id}_{vm}"

    def _fire(self, event: str, vm: str, **data: Any) -> None:
        device = self._device(vm)
        self.hass.bus.async_fire(
            event,
            {
                "device_id": device.id if device is not None else None,
                "config_entry_id": self._entry.entry_id,
                "vm": vm,
                **data,
            },
        )
