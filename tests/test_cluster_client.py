"""The cluster client: kubernetes_asyncio over real HTTPS against the emulator."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
import ssl

from kubernetes_asyncio.client import (
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
)
import pytest
import yaml

from custom_components.gpu_handoff.cluster_client import (
    ClusterAuthError,
    ClusterClient,
    ClusterConnectionError,
    DrainError,
    DrainProgress,
    KubeconfigError,
    NodeNotFoundError,
    _pod_gpu_request,
    build_ssl_context,
    parse_kubeconfig,
)
from tests.conftest import kubeconfig_text
from tests.k8semu import CONTROL_PLANE_NODE, GPU, GPU_NODE, K8sEmulator
from tests.k8semu.tls import make_tls


@pytest.fixture
async def client(cluster: K8sEmulator) -> AsyncIterator[ClusterClient]:
    """A client with the product's token."""
    api = await ClusterClient.create(kubeconfig_text(cluster))
    yield api
    await api.close()


def _kubeconfig(cluster: dict[str, object], user: dict[str, object]) -> str:
    return yaml.safe_dump(
        {
            "current-context": "c",
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            "clusters": [{"name": "k", "cluster": cluster}],
            "users": [{"name": "u", "user": user}],
        }
    )


SERVER = {"server": "https://127.0.0.1:6443"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [", "not YAML"),
        ("[1, 2]", "expected a mapping"),
        ("current-context: x\ncontexts: []", "no context named 'x'"),
        (_kubeconfig({"server": "ftp://x"}, {"token": "t"}), "https:// server"),
        (
            _kubeconfig(SERVER | {"certificate-authority": "/ca"}, {"token": "t"}),
            "points to a file",
        ),
        (_kubeconfig(SERVER, {"exec": {"command": "aws"}}), "not supported"),
        (_kubeconfig(SERVER, {"client-certificate": "/c"}), "point to files"),
        (_kubeconfig(SERVER, {}), "neither a token"),
        (
            _kubeconfig(SERVER | {"certificate-authority-data": "!!"}, {"token": "t"}),
            "not valid base64",
        ),
    ],
)
def test_unusable_kubeconfigs(text: str, message: str) -> None:
    """Each unusable kubeconfig says what is wrong with it."""
    with pytest.raises(KubeconfigError, match=message):
        parse_kubeconfig(text)


def test_single_context_without_current_context() -> None:
    """A kubeconfig with one context needs no current-context."""
    config = yaml.safe_load(_kubeconfig(SERVER, {"token": "secret-token"}))
    del config["current-context"]
    parsed = parse_kubeconfig(yaml.safe_dump(config))
    assert parsed.server == "https://127.0.0.1:6443"
    assert parsed.token == "secret-token"  # noqa: S105
    assert "secret-token" not in repr(parsed)


def test_client_certificate_context(tmp_path: Path) -> None:
    """Client certificate data becomes a loaded chain; no file stays behind."""
    material = make_tls(["127.0.0.1"])
    text = _kubeconfig(
        SERVER
        | {"certificate-authority-data": base64.b64encode(material.ca_pem).decode()},
        {
            "client-certificate-data": base64.b64encode(material.cert_pem).decode(),
            "client-key-data": base64.b64encode(material.key_pem).decode(),
        },
    )
    kubeconfig = parse_kubeconfig(text)
    context = build_ssl_context(kubeconfig)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.cert_store_stats()["x509_ca"] >= 1
    wrong = parse_kubeconfig(
        _kubeconfig(
            SERVER,
            {
                "client-certificate-data": base64.b64encode(material.cert_pem).decode(),
                "client-key-data": base64.b64encode(b"not a key").decode(),
            },
        )
    )
    with pytest.raises(KubeconfigError, match="unusable"):
        build_ssl_context(wrong)


def test_insecure_skip_verify() -> None:
    """insecure-skip-tls-verify turns verification off, as kubectl does."""
    kubeconfig = parse_kubeconfig(
        _kubeconfig(SERVER | {"insecure-skip-tls-verify": True}, {"token": "t"})
    )
    context = build_ssl_context(kubeconfig)
    assert context.verify_mode is ssl.CERT_NONE
    assert not context.check_hostname


