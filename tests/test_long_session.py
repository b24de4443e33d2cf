"""A return after a gaming session longer than the pods' toleration.

While the GPU node is off its Kubernetes node is Unknown, tainted
``node.kubernetes.io/unreachable:NoExecute``; five minutes later (every pod's
default toleration, DefaultTolerationSeconds) the taint eviction controller
deletes the pods still bound to it, and with no kubelet to finish them they
stay Terminating until the node's kubelet is back
(tests/k8semu/test_scheduling.py pins the emulator to upstream). Which pods
are still bound to it? Those the drain left: a Deployment's pod that tolerates
the cordon came back to the cordoned node (tests/test_drain_like_kubectl.py)
and went down with it. The return after such a session brings the cards back
all the same: the new kubelet finishes the terminating pod, the ReplicaSets'
new pods run on the node again, and nothing is reported unhealthy.

Real parts: sshd forcing the real agent, the tower simulator, the Kubernetes
emulator (a hundred times faster: the five minutes are 3 s) with the kubelet
stand-in playing the scheduler and the ReplicaSet controller.
"""

from __future__ import annotations

from typing import Any

from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.stories import cordoned, play, quit_game, setup_entry, until
from tests.towersim import Tower

BOUND = 60.0
HEALTH = "binary_sensor.gpu_node_health"


def _workload_pods(cluster: K8sEmulator) -> list[dict[str, Any]]:
    return [
        pod
        for pod in cluster.list_objects("Pod", "ai")
        if pod["spec"].get("nodeName") == GPU_NODE
    ]


def _terminating(cluster: K8sEmulator) -> list[str]:
    return sorted(
        pod["metadata"]["name"]
        for pod in _workload_pods(cluster)
        if pod["metadata"].get("deletionTimestamp")
    )


def _running(cluster: K8sEmulator) -> list[str]:
    return sorted(
        pod["metadata"]["labels"]["app"]
        for pod in _workload_pods(cluster)
        if pod["status"].get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
    )


async def test_a_return_after_the_pods_toleration_ran_out(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
) -> None:
    labels = {"app": "node-agent", "pod-template-hash": "55d6c7b8f"}
    owner = cluster.add_replicaset(
        "node-agent-55d6c7b8f", "ai", labels=labels, image="registry.example/a:3"
    )
    cluster.add_pod(
        "node-agent-55d6c7b8f-r2d2x",
        "ai",
        node=GPU_NODE,
        labels=labels,
        owner=cluster.owner_ref(owner),
        image="registry.example/a:3",
        # the cordon only: it gets the default 300 s for an unreachable node
        tolerations=[
            {
                "key": "node.kubernetes.io/unschedulable",
                "operator": "Exists",
                "effect": "NoSchedule",
            }
        ],
    )
    kubelet.follow_workloads()
    await setup_entry(hass, entry)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)

    await play(hass, entry, sim, 1)
    [came_back] = succeeded[0].data["pods_came_back"]
    back = came_back.split("/", 1)[1]
    await until(lambda: cluster.node_ready_status(GPU_NODE) == "Unknown", BOUND)
    # Five minutes (here 3 s) later the taint eviction controller deletes it.
    await until(lambda: _terminating(cluster) == [back], BOUND)

    await quit_game(hass, entry, sim, 1)
    await until(lambda: bool(returned), BOUND)
    assert failed == []
    assert unhealthy == []
    assert not cordoned(cluster)
    # The new kubelet finished it; the ReplicaSets' new pods run.
    await until(lambda: _terminating(cluster) == [], BOUND)
    assert cluster.get("Pod", back, "ai") is None
    await until(
        lambda: _running(cluster) == ["llm-inference", "node-agent", "trainer"],
        BOUND,
    )
    state = hass.states.get(HEALTH)
    assert state is not None
    assert state.state == "off"
