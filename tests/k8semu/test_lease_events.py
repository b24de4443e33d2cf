"""Node Leases (renewed while the node is up) and Events with field selectors."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio import client

from . import CONTROL_PLANE_NODE, GPU_NODE, NODE_LEASE_NAMESPACE, K8sEmulator

T = 10


async def read_lease(api: client.ApiClient, node: str) -> client.V1Lease:
    """The node's Lease."""
    return await client.CoordinationV1Api(api).read_namespaced_lease(
        node, NODE_LEASE_NAMESPACE, _request_timeout=T
    )


async def wait_for_renewals(
    api: client.ApiClient, node: str, count: int
) -> client.V1Lease:
    """Poll until the lease's renewTime changed ``count`` times (deadline 10 s)."""
    lease = await read_lease(api, node)
    renewals = 0
    async with asyncio.timeout(10):
        while renewals < count:
            await asyncio.sleep(0.02)
            current = await read_lease(api, node)
            if current.spec.renew_time != lease.spec.renew_time:
                renewals += 1
                lease = current
    return lease


async def test_lease_renews_while_up_and_stops_while_down(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """renewTime advances; after set_node_up(False) it stays while others renew."""
    lease = await read_lease(api, GPU_NODE)
    assert lease.spec.holder_identity == GPU_NODE
    assert lease.spec.lease_duration_seconds == 40
    assert lease.metadata.owner_references[0].kind == "Node"
    renewed = await wait_for_renewals(api, GPU_NODE, 2)
    assert renewed.spec.renew_time > lease.spec.renew_time

    emulator.set_node_up(GPU_NODE, False)
    frozen = await read_lease(api, GPU_NODE)
    await wait_for_renewals(
        api, CONTROL_PLANE_NODE, 3
    )  # the renewal loop ran meanwhile
    still = await read_lease(api, GPU_NODE)
    assert still.spec.renew_time == frozen.spec.renew_time
    assert still.metadata.resource_version == frozen.metadata.resource_version

    emulator.set_node_up(GPU_NODE, True)
    back = await read_lease(api, GPU_NODE)
    assert back.spec.renew_time > frozen.spec.renew_time


async def test_events_by_involved_object_and_reason(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """involvedObject.uid and reason field selectors, across and within namespaces."""
    pod = emulator.add_pod(
        "stuck",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
    )
    other = emulator.get("Pod", "trainer-7c6d5e4f3-m2n9v", "ai")
    assert other is not None
    emulator.add_event(
        "stuck.1",
        "ai",
        involved=pod,
        reason="FailedCreatePodSandBox",
        message="Failed to create pod sandbox: context deadline exceeded",
        event_type="Warning",
        host=GPU_NODE,
    )
    emulator.add_event(
        "stuck.2",
        "ai",
        involved=pod,
        reason="Scheduled",
        message="assigned",
        component="default-scheduler",
    )
    emulator.add_event(
        "trainer.1",
        "ai",
        involved=other,
        reason="Started",
        message="Started container main",
    )
    core = client.CoreV1Api(api)
    uid = pod["metadata"]["uid"]
    events = await core.list_event_for_all_namespaces(
        field_selector=f"involvedObject.uid={uid}", _request_timeout=T
    )
    assert sorted(e.metadata.name for e in events.items) == ["stuck.1", "stuck.2"]
    events = await core.list_namespaced_event(
        "ai",
        field_selector=f"involvedObject.uid={uid},reason=FailedCreatePodSandBox",
        _request_timeout=T,
    )
    [event] = events.items
    assert event.type == "Warning"
    assert event.involved_object.name == "stuck"
    assert event.source.host == GPU_NODE
    events = await core.list_event_for_all_namespaces(
        field_selector="reason!=FailedCreatePodSandBox", _request_timeout=T
    )
    assert sorted(e.metadata.name for e in events.items) == ["stuck.2", "trainer.1"]
    stuck = await core.read_namespaced_pod("stuck", "ai", _request_timeout=T)
    ready_to_start = next(
        c for c in stuck.status.conditions if c.type == "PodReadyToStartContainers"
    )
    assert ready_to_start.status == "False"
    assert (
        stuck.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
    )
