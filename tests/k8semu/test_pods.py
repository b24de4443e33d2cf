"""Pods: field and label selectors, paging with continue, the drain's inputs."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU, GPU_NODE, MIRROR_ANNOTATION, K8sEmulator
from .client import status_of, unset

T = 10

ON_GPU_NODE = [
    ("ai", "llm-inference-5d9c8b7f6-q4w8z"),
    ("ai", "trainer-7c6d5e4f3-m2n9v"),
    ("kube-system", "gpu-exporter-gpu-node"),
    ("kube-system", "nvidia-device-plugin-daemonset-x7k2p"),
]


def names(pod_list: client.V1PodList) -> list[tuple[str, str]]:
    """(namespace, name) of each pod, in the order served."""
    return [(p.metadata.namespace, p.metadata.name) for p in pod_list.items]


async def test_pods_on_a_node(api: client.ApiClient) -> None:
    """spec.nodeName across namespaces; the drain's filter inputs are there."""
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={GPU_NODE}", _request_timeout=T
    )
    assert names(pods) == ON_GPU_NODE
    by_name = {p.metadata.name: p for p in pods.items}
    plugin = by_name["nvidia-device-plugin-daemonset-x7k2p"]
    assert plugin.metadata.owner_references[0].kind == "DaemonSet"
    assert plugin.metadata.owner_references[0].controller is True
    mirror = by_name["gpu-exporter-gpu-node"]
    assert MIRROR_ANNOTATION in mirror.metadata.annotations
    llm = by_name["llm-inference-5d9c8b7f6-q4w8z"]
    assert llm.metadata.owner_references[0].kind == "ReplicaSet"
    assert llm.spec.containers[0].resources.requests[GPU] == "1"
    assert llm.spec.containers[0].resources.limits[GPU] == "1"
    assert llm.status.phase == "Running"
    assert next(c.status for c in llm.status.conditions if c.type == "Ready") == "True"


@pytest.mark.parametrize(
    ("field_selector", "expected"),
    [
        ("metadata.name=trainer-7c6d5e4f3-m2n9v", [("ai", "trainer-7c6d5e4f3-m2n9v")]),
        ("status.phase=Succeeded", [("ai", "batch-done")]),
        (
            "status.phase!=Running,spec.nodeName=gpu-node",
            [("ai", "batch-done"), ("ai", "scratchy")],
        ),
        (
            "status.phase!=Succeeded,status.phase!=Running",
            [("ai", "scratchy"), ("ai", "unscheduled")],
        ),
        ("spec.nodeName=gpu-node,metadata.namespace=kube-system", ON_GPU_NODE[2:]),
        ("spec.nodeName==", [("ai", "unscheduled")]),
    ],
)
async def test_field_selectors(
    emulator: K8sEmulator,
    api: client.ApiClient,
    field_selector: str,
    expected: list[tuple[str, str]],
) -> None:
    """=, ==, != joined by commas."""
    emulator.add_pod("batch-done", "ai", node=GPU_NODE, phase="Succeeded")
    emulator.add_pod("scratchy", "ai", node=GPU_NODE, phase="Pending", empty_dir=True)
    emulator.add_pod("unscheduled", "ai", phase="Pending")
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(
        field_selector=field_selector, _request_timeout=T
    )
    assert names(pods) == expected


@pytest.mark.parametrize(
    ("label_selector", "expected"),
    [
        ("app=trainer", ["trainer-7c6d5e4f3-m2n9v"]),
        ("app!=trainer", ["llm-inference-5d9c8b7f6-q4w8z", "plain"]),
        (
            "app in (trainer,llm-inference)",
            ["llm-inference-5d9c8b7f6-q4w8z", "trainer-7c6d5e4f3-m2n9v"],
        ),
        ("app notin (trainer)", ["llm-inference-5d9c8b7f6-q4w8z", "plain"]),
        (
            "pod-template-hash",
            ["llm-inference-5d9c8b7f6-q4w8z", "trainer-7c6d5e4f3-m2n9v"],
        ),
        ("!pod-template-hash", ["plain"]),
    ],
)
async def test_label_selectors(
    emulator: K8sEmulator,
    api: client.ApiClient,
    label_selector: str,
    expected: list[str],
) -> None:
    """=, !=, in, notin, exists, does-not-exist on a namespaced list."""
    emulator.add_pod("plain", "ai", node=GPU_NODE)
    pods = await client.CoreV1Api(api).list_namespaced_pod(
        "ai", label_selector=label_selector, _request_timeout=T
    )
    assert [p.metadata.name for p in pods.items] == expected


