"""The GPU node's changes as the emulator's store writes them, for tests
that wait on them (tests/k8semu/test_node_lifecycle.py and others)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import contextlib
from dataclasses import dataclass
import time
from typing import Any

from . import GPU, GPU_NODE, K8sEmulator
from .store import StoredEvent

BOUND = 10.0  # seconds any awaited change may take on a loaded machine


def _node(emulator: K8sEmulator, name: str = GPU_NODE) -> dict[str, Any]:
    node = emulator.get("Node", name, "")
    assert node is not None
    return node


@dataclass(frozen=True)
class Seen:
    """The node as one change left it."""

    at: float
    ready: str | None
    boot_id: str
    capacity: str | None
    allocatable: str | None
    taints: frozenset[tuple[str, str]]
    node: dict[str, Any]


class NodeLog:
    """Every change of the node and every renewal of its Lease, as the
    emulator's store writes them."""

    def __init__(self, emulator: K8sEmulator, node: str = GPU_NODE) -> None:
        self.emulator = emulator
        self.node = node
        self.seen: list[Seen] = [self._seen(_node(emulator, node))]
        self.renewals: list[float] = []
        self._changed = asyncio.Event()
        emulator.store.listeners.append(self._on)

    def close(self) -> None:
        self.emulator.store.listeners.remove(self._on)

    @staticmethod
    def _seen(node: dict[str, Any]) -> Seen:
        status = node["status"]
        ready = next(
            (c["status"] for c in status["conditions"] if c["type"] == "Ready"), None
        )
        return Seen(
            at=time.monotonic(),
            ready=ready,
            boot_id=status["nodeInfo"]["bootID"],
            capacity=status.get("capacity", {}).get(GPU),
            allocatable=status.get("allocatable", {}).get(GPU),
            taints=frozenset(
                (t["key"], t["effect"]) for t in node["spec"].get("taints", [])
            ),
            node=node,
        )

    def _on(self, event: StoredEvent) -> None:
        new = event.new
        if new is None or new["metadata"]["name"] != self.node:
            return
        if event.resource.kind == "Node":
            self.seen.append(self._seen(new))
        elif event.resource.kind == "Lease":
            self.renewals.append(time.monotonic())
        self._changed.set()

    @property
    def last(self) -> Seen:
        return self.seen[-1]

    async def until(self, done: Callable[[], bool], bound: float = BOUND) -> None:
        """Until ``done`` holds, woken by each change (and every 20 ms: a
        kubelet falling silent writes nothing)."""
        async with asyncio.timeout(bound):
            while not done():
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.02)
