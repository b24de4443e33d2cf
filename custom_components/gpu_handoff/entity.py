"""Base entity: one device per tower, per GPU node and per gaming VM."""

from __future__ import annotations

from dataclasses import dataclass

from homeassistant.helpers.device_registry import DeviceInfo
from homeassistant.helpers.entity import EntityDescription
from homeassistant.helpers.update_coordinator import CoordinatorEntity

from .const import CONF_DOMAIN_NAME, CONF_GPU_NODE
from .coordinator import GpuHandoffCoordinator
from .data import GpuHandoffConfigEntry, GpuHandoffData
from .models import domain_identifier, tower_identifier
from .protocol import DomainState


@dataclass(frozen=True, kw_only=True)
class ClusterBacked:
    """Mixin for descriptions of entities that show the Kubernetes node."""

    needs_cluster: bool = False


def gaming_vms(entry: GpuHandoffConfigEntry) -> list[tuple[str, str]]:
    """(subentry id, libvirt domain) of every gaming VM added to the tower."""
    return [
        (subentry_id, str(subentry.data[CONF_DOMAIN_NAME]))
        for subentry_id, subentry in entry.subentries.items()
    ]


class GpuHandoffEntity(CoordinatorEntity[GpuHandoffCoordinator]):
    """An entity of the tower (``domain`` None) or of one of its VMs."""

    _attr_has_entity_name = True

    def __init__(
        self,
        data: GpuHandoffData,
        description: EntityDescription,
        domain: str | None = None,
    ) -> None:
        """Describe the entity and the device it belongs to."""
        coordinator = data.coordinator
        super().__init__(coordinator)
        self.controller = data.controller
        self.entity_description = description
        self.domain = domain
        entry = coordinator.config_entry
        suffix = domain if domain is not None else "tower"
        self._attr_unique_id = f"{entry.entry_id}_{suffix}_{description.key}"
        if domain is None:
            self._attr_device_info = DeviceInfo(
                identifiers={tower_identifier(entry.entry_id)}
            )
            return
        vm = coordinator.data.tower.domains.get(domain)
        is_gpu_node = domain == entry.data[CONF_GPU_NODE]
        # A gaming VM is called what its subentry is called (the user may
        # rename it there); the GPU node by its libvirt title.
        name = next(
            (
                sub.title
                for sub in entry.subentries.values()
                if sub.data.get(CONF_DOMAIN_NAME) == domain
            ),
            vm.title if vm is not None else domain,
        )
        self._attr_device_info = DeviceInfo(
            identifiers={domain_identifier(entry.entry_id, domain)},
            name=name,
            manufacturer="GPU Handoff",
            model="GPU node VM" if is_gpu_node else "Gaming VM",
            via_device_id=data.tower_device_id,
        )

    @property
    def available(self) -> bool:
        """The tower must answer; the node's entities also need the cluster."""
        description = self.entity_description
        if isinstance(description, ClusterBacked) and description.needs_cluster:
            return super().available and self.coordinator.data.node is not None
        return super().available

    @property
    def vm(self) -> DomainState | None:
        """This entity's domain as last reported, if it has one and it exists."""
        if self.domain is None:
            return None
        return self.coordinator.data.tower.domains.get(self.domain)
