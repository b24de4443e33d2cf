"""The coordinator: one snapshot of the tower and the GPU node's Kubernetes node.

It holds data and nothing else. A refresh reads the tower (from the agent
session while one is open: under a millisecond, no process started on the
tower; one-shot while it is not) and the cluster, and judges the GPU node's
health from both. What the session pushes in between is applied through the
setters below (see session.py). Repair issues that follow this data
(repair_sync.py) and the gaming VMs that follow the agent (gaming_vms.py)
listen to it.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
import logging
from typing import Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import CALLBACK_TYPE, HomeAssistant, callback
from homeassistant.exceptions import ConfigEntryAuthFailed, ConfigEntryError
from homeassistant.helpers.debounce import Debouncer
from homeassistant.helpers.update_coordinator import DataUpdateCoordinator, UpdateFailed
from homeassistant.util import dt as dt_util

from .cluster_client import ClusterClient, ClusterError
from .cluster_model import NodeView
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
from .health import judge
from .models import OperationView, Snapshot
from .protocol import TowerStatus
from .tower_client import (
    TowerAuthError,
    TowerClient,
    TowerCredentials,
    TowerError,
    TowerHostKeyError,
)

_LOGGER = logging.getLogger(__name__)

REFRESH_COOLDOWN: Final = 0.3


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


def tower_update_failed(err: TowerError) -> UpdateFailed:
    """The tower's state cannot be read: its translated message."""
    return UpdateFailed(
        translation_domain=DOMAIN,
        translation_key=tower_error_key(err),
        translation_placeholders={"error": str(err)},
    )


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
        # Whether the cluster was readable at the last refresh, so that a
        # change is logged once.
        self._cluster_ok = True
        self._refresh_listeners: list[CALLBACK_TYPE] = []
        # Statuses the tower pushed so far: a refresh that saw one arrive
        # after its own read of the tower keeps the pushed one.
        self._pushes = 0

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
        """Close both clients."""
        await super().async_shutdown()
        await self.tower.close()
        await self.cluster.close()

    async def _async_update_data(self) -> Snapshot:
        status = await self._async_read_tower()
        pushes = self._pushes
        try:
            reading = await self.cluster.node_reading(self.k8s_node)
        except ClusterError as err:
            if self._cluster_ok:
                _LOGGER.warning(
                    "Kubernetes node %s unavailable: %s", self.k8s_node, err
                )
                self._cluster_ok = False
            return Snapshot(
                tower=self._newest(status, pushes),
                node=None,
                cluster_error=cluster_error_key(err),
                operation=self._operation,
            )
        if not self._cluster_ok:
            _LOGGER.info("Kubernetes node %s available again", self.k8s_node)
            self._cluster_ok = True
        status = self._newest(status, pushes)
        previous = self.data.health if self.data is not None else None
        health = judge(reading, status, dt_util.utcnow(), previous)
        return Snapshot(
            tower=status, node=reading.view, health=health, operation=self._operation
        )

    def _newest(self, status: TowerStatus, pushes: int) -> TowerStatus:
        """The tower's state a refresh shows: ``status``, read at the count of
        pushes ``pushes``, unless one was pushed since (while the cluster was
        read). The session's messages come in order, so that one is newer: a
        refresh landing with an older one would decide on a GPU node the
        operator shut down meanwhile as if it still ran."""
        if self._pushes != pushes and self.data is not None:
            return self.data.tower
        return status

    @property
    def _operation(self) -> OperationView:
        """The operation as last shown (a refresh reads only the tower and
        the cluster)."""
        return self.data.operation if self.data is not None else OperationView()

    async def _async_read_tower(self) -> TowerStatus:
        """The tower's state; its errors as Home Assistant's (the client
        error stays their cause, which the repairs read)."""
        try:
            return await self.tower.status()
        except TowerAuthError as err:
            raise ConfigEntryAuthFailed(
                translation_domain=DOMAIN, translation_key="invalid_auth"
            ) from err
        except TowerHostKeyError as err:
            raise UpdateFailed(
                translation_domain=DOMAIN, translation_key="host_key_changed"
            ) from err
        except TowerError as err:
            raise tower_update_failed(err) from err

    @callback
    def async_add_refresh_listener(self, finished: CALLBACK_TYPE) -> CALLBACK_TYPE:
        """Call ``finished`` after every refresh, failed or not, before the
        listeners hear of it; returns what removes it.

        Listeners hear of a failed refresh only when the one before it
        succeeded. What depends on why each refresh fails needs them all: a
        tower away for a while that comes back with another host key fails
        for a new reason in the middle of a run of failures.
        """
        self._refresh_listeners.append(finished)

        @callback
        def remove() -> None:
            self._refresh_listeners.remove(finished)

        return remove

    @callback
    def _async_refresh_finished(self) -> None:
        for finished in list(self._refresh_listeners):
            finished()

    # --- pushed state ----------------------------------------------------------

    @callback
    def async_set_node(self, view: NodeView) -> None:
        """Show a node view learned between polls (the controller's own
        cordon, a node just seen Ready) without rescheduling the poll."""
        self.data = replace(self.data, node=view, cluster_error=None)
        self.async_update_listeners()

    @callback
    def async_set_tower(self, status: TowerStatus) -> None:
        """Show the tower's state as pushed.

        Not ``async_set_updated_data``, which would put the next poll off:
        the tower pushes far more often than the cluster is read, and only
        the poll reads the cluster (and judges the GPU node's health).
        """
        self._pushes += 1
        self.data = replace(self.data, tower=status)
        self.last_update_success = True
        self.async_update_listeners()

    @callback
    def async_set_operation(self, view: OperationView) -> None:
        """Show what the controller is doing (the operation's step, its
        drain, the requests accepted, the last errors)."""
        self.data = replace(self.data, operation=view)
        self.async_update_listeners()

    @callback
    def async_set_tower_error(self, err: TowerError) -> None:
        """The tower's state cannot be read now (the agent says so): its
        entities are unavailable until the next status."""
        self.async_set_update_error(tower_update_failed(err))
