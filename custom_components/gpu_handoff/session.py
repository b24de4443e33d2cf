"""The agent session: one long-lived session per tower, kept open for as long
as the entry is loaded.

The session carries the tower's state whenever it changes, libvirt events
(applied at once) and job progress. The state goes to the coordinator's data
setters; job progress goes to whoever follows jobs (the controller's runner).
Its hello names the agent: the tower device shows it, and a repair says when
it is not the agent this integration ships. While the session is down, the
coordinator's poll reads the tower one-shot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
import logging
from typing import Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.const import CONF_HOST
from homeassistant.core import HomeAssistant, callback
from homeassistant.helpers import device_registry as dr, issue_registry as ir

from .const import DOMAIN
from .coordinator import GpuHandoffCoordinator
from .models import tower_identifier
from .protocol import (
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
    version_key,
)
from .repair_sync import agent_outdated_issue_id, async_raise_agent_outdated
from .tower.gpu_handoff import wire
from .tower_client import (
    AgentCommandError,
    AgentVersionError,
    TowerClient,
    TowerError,
    TowerSession,
)

_LOGGER = logging.getLogger(__name__)

# The wait before opening the session again, doubled at each failure.
# Module variables, read at each wait (tests shorten them).
WATCH_BACKOFF_START: float = 1.0
WATCH_BACKOFF_MAX: float = 60.0

# What a libvirt lifecycle event says the domain's state is now.
LIFECYCLE_STATES: Final = {
    "started": RUNNING,
    "resumed": RUNNING,
    "stopped": SHUT_OFF,
    "suspended": "paused",
    "crashed": "crashed",
    "pmsuspended": "pmsuspended",
}
# The agent's version against the one this integration ships (same protocol).
ISSUE_AGENT_VERSION: Final = "agent_version"
# The agent this integration ships, and so expects on the tower.
AGENT_VERSION: Final = wire.VERSION


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


class AgentSession:
    """Keeps one tower's agent session open and delivers what it pushes."""

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        tower: TowerClient,
        coordinator: GpuHandoffCoordinator,
        *,
        job_listener: Callable[[JobRecord], None],
        session_listener: Callable[[], None],
    ) -> None:
        """``job_listener`` gets pushed job progress; ``session_listener``
        hears that the session opened or ended."""
        self._hass = hass
        self._entry = entry
        self._tower = tower
        self._coordinator = coordinator
        self._job_listener = job_listener
        self._session_listener = session_listener
        self._session: TowerSession | None = None
        # The kind of unexpected failure logged last (not logged again).
        self._logged_failure: str | None = None
        # Whether the session is open now (diagnostics show it).
        self.connected = False

    async def async_run(self) -> None:
        """Keep the agent session open; ends only when cancelled (unload),
        closing the session it holds.

        Whatever closes the session (a dropped connection, an unexpected
        error) is logged once per kind of failure and followed by a
        reconnect with backoff. An agent too old for sessions raises a
        repair.
        """
        backoff = WATCH_BACKOFF_START
        try:
            while True:
                session = await self._async_open()
                if session is not None:
                    backoff = WATCH_BACKOFF_START
                    await self._async_hold(session)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, WATCH_BACKOFF_MAX)
        finally:
            if self._session is not None and not self._session.closed:
                await self._session.close()

    async def _async_open(self) -> TowerSession | None:
        """The session, or None once the failure is told: a repair for an
        agent of another protocol, the debug log for a tower away, the log
        for an unexpected error (once per kind until a session opens)."""
        try:
            session = await self._tower.open_session(self._on_push)
        except AgentVersionError as err:
            async_raise_agent_outdated(self._hass, self._entry, err)
        except TowerError as err:
            _LOGGER.debug("No agent session: %s", err)
        except Exception as err:
            if self._logged_failure != type(err).__name__:
                self._logged_failure = type(err).__name__
                _LOGGER.exception("Opening the agent session failed")
        else:
            self._logged_failure = None
            return session
        return None

    async def _async_hold(self, session: TowerSession) -> None:
        """While the session is open: what its hello says, then wait for it
        to end and catch up on what happened while it was closing."""
        self._session = session
        ir.async_delete_issue(self._hass, DOMAIN, agent_outdated_issue_id(self._entry))
        self.connected = True
        _LOGGER.debug("Agent session open (agent %s)", session.hello.version)
        self._show_agent(session.hello)
        self._compare_agent_version(session.hello.version)
        self._session_listener()
        await session.wait_closed()
        self.connected = False
        _LOGGER.debug("Agent session ended: %s", session.close_reason)
        self._session_listener()
        await self._coordinator.async_request_refresh()

    @callback
    def _on_push(self, push: Push) -> None:
        """One message the session pushed."""
        match push:
            case StatusPush(status=status):
                self._coordinator.async_set_tower(status)
            case LibvirtEvent() if push.event == "lifecycle":
                # Applied at once; the status that follows fills in the rest.
                state = LIFECYCLE_STATES.get(push.action or "")
                if state is not None:
                    now = self._coordinator.data.tower
                    tower = with_domain_state(now, push.domain, state)
                    if tower is not now:
                        self._coordinator.async_set_tower(tower)
            case JobPush(record=record):
                self._job_listener(record)
            case ErrorPush(error=error, source="status"):
                # The tower's state cannot be read now (libvirt away): its
                # entities are unavailable until the next status, which the
                # agent pushes as soon as it can read it again.
                self._coordinator.async_set_tower_error(
                    AgentCommandError(error.code, error.message)
                )
            case ErrorPush(error=error):
                _LOGGER.warning("The tower agent reports: %s", error.message)
            case _:
                pass

    def _show_agent(self, hello: Version) -> None:
        """The tower device shows the agent it runs (its software version)
        and is named after the tower, as the agent names it (an agent too old
        to say leaves the name it has). A name the user gave the device is
        theirs (``name_by_user``) and stays in front."""
        registry = dr.async_get(self._hass)
        entry_id = self._entry.entry_id
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
        entry = self._entry
        issue_id = f"{ISSUE_AGENT_VERSION}_{entry.entry_id}"
        ours_key, theirs_key = version_key(AGENT_VERSION), version_key(theirs)
        if ours_key is None or theirs_key is None or theirs_key == ours_key:
            ir.async_delete_issue(self._hass, DOMAIN, issue_id)
            return
        older = theirs_key < ours_key
        ir.async_create_issue(
            self._hass,
            DOMAIN,
            issue_id,
            # An older agent is updated from the repair (the guided path).
            is_fixable=older,
            data={"entry_id": entry.entry_id, "update_agent": 1} if older else None,
            severity=ir.IssueSeverity.WARNING,
            translation_key="agent_older" if older else "agent_newer",
            translation_placeholders={
                "host": entry.data[CONF_HOST],
                "theirs": theirs,
                "ours": AGENT_VERSION,
            },
        )
