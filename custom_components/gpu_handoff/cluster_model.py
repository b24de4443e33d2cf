"""The GPU node's Kubernetes node as the integration models it; no I/O and
no Home Assistant imports (the decisions read it, the cluster client fills
it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

CORDON_OWNER_US: Final = "gpu_handoff"
CORDON_OWNER_OTHER: Final = "other"
# kubectl drain's --skip-wait-for-delete-timeout, which GPU Handoff always
# sets: a pod whose deletionTimestamp passed this long ago sits on a kubelet
# that no longer reports (a NotReady node) and counts as gone.
SKIP_WAIT_FOR_DELETE: Final = 60.0


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """What the integration shows about the GPU node's Kubernetes node."""

    name: str
    ready: bool | None
    unschedulable: bool
    # Whose cordon it is: CORDON_OWNER_US, CORDON_OWNER_OTHER, or None.
    cordon_owner: str | None
    lease_age: float | None
    # NVIDIA GPU devices under every name they go by (is_gpu_resource):
    # capacity counts the unhealthy ones too, allocatable only the healthy.
    gpu_capacity: int
    gpu_allocatable: int
    # What the pods on the node request of them.
    gpu_requested: int
    pods: int
    evictable_pods: int
    # GPU Handoff's mark on a node nobody cordons (someone lifted our cordon
    # with `kubectl uncordon`, which leaves annotations alone): it must go
    # before anyone cordons the node again, or that cordon would look ours.
    stale_mark: bool = False
    # status.nodeInfo.bootID: new at each boot of the node's machine (the
    # kubelet posts it); None when the node reports none.
    boot_id: str | None = None
    # Pods on the node that nothing would recreate (no controller, not a
    # mirror pod, not finished): a drain refuses them unless forced.
    unmanaged: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DrainProgress:
    """How far a drain is: pods still on the node, how many of them a
    PodDisruptionBudget refuses to evict right now, how many are gone."""

    pods_left: int
    evictions_refused: int
    evicted: int
    # Pods that arrived on the cordoned node after the drain first listed it
    # and tolerate its cordon ("namespace/name"): not chased (see drain).
    came_back: tuple[str, ...] = ()
