"""Config flow for GPU Handoff: one entry per tower, one subentry per gaming VM.

The user gives the tower's address, confirms its host key fingerprint (pinned
from then on), gives Home Assistant an SSH key (generated here, or pasted),
picks the gaming VMs from what the tower's agent reports, and pastes a
kubeconfig whose node list offers the GPU node's Kubernetes node. Every step is
checked against the real tower and cluster before anything is stored.

A tower is its SSH host key: the entry's unique id is the key's SHA256
fingerprint (the one the user confirmed), so the same tower reached by name and
by IP address is one entry. The entry is titled with the name the agent
reports (its configured name, else the tower's host name), or the address for
an agent too old to say.

The forms' schemas are in config_flow_schemas, the guided install's work (the
administrator's login, the survey, the plan, the install) in
config_flow_install; the steps here chain them.
"""

from __future__ import annotations

from typing import Any, override

from homeassistant.config_entries import (
    SOURCE_REAUTH,
    ConfigEntry,
    ConfigFlow,
    ConfigFlowResult,
    ConfigSubentryData,
    ConfigSubentryFlow,
    OptionsFlow,
    SubentryFlowResult,
)
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import callback
from homeassistant.util import dt as dt_util

from .cluster_client import ClusterClient, ClusterError
from .config_flow_install import (
    GuidedInstall,
    admin_login,
    install_error_placeholders,
    login_placeholders,
    plan_placeholders,
    public_fields,
    retry_fields,
    survey_placeholders,
    tower_admin_session,
)
from .config_flow_schemas import (
    admin_schema,
    domain_label,
    gaming_vm_schema,
    gaming_vms_schema,
    install_confirm_schema,
    install_options_schema,
    install_schema,
    kubeconfig_schema,
    node_schema,
    options_schema,
    paste_key_schema,
    reconfigure_schema,
    tower_schema,
)
from .const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_HANDOFF_WHEN_CORDONED,
    CONF_HOST_KEY,
    CONF_HOST_KEY_PINNED_AT,
    CONF_K8S_NODE,
    CONF_KNOWN_VMS,
    CONF_KUBECONFIG,
    CONF_LEND_FREE_CARDS,
    CONF_LIBVIRT_URI,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_SCAN_INTERVAL,
    DEFAULT_AGENT_COMMAND,
    DEFAULT_AUTO_RETURN,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_SCAN_INTERVAL,
    DOMAIN,
    SUBENTRY_GAMING_VM,
)
from .errors import cluster_error_key, tower_error_key
from .installer import InstallError, InstallReport
from .protocol import DomainState, TowerStatus, Version
from .tower.gpu_handoff import wire
from .tower_client import (
    TowerAuthError,
    TowerClient,
    TowerCredentials,
    TowerError,
    authorized_keys_line,
    fetch_host_key,
    fingerprint,
    generate_key_pair,
    public_key_of,
)

# What the repairs' flows share with these steps (the administrator's login,
# the tower's identity, a gaming VM's subentry) is imported from here.
__all__ = [
    "GamingVmSubentryFlow",
    "GpuHandoffConfigFlow",
    "GpuHandoffOptionsFlow",
    "admin_login",
    "admin_schema",
    "entry_with_host_key",
    "install_error_placeholders",
    "public_fields",
    "tower_admin_session",
    "vm_subentry",
]

# The options a new entry starts with.
_NEW_ENTRY_OPTIONS = {
    CONF_SCAN_INTERVAL: DEFAULT_SCAN_INTERVAL,
    CONF_DRAIN_TIMEOUT: DEFAULT_DRAIN_TIMEOUT,
    CONF_AUTO_RETURN: DEFAULT_AUTO_RETURN,
}


def _clean_tower_input(
    user_input: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, str]]:
    """Trimmed host, port and user, or the field errors."""
    host = str(user_input[CONF_HOST]).strip()
    username = str(user_input[CONF_USERNAME]).strip()
    if not host or any(char.isspace() for char in host):
        return {}, {CONF_HOST: "invalid_host"}
    if not username or any(char.isspace() for char in username):
        return {}, {CONF_USERNAME: "invalid_username"}
    return {
        CONF_HOST: host,
        CONF_PORT: int(user_input[CONF_PORT]),
        CONF_USERNAME: username,
    }, {}


