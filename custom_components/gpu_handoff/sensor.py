"""Sensors: the GPU node's handoff state, VM states, GPUs lent to the cluster."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
import math
from typing import Any, Final

from homeassistant.components.sensor import (
    SensorDeviceClass,
    SensorEntity,
    SensorEntityDescription,
    SensorStateClass,
)
from homeassistant.const import EntityCategory, UnitOfTime
from homeassistant.core import HomeAssistant, callback
from homeassistant.helpers import entity_registry as er
from homeassistant.helpers.entity_platform import AddConfigEntryEntitiesCallback
from homeassistant.util import dt as dt_util

from .assist import (
    GPU_NODE_SPOKEN,
    async_expose_to_assist_once,
    async_offer_voice_aliases,
    device_name,
    is_english,
    spoken_forms,
    unique_names,
)
from .cluster_model import CORDON_OWNER_US
from .const import CONF_GPU_NODE, PHASE_DRAINING, PHASE_RETURNING, PHASE_STOPPING
from .data import GpuHandoffConfigEntry, GpuHandoffData
from .entity import ClusterBacked, GpuHandoffEntity, gaming_vms
from .models import OperationView, Snapshot
from .protocol import (
    IN_SHUTDOWN,
    RUNNING,
    DomainState,
    JobKind,
    StepName,
    TowerStatus,
)

PARALLEL_UPDATES = 0

GPU_NODE_STATES: Final = [
    "serving",
    "cordoned",
    "draining",
    "stopping",
    "off",
    "starting",
    "joining",
    "unreachable",
    "held",
]
VM_STATES: Final = [
    "running",
    "blocked",
    "paused",
    "in_shutdown",
    "shut_off",
    "crashed",
    "pmsuspended",
    "no_state",
    "missing",
]
# The order the Handoff state moves in through a handoff and through a return.
HANDOFF_ORDER: Final = ("serving", "draining", "stopping", "off")
RETURN_ORDER: Final = ("off", "starting", "joining", "serving")
STOPPING_JOBS: Final = frozenset({"stop", "handoff"})
# A lend job stops the GPU node and starts it again with the free cards.
STARTING_JOBS: Final = frozenset({"start", "release", "lend"})
STOP_STEPS: Final = frozenset(
    {StepName.WAIT_AGENT, StepName.SHUTDOWN, StepName.WAIT_SHUT_OFF}
)


def gpu_node_state(snapshot: Snapshot, phase: str | None = None) -> str:
    """The GPU node's place in the handoff cycle.

    ``phase`` is where the controller's running operation has the GPU node
    (PHASE_*): through an operation the state only moves forward, whatever
    lags in the snapshot (a handoff: draining, stopping, off; a return:
    starting, joining, serving).
    """
    tower = snapshot.tower
    vm = tower.domains.get(tower.gpu_node)
    job = tower.job_for(tower.gpu_node)
    node = snapshot.node
    # In shutdown: the guest has powered off and libvirt is ending its QEMU
    # process, which still holds the cards: stopping, off once shut off.
    if vm is None or vm.state not in (RUNNING, IN_SHUTDOWN):
        starting = phase == PHASE_RETURNING or (
            job is not None and job.kind in STARTING_JOBS
        )
        if starting:
            return "starting"
        # Off, its cards held for a gaming VM that starts soon (a prepare).
        return "held" if snapshot.operation.held_for is not None else "off"
    if (
        vm.state == IN_SHUTDOWN
        or phase == PHASE_STOPPING
        or (
            job is not None
            and job.state == "running"
            and (
                job.kind in STOPPING_JOBS
                or (job.kind is JobKind.LEND and job.step in STOP_STEPS)
            )
        )
    ):
        return "stopping"
    if phase == PHASE_DRAINING:
        return "draining"
    if node is None:
        return "unreachable"
    if not node.ready:
        return "starting" if vm.agent_ready is False else "joining"
    if phase == PHASE_RETURNING:
        # Ready, and our cordon not yet lifted: still joining the cluster.
        return "joining" if node.cordon_owner == CORDON_OWNER_US else "serving"
    return "cordoned" if node.unschedulable else "serving"


def pods_left(snapshot: Snapshot) -> int | None:
    """Pods a drain still has to move: live during a drain, else the node's."""
    if (drain := snapshot.operation.drain) is not None:
        return drain.pods_left
    return snapshot.node.evictable_pods if snapshot.node is not None else None


