"""The handoff controller: gives a gaming VM its cards, and the cluster its cards back.

Desired state (which gaming VMs should play, and the operation in flight with
its tower job) is stored, so an operation interrupted by a Home Assistant
restart or a dropped SSH connection is resumed: every step is idempotent, and a
tower job that already runs is followed rather than submitted again. One
operation runs per tower at a time. Nothing here can destroy a VM: the tower
agent offers no such verb.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import logging
from typing import TYPE_CHECKING, Any, Final

from homeassistant.core import HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import device_registry as dr, issue_registry as ir
from homeassistant.helpers.storage import Store
from homeassistant.util import dt as dt_util

from .cluster_client import ClusterError, DrainError, DrainProgress
from .const import (
    CONF_AUTO_RETURN,
    CONF_DRAIN_TIMEOUT,
    DEFAULT_AUTO_RETURN,
    DEFAULT_DRAIN_TIMEOUT,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
)
from .entity import domain_identifier
from .models import RUNNING, SHUT_OFF, TowerStatus
from .tower_client import TowerConnectionError, TowerError

if TYPE_CHECKING:
    from .coordinator import GpuHandoffCoordinator

_LOGGER = logging.getLogger(__name__)

STORAGE_VERSION: Final = 1
JOB_POLL: Final = 0.5
# How long a job may be followed through tower outages before giving up.
JOB_WAIT_MAX: Final = 1800.0
NODE_READY_TIMEOUT: Final = 900.0
NODE_POLL: Final = 2.0
ISSUE_HANDOFF_FAILED: Final = "handoff_failed"

# The agent's job steps, as the steps a user sees.
AGENT_STEPS: Final = {
    "wait_agent": "waiting_for_guest_agent",
    "shutdown": "stopping",
    "wait_shut_off": "stopping",
    "wait_devices_free": "waiting_for_cards",
    "start": "starting",
}


class JobFailedError(HomeAssistantError):
    """A tower job ended in failure."""

    def __init__(self, job: dict[str, Any]) -> None:
        error = job.get("error") or {}
        super().__init__(str(error.get("message", "the tower job failed")))
        self.code = str(error.get("code", "job_failed"))


@dataclass
class Operation:
    """What the controller is doing now for one gaming VM (or the GPU node)."""

    vm: str
    kind: str  # handoff | stop | return
    step: str
    started: str


class HandoffController:
    """Drives handoffs and returns for one tower."""

    def __init__(self, hass: HomeAssistant, coordinator: GpuHandoffCoordinator) -> None:
        """Nothing runs until ``async_start``."""
        self.hass = hass
        self.coordinator = coordinator
        entry = coordinator.config_entry
        self._entry = entry
        self._store: Store[dict[str, Any]] = Store(
            hass, STORAGE_VERSION, f"{DOMAIN}.{entry.entry_id}"
        )
        self._lock = asyncio.Lock()
        self.desired: set[str] = set()
        self.pending: dict[str, Any] | None = None
        self.operation: Operation | None = None
        self.drain: DrainProgress | None = None
        self.last_error: dict[str, str] = {}
        self._seen_hook_requests: set[str] = set()
        self._returning = False
        # VMs with an operation accepted and not finished (queued or running).
        self._busy: set[str] = set()

    # --- persistence ---------------------------------------------------------

    async def async_start(self) -> None:
        """Load the desired state and resume what an earlier run left."""
        stored = await self._store.async_load() or {}
        self.desired = set(stored.get("desired", []))
        self.pending = stored.get("pending")
        status = self.coordinator.data.tower
        self._seen_hook_requests = {_request_key(r) for r in status.hook_requests}
        if self.pending is not None:
            vm, kind = self.pending["vm"], self.pending["kind"]
            _LOGGER.info("Resuming the %s of %s after a restart", kind, vm)
            self._spawn(self._run(vm, kind, resume=True))
        self.coordinator.async_add_listener(self._reconcile)

    async def _save(self) -> None:
        await self._store.async_save(
            {"desired": sorted(self.desired), "pending": self.pending}
        )

    # --- requests ------------------------------------------------------------

    def _validate(self, vm: str) -> None:
        if vm not in self.coordinator.data.tower.gaming:
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="unknown_vm",
                translation_placeholders={"vm": vm},
            )
        if not self.coordinator.last_update_success:
            raise HomeAssistantError(
                translation_domain=DOMAIN, translation_key="tower_unreachable"
            )
        if vm in self._busy:
            raise ServiceValidationError(
                translation_domain=DOMAIN,
                translation_key="already_in_progress",
                translation_placeholders={"vm": vm},
            )

    async def async_turn_on(self, vm: str) -> asyncio.Task[bool]:
        """Accept a handoff to ``vm``; it runs in the background."""
        self._validate(vm)
        self._busy.add(vm)
        self.desired.add(vm)
        await self._save()
        return self._spawn(self._run(vm, "handoff"))

    async def async_turn_off(self, vm: str) -> asyncio.Task[bool]:
        """Shut ``vm`` down gracefully; its cards then go back to the cluster."""
        self._validate(vm)
        self._busy.add(vm)
        self.desired.discard(vm)
        await self._save()
        return self._spawn(self._run(vm, "stop"))

    async def async_return_cards(self) -> asyncio.Task[bool]:
        """Start the GPU node (once no gaming VM holds its cards) and uncordon it."""
        if not self.coordinator.last_update_success:
            raise HomeAssistantError(
                translation_domain=DOMAIN, translation_key="tower_unreachable"
            )
        return self._spawn(self._run(self.coordinator.data.tower.gpu_node, "return"))

    def _spawn(self, coro: Any) -> asyncio.Task[bool]:
        """Run an operation in the background (cancelled when the entry unloads)."""
        return self._entry.async_create_background_task(
            self.hass, coro, f"{DOMAIN} operation"
        )

    # --- reconciling desired and observed state --------------------------------

    @callback
    def _reconcile(self) -> None:
        """After each update: notice what happened on the tower, and return the
        cards or lift a leftover cordon when nothing else is going on."""
        if self._lock.locked() or self.pending is not None or self._busy:
            return
        data = self.coordinator.data
        status = data.tower
        for request in status.hook_requests:
            key = _request_key(request)
            if key in self._seen_hook_requests:
                continue
            self._seen_hook_requests.add(key)
            vm = str(request.get("domain"))
            if vm in status.gaming and vm not in self.desired:
                # A gaming VM started by hand while the GPU node held its
                # cards: do the handoff properly, so a retry of the start works.
                _LOGGER.info("%s was started on the tower; handing its cards over", vm)
                self.desired.add(vm)
                self._spawn(self._persist_and_run(vm, "handoff"))
                return
        for vm in sorted(self.desired):
            domain = status.domains.get(vm)
            if domain is not None and domain.state == SHUT_OFF:
                # The player shut the game down from inside.
                self.desired.discard(vm)
                self.hass.async_create_task(self._save())
        playing = [
            vm
            for vm in status.gaming
            if (d := status.domains.get(vm)) is not None and d.state == RUNNING
        ]
        gpu = status.domains.get(status.gpu_node)
        if gpu is None or playing or self.desired:
            return
        node = data.node
        auto = self._entry.options.get(CONF_AUTO_RETURN, DEFAULT_AUTO_RETURN)
        wanted = (gpu.state == SHUT_OFF and auto) or (
            gpu.state == RUNNING
            and node is not None
            and node.ready
            and node.unschedulable
        )
        if wanted and not self._returning:
            self._returning = True
            self._spawn(self._persist_and_run(status.gpu_node, "return"))

    async def _persist_and_run(self, vm: str, kind: str) -> bool:
        await self._save()
        return await self._run(vm, kind)

    # --- running operations ----------------------------------------------------

    async def _run(self, vm: str, kind: str, resume: bool = False) -> bool:
        """One operation at a time; True when it succeeded."""
        self._busy.add(vm)
        try:
            return await self._run_locked(vm, kind, resume)
        finally:
            self._busy.discard(vm)

    async def _run_locked(self, vm: str, kind: str, resume: bool) -> bool:
        async with self._lock:
            if not resume:
                self.pending = {"vm": vm, "kind": kind, "job": None}
                await self._save()
            self.operation = Operation(
                vm, kind, "preparing", dt_util.utcnow().isoformat()
            )
            self.last_error.pop(vm, None)
            self._fire(EVENT_HANDOFF_STARTED, vm, kind=kind)
            returned = False
            try:
                if kind == "handoff":
                    await self._handoff(vm)
                elif kind == "stop":
                    returned = await self._stop(vm)
                else:
                    await self._return()
                    returned = True
            except asyncio.CancelledError:
                # Home Assistant stops or the entry unloads: keep ``pending`` so
                # the next start resumes the operation.
                self.operation = None
                self.drain = None
                raise
            except (HomeAssistantError, TowerError, ClusterError) as err:
                await self._failed(vm, kind, err)
                succeeded = False
            else:
                succeeded = True
            self.operation = None
            self.drain = None
            # Fresh state before anything reconciles again: a stale snapshot
            # (say, the cordon just lifted) would start the same work twice.
            await self.coordinator.async_refresh()
            self._returning = False
            self.pending = None
            await self._save()
            if not succeeded:
                return False
            self._fire(EVENT_HANDOFF_SUCCEEDED, vm, kind=kind)
            if returned:
                self._fire(EVENT_CARDS_RETURNED, self.coordinator.data.tower.gpu_node)
            ir.async_delete_issue(self.hass, DOMAIN, self._issue_id(vm))
            return True

    def _step(self, step: str) -> None:
        operation = self.operation
        if operation is None or operation.step == step:
            return
        operation.step = step
        self._fire(EVENT_HANDOFF_STEP, operation.vm, kind=operation.kind, step=step)
        self.coordinator.async_update_listeners()

    async def _status(self) -> TowerStatus:
        return TowerStatus.from_reply(await self.coordinator.tower.status())

    async def _handoff(self, vm: str) -> None:
        status = await self._status()
        target = status.domains[vm]
        if target.state == RUNNING:
            return
        gpu_node = status.gpu_node
        node_holds = any(
            card.held_by == gpu_node and card.address in target.cards
            for card in status.cards
        )
        if node_holds and not self._resuming_job():
            self._step("draining")
            timeout = float(
                self._entry.options.get(CONF_DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT)
            )
            try:
                await self.coordinator.cluster.drain(
                    self.coordinator.k8s_node, timeout, self._drain_progress
                )
            except ClusterError:
                await self._uncordon_if_serving()
                raise
        try:
            await self._job("handoff" if node_holds else "start", vm)
        except JobFailedError, TowerError:
            await self._uncordon_if_serving()
            self.desired.discard(vm)
            raise

    async def _stop(self, vm: str) -> bool:
        """Stop ``vm``; True when the cards went back to the cluster too."""
        status = await self._status()
        others = [
            other
            for other in status.gaming
            if other != vm
            and (d := status.domains.get(other)) is not None
            and d.state == RUNNING
        ]
        auto = self._entry.options.get(CONF_AUTO_RETURN, DEFAULT_AUTO_RETURN)
        if others or not auto:
            await self._job("stop", vm)
            return False
        # Nobody else plays: stop the VM and start the GPU node in one job.
        await self._job("release", vm)
        await self._node_back()
        return True

    async def _return(self) -> None:
        status = await self._status()
        gpu = status.domains[status.gpu_node]
        if gpu.state != RUNNING:
            await self._job("release", None)
        await self._node_back()

    async def _node_back(self) -> None:
        """Wait until the GPU node's Kubernetes node is Ready, then uncordon it
        (a drain's cordon survives the node's reboot)."""
        self._step("waiting_for_node")
        cluster = self.coordinator.cluster
        deadline = asyncio.get_running_loop().time() + NODE_READY_TIMEOUT
        while True:
            try:
                view = await cluster.node_view(self.coordinator.k8s_node)
            except ClusterError:
                view = None
            if view is not None and view.ready:
                break
            if asyncio.get_running_loop().time() > deadline:
                raise HomeAssistantError(
                    translation_domain=DOMAIN, translation_key="node_not_ready"
                )
            await asyncio.sleep(NODE_POLL)
        self._step("uncordoning")
        await cluster.uncordon(self.coordinator.k8s_node)

    async def _uncordon_if_serving(self) -> None:
        """Roll back a cordon when the GPU node still runs (it was never stopped)."""
        try:
            status = await self._status()
            gpu = status.domains.get(status.gpu_node)
            if gpu is not None and gpu.state == RUNNING:
                await self.coordinator.cluster.uncordon(self.coordinator.k8s_node)
        except (TowerError, ClusterError) as err:
            _LOGGER.warning("Could not lift the cordon after a failed handoff: %s", err)

    def _resuming_job(self) -> bool:
        return self.pending is not None and self.pending.get("job") is not None

    async def _job(self, kind: str, arg: str | None) -> dict[str, Any]:
        """Submit a tower job (or follow the one a previous run submitted) until
        it ends; its steps show as the operation's steps."""
        tower = self.coordinator.tower
        pending = self.pending if self.pending is not None else {}
        self.pending = pending
        job_id = pending.get("job")
        if job_id is None:
            reply = await tower.call(kind, *([arg] if arg else []))
            job_id = str(reply["job"]["id"])
            pending["job"] = job_id
            await self._save()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOB_WAIT_MAX
        while True:
            try:
                job = (await tower.call("job", job_id))["job"]
            except TowerConnectionError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(JOB_POLL)
                continue
            step = job.get("step")
            steps = job.get("steps") or []
            if isinstance(step, int) and step < len(steps):
                current = steps[step]
                name = AGENT_STEPS.get(str(current.get("name")), "working")
                self._step(f"{name}_{_role(current.get('domain'), self)}")
            if job["state"] == "succeeded":
                pending["job"] = None
                return dict(job)
            if job["state"] == "failed":
                pending["job"] = None
                raise JobFailedError(job)
            await asyncio.sleep(JOB_POLL)

    @callback
    def _drain_progress(self, progress: DrainProgress) -> None:
        self.drain = progress
        self.coordinator.async_update_listeners()

    async def _failed(self, vm: str, kind: str, err: Exception) -> None:
        code = getattr(err, "code", None) or type(err).__name__
        message = str(err)
        _LOGGER.warning("The %s of %s failed: %s", kind, vm, message)
        self.last_error[vm] = message
        self._fire(EVENT_HANDOFF_FAILED, vm, kind=kind, error=message, code=code)
        if isinstance(err, (JobFailedError, DrainError)):
            ir.async_create_issue(
                self.hass,
                DOMAIN,
                self._issue_id(vm),
                is_fixable=False,
                is_persistent=False,
                severity=ir.IssueSeverity.ERROR,
                translation_key=ISSUE_HANDOFF_FAILED,
                translation_placeholders={"vm": vm, "kind": kind, "error": message},
            )

    def _issue_id(self, vm: str) -> str:
        return f"{ISSUE_HANDOFF_FAILED}_{self._entry.entry_id}_{vm}"

    def _fire(self, event: str, vm: str, **data: Any) -> None:
        device = dr.async_get(self.hass).async_get_device_by_identifier(
            domain_identifier(self.coordinator, vm), self._entry.entry_id
        )
        self.hass.bus.async_fire(
            event,
            {
                "device_id": device.id if device is not None else None,
                "config_entry_id": self._entry.entry_id,
                "vm": vm,
                **data,
            },
        )


def _role(domain: Any, controller: HandoffController) -> str:
    """``gpu_node`` or ``vm``: which machine a tower job step acts on."""
    return "gpu_node" if domain == controller.coordinator.data.tower.gpu_node else "vm"


def _request_key(request: dict[str, Any]) -> str:
    return f"{request.get('time')}|{request.get('domain')}"