async def _host_key_at(tower: dict[str, Any]) -> str | None:
    """The host key the tower presents at this address (None: no answer)."""
    try:
        return await fetch_host_key(tower[CONF_HOST], tower[CONF_PORT])
    except TowerError:
        return None


async def _reach_tower(
    user_input: dict[str, Any],
) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    """(trimmed host, port and user, the host key the tower presents there,
    {}), or (..., None, the errors)."""
    tower, errors = _clean_tower_input(user_input)
    if errors:
        return tower, None, errors
    host_key = await _host_key_at(tower)
    return tower, host_key, {} if host_key is not None else {"base": "cannot_connect"}


async def _reconfigured(
    entry: ConfigEntry, user_input: dict[str, Any]
) -> tuple[dict[str, Any], str | None, dict[str, str]]:
    """(the entry's data with the new address, user and kubeconfig, the host
    key the tower presents at a new address or None at the same one, {}), or
    ({}, None, the errors). A kubeconfig given must list the entry's node."""
    tower, errors = _clean_tower_input(user_input)
    kubeconfig = str(user_input.get(CONF_KUBECONFIG) or "").strip()
    if not errors and kubeconfig:
        nodes, error = await _cluster_nodes(kubeconfig)
        if error is not None:
            errors["base"] = error
        elif entry.data[CONF_K8S_NODE] not in nodes:
            errors["base"] = "node_not_found"
    if errors:
        return {}, None, errors
    data = dict(entry.data) | tower
    if kubeconfig:
        data[CONF_KUBECONFIG] = kubeconfig
    # At the address its key was pinned at, the tower must still present
    # that key: a changed one is refused by the login that follows (and its
    # repair shows both fingerprints), never pinned again here.
    if (tower[CONF_HOST], tower[CONF_PORT]) == (
        entry.data[CONF_HOST],
        entry.data[CONF_PORT],
    ):
        return data, None, {}
    host_key = await _host_key_at(tower)
    return data, host_key, {} if host_key is not None else {"base": "cannot_connect"}


def _reconfigure_suggestions(
    entry: ConfigEntry, user_input: dict[str, Any] | None
) -> dict[str, Any]:
    """The entry's address and user, or what the form was given (never the
    kubeconfig)."""
    suggested = {
        CONF_HOST: entry.data[CONF_HOST],
        CONF_PORT: entry.data[CONF_PORT],
        CONF_USERNAME: entry.data[CONF_USERNAME],
    } | (user_input or {})
    return {k: v for k, v in suggested.items() if k != CONF_KUBECONFIG}


def _key_placeholders(data: dict[str, Any]) -> dict[str, str]:
    """The tower's address and its host key's fingerprint, to confirm."""
    return {
        "host": data[CONF_HOST],
        "fingerprint": fingerprint(data[CONF_HOST_KEY]),
    }


def _public_key_placeholders(public: str) -> dict[str, str]:
    """Home Assistant's public key, and its line for authorized_keys."""
    return {
        "public_key": public,
        "authorized_keys_line": authorized_keys_line(public, DEFAULT_AGENT_COMMAND),
    }


def _key_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Home Assistant's key (and its passphrase) in the entry's data."""
    return {
        CONF_PRIVATE_KEY: data[CONF_PRIVATE_KEY],
        CONF_PASSPHRASE: data[CONF_PASSPHRASE],
    }


def _guess_gpu_node(domains: list[str]) -> str:
    """The domain most likely to be the GPU node, by its name."""
    for hint in ("gpu", "k3s", "k8s", "kube", "node"):
        for name in domains:
            if hint in name.lower():
                return name
    return domains[0]


def _findings_text(report: InstallReport, status: TowerStatus | None) -> str:
    """What the tower reports after the install, one line each: the findings
    of its status as read with Home Assistant's key, else (that login
    failed) those of the install's own check."""
    if status is not None:
        lines = [
            f"- {finding.code} ({finding.domain or '-'}): {finding.detail}"
            for finding in status.findings
        ]
    else:
        lines = [
            f"- {finding.get('code')} ({finding.get('domain')}): "
            f"{finding.get('detail')}"
            for finding in report.findings
        ]
        if report.status_error:
            lines.append(f"- {report.status_error}")
    if report.libvirt_restarted is False:
        lines.append(f"- libvirtd: {report.libvirt_restart_message}")
    return "\n".join(lines) or "-"


