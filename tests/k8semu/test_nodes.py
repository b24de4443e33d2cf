"""Nodes: status, GPUs, selectors, the three patch flavours, conflicts."""

from __future__ import annotations

import asyncio

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import CONTROL_PLANE_NODE, GPU, GPU_NODE, K8sEmulator
from .client import raw_request, status_of, unset

T = 10


def ready_status(node: client.V1Node) -> str:
    """The status of the node's Ready condition."""
    return next(c.status for c in node.status.conditions if c.type == "Ready")


async def test_node_status_and_gpus(api: client.ApiClient) -> None:
    """A seeded GPU node: Ready, nvidia.com/gpu in capacity and allocatable."""
    node = await client.CoreV1Api(api).read_node(GPU_NODE, _request_timeout=T)
    assert ready_status(node) == "True"
    assert node.status.capacity[GPU] == "3"
    assert node.status.allocatable[GPU] == "3"
    assert node.metadata.labels["nvidia.com/gpu.count"] == "3"
    assert unset(node.spec.unschedulable)
    assert int(node.metadata.resource_version) > 0


async def _taints(core: client.CoreV1Api) -> list[str]:
    """The node's taint keys once the node lifecycle controller's write
    after a cordon or uncordon has landed (the loop's next turns)."""
    for _ in range(100):
        await asyncio.sleep(0)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    return [t.key for t in node.spec.taints or []]