def gpu_node_attributes(snapshot: Snapshot) -> dict[str, Any]:
    """Drain progress, guest-agent readiness, card ownership, node health."""
    drain = snapshot.operation.drain
    tower = snapshot.tower
    vm = tower.domains.get(tower.gpu_node)
    node = snapshot.node
    job = tower.job_for(tower.gpu_node)
    return {
        "vm_state": vm.state if vm is not None else None,
        "guest_agent_ready": vm.agent_ready if vm is not None else None,
        "cordoned": node.unschedulable if node is not None else None,
        "cordoned_by": node.cordon_owner if node is not None else None,
        "pods_left": pods_left(snapshot),
        "evictions_refused": drain.evictions_refused if drain is not None else None,
        # Pods that came back to the cordoned node tolerating its cordon:
        # the drain leaves them (they stop with the GPU node).
        "pods_came_back": list(drain.came_back) if drain is not None else None,
        "node_ready": node.ready if node is not None else None,
        "lease_age": round(node.lease_age, 1)
        if node is not None and node.lease_age is not None
        else None,
        "gpus_allocatable": node.gpu_allocatable if node is not None else None,
        "gpus_in_use": node.gpu_requested if node is not None else None,
        # The tower job acting on the GPU node now, as words: its kind and
        # the step it is at ("none" while no job runs, never a JSON blob).
        "job": job.kind.value if job is not None else "none",
        "job_step": job.step.value if job is not None and job.step else "none",
        "cluster_error": snapshot.cluster_error,
        "cards": cards_by_device(tower),
        **hold_attributes(snapshot.operation),
    }


def hold_attributes(operation: OperationView) -> dict[str, Any]:
    """The gaming VM cards are held for after a prepare, when the hold ends,
    and the minutes left (shown anew each minute); none while nothing is
    held."""
    if operation.held_for is None or operation.hold_ends is None:
        return {"held_for": None, "hold_ends": None, "hold_minutes_left": None}
    ends = dt_util.parse_datetime(operation.hold_ends)
    left = (ends - dt_util.utcnow()).total_seconds() if ends is not None else 0.0
    return {
        "held_for": operation.held_for,
        "hold_ends": operation.hold_ends,
        "hold_minutes_left": max(0, math.ceil(left / 60)),
    }


def cards_by_device(tower: TowerStatus) -> list[dict[str, Any]]:
    """One row per card (PCI device), its functions (the GPU, its HDMI
    audio...) inside: who holds it now, which domains claim it, and what it is
    used for now: ``cluster`` (the GPU node has it), ``player`` (a gaming VM),
    ``idle`` (nobody), ``blocked`` (nobody, but ``blocked_by`` holds a card of
    its IOMMU group, so it cannot be lent), ``other`` (a domain GPU Handoff
    does not manage)."""
    rows: dict[str, dict[str, Any]] = {}
    for card in tower.cards:
        device = card.address.rsplit(".", 1)[0]
        row = rows.setdefault(
            device,
            {
                "card": device,
                "functions": [],
                "held_by": None,
                "claimed_by": [],
                "iommu_group": card.iommu_group,
                "blocked_by": None,
            },
        )
        row["functions"].append(card.address)
        row["held_by"] = row["held_by"] or card.held_by
        row["claimed_by"] = sorted({*row["claimed_by"], *card.claimed_by})
        row["blocked_by"] = row["blocked_by"] or tower.blocked_by(card)
    for row in rows.values():
        holder = row["held_by"]
        if holder is not None:
            row["blocked_by"] = None
        row["use"] = (
            "blocked"
            if row["blocked_by"] is not None
            else "idle"
            if holder is None
            else "cluster"
            if holder == tower.gpu_node
            else "player"
            if holder in tower.gaming
            else "other"
        )
    return list(rows.values())


@dataclass(frozen=True, kw_only=True)
class GpuHandoffSensorDescription(SensorEntityDescription, ClusterBacked):
    """A sensor and how it reads the snapshot of its domain."""

    value_fn: Callable[[Snapshot], str | int | float | None]


@dataclass(frozen=True, kw_only=True)
class VmSensorDescription(SensorEntityDescription):
    """A sensor of one VM and how it reads that VM's state."""

    value_fn: Callable[[DomainState | None], str | None]


GPU_NODE_SENSOR = SensorEntityDescription(
    key="handoff_state",
    translation_key="handoff_state",
    device_class=SensorDeviceClass.ENUM,
    options=GPU_NODE_STATES,
)

VM_STATE_SENSOR = VmSensorDescription(
    key="vm_state",
    translation_key="vm_state",
    device_class=SensorDeviceClass.ENUM,
    options=VM_STATES,
    value_fn=lambda vm: vm.state if vm is not None and vm.exists else "missing",
)

TOWER_SENSORS: Final = (
    GpuHandoffSensorDescription(
        key="gpus_lent",
        translation_key="gpus_lent",
        state_class=SensorStateClass.MEASUREMENT,
        value_fn=lambda snapshot: snapshot.tower.gpus_held_by(snapshot.tower.gpu_node),
    ),
)

