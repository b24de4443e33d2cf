"""What the entities show: one snapshot of the tower and of the GPU node's
Kubernetes node; no Home Assistant imports."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster_client import NodeView
from .const import DOMAIN
from .health import NodeHealth
from .protocol import TowerStatus


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Everything the entities show, from one update."""

    tower: TowerStatus
    node: NodeView | None
    cluster_error: str | None = None
    # Whether the GPU node works (None while the cluster cannot be read).
    health: NodeHealth | None = None


def tower_identifier(entry_id: str) -> tuple[str, str]:
    """The tower device's identifier."""
    return (DOMAIN, entry_id)


def domain_identifier(entry_id: str, domain: str) -> tuple[str, str]:
    """A VM device's identifier (the GPU node's or a gaming VM's)."""
    return (DOMAIN, f"{entry_id}_{domain}")