async def test_cordon_and_uncordon_with_strategic_merge_patch(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """kubectl's cordon body; the unschedulable taint follows in a write of
    the node lifecycle controller's own (doNoScheduleTaintingPass,
    SwapNodeControllerTaint), not in the cordon's; uncordon, the same."""
    core = client.CoreV1Api(api)
    before = await core.read_node(GPU_NODE, _request_timeout=T)
    cordoned = await core.patch_node(
        GPU_NODE, {"spec": {"unschedulable": True}}, _request_timeout=T
    )
    assert cordoned.spec.unschedulable is True
    assert unset(cordoned.spec.taints)
    assert await _taints(core) == ["node.kubernetes.io/unschedulable"]
    after = await core.read_node(GPU_NODE, _request_timeout=T)
    assert int(after.metadata.resource_version) > int(
        cordoned.metadata.resource_version
    )
    assert int(cordoned.metadata.resource_version) > int(
        before.metadata.resource_version
    )
    assert emulator.requests_for(verb="patch")[-1].body == {
        "spec": {"unschedulable": True}
    }
    listed = await core.list_node(
        field_selector="spec.unschedulable=true", _request_timeout=T
    )
    assert [n.metadata.name for n in listed.items] == [GPU_NODE]

    uncordoned = await core.patch_node(
        GPU_NODE, {"spec": {"unschedulable": None}}, _request_timeout=T
    )
    assert unset(uncordoned.spec.unschedulable)
    assert [t.key for t in uncordoned.spec.taints] == [
        "node.kubernetes.io/unschedulable"
    ]
    assert await _taints(core) == []
    assert ready_status(uncordoned) == "True"


async def test_patch_flavours_on_labels_and_annotations(api: client.ApiClient) -> None:
    """Strategic merge, JSON merge and JSON patch all reach metadata."""
    core = client.CoreV1Api(api)
    node = await core.patch_node(
        GPU_NODE,
        {"metadata": {"labels": {"handoff": "lent"}, "annotations": {"a": "1"}}},
        _request_timeout=T,
    )
    assert node.metadata.labels["handoff"] == "lent"
    node = await core.patch_node(  # type: ignore[call-arg]  # not in the stubs
        GPU_NODE,
        {"metadata": {"labels": {"handoff": None}, "annotations": {"b": "2"}}},
        _content_type="application/merge-patch+json",
        _request_timeout=T,
    )
    assert "handoff" not in node.metadata.labels
    assert node.metadata.annotations["a"] == "1"
    assert node.metadata.annotations["b"] == "2"
    node = await core.patch_node(
        GPU_NODE,
        [
            {"op": "test", "path": "/metadata/annotations/a", "value": "1"},
            {
                "op": "add",
                "path": "/metadata/labels/gpu-handoff~1owner",
                "value": "gaming-vm",
            },
            {"op": "remove", "path": "/metadata/annotations/b"},
            {"op": "add", "path": "/spec/unschedulable", "value": True},
        ],
        _request_timeout=T,
    )
    assert node.metadata.labels["gpu-handoff/owner"] == "gaming-vm"
    assert "b" not in node.metadata.annotations
    assert node.spec.unschedulable is True
    with pytest.raises(ApiException) as err:
        await core.patch_node(
            GPU_NODE,
            [{"op": "test", "path": "/metadata/annotations/a", "value": "2"}],
            _request_timeout=T,
        )
    assert err.value.status == 422


async def test_patch_cannot_change_status_or_name(api: client.ApiClient) -> None:
    """The main resource ignores status (status strategy)."""
    core = client.CoreV1Api(api)
    node = await core.patch_node(
        GPU_NODE, {"status": {"capacity": {GPU: "8"}}}, _request_timeout=T
    )
    assert node.status.capacity[GPU] == "3"


async def test_stale_resource_version_conflicts(api: client.ApiClient) -> None:
    """A resourceVersion in the patch is a precondition: 409 when stale."""
    core = client.CoreV1Api(api)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    stale = node.metadata.resource_version
    await core.patch_node(
        GPU_NODE, {"metadata": {"labels": {"x": "1"}}}, _request_timeout=T
    )
    with pytest.raises(ApiException) as err:
        await core.patch_node(
            GPU_NODE,
            {"metadata": {"resourceVersion": stale}, "spec": {"unschedulable": True}},
            _request_timeout=T,
        )
    assert err.value.status == 409
    body = status_of(err.value)
    assert body["reason"] == "Conflict"
    assert body["message"] == (
        f'Operation cannot be fulfilled on nodes "{GPU_NODE}": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )


async def test_unsupported_patch_type_is_415(api: client.ApiClient) -> None:
    """Server-side apply is not served: 415 UnsupportedMediaType."""
    with pytest.raises(ApiException) as err:
        await raw_request(
            api,
            "PATCH",
            f"/api/v1/nodes/{GPU_NODE}",
            body={"spec": {}},
            content_type="application/apply-patch+yaml",
        )
    assert err.value.status == 415


async def test_missing_node_is_404(api: client.ApiClient) -> None:
    """404 NotFound with upstream's message and details."""
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).read_node("nope", _request_timeout=T)
    assert err.value.status == 404
    assert status_of(err.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'nodes "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "nodes"},
        "code": 404,
    }


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("node-role.kubernetes.io/control-plane", [CONTROL_PLANE_NODE]),
        ("!node-role.kubernetes.io/control-plane", [GPU_NODE]),
        ("nvidia.com/gpu.present in (true,yes)", [GPU_NODE]),
        ("kubernetes.io/hostname notin (gpu-node)", [CONTROL_PLANE_NODE]),
        ("kubernetes.io/os=linux,kubernetes.io/hostname!=control-plane", [GPU_NODE]),
        ("kubernetes.io/os==linux", [CONTROL_PLANE_NODE, GPU_NODE]),
    ],
)
async def test_list_nodes_with_label_selector(
    api: client.ApiClient, selector: str, expected: list[str]
) -> None:
    """Label selector operators on nodes."""
    nodes = await client.CoreV1Api(api).list_node(
        label_selector=selector, _request_timeout=T
    )
    assert [n.metadata.name for n in nodes.items] == expected
    assert nodes.kind == "NodeList"
    assert int(nodes.metadata.resource_version) > 0


async def test_bad_selector_is_400(api: client.ApiClient) -> None:
    """Unparsable selectors are BadRequest."""
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).list_node(
            label_selector="a in (b", _request_timeout=T
        )
    assert err.value.status == 400
    with pytest.raises(ApiException) as err:
        await client.CoreV1Api(api).list_node(
            field_selector="status.phase=Running", _request_timeout=T
        )
    assert err.value.status == 400
    assert status_of(err.value)["message"] == "field label not supported: status.phase"


