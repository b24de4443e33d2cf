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
from dataclasses import dataclass, replace
import logging
from typing import TYPE_CHECKING, Any, Final

from homeassistant.core import HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import device_registry as dr, issue_registry as ir
from homeassistant.helpers.storage import Store
from homeassistant.util import dt as dt_util

from .cluster_client import (
    CORDON_OWNER_OTHER,
    CORDON_OWNER_US,
    SKIP_WAIT_FOR_DELETE,
    ClusterClient,
    ClusterError,
    DrainError,
    DrainProgress,
    NodeView,
    UnmanagedPodsError,
)
from .const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_HANDOFF_WHEN_CORDONED,
    DEFAULT_AUTO_RETURN,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_EVICT_UNMANAGED,
    DEFAULT_HANDOFF_WHEN_CORDONED,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    PHASE_DRAINING,
    PHASE_RETURNING,
    PHASE_STOPPING,
)
from .entity import domain_identifier
from .models import RUNNING, SHUT_OFF, TowerStatus
from .tower_client import TowerClient, TowerConnectionError, TowerError

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
ISSUE_UNMANAGED_PODS: Final = "unmanaged_pods"
# How long a pod may sit terminating past its deletion time before the drain
# stops waiting for it (its kubelet is not reporting): kubectl's
# --skip-wait-for-delete-timeout.
SKIP_WAIT: float = SKIP_WAIT_FOR_DELETE

# The agent's job steps, as the steps a user sees.
AGENT_STEPS: Final = {
    "wait_agent": "waiting_for_guest_agent",
    "shutdown": "stopping",
    "wait_shut_off": "stopping",
    "wait_devices_free": "waiting_for_cards",
    "start": "starting",
}


async def lift_own_cordon_if_serving(
    tower: TowerClient, cluster: ClusterClient, k8s_node: str
) -> bool:
    """Lift GPU Handoff's own cordon if the GPU node runs and no tower job may
    still stop it; an operator's cordon is never touched. True if lifted."""
    status = TowerStatus.from_reply(await tower.status())
    gpu = status.domains.get(status.gpu_node)
    if gpu is None or gpu.state != RUNNING or status.job_for(status.gpu_node):
        return False
    return await cluster.uncordon(k8s_node)


def handoff_store(hass: HomeAssistant, entry_id: str) -> Store[dict[str, Any]]:
    """Where a tower's desired state and operation in flight are kept."""
    return Store(hass, STORAGE_VERSION, f"{DOMAIN}.{entry_id}")


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
    phase: str | None = None  # PHASE_*: where the GPU node is in it


