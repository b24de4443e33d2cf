"""Stand-ins for the tower and cluster clients, for the tests of what listens
to the coordinator and of the agent session loop: each failure they must
handle, on demand, which the real sshd and agent cannot be made to give at
the right moment. The end-to-end stories use the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from homeassistant.const import CONF_HOST, CONF_PORT
from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.cluster_client import ClusterError
from custom_components.gpu_handoff.const import CONF_HOST_KEY, CONF_K8S_NODE, DOMAIN
from custom_components.gpu_handoff.coordinator import GpuHandoffCoordinator
from custom_components.gpu_handoff.protocol import Push, TowerStatus, Version
from custom_components.gpu_handoff.tower_client import generate_key_pair


def tower_status(**changes: Any) -> TowerStatus:
    """A tower with nothing on it (a new object at each call, as each status
    read or pushed is)."""
    empty = TowerStatus(
        uri="qemu:///system",
        gpu_node="gpu-node",
        gaming=(),
        domains={},
        cards=(),
        findings=(),
        hook_requests=(),
        active_jobs=(),
        virsh_calls=0,
    )
    return replace(empty, **changes)


class FakeSession:
    """A TowerSession as the loop sees it: its hello, and when it ends."""

    def __init__(self, hello: Version) -> None:
        self.hello = hello
        self.close_reason: str | None = None
        self._closed = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def end(self, reason: str) -> None:
        """The tower (or the connection) ends it."""
        self.close_reason = reason
        self._closed.set()

    async def close(self) -> None:
        self.end("closed by Home Assistant")


class FakeTower:
    """A TowerClient whose status and sessions are what the test queues."""

    def __init__(self) -> None:
        self.status_result: TowerStatus | Exception = tower_status()
        self.status_calls = 0
        self.on_push: Callable[[Push], None] | None = None
        self._sessions: list[FakeSession | Exception] = []
        self._queued = asyncio.Event()

    async def status(self) -> TowerStatus:
        self.status_calls += 1
        if isinstance(self.status_result, Exception):
            raise self.status_result
        return replace(self.status_result)

    def queue(self, *outcomes: FakeSession | Exception) -> None:
        """What the next attempts to open a session give, in order."""
        self._sessions.extend(outcomes)
        self._queued.set()

    @property
    def queued(self) -> int:
        return len(self._sessions)

    async def open_session(self, on_push: Callable[[Push], None]) -> FakeSession:
        """The next queued outcome (waits for one)."""
        self.on_push = on_push
        while not self._sessions:
            self._queued.clear()
            await self._queued.wait()
        outcome = self._sessions.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def close(self) -> None:
        return None


class FakeCluster:
    """A cluster that cannot be read (the snapshot then has no health)."""

    async def node_reading(self, node: str) -> None:
        raise ClusterError(f"{node}: unreachable")

    async def close(self) -> None:
        return None


def fake_entry(hass: HomeAssistant) -> MockConfigEntry:
    """An entry for "tower.lan" with a pinned host key."""
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="tower",
        data={
            CONF_HOST: "tower.lan",
            CONF_PORT: 22,
            CONF_HOST_KEY: generate_key_pair()[1],
            CONF_K8S_NODE: "gpu-node",
        },
    )
    entry.add_to_hass(hass)
    return entry


def fake_coordinator(
    hass: HomeAssistant, entry: MockConfigEntry, tower: FakeTower
) -> GpuHandoffCoordinator:
    """The real coordinator over the stand-ins."""
    return GpuHandoffCoordinator(hass, entry, tower, FakeCluster())  # type: ignore[arg-type]
