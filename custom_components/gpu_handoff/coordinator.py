"""The coordinator: one snapshot of the tower and the GPU node's Kubernetes node.

The tower's side is pushed: one long-lived agent session per tower carries the
tower's state whenever it changes (and libvirt events, applied at once). A
refresh asks that session, which answers from the state it keeps (under a
millisecond, no process started on the tower). The poll every
``scan_interval`` seconds reads the cluster, and the tower one-shot while the
session is down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
import logging
from typing import Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant, callback
from homeassistant.exceptions import ConfigEntryAuthFailed, ConfigEntryError
from homeassistant.helpers import device_registry as dr, issue_registry as ir
from homeassistant.helpers.debounce import Debouncer
from homeassistant.helpers.update_coordinator import DataUpdateCoordinator, UpdateFailed
from homeassistant.util import dt as dt_util

from .cluster_client import ClusterClient, ClusterError, NodeView
from .const import (
    CONF_DOMAIN_NAME,
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KNOWN_VMS,
    CONF_KUBECONFIG,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_SCAN_INTERVAL,
    DEFAULT_SCAN_INTERVAL,
    DOMAIN,
)
from .errors import cluster_error_key, tower_error_key
from .health import CONTAINERS_NOT_STARTING, NodeHealth, issue_placeholders, judge
from .models import Snapshot, tower_identifier
from .protocol import (
    PROTOCOL,
    RUNNING,
    SHUT_OFF,
    ErrorPush,
    JobPush,
    JobRecord,
    LibvirtEvent,
    Push,
    StatusPush,
    TowerStatus,
    Version,
)
from .tower import gpu_handoff as agent
from .tower_client import (
    AgentCommandError,
    AgentVersionError,
    TowerAuthError,
    TowerClient,
    TowerCredentials,
    TowerError,
    TowerHostKeyError,
    fetch_host_key,
    fingerprint,
)

_LOGGER = logging.getLogger(__name__)

REFRESH_COOLDOWN: Final = 0.3
WATCH_BACKOFF_START: Final = 1.0
WATCH_BACKOFF_MAX: Final = 60.0
ISSUE_HOST_KEY: Final = "host_key_mismatch"

# What a libvirt lifecycle event says the domain's state is now.
LIFECYCLE_STATES: Final = {
    "started": RUNNING,
    "resumed": RUNNING,
    "stopped": SHUT_OFF,
    "suspended": "paused",
    "crashed": "crashed",
    "pmsuspended": "pmsuspended",
}
ISSUE_AGENT_OUTDATED: Final = "agent_outdated"
# The agent's version against the one this integration ships (same protocol).
ISSUE_AGENT_VERSION: Final = "agent_version"
# The agent this integration ships, and so expects on the tower.
AGENT_VERSION: Final = agent.VERSION


def version_key(version: str) -> tuple[int, ...] | None:
    """``"0.3.0"`` -> ``(0, 3, 0)``; None for a version that is not dotted
    numbers (compared with nothing)."""
    parts = version.split(".")
    if not all(part.isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


ISSUE_NODE_HEALTH: Final = "node_health"
ISSUE_NEW_GAMING_VM: Final = "new_gaming_vm"


def with_domain_state(tower: TowerStatus, name: str, state: str) -> TowerStatus:
    """The tower after a libvirt lifecycle event: the domain's new state, and
    the cards a domain holds while it runs (a stopped one holds none; a
    started one holds what it is defined with)."""
    domain = tower.domains.get(name)
    if domain is None or domain.state == state:
        return tower
    domains = dict(tower.domains)
    holds = state != SHUT_OFF
    # A domain that just started has no guest agent yet (libvirt reports it
    # disconnected); a stopped one has none at all, as the status says.
    agent_ready = domain.agent_ready if domain.state == RUNNING else False
    domains[name] = replace(
        domain, state=state, agent_ready=agent_ready if holds else None
    )
    cards = tuple(
        replace(card, held_by=name)
        if holds and card.address in domain.cards and card.held_by is None
        else replace(card, held_by=None)
        if not holds and card.held_by == name
        else card
        for card in tower.cards
    )
    return replace(tower, domains=domains, cards=cards)


def tower_credentials(entry: ConfigEntry) -> TowerCredentials:
    """The SSH credentials stored in a config entry."""
    data = entry.data
    return TowerCredentials(
        host=data[CONF_HOST],
        port=data[CONF_PORT],
        username=data[CONF_USERNAME],
        private_key=data[CONF_PRIVATE_KEY],
        passphrase=data.get(CONF_PASSPHRASE) or None,
        host_key=data[CONF_HOST_KEY],
    )


@dataclass
class _Health:
    """Whether a part was reachable at the last update, to log transitions once."""

    ok: bool = True


class GpuHandoffCoordinator(DataUpdateCoordinator[Snapshot]):
    """Merges the agent's status and the cluster's view of the GPU node."""

    config_entry: ConfigEntry

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        tower: TowerClient,
        cluster: ClusterClient,
    ) -> None:
        """Set up with clients that are already built."""
        super().__init__(
            hass,
            _LOGGER,
            config_entry=entry,
            name=DOMAIN,
            update_interval=timedelta(
                seconds=entry.options.get(CONF_SCAN_INTERVAL, DEFAULT_SCAN_INTERVAL)
            ),
            request_refresh_debouncer=Debouncer(
                hass, _LOGGER, cooldown=REFRESH_COOLDOWN, immediate=True
            ),
        )
        self.tower = tower
        self.cluster = cluster
        self.k8s_node: str = entry.data[CONF_K8S_NODE]
        # Whether the agent session is open now (diagnostics show it).
        self.session_connected = False
        self._finding_issues: set[str] = set()
        self._cluster_health = _Health()
        # Who wants pushed job progress (the controller's runner).
        self.job_listener: Callable[[JobRecord], None] | None = None
        self.session_listener: Callable[[], None] | None = None

    @classmethod
    async def create(
        cls, hass: HomeAssistant, entry: ConfigEntry
    ) -> GpuHandoffCoordinator:
        """Build the clients from the entry (the SSL context off the loop)."""
        try:
            cluster = await ClusterClient.create(entry.data[CONF_KUBECONFIG])
        except ClusterError as err:
            # Building the client touches no network: the stored kubeconfig
            # itself is unusable, and only a reconfigure can fix that.
            raise ConfigEntryError(
                translation_domain=DOMAIN, translation_key="invalid_kubeconfig"
            ) from err
        return cls(hass, entry, TowerClient(tower_credentials(entry)), cluster)

    async def async_shutdown(self) -> None:
        """Close the session and both clients."""
        await super().async_shutdown()
        if self.tower.session is not None:
            await self.tower.session.close()
        await self.tower.close()
        await self.cluster.close()

    async def _async_update_data(self) -> Snapshot:
        try:
            status = await self.tower.status()
        except TowerAuthError as err:
            raise ConfigEntryAuthFailed(
                translation_domain=DOMAIN, translation_key="invalid_auth"
            ) from err
        except TowerHostKeyError as err:
            await self._async_raise_host_key_issue()
            raise UpdateFailed(
                translation_domain=DOMAIN, translation_key="host_key_changed"
            ) from err
        except AgentVersionError as err:
            # The entry cannot load with it: the repair that updates it is
            # the way out (it needs no loaded entry).
            self._raise_agent_outdated(err)
            raise UpdateFailed(
                translation_domain=DOMAIN,
                translation_key=tower_error_key(err),
                translation_placeholders={"error": str(err)},
            ) from err
        except TowerError as err:
            raise UpdateFailed(
                translation_domain=DOMAIN,
                translation_key=tower_error_key(err),
                translation_placeholders={"error": str(err)},
            ) from err
        ir.async_delete_issue(self.hass, DOMAIN, self._host_key_issue_id)
        self._sync_finding_issues(status)
        self._sync_gaming_vms(status)
        try:
            reading = await self.cluster.node_reading(self.k8s_node)
        except ClusterError as err:
            if self._cluster_health.ok:
                _LOGGER.warning(
                    "Kubernetes node %s unavailable: %s", self.k8s_node, err
                )
                self._cluster_health.ok = False
            return Snapshot(
                tower=status, node=None, cluster_error=cluster_error_key(err)
            )
        if not self._cluster_health.ok:
            _LOGGER.info("Kubernetes node %s available again", self.k8s_node)
            self._cluster_health.ok = True
        previous = self.data.health if self.data is not None else None
        health = judge(reading, status, dt_util.utcnow(), previous)
        self._sync_health_issue(health, status.gpu_node)
        return Snapshot(tower=status, node=reading.view, health=health)

    def _sync_health_issue(self, health: NodeHealth, gpu_node: str) -> None:
        """A repair issue while the GPU node is unhealthy, saying what was
        seen; gone once it works (or an operation has it)."""
        issue_id = f"{ISSUE_NODE_HEALTH}_{self.config_entry.entry_id}"
        if not health.problem:
            ir.async_delete_issue(self.hass, DOMAIN, issue_id)
            return
        ir.async_create_issue(
            self.hass,
            DOMAIN,
            issue_id,
            # The fix shows the GPU node's screen (its console says why).
            is_fixable=True,
            data={"entry_id": self.config_entry.entry_id, "screen_of": gpu_node},
            # A node that starts no container serves nothing; one short of
            # GPUs still runs the rest.
            severity=ir.IssueSeverity.ERROR
            if health.reason == CONTAINERS_NOT_STARTING
            else ir.IssueSeverity.WARNING,
            translation_key=f"node_{health.reason}",
            translation_placeholders=issue_placeholders(
                health, self.k8s_node, dt_util.get_default_time_zone()
            ),
        )

    def _sync_finding_issues(self, status: TowerStatus) -> None:
        """One repair issue per (finding, domain) the agent reports; gone when fixed."""
        details: dict[tuple[str, str], list[str]] = {}
        for finding in status.findings:
            details.setdefault((finding.code, finding.domain or ""), []).append(
                finding.detail
            )
        wanted: set[str] = set()
        for (code, domain), lines in details.items():
            issue_id = f"{code}_{self.config_entry.entry_id}_{domain}"
            wanted.add(issue_id)
            ir.async_create_issue(
                self.hass,
                DOMAIN,
                issue_id,
                is_fixable=False,
                severity=ir.IssueSeverity.WARNING,
                translation_key=code,
                translation_placeholders={
                    "domain": domain,
                    "details": "; ".join(sorted(lines)),
                },
            )
        for issue_id in self._finding_issues - wanted:
            ir.async_delete_issue(self.hass, DOMAIN, issue_id)
        self._finding_issues = wanted

    def _sync_gaming_vms(self, status: TowerStatus) -> None:
        """Follow the gaming VMs the agent manages.

        One that appears later is offered: a fixable repair adds its
        subentry (its switch and device) once the user agrees; those the
        user left out at setup are no news. One the agent no longer manages
        loses its subentry, and with it its entities and device: the agent
        refuses every request for it.
        """
        entry = self.config_entry
        managed = set(status.gaming)
        configured: dict[str, str] = {}
        for subentry_id, subentry in entry.subentries.items():
            configured[str(subentry.data[CONF_DOMAIN_NAME])] = subentry_id
        for name, subentry_id in configured.items():
            if name not in managed:
                _LOGGER.info(
                    "The tower's agent no longer manages %s: its switch and "
                    "device are removed",
                    name,
                )
                self.hass.config_entries.async_remove_subentry(entry, subentry_id)
        stored = entry.data.get(CONF_KNOWN_VMS)
        # An entry from before this was stored takes what the agent manages
        # now as known: nothing it already had is news.
        known = set(managed if stored is None else [*stored, *configured])
        known &= managed
        if stored != sorted(known):
            self.hass.config_entries.async_update_entry(
                entry, data={**entry.data, CONF_KNOWN_VMS: sorted(known)}
            )
        prefix = f"{ISSUE_NEW_GAMING_VM}_{entry.entry_id}_"
        wanted: set[str] = set()
        for name in sorted(managed - known):
            wanted.add(prefix + name)
            domain = status.domains.get(name)
            ir.async_create_issue(
                self.hass,
                DOMAIN,
                prefix + name,
                is_fixable=True,
                is_persistent=False,
                severity=ir.IssueSeverity.WARNING,
                translation_key=ISSUE_NEW_GAMING_VM,
                translation_placeholders={
                    "name": domain.title if domain is not None else name,
                    "domain": name,
                },
                data={"entry_id": entry.entry_id, "gaming_vm": name},
            )
        for domain_key, issue_id in list(ir.async_get(self.hass).issues):
            if (
                domain_key == DOMAIN
                and issue_id.startswith(prefix)
                and issue_id not in wanted
            ):
                ir.async_delete_issue(self.hass, DOMAIN, issue_id)

    @property
    def _host_key_issue_id(self) -> str:
        return f"{ISSUE_HOST_KEY}_{self.config_entry.entry_id}"

    async def _async_raise_host_key_issue(self) -> None:
        """Tell the user the tower's host key changed, with both fingerprints."""
        data = self.config_entry.data
        try:
            new_key = await fetch_host_key(data[CONF_HOST], data[CONF_PORT])
        except TowerError:
            return
        ir.async_create_issue(
            self.hass,
            DOMAIN,
            self._host_key_issue_id,
            is_fixable=True,
            is_persistent=False,
            severity=ir.IssueSeverity.ERROR,
            translation_key=ISSUE_HOST_KEY,
            translation_placeholders={
                "host": data[CONF_HOST],
                "old": fingerprint(data[CONF_HOST_KEY]),
                "new": fingerprint(new_key),
            },
            data={"entry_id": self.config_entry.entry_id, "host_key": new_key},
        )

    # --- pushed state ----------------------------------------------------------

    @callback
    def async_set_node(self, view: NodeView) -> None:
        """Show a node view learned between polls (the controller's own
        cordon, a node just seen Ready) without rescheduling the poll."""
        self.data = replace(self.data, node=view, cluster_error=None)
        self.async_update_listeners()

    @callback
    def async_set_tower(self, status: TowerStatus) -> None:
        """Show the tower's state as pushed, without rescheduling the poll
        (the cluster still needs it)."""
        self._sync_finding_issues(status)
        self._sync_gaming_vms(status)
        self.data = replace(self.data, tower=status)
        self.last_update_success = True
        self.async_update_listeners()

    @callback
    def _async_push(self, push: Push) -> None:
        """One message the session pushed."""
        match push:
            case StatusPush(status=status):
                self.async_set_tower(status)
            case LibvirtEvent() if push.event == "lifecycle":
                # Applied at once; the status that follows fills in the rest.
                state = LIFECYCLE_STATES.get(push.action or "")
                if state is not None:
                    tower = with_domain_state(self.data.tower, push.domain, state)
                    if tower is not self.data.tower:
                        self.async_set_tower(tower)
            case JobPush(record=record):
                if self.job_listener is not None:
                    self.job_listener(record)
            case ErrorPush(error=error, source="status"):
                # The tower's state cannot be read now (libvirt away): its
                # entities are unavailable until the next status, which the
                # agent pushes as soon as it can read it again.
                command_error = AgentCommandError(error.code, error.message)
                self.async_set_update_error(
                    UpdateFailed(
                        translation_domain=DOMAIN,
                        translation_key=tower_error_key(command_error),
                        translation_placeholders={"error": str(command_error)},
                    )
                )
            case ErrorPush(error=error):
                _LOGGER.warning("The tower agent reports: %s", error.message)
            case _:
                pass

    async def async_run_session(self) -> None:
        """Keep the agent session open for as long as the entry is loaded.

        It never ends for good: whatever closes the session (a dropped
        connection, an unexpected error) is logged once per kind of failure
        and followed by a reconnect with backoff; meanwhile the poll reads
        the tower one-shot. An agent too old for sessions raises a repair.
        """
        backoff = WATCH_BACKOFF_START
        logged: str | None = None
        while True:
            try:
                session = await self.tower.open_session(self._async_push)
            except AgentVersionError as err:
                self._raise_agent_outdated(err)
                session = None
            except TowerError as err:
                _LOGGER.debug("No agent session: %s", err)
                session = None
            except Exception as err:
                if logged != type(err).__name__:
                    logged = type(err).__name__
                    _LOGGER.exception("Opening the agent session failed")
                session = None
            if session is not None:
                ir.async_delete_issue(self.hass, DOMAIN, self._agent_issue_id)
                self.session_connected = True
                backoff = WATCH_BACKOFF_START
                logged = None
                _LOGGER.debug("Agent session open (agent %s)", session.hello.version)
                self._show_agent(session.hello)
                self._compare_agent_version(session.hello.version)
                self._session_changed()
                await session.wait_closed()
                self.session_connected = False
                _LOGGER.debug("Agent session ended: %s", session.close_reason)
                self.tower.session = None
                self._session_changed()
                # Catch up on what happened while it was closing.
                await self.async_request_refresh()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX)

    def _show_agent(self, hello: Version) -> None:
        """The tower device shows the agent it runs (its software version)
        and is named after the tower, as the agent names it (an agent too old
        to say leaves the name it has). A name the user gave the device is
        theirs (``name_by_user``) and stays in front."""
        registry = dr.async_get(self.hass)
        entry_id = self.config_entry.entry_id
        device = registry.async_get_device_by_identifier(
            tower_identifier(entry_id), entry_id
        )
        if device is None:
            return
        name = hello.host_name or device.name
        if (device.sw_version, device.name) != (hello.version, name):
            registry.async_update_device(device.id, sw_version=hello.version, name=name)

    def _compare_agent_version(self, theirs: str) -> None:
        """The agent this integration ships is AGENT_VERSION. An older one on
        the tower works (same protocol) but lacks what came since (lending
        the free cards, its name, the screen's conversion): a repair says how
        to update it. A newer one is reported as such, never guessed at."""
        issue_id = f"{ISSUE_AGENT_VERSION}_{self.config_entry.entry_id}"
        ours_key, theirs_key = version_key(AGENT_VERSION), version_key(theirs)
        if ours_key is None or theirs_key is None or theirs_key == ours_key:
            ir.async_delete_issue(self.hass, DOMAIN, issue_id)
            return
        older = theirs_key < ours_key
        ir.async_create_issue(
            self.hass,
            DOMAIN,
            issue_id,
            # An older agent is updated from the repair (the guided path).
            is_fixable=older,
            data={"entry_id": self.config_entry.entry_id, "update_agent": 1}
            if older
            else None,
            severity=ir.IssueSeverity.WARNING,
            translation_key="agent_older" if older else "agent_newer",
            translation_placeholders={
                "host": self.config_entry.data[CONF_HOST],
                "theirs": theirs,
                "ours": AGENT_VERSION,
            },
        )

    def _session_changed(self) -> None:
        if self.session_listener is not None:
            self.session_listener()

    @property
    def _agent_issue_id(self) -> str:
        return f"{ISSUE_AGENT_OUTDATED}_{self.config_entry.entry_id}"

    def _raise_agent_outdated(self, err: AgentVersionError) -> None:
        """An agent that does not speak this side's protocol: say how to
        update it, once."""
        ir.async_create_issue(
            self.hass,
            DOMAIN,
            self._agent_issue_id,
            is_fixable=True,
            data={"entry_id": self.config_entry.entry_id, "update_agent": 1},
            severity=ir.IssueSeverity.ERROR,
            translation_key=ISSUE_AGENT_OUTDATED,
            translation_placeholders={
                "host": self.config_entry.data[CONF_HOST],
                "theirs": str(err.protocol),
                "ours": str(PROTOCOL),
            },
        )