def _report_placeholders(
    data: dict[str, Any], report: InstallReport, status: TowerStatus | None
) -> dict[str, str]:
    """The install's outcome: the findings, and NixOS's module settings."""
    return {
        "host": data[CONF_HOST],
        "user": data[CONF_USERNAME],
        "findings": _findings_text(report, status),
        "module": report.nixos_module,
    }


def _gaming_domains(status: TowerStatus) -> list[DomainState]:
    """The gaming VMs a switch may be made for: never one whose name virsh
    would read as a domain id or UUID first (an agent older than its own
    check may still report one; a command for it could act on another VM)."""
    return [
        domain
        for domain in status.domains.values()
        if domain.name in status.gaming and not wire.virsh_reads_as(domain.name)
    ]


def _gpu_node_label(status: TowerStatus) -> str:
    """The GPU node as the gaming VMs' form names it."""
    gpu_node = status.domains.get(status.gpu_node)
    return domain_label(gpu_node) if gpu_node is not None else status.gpu_node


def vm_subentry(domain: DomainState) -> ConfigSubentryData:
    """A gaming VM's subentry: its switch and its device."""
    return ConfigSubentryData(
        data={CONF_DOMAIN_NAME: domain.name},
        subentry_type=SUBENTRY_GAMING_VM,
        title=domain.title or domain.name,
        unique_id=domain.name,
    )


def _pinned_identity(entry: ConfigEntry) -> str | None:
    """The fingerprint of the host key an entry pinned (None: it has none)."""
    try:
        return fingerprint(entry.data.get(CONF_HOST_KEY) or "")
    except ValueError:
        return None


def _is_tower_of(entry: ConfigEntry, host_key: str) -> bool:
    """Whether the host key is the entry's tower's: the fingerprint that is
    the entry's unique id (or, for an entry not migrated yet, that of the key
    it pinned)."""
    return fingerprint(host_key) in (entry.unique_id, _pinned_identity(entry))


def entry_with_host_key(
    entries: list[ConfigEntry], host_key: str, besides: ConfigEntry | None = None
) -> ConfigEntry | None:
    """The entry (other than ``besides``) of the tower with this host key: by
    its unique id, or by its pinned key for an entry not migrated yet."""
    identity = fingerprint(host_key)
    return next(
        (
            entry
            for entry in entries
            if entry is not besides
            and identity in (entry.unique_id, _pinned_identity(entry))
        ),
        None,
    )


async def _check_tower(
    data: dict[str, Any],
) -> tuple[tuple[Version, TowerStatus] | None, str | None]:
    """((the agent's version, its status), None) or (None, error key): a real
    round trip."""
    client = TowerClient(
        TowerCredentials(
            host=data[CONF_HOST],
            port=data[CONF_PORT],
            username=data[CONF_USERNAME],
            private_key=data[CONF_PRIVATE_KEY],
            passphrase=data.get(CONF_PASSPHRASE) or None,
            host_key=data[CONF_HOST_KEY],
        )
    )
    try:
        version = await client.version()
        return (version, await client.status()), None
    except TowerError as err:
        return None, tower_error_key(err)
    finally:
        await client.close()


async def _cluster_nodes(kubeconfig: str) -> tuple[list[str], str | None]:
    """(node names, None) or ([], error key)."""
    try:
        client = await ClusterClient.create(kubeconfig)
    except ClusterError as err:
        return [], cluster_error_key(err)
    try:
        return await client.node_names(), None
    except ClusterError as err:
        return [], cluster_error_key(err)
    finally:
        await client.close()


