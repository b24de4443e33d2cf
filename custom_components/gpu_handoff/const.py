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
# When the host key was last pinned (trusted on first use at setup, or a
# changed one accepted in its repair), ISO 8601 in UTC.
CONF_HOST_KEY_PINNED_AT: Final = "host_key_pinned_at"
CONF_GPU_NODE: Final = "gpu_node"
CONF_GAMING_VMS: Final = "gaming_vms"
CONF_KUBECONFIG: Final = "kubeconfig"
CONF_K8S_NODE: Final = "k8s_node"
CONF_DOMAIN_NAME: Final = "domain_name"
# The gaming VMs the tower's agent managed when the user last chose (setup):
# one that appears later is offered as new; one the user left out is not.
CONF_KNOWN_VMS: Final = "known_gaming_vms"

# The guided install's administrator login: used for one step, never stored.
CONF_ADMIN_USERNAME: Final = "admin_username"
CONF_ADMIN_PASSWORD: Final = "admin_password"  # noqa: S105 - a key name
CONF_ADMIN_KEY: Final = "admin_key"
CONF_ADMIN_PASSPHRASE: Final = "admin_passphrase"  # noqa: S105 - a key name
CONF_SUDO_PASSWORD: Final = "sudo_password"  # noqa: S105 - a key name
CONF_LIBVIRT_URI: Final = "libvirt_uri"
CONF_RESTART_LIBVIRT: Final = "restart_libvirt"
DEFAULT_LIBVIRT_URI: Final = "qemu:///system"

CONF_SCAN_INTERVAL: Final = "scan_interval"
CONF_DRAIN_TIMEOUT: Final = "drain_timeout"
CONF_AUTO_RETURN: Final = "auto_return"
CONF_EVICT_UNMANAGED: Final = "evict_unmanaged"
CONF_HANDOFF_WHEN_CORDONED: Final = "handoff_when_cordoned"
CONF_LEND_FREE_CARDS: Final = "lend_free_cards"
DEFAULT_SCAN_INTERVAL: Final = 30
DEFAULT_DRAIN_TIMEOUT: Final = 300
DEFAULT_AUTO_RETURN: Final = True
# kubectl drain refuses pods nothing recreates unless --force: so do we.
DEFAULT_EVICT_UNMANAGED: Final = False
# Someone else's cordon (an administrator's drain, an upgrade controller) is a
# reason to wait: a handoff on top of it needs the user's explicit choice.
DEFAULT_HANDOFF_WHEN_CORDONED: Final = False
# Lending the free cards while someone plays costs one more GPU node restart
# (and drain) per session, and a GPU node that boots with fewer GPUs than it
# was set up with: the user turns it on knowing both.
DEFAULT_LEND_FREE_CARDS: Final = False

SUBENTRY_GAMING_VM: Final = "gaming_vm"

EVENT_HANDOFF_STARTED: Final = "gpu_handoff_handoff_started"
EVENT_HANDOFF_STEP: Final = "gpu_handoff_handoff_step"
EVENT_HANDOFF_SUCCEEDED: Final = "gpu_handoff_handoff_succeeded"
EVENT_HANDOFF_FAILED: Final = "gpu_handoff_handoff_failed"
EVENT_CARDS_RETURNED: Final = "gpu_handoff_cards_returned"
# A handoff, a stop and a return each end with their own event.
EVENT_STOP_SUCCEEDED: Final = "gpu_handoff_stop_succeeded"
EVENT_RETURN_SUCCEEDED: Final = "gpu_handoff_return_succeeded"
# The cards went back, but the GPU node does not advertise them to the cluster.
EVENT_RETURN_UNHEALTHY: Final = "gpu_handoff_return_unhealthy"
# A prepare freed a gaming VM's cards and holds them for it (``hold_ends``);
# nobody started it by then: the cards go back.
EVENT_PREPARE_SUCCEEDED: Final = "gpu_handoff_prepare_succeeded"
EVENT_HOLD_EXPIRED: Final = "gpu_handoff_hold_expired"
# Every event GPU Handoff fires (the logbook describes each).
EVENTS: Final = (
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_STOP_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    EVENT_HANDOFF_FAILED,
    EVENT_CARDS_RETURNED,
    EVENT_RETURN_UNHEALTHY,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_HOLD_EXPIRED,
)

SERVICE_RETURN_CARDS: Final = "return_cards"
SERVICE_START_HANDOFF: Final = "start_handoff"
SERVICE_PREPARE: Final = "prepare"
# How long a prepare holds the cards by default, and at most (minutes).
DEFAULT_HOLD_MINUTES: Final = 15
MAX_HOLD_MINUTES: Final = 240
ATTR_CONFIG_ENTRY_ID: Final = "config_entry_id"
ATTR_VM: Final = "vm"
ATTR_WAIT: Final = "wait"
ATTR_HOLD_MINUTES: Final = "hold_minutes"

# Where the GPU node is in a running operation, for a Handoff state that only
# moves forward: a handoff drains, then stops it; a return starts it again.
PHASE_DRAINING: Final = "draining"
PHASE_STOPPING: Final = "stopping"
PHASE_RETURNING: Final = "returning"
