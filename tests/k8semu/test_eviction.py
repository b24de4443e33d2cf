"""The Eviction API: 201, 404, 429 from PodDisruptionBudgets, 500, termination."""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator
from .client import status_of

T = 10
TRAINER = "trainer-7c6d5e4f3-m2n9v"
LLM = "llm-inference-5d9c8b7f6-q4w8z"


def eviction(name: str, namespace: str) -> client.V1Eviction:
    """A policy/v1 Eviction body as kubectl drain sends it."""
    return client.V1Eviction(
        api_version="policy/v1",
        kind="Eviction",
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        delete_options=client.V1DeleteOptions(),
    )


async def evict(api: client.ApiClient, name: str, namespace: str) -> object:
    """POST the eviction subresource."""
    return await client.CoreV1Api(api).create_namespaced_pod_eviction(
        name, namespace, eviction(name, namespace), _request_timeout=T
    )


async def evict_status(
    api: client.ApiClient, name: str, namespace: str
) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the Status body of an eviction."""
    try:
        await evict(api, name, namespace)
    except ApiException as err:
        return err.status, status_of(err)
    return 201, {}


async def test_evict_unguarded_pod(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """201, then the pod is gone (grace delay 0): reading it is 404."""
    await evict(api, LLM, "ai")
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).read_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert err.value.status == 404
    [request] = emulator.requests_for(verb="create", resource="pods/eviction")
    assert (request.status, request.name, request.namespace) == (201, LLM, "ai")
    assert request.path == f"/api/v1/namespaces/ai/pods/{LLM}/eviction"
    assert request.body["kind"] == "Eviction"


async def test_evict_missing_pod_is_404(api: client.ApiClient) -> None:
    """A pod already gone: 404 NotFound (a drain treats it as done)."""
    status, body = await evict_status(api, "gone", "ai")
    assert status == 404
    assert body["message"] == 'pods "gone" not found'


async def test_pdb_refuses_with_429(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """minAvailable == replicas: 429 TooManyRequests with a DisruptionBudget cause."""
    status, body = await evict_status(api, TRAINER, "ai")
    assert status == 429
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Cannot evict pod as it would violate the pod's disruption budget.",
        "reason": "TooManyRequests",
        "details": {
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": "The disruption budget trainer needs 1 healthy pods and has 1 currently",
                }
            ]
        },
        "code": 429,
    }
    pod = emulator.get("Pod", TRAINER, "ai")
    assert pod is not None
    assert "deletionTimestamp" not in pod["metadata"]


async def test_two_pdbs_is_500(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """More than one PDB matching the pod: 500 with upstream's message, a
    Status with no reason (pkg/registry/core/pod/storage/eviction.go: "if
    len(pdbs) > 1" returns a metav1.Status, Code 500, whatever the budgets
    allow); kubectl drain retries only 429, so it fails at once."""
    emulator.add_pdb(
        "trainer-too", "ai", match_labels={"app": "trainer"}, max_unavailable=1
    )
    status, body = await evict_status(api, TRAINER, "ai")
    assert status == 500
    assert body["message"] == (
        "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
    )


async def test_pdb_status_and_max_unavailable(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """maxUnavailable 1 over a 3-replica ReplicaSet: one eviction, then 429."""
    rs = emulator.add_replicaset(
        "web-6f5d", "web", labels={"app": "web"}, image="nginx:1.29", replicas=3
    )
    for i in range(3):
        emulator.add_pod(
            f"web-6f5d-{i}",
            "web",
            node=GPU_NODE,
            labels={"app": "web"},
            owner=emulator.owner_ref(rs),
        )
    emulator.add_pdb("web", "web", match_labels={"app": "web"}, max_unavailable=1)
    # The product's rules have no PDB access; read it through the control API.
    pdb = emulator.get("PodDisruptionBudget", "web", "web")
    assert pdb is not None
    assert pdb["status"]["expectedPods"] == 3
    assert pdb["status"]["desiredHealthy"] == 2
    assert pdb["status"]["currentHealthy"] == 3
    assert pdb["status"]["disruptionsAllowed"] == 1
    assert (await evict_status(api, "web-6f5d-0", "web"))[0] == 201
    status, body = await evict_status(api, "web-6f5d-1", "web")
    assert status == 429
    assert (
        body["details"]["causes"][0]["message"]
        == "The disruption budget web needs 2 healthy pods and has 2 currently"
    )


async def test_pdb_percent_and_unhealthy_pods(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """minAvailable 50% of a 3-replica ReplicaSet with 2 ready pods; an unready
    pod may go while the budget is healthy (eviction.go, IfHealthyBudget)."""
    rs = emulator.add_replicaset(
        "db-7f8d", "db", labels={"app": "db"}, image="postgres:18", replicas=3
    )
    owner = emulator.owner_ref(rs)
    for i in range(2):
        emulator.add_pod(
            f"db-{i}", "db", node=GPU_NODE, labels={"app": "db"}, owner=owner
        )
    emulator.add_pod(
        "db-sick", "db", node=GPU_NODE, labels={"app": "db"}, ready=False, owner=owner
    )
    emulator.add_pdb("db", "db", match_labels={"app": "db"}, min_available="50%")
    pdb = emulator.get("PodDisruptionBudget", "db", "db")
    assert pdb is not None
    assert (
        pdb["status"]["expectedPods"],
        pdb["status"]["desiredHealthy"],
        pdb["status"]["currentHealthy"],
    ) == (3, 2, 2)
    assert pdb["status"]["disruptionsAllowed"] == 0
    assert (await evict_status(api, "db-0", "db"))[0] == 429
    assert (await evict_status(api, "db-sick", "db"))[0] == 201
    assert emulator.get("Pod", "db-sick", "db") is None


async def test_pending_and_finished_pods_ignore_pdbs(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Pending, Succeeded and Failed pods are deleted without a PDB check."""
    emulator.add_pdb("all", "jobs", selector={}, min_available=10)
    emulator.add_pod("waiting", "jobs", node=GPU_NODE, phase="Pending")
    emulator.add_pod("done", "jobs", node=GPU_NODE, phase="Succeeded")
    emulator.add_pod("running", "jobs", node=GPU_NODE)
    assert (await evict_status(api, "waiting", "jobs"))[0] == 201
    assert (await evict_status(api, "done", "jobs"))[0] == 201
    assert (await evict_status(api, "running", "jobs"))[0] == 429


