"""A Kubernetes API server emulator for the cluster side of the tests.

Serves the upstream REST API (discovery, nodes, pods, eviction with PDBs,
daemonsets, leases, events; watch, selectors, paging, patch flavours, Status
errors, bearer tokens with RBAC-like rules) over HTTPS with a fresh CA, and
offers a Python control API to shape the cluster. See ``K8sEmulator``.
"""

from .auth import ALL_RULES, PRODUCT_RULES, Rule, rule
from .emulator import (
    DEFAULT_TOKEN,
    DEFAULT_USER,
    ApiError,
    K8sEmulator,
    RecordedRequest,
)
from .objects import GPU, MIRROR_ANNOTATION, NODE_LEASE_NAMESPACE
from .seed import CONTROL_PLANE_NODE, GPU_NODE, SEEDS, seed_demo

__all__ = [
    "ALL_RULES",
    "CONTROL_PLANE_NODE",
    "DEFAULT_TOKEN",
    "DEFAULT_USER",
    "GPU",
    "GPU_NODE",
    "MIRROR_ANNOTATION",
    "NODE_LEASE_NAMESPACE",
    "PRODUCT_RULES",
    "SEEDS",
    "ApiError",
    "K8sEmulator",
    "RecordedRequest",
    "Rule",
    "rule",
    "seed_demo",
]
