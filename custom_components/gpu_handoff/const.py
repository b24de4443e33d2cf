"""Constants for the GPU Handoff integration."""

from typing import Final

DOMAIN: Final = "gpu_handoff"

DEFAULT_SSH_PORT: Final = 22
# What the tower's authorized_keys line forces (the agent's install prints it).
DEFAULT_AGENT_COMMAND: Final = (
    "/usr/local/bin/gpu-handoff --config /etc/gpu-handoff/config.json serve"
)

CONF_PRIVATE_KEY: Final = "private_key"
CONF_PASSPHRASE: Final = "passphrase"  # noqa: S105 - a key name, not a secret
CONF_HOST_KEY: Final = "host_key"
CONF_GPU_NODE: Final = "gpu_node"
CONF_GAMING_VMS: Final = "gaming_vms"
CONF_KUBECONFIG: Final = "kubeconfig"
CONF_K8S_NODE: Final = "k8s_node"
CONF_DOMAIN_NAME: Final = "domain_name"

CONF_SCAN_INTERVAL: Final = "scan_interval"
CONF_DRAIN_TIMEOUT: Final = "drain_timeout"
CONF_AUTO_RETURN: Final = "auto_return"
DEFAULT_SCAN_INTERVAL: Final = 30
DEFAULT_DRAIN_TIMEOUT: Final = 300
DEFAULT_AUTO_RETURN: Final = True

SUBENTRY_GAMING_VM: Final = "gaming_vm"
