"""The config flow's forms: their schemas, and how a VM is named in them."""

from __future__ import annotations

from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.helpers import selector
import probatio

from .const import (
    CONF_ADMIN_KEY,
    CONF_ADMIN_PASSPHRASE,
    CONF_ADMIN_PASSWORD,
    CONF_ADMIN_USERNAME,
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_HANDOFF_WHEN_CORDONED,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_LEND_FREE_CARDS,
    CONF_LIBVIRT_URI,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_RESTART_LIBVIRT,
    CONF_SCAN_INTERVAL,
    CONF_SUDO_PASSWORD,
    DEFAULT_EVICT_UNMANAGED,
    DEFAULT_HANDOFF_WHEN_CORDONED,
    DEFAULT_LEND_FREE_CARDS,
    DEFAULT_LIBVIRT_URI,
    DEFAULT_SSH_PORT,
)
from .protocol import DomainState

TEXT = selector.TextSelector()
MULTILINE = selector.TextSelector(selector.TextSelectorConfig(multiline=True))
PASSWORD = selector.TextSelector(
    selector.TextSelectorConfig(type=selector.TextSelectorType.PASSWORD)
)
PORT = selector.NumberSelector(
    selector.NumberSelectorConfig(
        min=1, max=65535, mode=selector.NumberSelectorMode.BOX
    )
)


def tower_schema() -> probatio.Schema:
    """The tower's SSH address and the user Home Assistant logs in as."""
    return probatio.Schema(
        {
            probatio.Required(CONF_HOST): TEXT,
            probatio.Required(CONF_PORT, default=DEFAULT_SSH_PORT): PORT,
            probatio.Required(CONF_USERNAME): TEXT,
        }
    )


def reconfigure_schema() -> probatio.Schema:
    """The tower's address and user, and a new kubeconfig if any."""
    return tower_schema().extend({probatio.Optional(CONF_KUBECONFIG): MULTILINE})


def paste_key_schema() -> probatio.Schema:
    """An existing private key and its passphrase."""
    return probatio.Schema(
        {
            probatio.Required(CONF_PRIVATE_KEY): MULTILINE,
            probatio.Optional(CONF_PASSPHRASE): PASSWORD,
        }
    )


def kubeconfig_schema() -> probatio.Schema:
    """The cluster's kubeconfig."""
    return probatio.Schema({probatio.Required(CONF_KUBECONFIG): MULTILINE})


def admin_schema() -> probatio.Schema:
    """An administrator's login on the tower (the guided install's and the
    agent update's): a key (first: its signature is bound to the session,
    where a password goes to whoever holds the pinned host key), or a
    password, and sudo's password if it differs."""
    return probatio.Schema(
        {
            probatio.Required(CONF_ADMIN_USERNAME, default="root"): TEXT,
            probatio.Optional(CONF_ADMIN_KEY): MULTILINE,
            probatio.Optional(CONF_ADMIN_PASSPHRASE): PASSWORD,
            probatio.Optional(CONF_ADMIN_PASSWORD): PASSWORD,
            probatio.Optional(CONF_SUDO_PASSWORD): PASSWORD,
        }
    )


def install_schema() -> probatio.Schema:
    """The guided install's first form: the account Home Assistant will log
    in as, an administrator's login and libvirt's URI."""
    return (
        probatio.Schema({probatio.Required(CONF_USERNAME): TEXT})
        .extend(admin_schema().schema)
        .extend(
            {probatio.Required(CONF_LIBVIRT_URI, default=DEFAULT_LIBVIRT_URI): TEXT}
        )
    )


def install_options_schema(domains: list[str], gpu_node: str) -> probatio.Schema:
    """The GPU node and the gaming VMs among the tower's VMs (all but the
    GPU node are offered as gaming VMs)."""
    options = [selector.SelectOptionDict(value=d, label=d) for d in domains]
    return probatio.Schema(
        {
            probatio.Required(CONF_GPU_NODE, default=gpu_node): (
                selector.SelectSelector(selector.SelectSelectorConfig(options=options))
            ),
            probatio.Required(
                CONF_GAMING_VMS,
                default=[d for d in domains if d != gpu_node],
            ): selector.SelectSelector(
                selector.SelectSelectorConfig(
                    options=options,
                    multiple=True,
                    mode=selector.SelectSelectorMode.LIST,
                )
            ),
        }
    )


def install_confirm_schema() -> probatio.Schema:
    """Whether the install may restart libvirtd (not unless ticked)."""
    return probatio.Schema(
        {
            probatio.Required(
                CONF_RESTART_LIBVIRT, default=False
            ): selector.BooleanSelector()
        }
    )


def domain_label(domain: DomainState) -> str:
    """``Gaming station 1 (gaming-1): 0000:02:00.0, 0000:02:00.1``."""
    name = domain.name
    title = domain.title
    label = f"{title} ({name})" if title and title != name else name
    cards = ", ".join(domain.cards)
    return f"{label}: {cards}" if cards else label


def gaming_vms_schema(domains: list[DomainState]) -> probatio.Schema:
    """The gaming VMs that get a switch (all of them unless unticked)."""
    return probatio.Schema(
        {
            probatio.Required(
                CONF_GAMING_VMS, default=[d.name for d in domains]
            ): selector.SelectSelector(
                selector.SelectSelectorConfig(
                    options=[
                        selector.SelectOptionDict(value=d.name, label=domain_label(d))
                        for d in domains
                    ],
                    multiple=True,
                    mode=selector.SelectSelectorMode.LIST,
                )
            )
        }
    )


def node_schema(nodes: list[str], gpu_node: str) -> probatio.Schema:
    """The GPU node VM's Kubernetes node among the cluster's nodes: by
    default the one named as the VM, else the first one."""
    default = gpu_node if gpu_node in nodes else nodes[0] if nodes else ""
    return probatio.Schema(
        {
            probatio.Required(CONF_K8S_NODE, default=default): selector.SelectSelector(
                selector.SelectSelectorConfig(options=nodes)
            )
        }
    )


def gaming_vm_schema(domains: dict[str, DomainState]) -> probatio.Schema:
    """One more gaming VM, among those that have no switch yet."""
    return probatio.Schema(
        {
            probatio.Required(CONF_DOMAIN_NAME): selector.SelectSelector(
                selector.SelectSelectorConfig(
                    options=[
                        selector.SelectOptionDict(value=name, label=domain_label(d))
                        for name, d in domains.items()
                    ]
                )
            )
        }
    )


def options_schema() -> probatio.Schema:
    """The options: update interval, drain timeout and behaviour."""
    seconds = selector.NumberSelector(
        selector.NumberSelectorConfig(
            min=5,
            max=3600,
            unit_of_measurement="s",
            mode=selector.NumberSelectorMode.BOX,
        )
    )
    return probatio.Schema(
        {
            probatio.Required(CONF_SCAN_INTERVAL): seconds,
            probatio.Required(CONF_DRAIN_TIMEOUT): seconds,
            probatio.Required(CONF_AUTO_RETURN): selector.BooleanSelector(),
            probatio.Required(
                CONF_EVICT_UNMANAGED, default=DEFAULT_EVICT_UNMANAGED
            ): selector.BooleanSelector(),
            probatio.Required(
                CONF_HANDOFF_WHEN_CORDONED, default=DEFAULT_HANDOFF_WHEN_CORDONED
            ): selector.BooleanSelector(),
            probatio.Required(
                CONF_LEND_FREE_CARDS, default=DEFAULT_LEND_FREE_CARDS
            ): selector.BooleanSelector(),
        }
    )
