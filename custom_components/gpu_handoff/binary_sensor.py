"""Binary sensors: guest agents, the Kubernetes node's readiness and cordon,
and whether the GPU node works (judged on what it does, not on Ready)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from homeassistant.components.binary_sensor import (
    BinarySensorEntity,
    BinarySensorEntityDescription,
)
from homeassistant.components.binary_sensor.const import BinarySensorDeviceClass
from homeassistant.const import EntityCategory
from homeassistant.core import HomeAssistant
from homeassistant.helpers.entity_platform import AddConfigEntryEntitiesCallback

from .const import CONF_GPU_NODE
from .data import GpuHandoffConfigEntry
from .entity import ClusterBacked, GpuHandoffEntity, gaming_vms
from .health import NO_PROBLEM, PODS_SHOWN, watched
from .models import Snapshot

PARALLEL_UPDATES = 0


@dataclass(frozen=True, kw_only=True)
class GpuHandoffBinarySensorDescription(BinarySensorEntityDescription, ClusterBacked):
    """A binary sensor and how it reads the snapshot of its domain."""

    is_on_fn: Callable[[Snapshot, str], bool | None]
    attributes_fn: Callable[[Snapshot], dict[str, Any]] | None = None


def _agent_ready(snapshot: Snapshot, domain: str) -> bool | None:
    vm = snapshot.tower.domains.get(domain)
    # A VM that is not running has no agent to answer: off, not unknown.
    return bool(vm.agent_ready) if vm is not None else None


GUEST_AGENT = GpuHandoffBinarySensorDescription(
    key="guest_agent",
    translation_key="guest_agent",
    device_class=BinarySensorDeviceClass.CONNECTIVITY,
    entity_category=EntityCategory.DIAGNOSTIC,
    is_on_fn=_agent_ready,
)


def _unhealthy(snapshot: Snapshot) -> bool:
    """The GPU node's problem, as long as it should work: the judgement of
    the last refresh, held against what was pushed since (a GPU node seen
    stopping, or cordoned by a handoff, is no problem)."""
    health = snapshot.health
    return (
        health is not None and health.problem and watched(snapshot.tower, snapshot.node)
    )


def _health_attributes(snapshot: Snapshot) -> dict[str, Any]:
    """Why (a translated reason) and which pods do not start."""
    health = snapshot.health
    if health is None or not _unhealthy(snapshot):
        return {"reason": NO_PROBLEM, "pods_not_starting": []}
    return {
        "reason": health.reason,
        "pods_not_starting": [pod.label for pod in health.stuck_pods[:PODS_SHOWN]],
    }


HEALTH = GpuHandoffBinarySensorDescription(
    key="node_health",
    translation_key="node_health",
    device_class=BinarySensorDeviceClass.PROBLEM,
    needs_cluster=True,
    is_on_fn=lambda snapshot, _domain: _unhealthy(snapshot),
    attributes_fn=_health_attributes,
)

NODE_SENSORS: Final = (
    GpuHandoffBinarySensorDescription(
        key="node_ready",
        translation_key="node_ready",
        device_class=BinarySensorDeviceClass.CONNECTIVITY,
        needs_cluster=True,
        is_on_fn=lambda snapshot, _domain: (
            snapshot.node.ready if snapshot.node is not None else None
        ),
    ),
    GpuHandoffBinarySensorDescription(
        key="cordoned",
        translation_key="cordoned",
        needs_cluster=True,
        is_on_fn=lambda snapshot, _domain: (
            snapshot.node.unschedulable if snapshot.node is not None else None
        ),
    ),
    HEALTH,
)


async def async_setup_entry(
    hass: HomeAssistant,
    entry: GpuHandoffConfigEntry,
    async_add_entities: AddConfigEntryEntitiesCallback,
) -> None:
    """Guest agents of every VM; readiness, cordon and health of the GPU
    node's node."""
    data = entry.runtime_data
    gpu_node = entry.data[CONF_GPU_NODE]
    async_add_entities(
        [
            GpuHandoffBinarySensor(data, GUEST_AGENT, gpu_node),
            *(GpuHandoffBinarySensor(data, d, gpu_node) for d in NODE_SENSORS),
        ]
    )
    for subentry_id, domain in gaming_vms(entry):
        async_add_entities(
            [GpuHandoffBinarySensor(data, GUEST_AGENT, domain)],
            config_subentry_id=subentry_id,
        )


class GpuHandoffBinarySensor(GpuHandoffEntity, BinarySensorEntity):
    """A binary sensor read from the snapshot."""

    entity_description: GpuHandoffBinarySensorDescription

    @property
    def is_on(self) -> bool | None:
        """The value."""
        return self.entity_description.is_on_fn(
            self.coordinator.data, self.domain or ""
        )

    @property
    def extra_state_attributes(self) -> dict[str, Any] | None:
        """What explains the value, where the description says."""
        attributes_fn = self.entity_description.attributes_fn
        return attributes_fn(self.coordinator.data) if attributes_fn else None