class HandoffController:
    """Drives handoffs and returns for one tower."""

    def __init__(self, hass: HomeAssistant, coordinator: GpuHandoffCoordinator) -> None:
        """Nothing runs until ``async_start``."""
        self.hass = hass
        self.coordinator = coordinator
        entry = coordinator.config_entry
        self._entry = entry
        self._store = handoff_store(hass, entry.entry_id)
        self._lock = asyncio.Lock()
        self.desired: set[str] = set()
        self.pending: dict[str, Any] | None = None
        self.operation: Operation | None = None
        self.drain: DrainProgress | None = None
        self.last_error: dict[str, str] = {}
        self._seen_hook_requests: set[str] = set()
        self._returning = False
        # Requests accepted and not finished (queued or running): VM -> kind.
        # The switch shows them at once, before any step has run.
        self.requests: dict[str, str] = {}

    # --- persistence ---------------------------------------------------------

    async def async_start(self) -> None:
        """Load the desired state and resume what an earlier run left."""
        stored = await self._store.async_load() or {}
        self.desired = set(stored.get("desired", []))
        self.pending = stored.get("pending")
        status = self.coordinator.data.tower
        self._seen_hook_requests = {_request_key(r) for r in status.hook_requests}
        self._forget_unknown_vms()
        if self.pending is not None:
            vm, kind = self.pending["vm"], self.pending["kind"]
            if vm == status.gpu_node or vm in self.configured_vms:
                _LOGGER.info("Resuming the %s of %s after a restart", kind, vm)
                self._spawn(self._run(vm, kind, resume=True))
            else:
                # Its gaming VM was removed meanwhile: end it at a safe point.
                self._spawn(self._abandon())
        self.coordinator.async_add_listener(self._reconcile)

    @property
    def configured_vms(self) -> set[str]:
        """The gaming VMs the user added to this tower (one subentry each)."""
        return {
            str(sub.data[CONF_DOMAIN_NAME]) for sub in self._entry.subentries.values()
        }

    def _forget_unknown_vms(self) -> bool:
        """Drop VMs no longer configured or no longer defined on the tower from
        the desired set (they would block the automatic return forever)."""
        domains = self.coordinator.data.tower.domains
        known = {
            vm
            for vm in self.desired
            if vm in self.configured_vms
            and (state := domains.get(vm)) is not None
            and state.exists
        }
        if known == self.desired:
            return False
        _LOGGER.info("Forgetting %s", ", ".join(sorted(self.desired - known)))
        self.desired = known
        return True

    async def _save(self) -> None:
        await self._store.async_save(
            {"desired": sorted(self.desired), "pending": self.pending}
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

    def _check_operator_cordon(self, owner: str | None) -> None:
        """Refuse to hand off on top of someone else's cordon unless the user
        chose to (an administrator's drain, an upgrade controller's cordon)."""
        if owner == CORDON_OWNER_OTHER and not self._entry.options.get(
            CONF_HANDOFF_WHEN_CORDONED, DEFAULT_HANDOFF_WHEN_CORDONED
        ):
            raise HomeAssistantError(
                translation_domain=DOMAIN,
                translation_key="cordoned_by_operator",
                translation_placeholders={"node": self.coordinator.k8s_node},
            )

    async def async_turn_on(self, vm: str) -> asyncio.Task[bool]:
        """Accept a handoff to ``vm``; it runs in the background."""
        self._validate(vm)
        node = self.coordinator.data.node
        if self._node_holds_cards_of(self.coordinator.data.tower, vm):
            self._check_operator_cordon(node.cordon_owner if node else None)
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
        for request in status.hook_requests:
            key = _request_key(request)
            if key in self._seen_hook_requests:
                continue
            self._seen_hook_requests.add(key)
            vm = str(request.get("domain"))
            if vm in status.gaming and vm in self.configured_vms:
                if vm in self.desired:
                    continue
                # A gaming VM started by hand while the GPU node held its
                # cards: do the handoff properly, so a retry of the start works.
                _LOGGER.info("%s was started on the tower; handing its cards over", vm)
                self.desired.add(vm)
                self._spawn(self._persist_and_run(vm, "handoff"))
                return
        changed = self._forget_unknown_vms()
        ended = [
            vm
            for vm in sorted(self.desired)
            if (domain := status.domains.get(vm)) is not None
            and domain.state == SHUT_OFF
        ]
        # The player shut the game down from inside.
        self.desired.difference_update(ended)
        changed = changed or bool(ended)
        playing = [
            vm
            for vm in status.gaming
            if (d := status.domains.get(vm)) is not None and d.state == RUNNING
        ]
        gpu = status.domains.get(status.gpu_node)
        auto = self._entry.options.get(CONF_AUTO_RETURN, DEFAULT_AUTO_RETURN)
        session_ended = bool(ended) and not playing and not self.desired
        node = data.node
        # The safety net: our own cordon on a GPU node that serves again
        # (an operation interrupted between the node's return and the uncordon).
        leftover = (
            gpu is not None
            and gpu.state == RUNNING
            and not playing
            and not self.desired
            and node is not None
            and node.ready is True
            and node.cordon_owner == CORDON_OWNER_US
            and status.job_for(status.gpu_node) is None
        )
        if (session_ended and auto and gpu is not None) or leftover:
            if not self._returning:
                self._returning = True
                self._spawn(self._persist_and_run(status.gpu_node, "return"))
            return
        if changed:
            self.hass.async_create_task(self._save_in_background(), f"{DOMAIN} save")

    async def _persist_and_run(self, vm: str, kind: str) -> bool:
        await self._save()
        return await self._run(vm, kind)

    # --- running operations ----------------------------------------------------

    async def _run(self, vm: str, kind: str, resume: bool = False) -> bool:
        """One operation at a time; True when it succeeded."""
        self.requests.setdefault(vm, kind)
        try:
            return await self._run_locked(vm, kind, resume)
        finally:
            if self.requests.get(vm) == kind:
                del self.requests[vm]
            if kind == "return":
                self._returning = False
            self.coordinator.async_update_listeners()

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
            self.coordinator.async_update_listeners()
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
            except Exception as err:  # noqa: BLE001 - every failure must end the operation
                await self._failed(vm, kind, err)
                succeeded = False
            else:
                succeeded = True
            # Fresh state before anything reconciles again: a stale snapshot
            # (say, the cordon just lifted) would start the same work twice.
            await self.coordinator.async_refresh()
            self.operation = None
            self.drain = None
            self.pending = None
            await self._save()
            if not succeeded:
                return False
            self._fire(EVENT_HANDOFF_SUCCEEDED, vm, kind=kind)
            if returned:
                self._fire(EVENT_CARDS_RETURNED, self.coordinator.data.tower.gpu_node)
            ir.async_delete_issue(self.hass, DOMAIN, self._issue_id(vm))
            ir.async_delete_issue(self.hass, DOMAIN, self._unmanaged_issue_id)
            return True

    @property
    def phase(self) -> str | None:
        """Where the GPU node is in the running operation (PHASE_*), if any."""
        return self.operation.phase if self.operation is not None else None

    def _set_phase(self, phase: str | None) -> None:
        if self.operation is not None and self.operation.phase != phase:
            self.operation.phase = phase
            self.coordinator.async_update_listeners()

    def _step(self, step: str) -> None:
        operation = self.operation
        if operation is None or operation.step == step:
            return
        operation.step = step
        self._fire(EVENT_HANDOFF_STEP, operation.vm, kind=operation.kind, step=step)
        self.coordinator.async_update_listeners()

    @callback
    def _show_node(self, view: NodeView) -> None:
        """Show what the controller just learned or did to the node at once, so
        every entity agrees with the Handoff state at every write."""
        data = self.coordinator.data
        self.coordinator.async_set_updated_data(replace(data, node=view))

    @callback
    def _show_cordon(self, owner: str | None) -> None:
        node = self.coordinator.data.node
        if node is not None:
            self._show_node(
                replace(node, unschedulable=owner is not None, cordon_owner=owner)
            )

    async def _status(self) -> TowerStatus:
        return TowerStatus.from_reply(await self.coordinator.tower.status())

    @staticmethod
    def _node_holds_cards_of(status: TowerStatus, vm: str) -> bool:
        target = status.domains.get(vm)
        return target is not None and any(
            card.held_by == status.gpu_node and card.address in target.cards
            for card in status.cards
        )

    async def _handoff(self, vm: str) -> None:
        status = await self._status()
        if status.domains[vm].state == RUNNING:
            return
        node_holds = self._node_holds_cards_of(status, vm)
        try:
            if node_holds and not self._resuming_job():
                await self._drain(vm)
            if node_holds:
                self._set_phase(PHASE_STOPPING)
            await self._job("handoff" if node_holds else "start", vm)
        except Exception:
            # Whatever went wrong: lift our own cordon if the GPU node still
            # serves and no tower job may still stop it.
            self.desired.discard(vm)
            await self._uncordon_if_serving()
            raise

    async def _drain(self, vm: str) -> None:
        """Cordon the GPU node's node (marking the cordon as ours), then drain
        it as kubectl does."""
        cluster = self.coordinator.cluster
        node = self.coordinator.k8s_node
        options = self._entry.options
        self._set_phase(PHASE_DRAINING)
        self._step("draining")
        owner = await cluster.cordon(node, f"handoff to {vm}")
        self._show_cordon(owner)
        self._check_operator_cordon(owner)
        await cluster.drain(
            node,
            float(options.get(CONF_DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT)),
            self._drain_progress,
            force=bool(options.get(CONF_EVICT_UNMANAGED, DEFAULT_EVICT_UNMANAGED)),
            skip_after=SKIP_WAIT,
        )

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
        # The return begins now (the Handoff state goes to `starting` and
        # only forward from there, whatever the snapshot lags behind).
        self._set_phase(PHASE_RETURNING)
        await self._job("release", vm)
        await self._node_back()
        return True

    async def _return(self) -> None:
        status = await self._status()
        gpu = status.domains[status.gpu_node]
        self._set_phase(PHASE_RETURNING)
        if gpu.state != RUNNING:
            await self._job("release", None)
        await self._node_back()

    async def _node_back(self) -> None:
        """Wait until the GPU node's Kubernetes node is Ready, then lift our own
        cordon (a drain's cordon survives the node's reboot); an operator's
        cordon stays."""
        self._set_phase(PHASE_RETURNING)
        self._step("waiting_for_node")
        cluster = self.coordinator.cluster
        deadline = asyncio.get_running_loop().time() + NODE_READY_TIMEOUT
        while True:
            try:
                view = await cluster.node_view(self.coordinator.k8s_node)
            except ClusterError:
                view = None
            if view is not None and view.ready:
                self._show_node(view)
                break
            if asyncio.get_running_loop().time() > deadline:
                raise HomeAssistantError(
                    translation_domain=DOMAIN, translation_key="node_not_ready"
                )
            await asyncio.sleep(NODE_POLL)
        self._step("uncordoning")
        if await cluster.uncordon(self.coordinator.k8s_node):
            self._show_cordon(None)

    async def _uncordon_if_serving(self) -> None:
        """Roll back our own cordon when the GPU node still runs (it was never
        stopped) and no tower job may still stop it."""
        try:
            if await lift_own_cordon_if_serving(
                self.coordinator.tower,
                self.coordinator.cluster,
                self.coordinator.k8s_node,
            ):
                self._show_cordon(None)
        except (TowerError, ClusterError) as err:
            _LOGGER.warning("Could not lift the cordon after a failed handoff: %s", err)

    async def _abandon(self) -> None:
        """End an operation whose gaming VM is no longer configured: follow a
        tower job it started to its end, then lift our own cordon if the GPU
        node still serves, and forget it."""
        async with self._lock:
            try:
                if self._resuming_job():
                    await self._job("", None)
            except Exception as err:  # noqa: BLE001 - logged; nothing to resume
                _LOGGER.warning("The abandoned operation's job failed: %s", err)
            await self._uncordon_if_serving()
            self.pending = None
            await self._save()

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
        message = str(err) or type(err).__name__
        if isinstance(err, HomeAssistantError | TowerError | ClusterError):
            _LOGGER.warning("The %s of %s failed: %s", kind, vm, message)
        else:
            _LOGGER.error("The %s of %s failed unexpectedly", kind, vm, exc_info=err)
        if isinstance(err, UnmanagedPodsError):
            code = ISSUE_UNMANAGED_PODS
        self.last_error[vm] = message
        self._fire(EVENT_HANDOFF_FAILED, vm, kind=kind, error=message, code=code)
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
                    "vm": vm,
                    "node": self.coordinator.k8s_node,
                    "pods": ", ".join(err.pods),
                },
            )
        elif isinstance(err, JobFailedError | DrainError) or not isinstance(
            err, HomeAssistantError | TowerError | ClusterError
        ):
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

    @property
    def _unmanaged_issue_id(self) -> str:
        return f"{ISSUE_UNMANAGED_PODS}_{self._entry.entry_id}"

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
