"""The cluster is told why: GPU Handoff's Kubernetes Events about the GPU node
(events.k8s.io/v1, posted as client-go's events recorder posts them), read
back the way an operator reads them (the core/v1 list with
``involvedObject.name=gpu-node``), over real HTTPS against the emulator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from homeassistant.core import HomeAssistant
from kubernetes_asyncio.client import CoreV1Api
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.cluster_client import (
    ClusterClient,
    DrainError,
    PodRef,
)
from custom_components.gpu_handoff.cluster_events import (
    FINISH_TIME,
    NOTE_LIMIT,
    REPORTING_CONTROLLER,
    NodeEvents,
)
from custom_components.gpu_handoff.drain import NodeDrain
from tests.k8semu import GPU_NODE, PRODUCT_RULES, K8sEmulator
from tests.support.stories import play, quit_game, setup_entry, until
from tests.towersim import Tower


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def posting(
    cluster_client: ClusterClient,
) -> AsyncIterator[Callable[[Clock], NodeEvents]]:
    """NodeEvents of the GPU node with a clock of the test's, posting."""
    tasks: list[asyncio.Task[None]] = []

    def make(clock: Clock) -> NodeEvents:
        events = NodeEvents(
            cluster_client, GPU_NODE, instance="gpu-handoff-test", clock=clock
        )
        tasks.append(asyncio.get_running_loop().create_task(events.run()))
        return events

    yield make
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def node_events(operator: CoreV1Api) -> list[Any]:
    """GPU Handoff's events about the GPU node, as ``kubectl get events
    --field-selector involvedObject.name=gpu-node`` lists them, oldest first."""
    listed = await operator.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={GPU_NODE}"
    )
    ours = [e for e in listed.items if e.reporting_component == REPORTING_CONTROLLER]
    return sorted(ours, key=lambda e: (e.event_time, e.metadata.name))


async def posted(
    operator: CoreV1Api, done: Callable[[list[Any]], bool], bound: float = 10.0
) -> list[Any]:
    """The node's events once ``done`` holds for them."""
    async with asyncio.timeout(bound):
        while True:
            events = await node_events(operator)
            if done(events):
                return events
            await asyncio.sleep(0.05)


# --- a handoff and a return, told -------------------------------------------------


async def test_a_handoff_and_a_return_leave_a_readable_trail(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    operator: CoreV1Api,
    no_pdb: None,
) -> None:
    """Gaming station 1 plays, then stops: the node's events say, in order,
    that GPU Handoff cordoned it for gaming-1, drained it (the trainer pod
    evicted), shut the GPU node down through its guest agent, and lifted
    its cordon once the node was back with its GPUs."""
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await quit_game(hass, entry, sim, 1)
    events = await posted(
        operator, lambda events: any(e.reason == "Uncordoned" for e in events)
    )
    reasons = [e.reason for e in events]
    assert reasons[0] == "Cordoned"
    assert reasons[-1] == "Uncordoned"
    order = ["Cordoned", "Draining", "Evicted", "Drained", "ShuttingDown", "Uncordoned"]
    firsts = list(dict.fromkeys(r for r in reasons if r in order))
    assert firsts == order, reasons
    by_reason = {e.reason: e for e in events}
    assert "handoff to gaming-1" in by_reason["Cordoned"].message
    assert "gaming-1" in by_reason["ShuttingDown"].message
    assert "guest agent" in by_reason["ShuttingDown"].message
    assert "lifted its cordon" in by_reason["Uncordoned"].message
    evicted = by_reason["Evicted"]
    assert evicted.related.kind == "Pod"
    assert evicted.related.namespace == "ai"
    assert evicted.related.name.startswith("trainer-")
    node = cluster.get("Node", GPU_NODE, "")
    assert node is not None
    for event in events:
        assert event.metadata.namespace == "default"
        assert event.involved_object.kind == "Node"
        assert event.involved_object.uid == node["metadata"]["uid"]
        assert event.reporting_instance
        assert event.type == "Normal"
        assert event.action


