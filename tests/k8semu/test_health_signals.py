"""What tells a working node from a ghost one: the pod sandbox condition,
container states and start times, the kubelet's aggregated events, and the
device plugin's GPUs in the node status, as a real API server carries them.

Upstream sources (kubernetes/kubernetes unless said otherwise):
- pkg/kubelet/status/generate.go GeneratePodReadyToStartContainersCondition:
  True once a sandbox with its network exists, False while one must be made;
  no reason either way. The condition was PodHasNetwork in 1.25-1.27.
- pkg/kubelet/kubelet_pods.go: a container not created yet waits with reason
  ContainerCreating; images are pulled only once the sandbox is up, so a pod
  pulling a large image has its sandbox condition True.
- pkg/kubelet/events/event.go: FailedCreatePodSandBox (Warning) on the pod.
- client-go tools/record (events.go makeEvent, events_cache.go
  EventCorrelator): the event is named ``<object>.<hex ns>``; a repeat bumps
  count and lastTimestamp. client-go tools/events (events.k8s.io/v1) writes
  eventTime and series instead, seen through core/v1 without
  first/lastTimestamp.
- pkg/kubelet/cm/devicemanager/manager.go GetCapacity: capacity = healthy +
  unhealthy devices, allocatable = healthy; zero after a kubelet restart until
  the device plugin registers again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json

from kubernetes_asyncio import client

from . import GPU, GPU_NODE, K8sEmulator
from .client import raw_watch, unset

T = 10
STUCK = "Failed to create pod sandbox: rpc error: code = DeadlineExceeded"


def condition(pod: client.V1Pod, kind: str) -> client.V1PodCondition | None:
    """The pod's condition of that type, if it carries one."""
    return next((c for c in pod.status.conditions or [] if c.type == kind), None)


