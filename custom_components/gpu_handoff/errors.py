"""Which translated message each client error maps to (one place for all)."""

from __future__ import annotations

from .cluster_client import (
    ClusterAuthError,
    ClusterError,
    KubeconfigError,
    NodeNotFoundError,
)
from .tower.gpu_handoff import wire
from .tower_client import (
    AgentCommandError,
    AgentMissingError,
    AgentVersionError,
    TowerAuthError,
    TowerError,
    TowerHostKeyError,
)


def tower_error_key(err: TowerError) -> str:
    """Translation key of a tower error."""
    match err:
        case TowerAuthError():
            return "invalid_auth"
        case TowerHostKeyError():
            return "host_key_changed"
        case AgentMissingError():
            return "agent_missing"
        case AgentVersionError():
            return "agent_version"
        case AgentCommandError(code=wire.ERR_CONFIG_INVALID):
            return "agent_config_invalid"
        case AgentCommandError():
            return "agent_error"
        case _:
            return "cannot_connect"


def cluster_error_key(err: ClusterError) -> str:
    """Translation key of a cluster error."""
    match err:
        case KubeconfigError():
            return "invalid_kubeconfig"
        case ClusterAuthError():
            return "cluster_auth"
        case NodeNotFoundError():
            return "node_not_found"
        case _:
            return "cluster_unreachable"
