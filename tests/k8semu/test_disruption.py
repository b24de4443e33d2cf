"""PodDisruptionBudgets as the disruption controller keeps them and as the
eviction subresource spends them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator
from .client import status_of, unset
from .test_eviction import TRAINER, evict_status
from .test_throttle import header

T = 10


async def eventually(condition: Callable[[], bool], bound: float = 5) -> None:
    """Wait (bounded) until the emulator's timers made the condition true."""
    async with asyncio.timeout(bound):
        while not condition():  # noqa: ASYNC110 - polls the emulator's state
            await asyncio.sleep(0.05)


async def evict_with_uid(
    api: client.ApiClient, name: str, namespace: str, uid: str
) -> tuple[int, dict[str, Any]]:
    """An eviction carrying a UID precondition (as a careful drain sends it)."""
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        delete_options=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid)
        ),
    )
    try:
        await client.CoreV1Api(api).create_namespaced_pod_eviction(
            name, namespace, body, _request_timeout=T
        )
    except ApiException as err:
        return err.status, status_of(err)
    return 201, {}


def web_workload(
    emulator: K8sEmulator, replicas: int = 3, **budget: Any
) -> dict[str, Any]:
    """A ReplicaSet `web` with its ready pods and a budget `web` (the given
    spec) over them; returns the ReplicaSet."""
    rs = emulator.add_replicaset(
        "web-6f5d", "web", labels={"app": "web"}, image="nginx:1.29", replicas=replicas
    )
    for i in range(replicas):
        emulator.add_pod(
            f"web-6f5d-{i}",
            "web",
            node=GPU_NODE,
            labels={"app": "web"},
            owner=emulator.owner_ref(rs),
        )
    emulator.add_pdb("web", "web", match_labels={"app": "web"}, **budget)
    return rs


def budget(emulator: K8sEmulator, name: str, namespace: str) -> dict[str, Any]:
    """A budget's status as stored."""
    pdb = emulator.get("PodDisruptionBudget", name, namespace)
    assert pdb is not None
    status: dict[str, Any] = pdb["status"]
    return status


def recreate(emulator: K8sEmulator, name: str, namespace: str) -> str:
    """Replace a pod by a new one of the same name (as a StatefulSet or a
    quick ReplicaSet would); returns the old UID."""
    old = emulator.get("Pod", name, namespace)
    assert old is not None
    emulator.remove_pod(name, namespace)
    emulator.add_pod(
        name,
        namespace,
        node=GPU_NODE,
        labels=old["metadata"]["labels"],
        owner=old["metadata"]["ownerReferences"][0],
    )
    return str(old["metadata"]["uid"])