class GpuHandoffConfigFlow(ConfigFlow, domain=DOMAIN):
    """Set up a tower."""

    VERSION = 1
    # 2: the unique id is the host key's fingerprint (it was "host:port").
    MINOR_VERSION = 2

    def __init__(self) -> None:
        """Start with nothing known."""
        self._data: dict[str, Any] = {}
        self._status: TowerStatus | None = None
        self._host_name: str | None = None
        self._generated: tuple[str, str] | None = None
        self._nodes: list[str] = []
        self._vms: list[str] = []
        # The guided install: it holds the administrator login from the login
        # form to the end of the install, never longer (see async_remove).
        self._install = GuidedInstall()
        # Why Home Assistant's key was refused after the install (empty: not).
        self._key_errors: dict[str, str] = {}

    @override
    def async_remove(self) -> None:
        """A flow closed half way forgets the administrator login too."""
        self._install.forget()

    @property
    def _known_status(self) -> TowerStatus:
        """The tower's status as read with the key (the steps run in order)."""
        if self._status is None:  # pragma: no cover - a step out of order
            raise RuntimeError("the tower has not been asked yet")
        return self._status

    @staticmethod
    @callback
    @override
    def async_get_options_flow(config_entry: ConfigEntry) -> GpuHandoffOptionsFlow:
        """Timeouts and behaviour."""
        return GpuHandoffOptionsFlow()

    @classmethod
    @callback
    @override
    def async_get_supported_subentry_types(
        cls, config_entry: ConfigEntry
    ) -> dict[str, type[ConfigSubentryFlow]]:
        """Gaming VMs can be added and removed after setup."""
        return {SUBENTRY_GAMING_VM: GamingVmSubentryFlow}

    # --- the tower -----------------------------------------------------------

    @override
    async def async_step_user(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Ask for the tower's SSH address and user."""
        errors: dict[str, str] = {}
        if user_input is not None:
            tower, host_key, errors = await _reach_tower(user_input)
            if host_key is not None:
                # The same tower by another name or address is the same
                # host key: already configured.
                await self.async_set_unique_id(fingerprint(host_key))
                self._abort_if_unique_id_configured()
                if entry_with_host_key(self._async_current_entries(), host_key):
                    return self.async_abort(reason="already_configured")
                self._data = tower | {CONF_HOST_KEY: host_key}
                return await self.async_step_host_key()
        schema = self.add_suggested_values_to_schema(tower_schema(), user_input)
        return self.async_show_form(step_id="user", data_schema=schema, errors=errors)

    async def async_step_host_key(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Show the host key's fingerprint; going on pins it (and when)."""
        if user_input is not None:
            self._data[CONF_HOST_KEY_PINNED_AT] = dt_util.utcnow().isoformat()
            return await self.async_step_credentials()
        return self.async_show_form(
            step_id="host_key", description_placeholders=_key_placeholders(self._data)
        )

    async def async_step_credentials(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Generate a key pair here, or use an existing key."""
        return self.async_show_menu(
            step_id="credentials",
            menu_options=["install_agent", "generate_key", "paste_key"],
        )

    # --- the guided install ----------------------------------------------------

    async def async_step_install_agent(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Ask for an administrator login on the tower, used for this step only."""
        error: InstallError | None = None
        if user_input is not None:
            self._data[CONF_USERNAME] = str(user_input[CONF_USERNAME]).strip()
            error = await self._install.log_in(self.hass, self._data, user_input)
            if error is None:
                return await self.async_step_install_options()
        suggested = {CONF_USERNAME: self._data[CONF_USERNAME]}
        return self._async_show_login(suggested | public_fields(user_input), error)

    def _async_show_login(
        self, suggested: dict[str, Any], error: InstallError | None
    ) -> ConfigFlowResult:
        """The administrator's login form, with why the last try failed."""
        return self.async_show_form(
            step_id="install_agent",
            data_schema=self.add_suggested_values_to_schema(
                install_schema(), suggested
            ),
            description_placeholders=login_placeholders(self._data, error),
            errors={"base": error.key} if error is not None else {},
        )

    async def async_step_install_options(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Pick the GPU node and the gaming VMs from the tower's own list."""
        survey = self._install.known_survey
        errors: dict[str, str] = {}
        if user_input is not None:
            if self._install.choose(self._data[CONF_USERNAME], user_input):
                return await self.async_step_install_confirm()
            errors[CONF_GAMING_VMS] = "no_gaming_vm"
        gpu_node = _guess_gpu_node(survey.domains)
        return self.async_show_form(
            step_id="install_options",
            data_schema=install_options_schema(survey.domains, gpu_node),
            description_placeholders=survey_placeholders(self._data[CONF_HOST], survey),
            errors=errors,
        )

    async def async_step_install_confirm(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Show exactly what the install does; on submit, do it, then log in
        with Home Assistant's restricted key. The administrator login is
        forgotten here whatever happens: a retry asks for it again."""
        install = self._install
        if install.plan is None:  # pragma: no cover - a step out of order
            return await self.async_step_install_agent()
        if install.admin is None:
            # Kept ADMIN_LOGIN_KEPT at most: asked for again.
            return self._async_show_login(
                {CONF_USERNAME: install.plan.user, CONF_LIBVIRT_URI: install.plan.uri},
                InstallError("admin_login_expired"),
            )
        private, public = await self._async_key_pair()
        account = install.known_survey.account
        if user_input is None:
            return self.async_show_form(
                # An account that exists is kept as it is: that step says so,
                # with what it is now.
                step_id="install_confirm_existing" if account else "install_confirm",
                data_schema=install_confirm_schema(),
                description_placeholders=plan_placeholders(
                    self._data[CONF_HOST],
                    install.admin.username,
                    install.plan,
                    account,
                ),
            )
        again = retry_fields(install.plan, install.admin)
        try:
            report = await install.install(self._data, public, user_input)
        except InstallError as err:
            return self._async_show_login(again, err)
        self._vms = list(install.plan.gaming)
        if report.nixos:
            return await self.async_step_install_nixos()
        # Proven at once with the restricted key: what it reads is shown.
        self._status = None
        self._key_errors = await self._async_use_key(private, None)
        return await self.async_step_install_done()

    async def async_step_install_confirm_existing(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """The confirmation for an account that exists already."""
        return await self.async_step_install_confirm(user_input)

    async def async_step_install_done(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Show what the tower's check found; on submit, log in with the
        restricted key."""
        return await self._async_after_install("install_done", user_input)

    async def async_step_install_nixos(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """NixOS installs nothing by hand: show the module's settings (with
        Home Assistant's key); once the user switched, log in with the key."""
        return await self._async_after_install("install_nixos", user_input)

    async def _async_after_install(
        self, step_id: str, user_input: dict[str, Any] | None
    ) -> ConfigFlowResult:
        """The install's outcome on screen until the restricted key logs in
        (refused in place, with the tower's reason); then the cluster."""
        report = self._install.report
        if report is None or self._generated is None:  # pragma: no cover - order
            return await self.async_step_install_agent()
        if user_input is not None:
            # The key once more: what is stored must work now (after the
            # NixOS switch, a key line put back, or one removed meanwhile).
            self._key_errors = await self._async_use_key(self._generated[0], None)
            if not self._key_errors:
                self._data[CONF_GPU_NODE] = self._known_status.gpu_node
                return await self.async_step_cluster()
        return self.async_show_form(
            step_id=step_id,
            description_placeholders=_report_placeholders(
                self._data, report, self._status
            ),
            errors=self._key_errors,
        )

    async def _async_key_pair(self) -> tuple[str, str]:
        """Home Assistant's new key pair (private, public), made once."""
        if self._generated is None:
            self._generated = await self.hass.async_add_executor_job(generate_key_pair)
        return self._generated

    async def async_step_generate_key(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Make a key pair; the user adds its public half to the tower."""
        private, public = await self._async_key_pair()
        errors: dict[str, str] = {}
        if user_input is not None:
            errors = await self._async_use_key(private, None)
            if not errors:
                return await self._async_after_key()
        return self.async_show_form(
            step_id="generate_key",
            description_placeholders=_public_key_placeholders(public),
            errors=errors,
        )

    async def async_step_paste_key(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Take an existing private key (and its passphrase)."""
        errors: dict[str, str] = {}
        if user_input is not None:
            private = str(user_input[CONF_PRIVATE_KEY]).strip() + "\n"
            passphrase = user_input.get(CONF_PASSPHRASE) or None
            try:
                await self.hass.async_add_executor_job(
                    public_key_of, private, passphrase
                )
            except TowerAuthError:
                errors[CONF_PRIVATE_KEY] = "invalid_key"
            else:
                errors = await self._async_use_key(private, passphrase)
                if not errors:
                    return await self._async_after_key()
        return self.async_show_form(
            step_id="paste_key", data_schema=paste_key_schema(), errors=errors
        )

    async def _async_use_key(
        self, private: str, passphrase: str | None
    ) -> dict[str, str]:
        """Log in with the key and ask the agent for its status."""
        data = self._data | {CONF_PRIVATE_KEY: private, CONF_PASSPHRASE: passphrase}
        answer, error = await _check_tower(data)
        if answer is None:
            return {"base": error or "cannot_connect"}
        self._data = data
        version, self._status = answer
        self._host_name = version.host_name or None
        return {}

    async def _async_after_key(self) -> ConfigFlowResult:
        if self.source == SOURCE_REAUTH:
            return self.async_update_reload_and_abort(
                self._get_reauth_entry(), data_updates=_key_fields(self._data)
            )
        self._data[CONF_GPU_NODE] = self._known_status.gpu_node
        return await self.async_step_gaming_vms()

    async def async_step_gaming_vms(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Pick the gaming VMs that get a switch."""
        status = self._known_status
        errors: dict[str, str] = {}
        if user_input is not None:
            self._vms = list(user_input[CONF_GAMING_VMS])
            if self._vms:
                return await self.async_step_cluster()
            errors[CONF_GAMING_VMS] = "no_gaming_vm"
        return self.async_show_form(
            step_id="gaming_vms",
            data_schema=gaming_vms_schema(_gaming_domains(status)),
            description_placeholders={"gpu_node": _gpu_node_label(status)},
            errors=errors,
        )

    # --- the cluster ---------------------------------------------------------

    async def async_step_cluster(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Take a kubeconfig and list the cluster's nodes with it."""
        errors: dict[str, str] = {}
        if user_input is not None:
            kubeconfig = str(user_input[CONF_KUBECONFIG]).strip()
            self._nodes, error = await _cluster_nodes(kubeconfig)
            if error is None:
                self._data[CONF_KUBECONFIG] = kubeconfig
                return await self.async_step_node()
            errors["base"] = error
        return self.async_show_form(
            step_id="cluster", data_schema=kubeconfig_schema(), errors=errors
        )

    async def async_step_node(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Pick the GPU node VM's Kubernetes node."""
        if user_input is not None:
            self._data[CONF_K8S_NODE] = user_input[CONF_K8S_NODE]
            status = self._known_status
            # Those left out now are the user's choice, not news later.
            self._data[CONF_KNOWN_VMS] = sorted(status.gaming)
            return self.async_create_entry(
                title=self._host_name or self._data[CONF_HOST],
                data=self._data,
                options=dict(_NEW_ENTRY_OPTIONS),
                subentries=[vm_subentry(status.domains[name]) for name in self._vms],
            )
        schema = node_schema(self._nodes, self._data[CONF_GPU_NODE])
        return self.async_show_form(step_id="node", data_schema=schema)

    # --- reauth and reconfigure ----------------------------------------------

    async def async_step_reauth(self, entry_data: dict[str, Any]) -> ConfigFlowResult:
        """The tower refused the key: give it a new one."""
        self._data = dict(entry_data)
        return await self.async_step_reauth_confirm()

    async def async_step_reauth_confirm(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Generate a new key pair, or use another existing key."""
        return self.async_show_menu(
            step_id="reauth_confirm", menu_options=["generate_key", "paste_key"]
        )

    async def async_step_reconfigure(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """Change the tower's address or user, or the kubeconfig."""
        entry = self._get_reconfigure_entry()
        errors: dict[str, str] = {}
        if user_input is not None:
            data, host_key, errors = await _reconfigured(entry, user_input)
            if not errors:
                self._data = data
                return await self._async_new_address(host_key)
        suggested = _reconfigure_suggestions(entry, user_input)
        schema = self.add_suggested_values_to_schema(reconfigure_schema(), suggested)
        return self.async_show_form(
            step_id="reconfigure", data_schema=schema, errors=errors
        )

    async def _async_new_address(self, host_key: str | None) -> ConfigFlowResult:
        """The same address (None), or the same host key at a new one, is the
        same tower. A tower is its host key (the entry's unique id): another
        key is another tower, refused, whether it is set up already or not."""
        entry = self._get_reconfigure_entry()
        if host_key is None or _is_tower_of(entry, host_key):
            return await self._async_finish_reconfigure()
        if entry_with_host_key(self._async_current_entries(), host_key, entry):
            return self.async_abort(reason="other_tower_configured")
        return self.async_abort(
            reason="different_tower",
            description_placeholders={
                "fingerprint": fingerprint(host_key),
                "pinned": fingerprint(entry.data[CONF_HOST_KEY]),
            },
        )

    async def _async_finish_reconfigure(self) -> ConfigFlowResult:
        """Log in with the entry's key. The tower's agent must still name the
        entry's GPU node: the entry's devices and entities are that VM's."""
        entry = self._get_reconfigure_entry()
        answer, error = await _check_tower(self._data)
        if answer is None:
            return self.async_abort(reason=error or "cannot_connect")
        if (gpu_node := answer[1].gpu_node) != entry.data[CONF_GPU_NODE]:
            return self.async_abort(
                reason="gpu_node_changed",
                description_placeholders={
                    "gpu_node": gpu_node,
                    "configured": entry.data[CONF_GPU_NODE],
                },
            )
        return self.async_update_reload_and_abort(entry, data=self._data)


class GpuHandoffOptionsFlow(OptionsFlow):
    """Update interval, drain timeout, whether cards return by themselves."""

    async def async_step_init(
        self, user_input: dict[str, Any] | None = None
    ) -> ConfigFlowResult:
        """One form for all options."""
        if user_input is not None:
            return self.async_create_entry(
                data={
                    CONF_SCAN_INTERVAL: int(user_input[CONF_SCAN_INTERVAL]),
                    CONF_DRAIN_TIMEOUT: int(user_input[CONF_DRAIN_TIMEOUT]),
                    CONF_AUTO_RETURN: bool(user_input[CONF_AUTO_RETURN]),
                    CONF_EVICT_UNMANAGED: bool(user_input[CONF_EVICT_UNMANAGED]),
                    CONF_HANDOFF_WHEN_CORDONED: bool(
                        user_input[CONF_HANDOFF_WHEN_CORDONED]
                    ),
                    CONF_LEND_FREE_CARDS: bool(user_input[CONF_LEND_FREE_CARDS]),
                }
            )
        return self.async_show_form(
            step_id="init",
            data_schema=self.add_suggested_values_to_schema(
                options_schema(), self.config_entry.options
            ),
        )


class GamingVmSubentryFlow(ConfigSubentryFlow):
    """Add one more gaming VM of the tower."""

    async def async_step_user(
        self, user_input: dict[str, Any] | None = None
    ) -> SubentryFlowResult:
        """Pick a gaming VM the tower's agent manages and that has no switch yet."""
        entry = self._get_entry()
        answer, error = await _check_tower(dict(entry.data))
        if answer is None:
            return self.async_abort(reason=error or "cannot_connect")
        status = answer[1]
        taken = {sub.unique_id for sub in entry.subentries.values()}
        domains = {d.name: d for d in _gaming_domains(status) if d.name not in taken}
        if not domains:
            return self.async_abort(reason="no_more_gaming_vms")
        if user_input is not None and user_input[CONF_DOMAIN_NAME] in domains:
            vm = vm_subentry(domains[user_input[CONF_DOMAIN_NAME]])
            return self.async_create_entry(
                title=vm["title"], data=dict(vm["data"]), unique_id=vm["unique_id"]
            )
        return self.async_show_form(
            step_id="user", data_schema=gaming_vm_schema(domains)
        )
