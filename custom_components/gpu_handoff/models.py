"""What the entities show: one snapshot of the tower, of the GPU node's
Kubernetes node and of the operation running; no Home Assistant imports."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .cluster_model import DrainProgress, NodeView
from .const import DOMAIN
from .health import NodeHealth
from .protocol import TowerStatus


@dataclass(frozen=True, kw_only=True)
class OperationView:
    """What the controller is doing, as the entities show it: the request
    each VM has accepted and not finished (the switch shows it at once), the
    operation running (its VM, kind, step, and where the GPU node is in it),
    the drain's progress, and each VM's last error."""

    requests: Mapping[str, str] = field(default_factory=dict)
    vm: str | None = None
    kind: str | None = None
    step: str | None = None
    phase: str | None = None
    # When it began: tells one operation from the next.
    started: str | None = None
    drain: DrainProgress | None = None
    last_error: Mapping[str, str] = field(default_factory=dict)
    # Cards held for a gaming VM after a prepare: the VM, and until when
    # (ISO 8601).
    held_for: str | None = None
    hold_ends: str | None = None


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Everything the entities show, from one update."""

    tower: TowerStatus
    node: NodeView | None
    cluster_error: str | None = None
    # Whether the GPU node works (None while the cluster cannot be read).
    health: NodeHealth | None = None
    operation: OperationView = OperationView()


def tower_identifier(entry_id: str) -> tuple[str, str]:
    """The tower device's identifier."""
    return (DOMAIN, entry_id)


def domain_identifier(entry_id: str, domain: str) -> tuple[str, str]:
    """A VM device's identifier (the GPU node's or a gaming VM's)."""
    return (DOMAIN, f"{entry_id}_{domain}")
