"""Namespaces: a Terminating namespace refuses new content (evictions too)
until the namespace controller has emptied and removed it."""

from __future__ import annotations

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator
from .client import raw_request, status_of
from .test_eviction import LLM, TRAINER, evict_status

T = 10


def terminating_body(resource: str, name: str, namespace: str) -> dict[str, object]:
    """The 403 of the NamespaceLifecycle admission plugin, as served."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": (
            f'{resource} "{name}" is forbidden: unable to create new content in '
            f"namespace {namespace} because it is being terminated"
        ),
        "reason": "Forbidden",
        "details": {
            "name": name,
            **({"group": "policy"} if "." in resource else {}),
            "kind": resource.split(".", maxsplit=1)[0],
            "causes": [
                {
                    "reason": "NamespaceTerminating",
                    "message": f"namespace {namespace} is being terminated",
                    "field": "metadata.namespace",
                }
            ],
        },
        "code": 403,
    }


async def test_terminating_namespace_refuses_evictions_and_creates(
    emulator: K8sEmulator, api: client.ApiClient, admin_api: client.ApiClient
) -> None:
    """plugin/pkg/admission/namespace/lifecycle (apiserver admission.go
    Admit): creates in a Terminating namespace, the pods/eviction
    subresource included, are 403 Forbidden with a NamespaceTerminating
    cause; the namespace controller has removed the other content and
    deleted the pods gracefully; the namespace goes once its pods are gone."""
    for name in (LLM, TRAINER):
        emulator.set_pod_refuse_termination(name, "ai")
    marked = emulator.terminate_namespace("ai")
    assert marked["status"]["phase"] == "Terminating"
    assert marked["metadata"]["deletionTimestamp"]
    assert emulator.namespace_phase("ai") == "Terminating"
    # The namespace controller: budgets and ReplicaSets gone, pods deleting.
    assert emulator.list_objects("PodDisruptionBudget", "ai") == []
    assert emulator.list_objects("ReplicaSet", "ai") == []
    pods = emulator.list_objects("Pod", "ai")
    assert [p["metadata"]["deletionGracePeriodSeconds"] for p in pods] == [30, 30]

    status, body = await evict_status(api, LLM, "ai")
    assert status == 403
    assert body == terminating_body("pods", LLM, "ai")

    with pytest.raises(ApiException) as err:
        await client.PolicyV1Api(admin_api).create_namespaced_pod_disruption_budget(
            "ai",
            client.V1PodDisruptionBudget(
                metadata=client.V1ObjectMeta(name="late"),
                spec=client.V1PodDisruptionBudgetSpec(min_available=1),
            ),
            _request_timeout=T,
        )
    assert err.value.status == 403
    assert status_of(err.value) == terminating_body(
        "poddisruptionbudgets.policy", "late", "ai"
    )

    namespace = emulator.get("Namespace", "ai", "")
    assert namespace is not None
    remaining = next(
        c
        for c in namespace["status"]["conditions"]
        if c["type"] == "NamespaceContentRemaining"
    )
    assert remaining["message"] == (
        "Some resources are remaining: pods. has 2 resource instances"
    )
    emulator.set_pod_refuse_termination(LLM, "ai", refuse=False)
    assert emulator.namespace_phase("ai") == "Terminating"  # one pod left
    emulator.set_pod_refuse_termination(TRAINER, "ai", refuse=False)
    assert emulator.namespace_phase("ai") is None
    # Gone: creates there now fail the namespace lookup (404).
    status, body = await evict_status(api, LLM, "ai")
    assert status == 404
    assert body["message"] == 'namespaces "ai" not found'
    assert body["details"] == {"name": "ai", "kind": "namespaces"}


async def test_namespace_on_a_down_node_stays_terminating(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """pkg/controller/namespace/deletion/namespaced_resources_deleter.go:
    pods on a NotReady node keep their deletionTimestamp, so their namespace
    stays Terminating (NamespaceContentRemaining) until the node is back and
    its kubelet finishes them."""
    emulator.set_node_up(GPU_NODE, False)
    emulator.terminate_namespace("ai")
    assert emulator.namespace_phase("ai") == "Terminating"
    assert len(emulator.list_objects("Pod", "ai")) == 2
    assert (await evict_status(api, TRAINER, "ai"))[0] == 403
    emulator.set_node_up(GPU_NODE, True)
    assert emulator.list_objects("Pod", "ai") == []
    assert emulator.namespace_phase("ai") is None


async def test_delete_namespace_over_the_api(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """pkg/registry/core/namespace/storage/storage.go Delete: the first DELETE
    answers 200 with the namespace Terminating; a second one is 409 while it
    is still there; the NamespaceLifecycle plugin refuses to delete the
    immortal namespaces (403)."""
    emulator.set_pod_refuse_termination(LLM, "ai")
    core = client.CoreV1Api(admin_api)
    # The generated client reads this answer as a V1Status: read it raw.
    answered = await raw_request(admin_api, "DELETE", "/api/v1/namespaces/ai")
    assert isinstance(answered, dict)
    assert answered["kind"] == "Namespace"
    assert answered["status"]["phase"] == "Terminating"
    assert answered["metadata"]["deletionTimestamp"]
    with pytest.raises(ApiException) as err:
        await core.delete_namespace("ai", _request_timeout=T)
    assert err.value.status == 409
    assert status_of(err.value)["message"] == (
        'Operation cannot be fulfilled on namespaces "ai": The system is ensuring all '
        "content is removed from this namespace.  Upon completion, this namespace will "
        "automatically be purged by the system."
    )
    read = await core.read_namespace("ai", _request_timeout=T)
    assert read.status.phase == "Terminating"
    for immortal in ("default", "kube-system", "kube-public"):
        with pytest.raises(ApiException) as err:
            await core.delete_namespace(immortal, _request_timeout=T)
        assert err.value.status == 403
        assert status_of(err.value)["message"] == (
            f'namespaces "{immortal}" is forbidden: this namespace may not be deleted'
        )
    # An empty namespace is removed as soon as the controller looks.
    await core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name="scratch")),
        _request_timeout=T,
    )
    created = emulator.get("Namespace", "scratch", "")
    assert created is not None
    assert created["status"] == {"phase": "Active"}
    assert created["spec"] == {"finalizers": ["kubernetes"]}
    gone = await raw_request(admin_api, "DELETE", "/api/v1/namespaces/scratch")
    assert isinstance(gone, dict)
    assert gone["status"]["phase"] == "Terminating"
    assert emulator.namespace_phase("scratch") is None


async def test_creates_need_an_existing_namespace(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """staging/src/k8s.io/apiserver/pkg/admission/plugin/namespace/lifecycle
    admission.go: a create in a namespace that does not exist is 404 for the
    namespace. (The control API creates namespaces as needed.)"""
    with pytest.raises(ApiException) as err:
        await client.PolicyV1Api(admin_api).create_namespaced_pod_disruption_budget(
            "nowhere",
            client.V1PodDisruptionBudget(
                metadata=client.V1ObjectMeta(name="x"),
                spec=client.V1PodDisruptionBudgetSpec(min_available=1),
            ),
            _request_timeout=T,
        )
    assert err.value.status == 404
    assert status_of(err.value)["message"] == 'namespaces "nowhere" not found'
    emulator.add_pod("p", "brand-new", node=GPU_NODE)
    assert emulator.namespace_phase("brand-new") == "Active"
