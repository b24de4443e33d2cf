"""The coordinator: one snapshot of the tower and the GPU node's Kubernetes node.

The tower's ``watch`` stream pushes libvirt and job events; each one triggers a
refresh within a fraction of a second. The poll every ``scan_interval`` seconds
is the fallback for when the stream is down, and the cluster's only source.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
import logging
from typing import TYPE_CHECKING, Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import ConfigEntryAuthFailed, ConfigEntryError
from homeassistant.helpers import issue_registry as ir
from homeassistant.helpers.debounce import Debouncer
from homeassistant.helpers.update_coordinator import DataUpdateCoordinator, UpdateFailed

from .cluster_client import ClusterClient, ClusterError
from .const import (
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_SCAN_INTERVAL,
    DEFAULT_SCAN_INTERVAL,
    DOMAIN,
)
from .errors import cluster_error_key, tower_error_key
from .models import Snapshot, TowerStatus
from .tower_client import (
    TowerAuthError,
    TowerClient,
    TowerCredentials,
    TowerError,
    TowerHostKeyError,
    fetch_host_key,
    fingerprint,
)

if TYPE_CHECKING:
    from .controller import HandoffController

_LOGGER = logging.getLogger(__name__)

REFRESH_COOLDOWN: Final = 0.3
WATCH_BACKOFF_START: Final = 1.0
WATCH_BACKOFF_MAX: Final = 60.0
ISSUE_HOST_KEY: Final = "host_key_mismatch"

type GpuHandoffConfigEntry = ConfigEntry[GpuHandoffCoordinator]


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

    config_entry: GpuHandoffConfigEntry

    def __init__(
        self,
        hass: HomeAssistant,
        entry: GpuHandoffConfigEntry,
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
        self.watch_connected = False
        self._finding_issues: set[str] = set()
        self.tower_device_id = ""  # set by setup once the device exists
        self.controller: HandoffController  # set by setup after the first update
        self._cluster_health = _Health()
        self.setup_signature = self.signature_of(entry)

    @staticmethod
    def signature_of(entry: ConfigEntry) -> tuple[object, ...]:
        """What a reload must follow: the options and the set of gaming VMs."""
        return (
            tuple(sorted(entry.options.items())),
            tuple(sorted(entry.subentries)),
        )

    @classmethod
    async def create(
        cls, hass: HomeAssistant, entry: GpuHandoffConfigEntry
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
        """Close both clients."""
        await super().async_shutdown()
        await self.tower.close()
        await self.cluster.close()

    async def _async_update_data(self) -> Snapshot:
        try:
            reply = await self.tower.status()
        except TowerAuthError as err:
            raise ConfigEntryAuthFailed(
                translation_domain=DOMAIN, translation_key="invalid_auth"
            ) from err
        except TowerHostKeyError as err:
            await self._async_raise_host_key_issue()
            raise UpdateFailed(
                translation_domain=DOMAIN, translation_key="host_key_changed"
            ) from err
        except TowerError as err:
            raise UpdateFailed(
                translation_domain=DOMAIN,
                translation_key=tower_error_key(err),
                translation_placeholders={"error": str(err)},
            ) from err
        ir.async_delete_issue(self.hass, DOMAIN, self._host_key_issue_id)
        status = TowerStatus.from_reply(reply)
        self._sync_finding_issues(status)
        try:
            node = await self.cluster.node_view(self.k8s_node)
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
        return Snapshot(tower=status, node=node)

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

    async def async_watch(self) -> None:
        """Follow the tower's event stream for as long as the entry is loaded.

        The stream never ends for good: whatever ends it (a dropped
        connection, an unexpected error) is logged once per kind of failure
        and followed by a reconnect with backoff; diagnostics show whether it
        is connected now.
        """
        backoff = WATCH_BACKOFF_START
        logged: str | None = None
        while True:
            try:
                async for message in self.tower.watch():
                    if message.get("type") == "watching":
                        self.watch_connected = True
                        backoff = WATCH_BACKOFF_START
                        logged = None
                        _LOGGER.debug("Watching the tower's events")
                    await self.async_request_refresh()
            except TowerError as err:
                _LOGGER.debug("Tower event stream ended: %s", err)
            except Exception as err:
                kind = type(err).__name__
                if logged != kind:
                    logged = kind
                    _LOGGER.exception("The tower's event stream failed; reconnecting")
            if self.watch_connected:
                self.watch_connected = False
                # Catch up on what happened while the stream was down.
                await self.async_request_refresh()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_MAX)