async def test_node_names(client: ClusterClient) -> None:
    """Every node, sorted."""
    assert await client.node_names() == sorted([CONTROL_PLANE_NODE, GPU_NODE])


async def test_node_view_of_the_demo_gpu_node(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Ready, not cordoned, a fresh lease, GPUs and the pods a drain would evict."""
    view = await client.node_view(GPU_NODE)
    assert view.ready is True
    assert view.unschedulable is False
    assert view.lease_age is not None
    assert view.lease_age < cluster.lease_duration
    assert view.gpu_capacity == 3
    assert view.gpu_allocatable == 3
    assert view.gpu_requested == 2  # the inference and the training pod
    assert view.pods == 4
    # The DaemonSet pod and the mirror pod are not evicted.
    assert view.evictable_pods == 2


async def test_node_view_follows_the_cluster(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Cordon, a node going down, finished pods: the view shows each."""
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )
    cluster.add_pod("done", "default", node=GPU_NODE, phase="Succeeded")
    cluster.set_node_up(GPU_NODE, up=False)
    view = await client.node_view(GPU_NODE)
    assert view.unschedulable is True
    assert view.ready is False
    assert view.pods == 4
    cluster.delete("Lease", GPU_NODE, "kube-node-lease")
    assert (await client.node_view(GPU_NODE)).lease_age is None


async def test_errors_are_typed(client: ClusterClient, cluster: K8sEmulator) -> None:
    """404, 403, 500 and a stopped server map to the client's errors."""
    with pytest.raises(NodeNotFoundError):
        await client.node_view("no-such-node")
    cluster.fail_next(1, 403, resource="nodes")
    with pytest.raises(ClusterAuthError):
        await client.node_names()
    cluster.fail_next(1, 500, resource="nodes")
    with pytest.raises(ClusterConnectionError):
        await client.node_names()
    await cluster.stop()
    with pytest.raises(ClusterConnectionError):
        await client.node_names()


def test_gpu_requests_count_limits_when_no_request() -> None:
    """Requested GPUs: requests, else limits (as the scheduler counts them)."""
    pod = V1Pod(
        metadata=V1ObjectMeta(name="p"),
        spec=V1PodSpec(
            containers=[
                V1Container(name="none"),
                V1Container(
                    name="limit", resources=V1ResourceRequirements(limits={GPU: "2"})
                ),
                V1Container(
                    name="both",
                    resources=V1ResourceRequirements(
                        requests={GPU: "1"}, limits={GPU: "1"}
                    ),
                ),
                V1Container(
                    name="odd", resources=V1ResourceRequirements(limits={GPU: "lots"})
                ),
            ]
        ),
    )
    assert _pod_gpu_request(pod) == 3


# --- cordon and drain --------------------------------------------------------


def _on_node(cluster: K8sEmulator) -> set[str]:
    return {
        pod["metadata"]["name"]
        for pod in cluster.list_objects("Pod")
        if pod["spec"].get("nodeName") == GPU_NODE
    }


