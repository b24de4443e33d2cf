"""What the running operation shows: its step and phase, the drain, the last
errors; published in the coordinator's snapshot (every entity reads it from
there). It is the operation runner's host."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace

from homeassistant.core import callback
from homeassistant.util import dt as dt_util

from .cluster_model import DrainProgress, NodeView
from .const import EVENT_HANDOFF_STEP
from .coordinator import GpuHandoffCoordinator
from .core import Hold, Kind, PendingJob, Request
from .models import OperationView
from .protocol import TowerStatus
from .report import Reporter


@dataclass
class Operation:
    """What the controller is doing now for one gaming VM (or the GPU node)."""

    vm: str
    kind: str  # handoff | stop | return
    step: str
    started: str
    phase: str | None = None  # PHASE_*: where the GPU node is in it


class OperationProgress:
    """The running operation as users see it, and the runner's host (the
    tower job it asks for is stored by the controller: ``pending_job`` and
    ``save_job`` are the controller's)."""

    def __init__(
        self,
        coordinator: GpuHandoffCoordinator,
        report: Reporter,
        *,
        requests: Callable[[], Mapping[str, Request]],
        job: Callable[[], PendingJob | None],
        save_job: Callable[[PendingJob | None], Awaitable[None]],
        hold: Callable[[], Hold | None] = lambda: None,
    ) -> None:
        """Nothing runs: no operation, no drain, no error."""
        self.coordinator = coordinator
        self.report = report
        self._requests = requests
        self._job = job
        self._save_job = save_job
        self._hold = hold
        self.operation: Operation | None = None
        self.drain: DrainProgress | None = None
        self.last_error: dict[str, str] = {}

    def begin(self, vm: str, kind: Kind) -> None:
        """An operation for ``vm`` begins: its last error is gone."""
        self.operation = Operation(vm, kind, "preparing", dt_util.utcnow().isoformat())
        self.last_error.pop(vm, None)

    def end(self) -> None:
        """No operation runs."""
        self.operation = None
        self.drain = None

    def failed(self, vm: str, message: str) -> None:
        """Show ``vm``'s failure on its switch and the sensor."""
        self.last_error[vm] = message
        self.publish()

    @callback
    def publish(self) -> None:
        """Show what the controller is doing: every entity reads it from the
        coordinator's snapshot."""
        operation = self.operation
        hold = self._hold()
        self.coordinator.async_set_operation(
            OperationView(
                requests={vm: r.kind.value for vm, r in self._requests().items()},
                vm=operation.vm if operation is not None else None,
                kind=operation.kind if operation is not None else None,
                step=operation.step if operation is not None else None,
                phase=operation.phase if operation is not None else None,
                started=operation.started if operation is not None else None,
                drain=self.drain,
                last_error=dict(self.last_error),
                held_for=hold.vm if hold is not None else None,
                hold_ends=hold.until if hold is not None else None,
            )
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
            self.publish()

    def step(self, step: str) -> None:
        """The running operation is at ``step``: an event, and the entities."""
        operation = self.operation
        if operation is None or operation.step == step:
            return
        operation.step = step
        self.report.fire(
            EVENT_HANDOFF_STEP, operation.vm, kind=operation.kind, step=step
        )
        self.publish()

    def drain_progress(self, progress: DrainProgress) -> None:
        """How far the drain is, shown live."""
        self.drain = progress
        self.publish()

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
        return self._job()

    async def save_job(self, job: PendingJob | None) -> None:
        """Store the operation's tower job (before it is asked for), and
        what its jobs did so far (once one has ended)."""
        await self._save_job(job)