async def test_paging_is_a_consistent_snapshot(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """limit + continue walk the list as of the first page; changes after it wait for the next list."""
    for i in range(5):
        emulator.add_pod(f"worker-{i}", "batch", node=GPU_NODE)
    core = client.CoreV1Api(api)
    first = await core.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={GPU_NODE}", limit=3, _request_timeout=T
    )
    assert len(first.items) == 3
    assert first.metadata._continue
    assert unset(first.metadata.remaining_item_count)  # not set with selectors
    emulator.add_pod("worker-late", "batch", node=GPU_NODE)
    emulator.remove_pod("trainer-7c6d5e4f3-m2n9v", "ai")
    seen = names(first)
    token = first.metadata._continue
    pages = 1
    while token:
        page = await core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={GPU_NODE}",
            limit=3,
            _continue=token,
            _request_timeout=T,
        )
        assert page.metadata.resource_version == first.metadata.resource_version
        seen += names(page)
        token = page.metadata._continue
        pages += 1
    assert pages == 3
    assert seen == sorted(seen)
    assert ("ai", "trainer-7c6d5e4f3-m2n9v") in seen
    assert ("batch", "worker-late") not in seen
    assert len(seen) == 9
    fresh = await core.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={GPU_NODE}", _request_timeout=T
    )
    assert ("batch", "worker-late") in names(fresh)
    assert ("ai", "trainer-7c6d5e4f3-m2n9v") not in names(fresh)


async def test_remaining_item_count_without_selectors(api: client.ApiClient) -> None:
    """remainingItemCount is set when nothing filters."""
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(
        limit=2, _request_timeout=T
    )
    assert pods.metadata.remaining_item_count == 3


async def test_expired_continue_is_410(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """A continue token older than the compacted history: 410 Expired."""
    core = client.CoreV1Api(api)
    first = await core.list_pod_for_all_namespaces(limit=1, _request_timeout=T)
    emulator.add_pod("after", "ai", node=GPU_NODE)
    emulator.compact()
    with pytest.raises(ApiException) as err:
        await core.list_pod_for_all_namespaces(
            limit=1, _continue=first.metadata._continue, _request_timeout=T
        )
    assert err.value.status == 410
    assert status_of(err.value)["reason"] == "Expired"
    with pytest.raises(ApiException) as err:
        await core.list_pod_for_all_namespaces(
            limit=1, _continue="garbage!", _request_timeout=T
        )
    assert err.value.status == 400


async def test_read_and_missing_pod(api: client.ApiClient) -> None:
    """Read by namespace and name; 404 once gone."""
    core = client.CoreV1Api(api)
    pod = await core.read_namespaced_pod(
        "trainer-7c6d5e4f3-m2n9v", "ai", _request_timeout=T
    )
    assert pod.spec.node_name == GPU_NODE
    with pytest.raises(ApiException) as err:
        await core.read_namespaced_pod(
            "trainer-7c6d5e4f3-m2n9v", "default", _request_timeout=T
        )
    assert err.value.status == 404
    assert status_of(err.value)["message"] == 'pods "trainer-7c6d5e4f3-m2n9v" not found'


async def test_delete_pod_with_rights(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """DELETE returns the pod; a UID precondition mismatch is 409."""
    core = client.CoreV1Api(admin_api)
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod(
            "trainer-7c6d5e4f3-m2n9v",
            "ai",
            body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid="other")
            ),
            _request_timeout=T,
        )
    assert err.value.status == 409
    deleted = await core.delete_namespaced_pod(
        "trainer-7c6d5e4f3-m2n9v", "ai", _request_timeout=T
    )
    assert deleted.metadata.name == "trainer-7c6d5e4f3-m2n9v"
    assert emulator.get("Pod", "trainer-7c6d5e4f3-m2n9v", "ai") is None


async def test_paging_visits_every_pod_once(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """limit=1 pages through namespaces that prefix each other (etcd key order)."""
    emulator.add_pod("a", "ai-x", node=GPU_NODE)
    emulator.add_pod("zz", "ai", node=GPU_NODE)
    core = client.CoreV1Api(api)
    everything = names(await core.list_pod_for_all_namespaces(_request_timeout=T))
    paged: list[tuple[str, str]] = []
    token = ""  # an empty continue starts from the beginning
    async with asyncio.timeout(20):
        while True:
            page = await core.list_pod_for_all_namespaces(
                limit=1, _continue=token, _request_timeout=T
            )
            paged += names(page)
            token = page.metadata._continue
            if not token:
                break
    assert paged == everything
    assert len(set(paged)) == len(everything) == 7
    assert paged.index(("ai-x", "a")) < paged.index(("ai", "zz"))