async def test_node_down_and_up(emulator: K8sEmulator, api: client.ApiClient) -> None:
    """Down: Ready Unknown + unreachable taints; up again: Ready True."""
    core = client.CoreV1Api(api)
    emulator.set_node_up(GPU_NODE, False)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    assert ready_status(node) == "Unknown"
    assert {(t.key, t.effect) for t in node.spec.taints} == {
        ("node.kubernetes.io/unreachable", "NoSchedule"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
    }
    emulator.set_node_up(GPU_NODE, True)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    assert ready_status(node) == "True"
    assert unset(node.spec.taints)


async def test_status_subresource_merges_conditions(
    admin_api: client.ApiClient,
) -> None:
    """nodes/status: conditions merge by type; spec changes are ignored there."""
    core = client.CoreV1Api(admin_api)
    node = await core.patch_node_status(
        GPU_NODE,
        {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "False",
                        "reason": "KubeletNotReady",
                        "message": "container runtime network not ready",
                    }
                ]
            },
            "spec": {"unschedulable": True},
        },
        _request_timeout=T,
    )
    assert [c.type for c in node.status.conditions] == [
        "MemoryPressure",
        "DiskPressure",
        "PIDPressure",
        "Ready",
    ]
    assert ready_status(node) == "False"
    assert unset(node.spec.unschedulable)
    assert node.status.capacity[GPU] == "3"


async def test_replace_node_and_exact_list(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """PUT with the current resourceVersion works, a stale one is 409; an Exact
    list shows the past; a compacted one is 410."""
    core = client.CoreV1Api(admin_api)
    node = await core.read_node(GPU_NODE, _request_timeout=T)
    before = node.metadata.resource_version
    node.metadata.labels["replaced"] = "yes"
    replaced = await core.replace_node(GPU_NODE, node, _request_timeout=T)
    assert replaced.metadata.labels["replaced"] == "yes"
    with pytest.raises(ApiException) as err:
        await core.replace_node(
            GPU_NODE, node, _request_timeout=T
        )  # still carries `before`
    assert err.value.status == 409

    old = await core.list_node(
        resource_version=before, resource_version_match="Exact", _request_timeout=T
    )
    assert old.metadata.resource_version == before
    assert (
        "replaced"
        not in next(n for n in old.items if n.metadata.name == GPU_NODE).metadata.labels
    )
    emulator.compact()
    with pytest.raises(ApiException) as err:
        await core.list_node(
            resource_version=before, resource_version_match="Exact", _request_timeout=T
        )
    assert err.value.status == 410


async def test_uncordon_with_false_is_omitted(api: client.ApiClient) -> None:
    """spec.unschedulable false is not serialized (omitempty), like upstream."""
    core = client.CoreV1Api(api)
    await core.patch_node(
        GPU_NODE, {"spec": {"unschedulable": True}}, _request_timeout=T
    )
    node = await core.patch_node(
        GPU_NODE, {"spec": {"unschedulable": False}}, _request_timeout=T
    )
    assert unset(node.spec.unschedulable)
    assert await _taints(core) == []


async def test_node_down_marks_its_pods_not_ready(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """As the node lifecycle controller does; up again, running pods are Ready."""
    emulator.set_node_up(GPU_NODE, False)
    pod = emulator.get("Pod", "trainer-7c6d5e4f3-m2n9v", "ai")
    assert pod is not None
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    pdb = emulator.get("PodDisruptionBudget", "trainer", "ai")
    assert pdb is not None
    assert pdb["status"]["currentHealthy"] == 0
    emulator.set_node_up(GPU_NODE, True)
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={GPU_NODE}", _request_timeout=T
    )
    for item in pods.items:
        assert (
            next(c.status for c in item.status.conditions if c.type == "Ready")
            == "True"
        )


async def test_a_write_between_a_read_and_a_patch_conflicts(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """The controller's taint write held until the next read: a client that
    read the node before it patches with a stale resourceVersion and gets
    409, as a real one may when the write lands between its read and its
    patch."""
    core = client.CoreV1Api(api)
    emulator.hold_cordon_taint()
    await core.patch_node(
        GPU_NODE, {"spec": {"unschedulable": True}}, _request_timeout=T
    )
    read = await core.read_node(GPU_NODE, _request_timeout=T)
    assert unset(read.spec.taints)  # the taint write came just after this read
    with pytest.raises(ApiException) as err:
        await core.patch_node(
            GPU_NODE,
            {
                "metadata": {"resourceVersion": read.metadata.resource_version},
                "spec": {"unschedulable": None},
            },
            _request_timeout=T,
        )
    assert err.value.status == 409
    assert await _taints(core) == ["node.kubernetes.io/unschedulable"]
