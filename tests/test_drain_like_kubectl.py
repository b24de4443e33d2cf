"""The drain as ``kubectl drain`` does it, where a cluster has habits the
eviction path alone does not show.

1. A pod that tolerates the cordon comes back to the cordoned GPU node.

Many monitoring agents and GPU-operator helpers run as Deployments whose pods
tolerate everything (``tolerations: [{operator: Exists}]``). Such a pod passes
the scheduler's NodeUnschedulable filter: evicted from the cordoned GPU node,
its ReplicaSet recreates it and the scheduler binds it to the same cordoned
node again (tests/k8semu/test_scheduling.py pins the stand-in to upstream).
``kubectl drain`` lists the node's pods once, evicts them and is done; a drain
that lists again and evicts every newcomer chases that pod until its timeout,
and the game never starts.

GPU Handoff drains as kubectl does: a pod that arrived after the first
listing and tolerates the cordon is not chased. The handoff goes on (the pod
stops with the GPU node, as on any node whose pods tolerate a cordon), and
the GPU node's drain attributes and the handoff's event say which pods came
back and why.

2. A pod that more than one PodDisruptionBudget selects: the eviction API
answers 500 "This pod has more than one PodDisruptionBudget, which the
eviction subresource does not support." whatever the budgets allow
(pkg/registry/core/pod/storage/eviction.go); kubectl drain fails at once on
it (only 429 is retried). So does GPU Handoff, naming the budgets (its
ClusterRole may list them), instead of retrying a server error until the
drain timeout.

Real parts: sshd forcing the real agent, the tower simulator, the Kubernetes
emulator with the kubelet stand-in playing the scheduler and the ReplicaSet
controller for the node's workloads.
"""

from __future__ import annotations

from typing import Any

from homeassistant.const import EVENT_STATE_CHANGED
from homeassistant.core import Event, HomeAssistant, callback
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
)
from tests.conftest import add_tower_entry
from tests.k8semu import GPU_NODE, PRODUCT_RULES, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.sshd import Sshd
from tests.support.stories import (
    SWITCH_1,
    cordoned,
    idle,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

BOUND = 60.0
HANDOFF_STATE = "sensor.gpu_node_handoff_state"
NAMESPACE = "monitoring"
AGENT_LABELS = {"app": "node-agent", "pod-template-hash": "6f7d8c9b4"}
FIRST = "node-agent-6f7d8c9b4-k2j4x"


def _agent_pods(cluster: K8sEmulator) -> list[dict[str, Any]]:
    return [
        pod
        for pod in cluster.list_objects("Pod", NAMESPACE)
        if pod["metadata"]["labels"].get("app") == "node-agent"
        and pod["spec"].get("nodeName") == GPU_NODE
    ]


async def test_a_pod_tolerating_the_cordon_that_comes_back_is_not_chased(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
) -> None:
    owner = cluster.add_replicaset(
        "node-agent-6f7d8c9b4",
        NAMESPACE,
        labels=AGENT_LABELS,
        image="registry.example/node-agent:2.4",
    )
    cluster.add_pod(
        FIRST,
        NAMESPACE,
        node=GPU_NODE,
        labels=AGENT_LABELS,
        owner=cluster.owner_ref(owner),
        image="registry.example/node-agent:2.4",
        tolerations=[{"operator": "Exists"}],
    )
    kubelet.follow_workloads()
    await setup_entry(hass, entry)
    succeeded = async_capture_events(hass, EVENT_HANDOFF_SUCCEEDED)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    shown: list[list[str] | None] = []

    @callback
    def seen(event: Event) -> None:
        if event.data["entity_id"] == HANDOFF_STATE and event.data["new_state"]:
            shown.append(event.data["new_state"].attributes.get("pods_came_back"))

    hass.bus.async_listen(EVENT_STATE_CHANGED, seen)

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(succeeded) or bool(failed), BOUND)
    assert [e.data.get("error") for e in failed] == []
    await until(lambda: sim.is_running("gaming-1"), BOUND)
    await until(lambda: idle(entry), BOUND)

    # The first pod was evicted; its replacement came back and was left be.
    evicted = {
        r.name
        for r in cluster.requests_for(
            verb="create", resource="pods/eviction", namespace=NAMESPACE
        )
    }
    assert evicted == {FIRST}
    [back] = _agent_pods(cluster)
    label = f"{NAMESPACE}/{back['metadata']['name']}"
    assert back["metadata"]["name"] != FIRST
    [event] = succeeded
    assert event.data["pods_came_back"] == [label]
    # The GPU node's state showed it while draining, and shows none after.
    assert [label] in shown
    assert shown[-1] is None


async def _two_budgets_handoff(
    hass: HomeAssistant, sim_sshd: Sshd, cluster: K8sEmulator
) -> Event:
    """Gaming station 1 asked for while two budgets select the trainer pod
    (a drain timeout of five minutes): the failure event."""
    cluster.add_pdb(
        "trainer-floor", "ai", match_labels={"app": "trainer"}, max_unavailable=1
    )
    entry = add_tower_entry(hass, sim_sshd, cluster, drain_timeout=300)
    await setup_entry(hass, entry)
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed), BOUND)
    await until(lambda: idle(entry), BOUND)
    [event] = failed
    return event


def _trainer_evictions(cluster: K8sEmulator) -> int:
    return sum(
        1
        for r in cluster.requests_for(
            verb="create", resource="pods/eviction", namespace="ai"
        )
        if r.name is not None and r.name.startswith("trainer-")
    )


async def test_a_pod_two_budgets_select_fails_the_drain_at_once_naming_them(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: Kubelet,
) -> None:
    event = await _two_budgets_handoff(hass, sim_sshd, cluster)
    assert event.data["code"] == "MultipleBudgetsError"
    assert event.data["error"] == (
        "ai/trainer-7c6d5e4f3-m2n9v cannot be evicted: the eviction API refuses "
        "a pod that more than one PodDisruptionBudget selects: ai/trainer, "
        "ai/trainer-floor; leave one budget per pod"
    )
    assert _trainer_evictions(cluster) == 1  # not retried
    # The failed handoff undid its cordon; nothing was stopped.
    assert not cordoned(cluster)
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")


async def test_without_the_budget_list_the_drain_fails_at_once_all_the_same(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: Kubelet,
) -> None:
    """A ClusterRole applied from an older README (no list of
    poddisruptionbudgets): the same failure, the budgets unnamed."""
    cluster.set_rules(
        tuple(r for r in PRODUCT_RULES if "poddisruptionbudgets" not in r.resources)
    )
    event = await _two_budgets_handoff(hass, sim_sshd, cluster)
    assert event.data["code"] == "MultipleBudgetsError"
    assert event.data["error"].endswith(
        "selects (GPU Handoff may not list PodDisruptionBudgets to name them); "
        "leave one budget per pod"
    )
    assert _trainer_evictions(cluster) == 1