# --- as client-go's recorder: series, limits, refusals ----------------------------


async def test_a_budget_refusing_again_and_again_is_one_series_naming_it(
    cluster_client: ClusterClient,
    cluster: K8sEmulator,
    operator: CoreV1Api,
    posting: Callable[[Clock], NodeEvents],
) -> None:
    """The trainer's budget refuses every eviction until the drain's timeout:
    one EvictionRefused warning naming the budget, its repeats a series
    (count 2 at the second refusal, as recordToSink patches it; the final
    count once the series finished, 6 minutes after its last refusal), and
    a DrainFailed warning."""
    clock = Clock()
    events = posting(clock)
    await cluster_client.cordon(GPU_NODE, "test")
    with pytest.raises(DrainError):
        await NodeDrain(cluster_client, events).run(
            GPU_NODE, timeout=1.0, retry_interval=0.1, poll_interval=0.05
        )
    found = await posted(
        operator,
        lambda es: (
            any(e.reason == "DrainFailed" for e in es)
            and any(e.series is not None for e in es if e.reason == "EvictionRefused")
        ),
    )
    refused = [e for e in found if e.reason == "EvictionRefused"]
    assert len(refused) == 1
    assert refused[0].type == "Warning"
    assert "ai/trainer" in refused[0].message
    assert "disruption budget trainer" in refused[0].message
    assert refused[0].series.count == 2
    failed = next(e for e in found if e.reason == "DrainFailed")
    assert failed.type == "Warning"
    assert "ai/trainer" in failed.message

    # Every refusal the API server answered is one of the series.
    total = sum(
        1 for r in cluster.requests_for(resource="pods/eviction") if r.status == 429
    )
    assert total > 2  # retried every 0.1 s for a second
    clock.now += FINISH_TIME + 1
    await events.finish_series()
    found = await posted(
        operator,
        lambda es: any(
            e.reason == "EvictionRefused" and e.series.count == total for e in es
        ),
    )
    assert len([e for e in found if e.reason == "EvictionRefused"]) == 1
    # A refusal after the series finished is a new event.
    events.warning(
        "EvictionRefused",
        "Evict",
        "again",
        PodRef("ai", refused[0].related.name, refused[0].related.uid),
    )
    await posted(
        operator, lambda es: len([e for e in es if e.reason == "EvictionRefused"]) == 2
    )


async def test_a_note_longer_than_the_api_allows_is_cut(
    operator: CoreV1Api, posting: Callable[[Clock], NodeEvents]
) -> None:
    """A drain error naming many pods is cut to the API server's 1024
    bytes (NoteLengthLimit, Go's len: é is two): the event is accepted, not
    refused."""
    events = posting(Clock())
    events.warning("DrainRefused", "Drain", "pods: " + ", ".join(["é" * 60] * 40))
    (event,) = await posted(operator, bool)
    assert NOTE_LIMIT - 3 <= len(event.message.encode()) <= NOTE_LIMIT
    assert event.message.endswith("…")
    assert event.message.startswith("pods: éé")


async def test_events_refused_by_rbac_are_logged_once_and_change_nothing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    operator: CoreV1Api,
    no_pdb: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ClusterRole applied before events were posted (no events.k8s.io
    grant): every refused event is a 403, the handoff and the return work
    as before, and the log says it once, naming the missing grant."""
    cluster.set_rules(
        tuple(r for r in PRODUCT_RULES if "events.k8s.io" not in r.api_groups)
    )
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await quit_game(hass, entry, sim, 1)
    assert sim.is_running("gpu-node")
    await until(
        lambda: any(
            r.group == "events.k8s.io" and r.status == 403
            for r in cluster.requests_for(resource="events")
        )
    )
    warnings = [
        r for r in caplog.records if "refused GPU Handoff's event" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "events.k8s.io" in warnings[0].getMessage()
    assert await node_events(operator) == []
