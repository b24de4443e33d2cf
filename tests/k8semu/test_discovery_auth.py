"""Discovery, bearer authentication, RBAC-like authorization, fault injection."""

from __future__ import annotations

from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest
import yaml

from . import DEFAULT_USER, GPU_NODE, PRODUCT_RULES, K8sEmulator
from .auth import rule
from .client import api_client_for, raw_request, raw_watch, status_of

T = 10  # _request_timeout for every call


async def test_discovery(api: client.ApiClient) -> None:
    """Core, group and resource discovery parse with the real client's models."""
    versions = await client.CoreApi(api).get_api_versions(_request_timeout=T)
    assert versions.versions == ["v1"]
    core = await client.CoreV1Api(api).get_api_resources(_request_timeout=T)
    names = {r.name: r for r in core.resources}
    assert core.group_version == "v1"
    assert names["nodes"].namespaced is False
    assert names["pods"].namespaced is True
    assert names["pods/eviction"].group == "policy"
    assert names["pods/eviction"].verbs == ["create"]
    groups = await client.ApisApi(api).get_api_versions(_request_timeout=T)
    assert {g.name: g.preferred_version.group_version for g in groups.groups} == {
        "apps": "apps/v1",
        "events.k8s.io": "events.k8s.io/v1",
        "policy": "policy/v1",
        "coordination.k8s.io": "coordination.k8s.io/v1",
    }
    policy = await client.PolicyV1Api(api).get_api_resources(_request_timeout=T)
    assert [r.name for r in policy.resources] == [
        "poddisruptionbudgets",
        "poddisruptionbudgets/status",
    ]
    apps = await client.AppsV1Api(api).get_api_resources(_request_timeout=T)
    assert "daemonsets" in {r.name for r in apps.resources}
    coordination = await client.CoordinationV1Api(api).get_api_resources(
        _request_timeout=T
    )
    assert [r.kind for r in coordination.resources] == ["Lease"]
    version = await client.VersionApi(api).get_code(_request_timeout=T)
    assert version.major == "1"
    assert version.git_version.startswith("v1.")


async def test_unknown_path_is_404(admin_api: client.ApiClient) -> None:
    """A resource the server does not serve: upstream's generic 404."""
    with pytest.raises(ApiException) as err:
        await raw_request(admin_api, "GET", "/api/v1/secrets")
    assert err.value.status == 404
    assert (
        status_of(err.value)["message"]
        == "the server could not find the requested resource"
    )


@pytest.mark.parametrize("token", [None, "not-a-token"])
async def test_401_without_a_valid_token(
    emulator: K8sEmulator, tmp_path: Path, token: str | None
) -> None:
    """No token, or an unknown one: 401 with an Unauthorized Status."""
    conf = client.Configuration()
    conf.host = emulator.url
    ca = tmp_path / "ca.crt"
    ca.write_bytes(emulator.ca_pem)
    conf.ssl_ca_cert = str(ca)
    if token:
        conf.api_key = {"BearerToken": token}
        conf.api_key_prefix = {"BearerToken": "Bearer"}
    async with client.ApiClient(conf) as api:
        with pytest.raises(ApiException) as err:
            await client.CoreV1Api(api).list_node(_request_timeout=T)
    assert err.value.status == 401
    body = status_of(err.value)
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    assert emulator.requests[-1].status == 401


