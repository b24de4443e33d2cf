"""The agent session loop over a stand-in client: each way opening fails,
every kind of push, the session's end and the unload, on demand. The
end-to-end stories with the real sshd and agent are in test_live.py,
test_session_moments.py, test_agent_version.py and test_cluster_promise.py."""

from __future__ import annotations

import asyncio
import logging

from homeassistant.core import HomeAssistant
from homeassistant.helpers import issue_registry as ir
import pytest

from custom_components.gpu_handoff import session as session_module
from custom_components.gpu_handoff.const import DOMAIN
from custom_components.gpu_handoff.coordinator import GpuHandoffCoordinator
from custom_components.gpu_handoff.protocol import (
    PROTOCOL,
    AgentError,
    ErrorPush,
    Job,
    JobKind,
    JobPush,
    JobRecord,
    JobState,
    LibvirtEvent,
    StatusPush,
    Version,
)
from custom_components.gpu_handoff.session import AGENT_VERSION, AgentSession
from custom_components.gpu_handoff.tower_client import (
    AgentVersionError,
    TowerConnectionError,
)
from tests.support.fake_tower import (
    FakeSession,
    FakeTower,
    fake_coordinator,
    fake_entry,
    tower_status,
)
from tests.support.stories import until

HELLO = Version(protocol=PROTOCOL, version=AGENT_VERSION, verbs=(), host_name="tower")
RECORD = JobRecord(
    job=Job(
        id="j1",
        kind=JobKind.HANDOFF,
        domain="gaming-1",
        state=JobState.RUNNING,
        step=None,
        request_id=None,
        requested_by="ssh",
        created="t",
        finished=None,
        error=None,
    ),
    steps=(),
)


class _UnexpectedError(Exception):
    """A bug while opening the session."""


async def test_the_session_loop(
    hass: HomeAssistant,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent of another protocol raises its repair; a tower away is no
    error; the same unexpected error twice is logged once; the session that opens clears the repair
    and delivers its pushes; its end is told and caught up on; the unload
    closes the session it holds."""
    monkeypatch.setattr(session_module, "WATCH_BACKOFF_START", 0.01)
    entry = fake_entry(hass)
    tower = FakeTower()
    coordinator = fake_coordinator(hass, entry, tower)
    await coordinator.async_refresh()
    jobs: list[JobRecord] = []
    changes: list[bool] = []
    session = AgentSession(
        hass,
        entry,
        tower,  # type: ignore[arg-type]
        coordinator,
        job_listener=jobs.append,
        session_listener=lambda: changes.append(session.connected),
    )
    outdated = f"agent_outdated_{entry.entry_id}"
    first, second = FakeSession(HELLO), FakeSession(HELLO)
    tower.queue(AgentVersionError(PROTOCOL - 1))
    task = asyncio.get_running_loop().create_task(session.async_run())
    await until(
        lambda: ir.async_get(hass).async_get_issue(DOMAIN, outdated) is not None
    )
    tower.queue(
        TowerConnectionError("away"),
        _UnexpectedError("a bug"),
        _UnexpectedError("a bug"),
        first,
    )
    await until(lambda: session.connected)
    assert ir.async_get(hass).async_get_issue(DOMAIN, outdated) is None
    assert caplog.text.count("Opening the agent session failed") == 1
    assert changes == [True]

    _push_each_kind(tower, coordinator, jobs, caplog)

    calls = tower.status_calls
    tower.queue(second)
    first.end("connection lost")
    await until(lambda: changes == [True, False, True])
    assert tower.status_calls > calls  # caught up after the end
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert second.closed
    await coordinator.async_shutdown()


def _push_each_kind(
    tower: FakeTower,
    coordinator: GpuHandoffCoordinator,
    jobs: list[JobRecord],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every push the session delivers, and where it goes."""
    assert tower.on_push is not None
    push = tower.on_push
    status = tower_status(gaming=("gaming-1",))
    push(StatusPush(status=status))
    assert coordinator.data.tower is status
    # Events that change nothing: an action without a state, a domain the
    # status does not have, an event that is no lifecycle event.
    for event in (
        LibvirtEvent(time="t", domain="gpu-node", event="lifecycle", action="defined"),
        LibvirtEvent(time="t", domain="nowhere", event="lifecycle", action="started"),
        LibvirtEvent(time="t", domain="gpu-node", event="reboot"),
    ):
        push(event)
        assert coordinator.data.tower is status
    push(JobPush(record=RECORD))
    assert jobs == [RECORD]
    with caplog.at_level(logging.WARNING):
        push(ErrorPush(error=AgentError(code="libvirt", message="events lost")))
    assert "The tower agent reports: events lost" in caplog.text
    assert coordinator.last_update_success
    push(
        ErrorPush(
            error=AgentError(code="libvirt", message="no libvirt"), source="status"
        )
    )
    assert not coordinator.last_update_success
    push(StatusPush(status=tower_status()))
    assert coordinator.last_update_success