NODE_SENSORS: Final = (
    GpuHandoffSensorDescription(
        key="gpus_in_use",
        translation_key="gpus_in_use",
        needs_cluster=True,
        state_class=SensorStateClass.MEASUREMENT,
        value_fn=lambda snapshot: (
            snapshot.node.gpu_requested if snapshot.node is not None else None
        ),
    ),
    GpuHandoffSensorDescription(
        key="pods_left",
        translation_key="pods_left",
        needs_cluster=True,
        state_class=SensorStateClass.MEASUREMENT,
        value_fn=pods_left,
    ),
    GpuHandoffSensorDescription(
        key="lease_age",
        translation_key="lease_age",
        needs_cluster=True,
        device_class=SensorDeviceClass.DURATION,
        native_unit_of_measurement=UnitOfTime.SECONDS,
        entity_category=EntityCategory.DIAGNOSTIC,
        entity_registry_enabled_default=False,
        value_fn=lambda snapshot: (
            round(snapshot.node.lease_age, 1)
            if snapshot.node is not None and snapshot.node.lease_age is not None
            else None
        ),
    ),
)


async def async_setup_entry(
    hass: HomeAssistant,
    entry: GpuHandoffConfigEntry,
    async_add_entities: AddConfigEntryEntitiesCallback,
) -> None:
    """Sensors of the tower, of the GPU node and of each gaming VM."""
    data = entry.runtime_data
    gpu_node = entry.data[CONF_GPU_NODE]
    async_add_entities(
        [
            *(GpuHandoffSensor(data, d) for d in TOWER_SENSORS),
            GpuNodeStateSensor(data, GPU_NODE_SENSOR, gpu_node),
            VmStateSensor(data, VM_STATE_SENSOR, gpu_node),
            *(GpuHandoffSensor(data, d, gpu_node) for d in NODE_SENSORS),
        ]
    )
    for subentry_id, domain in gaming_vms(entry):
        async_add_entities(
            [VmStateSensor(data, VM_STATE_SENSOR, domain)],
            config_subentry_id=subentry_id,
        )


class GpuHandoffSensor(GpuHandoffEntity, SensorEntity):
    """A sensor read from the snapshot."""

    entity_description: GpuHandoffSensorDescription

    @property
    def native_value(self) -> str | int | float | None:
        """The value."""
        return self.entity_description.value_fn(self.coordinator.data)


class VmStateSensor(GpuHandoffEntity, SensorEntity):
    """A VM's libvirt state."""

    entity_description: VmSensorDescription

    @property
    def native_value(self) -> str | None:
        """The value."""
        return self.entity_description.value_fn(self.vm)


class GpuNodeStateSensor(GpuHandoffEntity, SensorEntity):
    """The GPU node's place in the handoff cycle, from the tower, the cluster
    and the controller (a drain in progress, evictions a PDB refuses)."""

    # Card ownership is shown live; the recorder need not keep every copy.
    _unrecorded_attributes = frozenset({"cards", "job", "job_step", "lease_age"})

    _ratchet: tuple[object, int] | None = None

    async def async_added_to_hass(self) -> None:
        """Answer Assist's "what is the state of the GPU node": exposed to it
        on first sight, with the GPU node's name as an alias (the sensor's
        own name is "GPU node Handoff state")."""
        await super().async_added_to_hass()
        hass = self.hass
        if (entry := self.registry_entry) is None:
            return
        english = is_english(hass)
        names: list[str] = []
        if (device := device_name(hass, entry)) is not None:
            names += [device, *spoken_forms(device, english=english)]
        if english:
            names.append(GPU_NODE_SPOKEN)
        own = er.async_get_full_entity_name(hass, entry)
        async_offer_voice_aliases(
            hass, self.entity_id, unique_names(names, besides=own)
        )
        async_expose_to_assist_once(hass, self.entity_id)

    def __init__(
        self, data: GpuHandoffData, description: SensorEntityDescription, domain: str
    ) -> None:
        """Start from the snapshot as it is."""
        super().__init__(data, description, domain)
        self._attr_native_value = self._next_state()

    @callback
    def _handle_coordinator_update(self) -> None:
        """Each new snapshot moves the state (reading it changes nothing)."""
        self._attr_native_value = self._next_state()
        super()._handle_coordinator_update()

    def _next_state(self) -> str:
        """The GPU node's place in the handoff cycle: through an operation it
        only moves forward (a snapshot that lags, or a push that overtakes
        another, never shows an earlier state again)."""
        snapshot = self.coordinator.data
        operation = snapshot.operation
        phase = operation.phase
        state = gpu_node_state(snapshot, phase)
        order = RETURN_ORDER if phase == PHASE_RETURNING else HANDOFF_ORDER
        if operation.started is None or phase is None or state not in order:
            self._ratchet = None
            return state
        rank = order.index(state)
        which = (operation.started, operation.vm)
        if self._ratchet is not None and self._ratchet[0] == which:
            rank = max(rank, self._ratchet[1])
        self._ratchet = (which, rank)
        return order[rank]

    @property
    def extra_state_attributes(self) -> Mapping[str, Any]:
        """Drain progress (live during a drain), agent, cards, node health."""
        return gpu_node_attributes(self.coordinator.data)