async def test_a_pod_waiting_for_its_sandbox_then_started(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Waiting: PodReadyToStartContainers False (no reason), phase Pending,
    the container waiting in ContainerCreating, never started. Started: the
    condition turns True at a later transition, the container runs since a
    startedAt, the pod is Running and Ready."""
    emulator.add_pod(
        "ghost",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
        age=600,
    )
    core = client.CoreV1Api(api)
    pod = await core.read_namespaced_pod("ghost", "ai", _request_timeout=T)
    sandbox = condition(pod, "PodReadyToStartContainers")
    assert sandbox is not None
    assert sandbox.status == "False"
    assert unset(sandbox.reason)
    now = dt.datetime.now(dt.UTC)
    assert 590 <= (now - sandbox.last_transition_time).total_seconds() <= 610
    assert 590 <= (now - pod.status.start_time).total_seconds() <= 610
    assert pod.status.phase == "Pending"
    [container] = pod.status.container_statuses
    assert container.state.waiting.reason == "ContainerCreating"
    assert unset(container.state.running)
    assert container.started is False

    emulator.start_pod_containers("ghost", "ai")
    pod = await core.read_namespaced_pod("ghost", "ai", _request_timeout=T)
    started = condition(pod, "PodReadyToStartContainers")
    assert started is not None
    assert started.status == "True"
    assert started.last_transition_time > sandbox.last_transition_time
    assert pod.status.phase == "Running"
    [container] = pod.status.container_statuses
    assert unset(container.state.waiting)
    assert (now - container.state.running.started_at).total_seconds() < 5
    assert condition(pod, "Ready").status == "True"


async def test_a_pod_pulling_an_image_has_its_sandbox(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """The same waiting reason with the sandbox up: only the condition tells
    an image pull from a sandbox that never came."""
    emulator.add_pod(
        "pulling",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
        sandbox_ready=True,
    )
    pod = await client.CoreV1Api(api).read_namespaced_pod(
        "pulling", "ai", _request_timeout=T
    )
    assert condition(pod, "PodReadyToStartContainers").status == "True"
    assert pod.status.container_statuses[0].state.waiting.reason == "ContainerCreating"


async def test_older_kubelets_name_the_condition_otherwise_or_not_at_all(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """1.25-1.27 with the gate: PodHasNetwork; older: no such condition."""
    for name, kind in (("v127", "PodHasNetwork"), ("v124", None)):
        emulator.add_pod(
            name,
            "ai",
            node=GPU_NODE,
            phase="Pending",
            waiting_reason="ContainerCreating",
            sandbox_condition=kind,
        )
    core = client.CoreV1Api(api)
    v127 = await core.read_namespaced_pod("v127", "ai", _request_timeout=T)
    assert condition(v127, "PodHasNetwork").status == "False"
    assert condition(v127, "PodReadyToStartContainers") is None
    v124 = await core.read_namespaced_pod("v124", "ai", _request_timeout=T)
    assert {c.type for c in v124.status.conditions} == {
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    }


async def test_the_kubelet_aggregates_a_repeated_event(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """One Event per (object, reason, message, type, source), named after the
    object; each repeat raises count and moves lastTimestamp. Field selectors
    find it by the pod's UID and type."""
    pod = emulator.add_pod(
        "ghost",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
    )
    first = emulator.record_event(
        pod, reason="FailedCreatePodSandBox", message=STUCK, host=GPU_NODE
    )
    await asyncio.sleep(1.1)  # metav1.Time has whole seconds
    for _ in range(2):
        emulator.record_event(
            pod, reason="FailedCreatePodSandBox", message=STUCK, host=GPU_NODE
        )
    emulator.record_event(
        pod, reason="Scheduled", message="assigned", event_type="Normal"
    )
    events = await client.CoreV1Api(api).list_namespaced_event(
        "ai",
        field_selector=f"involvedObject.uid={pod['metadata']['uid']},type=Warning",
        _request_timeout=T,
    )
    [event] = events.items
    assert event.metadata.name == first["metadata"]["name"]
    assert event.metadata.name.startswith("ghost.")
    int(event.metadata.name.removeprefix("ghost."), 16)
    assert event.count == 3
    assert event.reason == "FailedCreatePodSandBox"
    assert event.last_timestamp > event.first_timestamp
    assert event.source.host == GPU_NODE
    assert event.involved_object.kind == "Pod"


async def test_an_events_api_event_seen_through_core_v1(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """eventTime and series, no first/lastTimestamp and no count."""
    pod = emulator.add_pod("ghost", "ai", node=GPU_NODE)
    emulator.add_event(
        "ghost.new",
        "ai",
        involved=pod,
        reason="FailedCreatePodSandBox",
        message=STUCK,
        event_type="Warning",
        count=4,
        series=True,
        age=120,
    )
    [event] = (
        await client.CoreV1Api(api).list_namespaced_event("ai", _request_timeout=T)
    ).items
    assert unset(event.first_timestamp)
    assert unset(event.last_timestamp)
    assert unset(event.count)
    assert event.series.count == 4
    assert event.series.last_observed_time > event.event_time
    assert event.reporting_component == "kubelet"


async def test_the_device_plugin_gpus_in_the_node_status(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Zero after a kubelet restart, every card once the plugin registered,
    one less allocatable than capacity for an unhealthy card; each change is
    a MODIFIED event on a node watch."""
    core = client.CoreV1Api(api)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    response = await raw_watch(
        core.list_node,
        field_selector=f"metadata.name={GPU_NODE}",
        resource_version=node.metadata.resource_version,
        timeout_seconds=5,
        _request_timeout=T,
    )
    try:
        seen: list[tuple[str, str, str]] = []
        for healthy, unhealthy in ((0, 0), (3, 0), (2, 1)):
            emulator.set_node_gpus(GPU_NODE, healthy, unhealthy)
            line = await asyncio.wait_for(response.content.readline(), T)
            event = json.loads(line)
            status = event["object"]["status"]
            seen.append(
                (event["type"], status["capacity"][GPU], status["allocatable"][GPU])
            )
    finally:
        response.release()
    assert seen == [
        ("MODIFIED", "0", "0"),
        ("MODIFIED", "3", "3"),
        ("MODIFIED", "3", "2"),
    ]
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    assert node.status.capacity["cpu"] == "8"  # the rest of the status stays
