"""Repair issues that follow the coordinator: the GPU node's health, the
agent's findings, a changed host key and an agent too old to talk to.

They listen to the coordinator rather than live in its refresh, so that the
coordinator only reads. Each issue appears and clears at the refresh (or the
pushed status) that says so, as a user expects from a repair:

- the findings the agent reports, with every status (read or pushed);
- the GPU node's health, with every judgement (each refresh that read the
  cluster);
- the host key, on every refresh that fails because the tower presents
  another key (with both fingerprints), gone on the next refresh that reads
  the tower;
- an agent that speaks another protocol, on every refresh that fails for it
  (the agent session raises it too, see session.py).
"""

from __future__ import annotations

from typing import Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.const import CONF_HOST, CONF_PORT
from homeassistant.core import CALLBACK_TYPE, HomeAssistant, callback
from homeassistant.helpers import issue_registry as ir
from homeassistant.util import dt as dt_util

from .const import CONF_HOST_KEY, DOMAIN
from .coordinator import GpuHandoffCoordinator
from .health import CONTAINERS_NOT_STARTING, NodeHealth, issue_placeholders
from .protocol import PROTOCOL, TowerStatus
from .tower.gpu_handoff import wire
from .tower_client import (
    AgentVersionError,
    TowerError,
    TowerHostKeyError,
    fetch_host_key,
    fingerprint,
)

ISSUE_HOST_KEY: Final = "host_key_mismatch"
ISSUE_AGENT_OUTDATED: Final = "agent_outdated"
ISSUE_NODE_HEALTH: Final = "node_health"
# The libvirt XML a finding's text names. A placeholder, not part of the
# text: Home Assistant's strings hold no markup (hassfest refuses it).
FINDING_PLACEHOLDERS: Final[dict[str, dict[str, str]]] = {
    wire.FINDING_ROM_BAR: {
        "rom_element": "<rom bar='off'/>",
        "hostdev_element": "<hostdev>",
    },
    wire.FINDING_NO_AGENT_CHANNEL: {
        "channel_element": "<channel type='unix'><target type='virtio' "
        "name='org.qemu.guest_agent.0'/></channel>",
    },
}


def agent_outdated_issue_id(entry: ConfigEntry) -> str:
    """The id of the entry's "agent outdated" issue."""
    return f"{ISSUE_AGENT_OUTDATED}_{entry.entry_id}"


@callback
def async_raise_agent_outdated(
    hass: HomeAssistant, entry: ConfigEntry, err: AgentVersionError
) -> None:
    """An agent that does not speak this side's protocol: say how to update
    it. The entry cannot load with it: the repair that updates it is the way
    out (it needs no loaded entry)."""
    ir.async_create_issue(
        hass,
        DOMAIN,
        agent_outdated_issue_id(entry),
        is_fixable=True,
        data={"entry_id": entry.entry_id, "update_agent": 1},
        severity=ir.IssueSeverity.ERROR,
        translation_key=ISSUE_AGENT_OUTDATED,
        translation_placeholders={
            "host": entry.data[CONF_HOST],
            "theirs": str(err.protocol),
            "ours": str(PROTOCOL),
        },
    )


class RepairSync:
    """Raises and clears the repair issues that follow one tower's data."""

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        coordinator: GpuHandoffCoordinator,
    ) -> None:
        """Nothing is followed until ``async_start``."""
        self._hass = hass
        self._entry = entry
        self._coordinator = coordinator
        # What the issues were last synced with (a new status or judgement
        # is a new object; what the controller only redraws is not).
        self._tower: TowerStatus | None = None
        self._health: NodeHealth | None = None
        self._finding_issues: set[str] = set()

    @callback
    def async_start(self) -> CALLBACK_TYPE:
        """Follow the coordinator (from before its first refresh, whose
        failure may need a repair); returns what stops it."""
        stops = (
            self._coordinator.async_add_refresh_listener(self._refresh_finished),
            self._coordinator.async_add_listener(self._data_changed),
        )

        @callback
        def stop() -> None:
            for stop_one in stops:
                stop_one()

        return stop

    @property
    def _host_key_issue_id(self) -> str:
        return f"{ISSUE_HOST_KEY}_{self._entry.entry_id}"

    @callback
    def _refresh_finished(self) -> None:
        """A refresh that read the tower clears the host key issue; one that
        failed says why, and some reasons are repairs."""
        coordinator = self._coordinator
        if coordinator.last_update_success:
            ir.async_delete_issue(self._hass, DOMAIN, self._host_key_issue_id)
            return
        # The client's error that made the refresh fail (coordinator.py
        # raises Home Assistant's errors from it).
        cause = getattr(coordinator.last_exception, "__cause__", None)
        if isinstance(cause, TowerHostKeyError):
            self._entry.async_create_task(
                self._hass,
                self._async_raise_host_key_issue(),
                f"{self._entry.title} host key issue",
            )
        elif isinstance(cause, AgentVersionError):
            async_raise_agent_outdated(self._hass, self._entry, cause)

    async def _async_raise_host_key_issue(self) -> None:
        """Tell the user the tower's host key changed, with both fingerprints
        (unless a refresh read the tower meanwhile)."""
        data = self._entry.data
        try:
            new_key = await fetch_host_key(data[CONF_HOST], data[CONF_PORT])
        except TowerError:
            return
        if self._coordinator.last_update_success:
            return
        ir.async_create_issue(
            self._hass,
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
            data={"entry_id": self._entry.entry_id, "host_key": new_key},
        )

    @callback
    def _data_changed(self) -> None:
        """Sync what a new status or a new judgement says."""
        if not self._coordinator.last_update_success:
            return  # nothing new read (and nothing at all if the first failed)
        data = self._coordinator.data
        if data.tower is not self._tower:
            self._tower = data.tower
            self._sync_finding_issues(data.tower)
        if data.health is not None and data.health is not self._health:
            self._health = data.health
            self._sync_health_issue(data.health, data.tower.gpu_node)

    def _sync_health_issue(self, health: NodeHealth, gpu_node: str) -> None:
        """A repair issue while the GPU node is unhealthy, saying what was
        seen; gone once it works (or an operation has it)."""
        issue_id = f"{ISSUE_NODE_HEALTH}_{self._entry.entry_id}"
        if not health.problem:
            ir.async_delete_issue(self._hass, DOMAIN, issue_id)
            return
        ir.async_create_issue(
            self._hass,
            DOMAIN,
            issue_id,
            # The fix shows the GPU node's screen (its console says why).
            is_fixable=True,
            data={"entry_id": self._entry.entry_id, "screen_of": gpu_node},
            # A node that starts no container serves nothing; one short of
            # GPUs still runs the rest.
            severity=ir.IssueSeverity.ERROR
            if health.reason == CONTAINERS_NOT_STARTING
            else ir.IssueSeverity.WARNING,
            translation_key=f"node_{health.reason}",
            translation_placeholders=issue_placeholders(
                health, self._coordinator.k8s_node, dt_util.get_default_time_zone()
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
            issue_id = f"{code}_{self._entry.entry_id}_{domain}"
            wanted.add(issue_id)
            ir.async_create_issue(
                self._hass,
                DOMAIN,
                issue_id,
                is_fixable=False,
                severity=ir.IssueSeverity.WARNING,
                translation_key=code,
                translation_placeholders={
                    "domain": domain,
                    "details": "; ".join(sorted(lines)),
                }
                | FINDING_PLACEHOLDERS.get(code, {}),
            )
        for issue_id in self._finding_issues - wanted:
            ir.async_delete_issue(self._hass, DOMAIN, issue_id)
        self._finding_issues = wanted