async def test_refusing_pod_stays_terminating(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """A pod that refuses to terminate: 201, deletionTimestamp set, never gone until released."""
    emulator.set_pod_refuse_termination(LLM, "ai")
    await evict(api, LLM, "ai")
    core = client.CoreV1Api(api)
    pod = await core.read_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert pod.metadata.deletion_timestamp is not None
    assert pod.metadata.deletion_grace_period_seconds == 30
    assert (await evict_status(api, LLM, "ai"))[
        0
    ] == 201  # evicting a terminating pod is fine
    emulator.set_pod_refuse_termination(LLM, "ai", refuse=False)
    with pytest.raises(ApiException) as err:
        await core.read_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert err.value.status == 404


async def test_grace_delay(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """With a grace delay, the pod is Terminating first, then gone."""
    emulator.deletion_grace = 0.2
    await evict(api, LLM, "ai")
    core = client.CoreV1Api(api)
    pod = await core.read_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert pod.metadata.deletion_timestamp is not None
    reads = 0
    async with asyncio.timeout(10):  # poll like a drain does, until 404
        while True:
            try:
                await core.read_namespaced_pod(LLM, "ai", _request_timeout=T)
            except ApiException as err:
                if err.status != 404:
                    raise
                break
            reads += 1
            await asyncio.sleep(0.05)
    assert reads >= 1
    assert emulator.get("Pod", LLM, "ai") is None


async def test_name_mismatch_is_400(api: client.ApiClient) -> None:
    """The Eviction's name must be the URL's."""
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).create_namespaced_pod_eviction(
            LLM, "ai", eviction("other", "ai"), _request_timeout=T
        )
    assert err.value.status == 400
    assert (
        status_of(err.value)["message"]
        == "name in URL does not match name in Eviction object"
    )


async def test_pdbs_over_the_api(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """Create, get and list PDBs (policy/v1) with computed status; duplicates are 409."""
    policy = client.PolicyV1Api(admin_api)
    body = client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="llm"),
        spec=client.V1PodDisruptionBudgetSpec(
            min_available=1,
            selector=client.V1LabelSelector(match_labels={"app": "llm-inference"}),
        ),
    )
    created = await policy.create_namespaced_pod_disruption_budget(
        "ai", body, _request_timeout=T
    )
    assert created.metadata.uid
    assert created.status.current_healthy == 1
    assert created.status.disruptions_allowed == 0
    with pytest.raises(ApiException) as err:
        await policy.create_namespaced_pod_disruption_budget(
            "ai", body, _request_timeout=T
        )
    assert err.value.status == 409
    assert status_of(err.value)["reason"] == "AlreadyExists"
    got = await policy.read_namespaced_pod_disruption_budget(
        "llm", "ai", _request_timeout=T
    )
    assert got.spec.min_available == 1
    listed = await policy.list_pod_disruption_budget_for_all_namespaces(
        _request_timeout=T
    )
    assert sorted(p.metadata.name for p in listed.items) == ["llm", "trainer"]
    assert (await evict_status(admin_api, LLM, "ai"))[0] == 429