async def test_cordon_and_uncordon_are_idempotent(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Cordon twice, uncordon twice: the node ends schedulable again."""
    await client.cordon(GPU_NODE)
    await client.cordon(GPU_NODE)
    assert cluster.get("Node", GPU_NODE, "")["spec"]["unschedulable"] is True
    await client.uncordon(GPU_NODE)
    await client.uncordon(GPU_NODE)
    assert not cluster.get("Node", GPU_NODE, "")["spec"].get("unschedulable")


async def test_drain_refused_by_a_pdb_until_the_timeout(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The trainer's PDB refuses its eviction: the drain retries, then fails with
    the node still cordoned; DaemonSet and mirror pods were never touched."""
    seen: list[int] = []
    with pytest.raises(DrainError) as err:
        await client.drain(
            GPU_NODE,
            timeout=0.5,
            progress=lambda p: seen.append(p.pods_left),
            retry_interval=0.1,
            poll_interval=0.05,
        )
    assert err.value.progress.pods_left == 1
    assert err.value.progress.evictions_refused == 1
    assert cluster.get("Node", GPU_NODE, "")["spec"]["unschedulable"] is True
    evictions = cluster.requests_for(resource="pods/eviction")
    evicted = {request.name for request in evictions}
    assert evicted == {"llm-inference-5d9c8b7f6-q4w8z", "trainer-7c6d5e4f3-m2n9v"}
    # Refused, then retried at least once before the deadline.
    assert sum(1 for r in evictions if r.status == 429) >= 2
    assert seen[0] == 2
    assert seen[-1] == 1
    assert cluster.requests_for(verb="delete") == []


async def test_drain_succeeds_once_the_pdb_allows_it(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """When the PDB relaxes, the retried eviction goes through and the drain
    waits until the pods are gone."""
    loop = asyncio.get_running_loop()
    loop.call_later(
        0.3,
        lambda: cluster.modify(
            "PodDisruptionBudget",
            "trainer",
            "ai",
            mutate=lambda pdb: pdb["spec"].update(minAvailable=0),
        ),
    )
    result = await client.drain(
        GPU_NODE, timeout=10, retry_interval=0.1, poll_interval=0.05
    )
    assert result.pods_left == 0
    assert result.evicted == 2
    assert _on_node(cluster) == {
        "nvidia-device-plugin-daemonset-x7k2p",
        f"gpu-exporter-{GPU_NODE}",
    }


async def test_drain_waits_for_terminating_pods(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """An evicted pod that takes its time is waited for; one that never goes
    fails the drain."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.deletion_grace = 0.3
    result = await client.drain(GPU_NODE, timeout=10, poll_interval=0.05)
    assert result.pods_left == 0
    cluster.add_pod("stuck", "default", node=GPU_NODE, refuse_termination=True)
    with pytest.raises(DrainError, match="1 pod"):
        await client.drain(GPU_NODE, timeout=0.5, poll_interval=0.05)


async def test_drain_evicts_an_orphaned_daemonset_pod(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A pod whose DaemonSet is gone is evicted like any other; finished pods
    are left alone."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.delete("DaemonSet", "nvidia-device-plugin-daemonset", "kube-system")
    cluster.add_pod("finished", "default", node=GPU_NODE, phase="Succeeded")
    await client.drain(GPU_NODE, timeout=10, poll_interval=0.05)
    assert _on_node(cluster) == {f"gpu-exporter-{GPU_NODE}", "finished"}


async def test_drain_errors(client: ClusterClient, cluster: K8sEmulator) -> None:
    """Server errors and refused verbs during eviction are reported as such."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.fail_next(1, 500, resource="pods/eviction")
    with pytest.raises(ClusterConnectionError, match="500"):
        await client.drain(GPU_NODE, timeout=5)
    cluster.fail_next(1, 403, resource="pods/eviction")
    with pytest.raises(ClusterAuthError):
        await client.drain(GPU_NODE, timeout=5)
    await cluster.stop()
    with pytest.raises(ClusterConnectionError):
        await client.drain(GPU_NODE, timeout=5)


async def test_drain_lists_pods_page_by_page(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """More pods than one page: all are found and evicted."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    for n in range(260):
        cluster.add_pod(f"batch-{n}", "default", node=GPU_NODE)
    result = await client.drain(GPU_NODE, timeout=30, poll_interval=0.05)
    assert result.evicted == 262
    pages = [
        r
        for r in cluster.requests_for(verb="list", resource="pods")
        if "continue" in r.query
    ]
    assert pages


async def test_drain_pod_deleted_meanwhile(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A pod deleted between the listing and its eviction (404) counts as gone."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")

    def delete_it(progress: DrainProgress) -> None:
        if cluster.get("Pod", "trainer-7c6d5e4f3-m2n9v", "ai") is not None:
            cluster.remove_pod("trainer-7c6d5e4f3-m2n9v", "ai")

    result = await client.drain(GPU_NODE, timeout=10, progress=delete_it)
    assert result.pods_left == 0
    statuses = {
        r.name: r.status for r in cluster.requests_for(resource="pods/eviction")
    }
    assert statuses["trainer-7c6d5e4f3-m2n9v"] == 404