async def test_product_verbs_are_allowed(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Everything the integration needs works with its minimal rules."""
    core = client.CoreV1Api(api)
    await core.read_node(GPU_NODE, _request_timeout=T)
    await core.list_node(_request_timeout=T)
    stream = await raw_watch(core.list_node, timeout_seconds=1, _request_timeout=T)
    assert b'"type":"ADDED"' in await stream.content.readline()
    stream.release()
    await core.patch_node(
        GPU_NODE, {"metadata": {"labels": {"x": "y"}}}, _request_timeout=T
    )
    pods = await core.list_pod_for_all_namespaces(_request_timeout=T)
    pod = pods.items[0]
    await core.read_namespaced_pod(
        pod.metadata.name, pod.metadata.namespace, _request_timeout=T
    )
    await core.list_namespaced_pod("ai", _request_timeout=T)
    await client.AppsV1Api(api).read_namespaced_daemon_set(
        "nvidia-device-plugin-daemonset", "kube-system", _request_timeout=T
    )
    await client.CoordinationV1Api(api).read_namespaced_lease(
        GPU_NODE, "kube-node-lease", _request_timeout=T
    )
    await core.list_event_for_all_namespaces(_request_timeout=T)
    await core.list_namespaced_event("ai", _request_timeout=T)
    await core.create_namespaced_pod_eviction(
        "llm-inference-5d9c8b7f6-q4w8z",
        "ai",
        client.V1Eviction(
            metadata=client.V1ObjectMeta(
                name="llm-inference-5d9c8b7f6-q4w8z", namespace="ai"
            )
        ),
        _request_timeout=T,
    )
    assert {r.status for r in emulator.requests} == {200, 201}
    assert {(r.verb, r.resource) for r in emulator.requests} == {
        ("get", "nodes"),
        ("list", "nodes"),
        ("watch", "nodes"),
        ("patch", "nodes"),
        ("list", "pods"),
        ("get", "pods"),
        ("get", "daemonsets"),
        ("get", "leases"),
        ("list", "events"),
        ("create", "pods/eviction"),
    }


async def test_403_outside_the_allow_list(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Deleting a pod, listing daemonsets, patching pods: Forbidden, word for word."""
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as err:
        await core.delete_namespaced_pod(
            "trainer-7c6d5e4f3-m2n9v", "ai", _request_timeout=T
        )
    assert err.value.status == 403
    body = status_of(err.value)
    assert body["reason"] == "Forbidden"
    assert body["message"] == (
        'pods "trainer-7c6d5e4f3-m2n9v" is forbidden: User "system:serviceaccount:gpu-handoff:gpu-handoff" '
        'cannot delete resource "pods" in API group "" in the namespace "ai"'
    )
    assert body["details"] == {"name": "trainer-7c6d5e4f3-m2n9v", "kind": "pods"}
    assert emulator.get("Pod", "trainer-7c6d5e4f3-m2n9v", "ai") is not None

    with pytest.raises(ApiException) as err:
        await client.AppsV1Api(api).list_namespaced_daemon_set(
            "kube-system", _request_timeout=T
        )
    assert err.value.status == 403
    assert status_of(err.value)["message"] == (
        f'daemonsets.apps is forbidden: User "{DEFAULT_USER}" cannot list resource "daemonsets" '
        'in API group "apps" in the namespace "kube-system"'
    )
    with pytest.raises(ApiException) as err:
        await core.delete_node(GPU_NODE, _request_timeout=T)
    assert status_of(err.value)["message"] == (
        f'nodes "{GPU_NODE}" is forbidden: User "{DEFAULT_USER}" cannot delete resource "nodes" '
        'in API group "" at the cluster scope'
    )
    deletes = emulator.requests_for(verb="delete", resource="pods")
    assert [(r.name, r.status) for r in deletes] == [("trainer-7c6d5e4f3-m2n9v", 403)]


async def test_rules_are_configurable(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Narrowing the rules takes effect at once."""
    from . import rule

    emulator.set_rules((rule(["get"], ["nodes"]),))
    core = client.CoreV1Api(api)
    await core.read_node(GPU_NODE, _request_timeout=T)
    with pytest.raises(ApiException) as err:
        await core.list_node(_request_timeout=T)
    assert err.value.status == 403


async def test_fail_next_injects_errors(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """fail_next(n, status) fails exactly n matching requests, then recovers."""
    core = client.CoreV1Api(api)
    emulator.fail_next(2, 503, verb="list", resource="pods")
    await core.read_node(GPU_NODE, _request_timeout=T)  # not matching: unaffected
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            await core.list_pod_for_all_namespaces(_request_timeout=T)
        assert err.value.status == 503
        assert status_of(err.value)["reason"] == "ServiceUnavailable"
    pods = await core.list_pod_for_all_namespaces(_request_timeout=T)
    assert len(pods.items) == 5


async def test_kubeconfig_carries_ca_data(
    emulator: K8sEmulator, tmp_path: Path
) -> None:
    """The kubeconfig verifies the server with its CA (no insecure skip)."""
    kubeconfig = emulator.kubeconfig()
    cluster = kubeconfig["clusters"][0]["cluster"]
    assert cluster["server"] == emulator.url
    assert cluster["server"].startswith("https://127.0.0.1:")
    assert "insecure-skip-tls-verify" not in cluster
    api = await api_client_for(emulator, tmp_path)
    try:
        assert api.configuration.verify_ssl is True
        nodes = await client.CoreV1Api(api).list_node(_request_timeout=T)
        assert len(nodes.items) == 2
    finally:
        await api.close()


async def test_plain_http(socket_enabled: None, tmp_path: Path) -> None:
    """tls=False serves plain HTTP; the kubeconfig then has no CA."""
    emu = K8sEmulator(tls=False)
    emu.add_node(GPU_NODE)
    async with emu:
        cluster = emu.kubeconfig()["clusters"][0]["cluster"]
        assert cluster == {"server": f"http://127.0.0.1:{emu.port}"}
        api = await api_client_for(emu, tmp_path)
        try:
            nodes = await client.CoreV1Api(api).list_node(_request_timeout=T)
        finally:
            await api.close()
    assert [n.metadata.name for n in nodes.items] == [GPU_NODE]


def test_the_documented_cluster_role_is_what_the_product_token_gets() -> None:
    """The ClusterRole a user applies (docs/cluster-setup.md) grants exactly
    the rules the emulator gives the product's token: every test that passes
    against the emulator passes with what users grant."""
    page = Path(__file__).parents[2] / "docs" / "cluster-setup.md"
    text = page.read_text(encoding="utf-8")
    block = text.split("```yaml", 1)[1]
    documents = list(yaml.safe_load_all(block.split("```", 1)[0]))
    [role] = [d for d in documents if d["kind"] == "ClusterRole"]
    granted = {rule(r["verbs"], r["resources"], r["apiGroups"]) for r in role["rules"]}
    assert granted == set(PRODUCT_RULES)