async def test_a_dry_run_eviction_checks_everything_and_changes_nothing(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """``dryRun=All`` (the request's, or the body's deleteOptions'): the
    budget is checked (429 when it allows nothing) but not spent, no
    DisruptionTarget condition, the pod stays (pkg/registry/core/pod/storage/
    eviction.go: propagateDryRun, checkAndDecrement returns before it writes
    the budget, addConditionAndDeletePod adds nothing and the store's delete
    is a dry run). Different values in both places: 400; a value other than
    "All": 422 (ValidateCreateOptions)."""
    core = client.CoreV1Api(api)
    emulator.add_pdb(
        "llm", "ai", match_labels={"app": "llm-inference"}, max_unavailable=1
    )
    budget = emulator.get("PodDisruptionBudget", "llm", "ai")
    assert budget is not None
    before = budget.get("status")
    pod = emulator.get("Pod", LLM, "ai")
    assert pod is not None
    await core.create_namespaced_pod_eviction(  # 201, as a real eviction
        LLM, "ai", eviction(LLM, "ai"), dry_run="All", _request_timeout=T
    )
    [request] = emulator.requests_for(verb="create", resource="pods/eviction")
    assert request.status == 201
    assert emulator.get("Pod", LLM, "ai") == pod  # not deleted, not even touched
    assert emulator.get("PodDisruptionBudget", "llm", "ai")["status"] == before  # type: ignore[index]
    body = eviction(LLM, "ai")
    body.delete_options = client.V1DeleteOptions(dry_run=["All"])
    await core.create_namespaced_pod_eviction(LLM, "ai", body, _request_timeout=T)
    assert emulator.get("Pod", LLM, "ai") == pod
    # A budget that allows nothing refuses the dry run as the real one.
    with pytest.raises(ApiException) as refused:
        await core.create_namespaced_pod_eviction(
            TRAINER, "ai", eviction(TRAINER, "ai"), dry_run="All", _request_timeout=T
        )
    assert refused.value.status == 429
    # A pod that can ignore budgets (Pending) is not deleted either.
    emulator.add_pod("waiting", namespace="ai", phase="Pending")
    waiting = emulator.get("Pod", "waiting", "ai")
    await core.create_namespaced_pod_eviction(
        "waiting", "ai", eviction("waiting", "ai"), dry_run="All", _request_timeout=T
    )
    assert emulator.get("Pod", "waiting", "ai") == waiting
    body.delete_options = client.V1DeleteOptions(dry_run=["Nope"])
    with pytest.raises(ApiException) as mismatched:
        await core.create_namespaced_pod_eviction(
            LLM, "ai", body, dry_run="All", _request_timeout=T
        )
    assert mismatched.value.status == 400
    assert status_of(mismatched.value)["message"] == (
        "Non-matching dry-run options in request and content: [All] and [Nope]"
    )
    with pytest.raises(ApiException) as unsupported:
        await core.create_namespaced_pod_eviction(
            LLM, "ai", eviction(LLM, "ai"), dry_run="Some", _request_timeout=T
        )
    assert unsupported.value.status == 422
    # Without it, the same eviction does what it says.
    await evict(api, LLM, "ai")
    assert emulator.get("Pod", LLM, "ai") is None