async def test_stale_uid_under_a_refusing_budget_is_429(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """eviction.go Create: the budget is checked (checkAndDecrement) before
    the delete that enforces the preconditions, so a refusing budget
    answers first: 429, not 409."""
    old_uid = recreate(emulator, TRAINER, "ai")
    status, body = await evict_with_uid(api, TRAINER, "ai", old_uid)
    assert status == 429
    assert body["details"]["causes"][0]["reason"] == "DisruptionBudget"


async def test_stale_uid_under_an_allowing_budget_spends_it_then_409(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """eviction.go: checkAndDecrement spends the budget (disruptionsAllowed
    - 1, the pod's name in status.disruptedPods), then
    addConditionAndDeletePod finds the UID changed: 409 naming the Kind. The
    recreated pod is left alone, but counts as disrupted, so the next
    eviction is refused; once the entry expires (disruption.go
    buildDisruptedPodMap, DeletionTimeout) the budget is whole again."""
    # disruptedPods holds metav1.Time (whole seconds): keep the timeout above 1 s.
    emulator.pdb_deletion_timeout = 1.5
    web_workload(emulator, max_unavailable=1)
    assert budget(emulator, "web", "web")["disruptionsAllowed"] == 1
    old_uid = recreate(emulator, "web-6f5d-0", "web")
    new = emulator.get("Pod", "web-6f5d-0", "web")
    assert new is not None
    status, body = await evict_with_uid(api, "web-6f5d-0", "web", old_uid)
    assert status == 409
    assert body["reason"] == "Conflict"
    assert body["message"] == (
        f'Operation cannot be fulfilled on Pod "web-6f5d-0": the UID in the precondition '
        f"({old_uid}) does not match the UID in record ({new['metadata']['uid']}). "
        "The object might have been deleted and then recreated"
    )
    spent = budget(emulator, "web", "web")
    assert spent["disruptionsAllowed"] == 0
    assert list(spent["disruptedPods"]) == ["web-6f5d-0"]
    assert spent["currentHealthy"] == 2
    after = emulator.get("Pod", "web-6f5d-0", "web")
    assert after is not None
    assert "deletionTimestamp" not in after["metadata"]
    status, body = await evict_status(api, "web-6f5d-1", "web")
    assert status == 429
    assert body["details"]["causes"][0]["message"] == (
        "The disruption budget web needs 2 healthy pods and has 2 currently"
    )
    await eventually(lambda: budget(emulator, "web", "web")["disruptionsAllowed"] == 1)
    assert "disruptedPods" not in budget(emulator, "web", "web")


async def test_back_to_back_evictions_under_max_unavailable_one(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Two evictions in a row under maxUnavailable 1: the first spends the
    budget, the second is refused, with an instant controller and with a
    lagging one (the eviction's own status update, eviction.go
    checkAndDecrement, is what the second reads)."""
    emulator.deletion_grace = 5  # evicted pods stay Terminating a while
    rs = web_workload(emulator, max_unavailable=1)
    assert (await evict_status(api, "web-6f5d-0", "web"))[0] == 201
    assert (await evict_status(api, "web-6f5d-1", "web"))[0] == 429
    emulator.pdb_sync_delay = 30
    emulator.add_pod(
        "web-6f5d-3",
        "web",
        node=GPU_NODE,
        labels={"app": "web"},
        owner=emulator.owner_ref(rs),
    )
    emulator.sync_pdbs()  # the controller sees the replacement: allowed 1
    assert budget(emulator, "web", "web")["disruptionsAllowed"] == 1
    assert (await evict_status(api, "web-6f5d-1", "web"))[0] == 201
    stored = budget(emulator, "web", "web")
    assert stored["disruptionsAllowed"] == 0
    assert "web-6f5d-1" in stored["disruptedPods"]
    assert (await evict_status(api, "web-6f5d-2", "web"))[0] == 429


async def test_unmanaged_pods(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """disruption.go getExpectedScale: pods without a controllerRef are left
    out of expectedPods (the controller only warns, UnmanagedPods). With
    maxUnavailable or a percentage over bare pods nothing is expected, so
    nothing may be disrupted (updatePdbStatus: expectedCount <= 0); an
    integer minAvailable counts every selected pod and works."""
    for ns, spec in (
        ("bare-max", {"max_unavailable": 1}),
        ("bare-pct", {"min_available": "50%"}),
        ("bare-int", {"min_available": 1}),
    ):
        for i in range(2):
            emulator.add_pod(f"job-{i}", ns, node=GPU_NODE, labels={"app": "job"})
        emulator.add_pdb("job", ns, match_labels={"app": "job"}, **spec)
    for ns in ("bare-max", "bare-pct"):
        status = budget(emulator, "job", ns)
        assert (
            status["expectedPods"],
            status["desiredHealthy"],
            status["currentHealthy"],
            status["disruptionsAllowed"],
        ) == (0, 0, 2, 0)
        code, body = await evict_status(api, "job-0", ns)
        assert code == 429
        assert body["details"]["causes"][0]["message"] == (
            "The disruption budget job needs 0 healthy pods and has 2 currently"
        )
    status = budget(emulator, "job", "bare-int")
    assert (status["expectedPods"], status["disruptionsAllowed"]) == (2, 1)
    assert (await evict_status(api, "job-0", "bare-int"))[0] == 201


async def test_unmanaged_pods_beside_managed_ones(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """disruption.go getExpectedScale and countHealthyPods: next to a
    ReplicaSet's pods, a bare pod adds nothing to expectedPods (the
    ReplicaSet's scale) but still counts as healthy."""
    web_workload(emulator, replicas=2, max_unavailable=1)
    emulator.add_pod("debug", "web", node=GPU_NODE, labels={"app": "web"})
    status = budget(emulator, "web", "web")
    assert (
        status["expectedPods"],
        status["desiredHealthy"],
        status["currentHealthy"],
        status["disruptionsAllowed"],
    ) == (2, 1, 3, 2)


async def test_controller_without_scale_fails_safe(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """disruption.go: a DaemonSet has no /scale (getScaleController), so the
    sync fails and failSafe sets disruptionsAllowed 0 with a SyncFailed
    condition, leaving observedGeneration unset: evictions are told the
    budget "is still being processed" (checkAndDecrement), Retry-After 10."""
    emulator.add_pdb(
        "plugin",
        "kube-system",
        match_labels={"name": "nvidia-device-plugin-ds"},
        max_unavailable=1,
    )
    status = budget(emulator, "plugin", "kube-system")
    assert status["disruptionsAllowed"] == 0
    assert "observedGeneration" not in status
    [condition] = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "DisruptionAllowed",
        "False",
        "SyncFailed",
    )
    assert condition["message"] == (
        "daemonsets.apps does not implement the scale subresource"
    )
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).create_namespaced_pod_eviction(
            "nvidia-device-plugin-daemonset-x7k2p",
            "kube-system",
            client.V1Eviction(
                metadata=client.V1ObjectMeta(
                    name="nvidia-device-plugin-daemonset-x7k2p", namespace="kube-system"
                )
            ),
            _request_timeout=T,
        )
    assert err.value.status == 429
    assert status_of(err.value)["details"] == {
        "causes": [
            {
                "reason": "DisruptionBudget",
                "message": "The disruption budget plugin is still being processed by the server.",
            }
        ],
        "retryAfterSeconds": 10,
    }
    assert header(err.value, "Retry-After") == "10"


async def test_lost_controller_fails_safe_after_a_good_sync(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """The pods' ReplicaSet disappears: "found no controllers for pod", the
    budget keeps its last counts and observedGeneration but allows nothing."""
    web_workload(emulator, max_unavailable=1)
    emulator.delete("ReplicaSet", "web-6f5d", "web")
    status = budget(emulator, "web", "web")
    assert status["observedGeneration"] == 1
    assert status["disruptionsAllowed"] == 0
    assert status["conditions"][0]["message"] == (
        'found no controllers for pod "web-6f5d-0"'
    )
    code, body = await evict_status(api, "web-6f5d-0", "web")
    assert code == 429
    assert body["details"]["causes"][0]["message"] == (
        "The disruption budget web needs 2 healthy pods and has 3 currently"
    )


async def test_edited_budget_is_still_being_processed(
    emulator: K8sEmulator, api: client.ApiClient, admin_api: client.ApiClient
) -> None:
    """checkAndDecrement: while status.observedGeneration < generation the
    answer is 429 "still being processed" with retryAfterSeconds 10 and the
    Retry-After header; after ``pdb_sync_delay`` the controller catches up
    (observedGeneration = generation) and the new spec applies."""
    emulator.pdb_sync_delay = 0.3
    await client.PolicyV1Api(admin_api).patch_namespaced_pod_disruption_budget(
        "trainer", "ai", {"spec": {"minAvailable": 0}}, _request_timeout=T
    )
    pdb = emulator.get("PodDisruptionBudget", "trainer", "ai")
    assert pdb is not None
    assert (pdb["metadata"]["generation"], pdb["status"]["observedGeneration"]) == (
        2,
        1,
    )
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).create_namespaced_pod_eviction(
            TRAINER,
            "ai",
            client.V1Eviction(
                metadata=client.V1ObjectMeta(name=TRAINER, namespace="ai")
            ),
            _request_timeout=T,
        )
    assert err.value.status == 429
    assert header(err.value, "Retry-After") == "10"
    body = status_of(err.value)
    assert body["details"]["retryAfterSeconds"] == 10
    assert body["details"]["causes"][0]["message"] == (
        "The disruption budget trainer is still being processed by the server."
    )
    await eventually(
        lambda: budget(emulator, "trainer", "ai")["observedGeneration"] == 2
    )
    assert budget(emulator, "trainer", "ai")["disruptionsAllowed"] == 1
    assert (await evict_status(api, TRAINER, "ai"))[0] == 201


async def test_a_lagging_controller_shows_new_budgets_unsynced(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """pkg/registry/policy/poddisruptionbudget/strategy.go PrepareForCreate
    empties the status; until the lagging controller's first sync,
    eviction.go checkAndDecrement answers "still being processed"."""
    emulator.pdb_sync_delay = 0.2
    created = await client.PolicyV1Api(
        admin_api
    ).create_namespaced_pod_disruption_budget(
        "ai",
        client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="llm"),
            spec=client.V1PodDisruptionBudgetSpec(
                min_available=0,
                selector=client.V1LabelSelector(match_labels={"app": "llm-inference"}),
            ),
        ),
        _request_timeout=T,
    )
    assert created.status.disruptions_allowed == 0
    assert unset(created.status.observed_generation)
    code, body = await evict_status(admin_api, "llm-inference-5d9c8b7f6-q4w8z", "ai")
    assert code == 429
    assert "still being processed" in body["details"]["causes"][0]["message"]
    await eventually(
        lambda: budget(emulator, "llm", "ai").get("observedGeneration") == 1
    )
    code, _ = await evict_status(admin_api, "llm-inference-5d9c8b7f6-q4w8z", "ai")
    assert code == 201
