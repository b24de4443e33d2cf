"""The cluster client: kubernetes_asyncio over real HTTPS against the emulator."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
import ssl
from typing import Any

from kubernetes_asyncio.client import (
    V1Container,
    V1LabelSelector,
    V1LabelSelectorRequirement,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
    V1Toleration,
)
import pytest
import yaml

from custom_components.gpu_handoff.cluster_client import (
    CORDON_ANNOTATION,
    ClusterAuthError,
    ClusterClient,
    ClusterConnectionError,
    DrainError,
    DrainProgress,
    KubeconfigError,
    NodeNotFoundError,
    UnmanagedPodsError,
    _pod_gpu_request,
    build_ssl_context,
    parse_kubeconfig,
    selects,
    tolerates_cordon,
)
from custom_components.gpu_handoff.cluster_model import (
    CORDON_OWNER_OTHER,
    CORDON_OWNER_US,
)
from custom_components.gpu_handoff.drain import NodeDrain
from tests.conftest import kubeconfig_text
from tests.k8semu import CONTROL_PLANE_NODE, GPU, GPU_NODE, K8sEmulator
from tests.k8semu.objects import make_namespace
from tests.k8semu.tls import make_tls


@pytest.fixture
def client(cluster_client: ClusterClient) -> ClusterClient:
    """The product's client (tests/conftest.py), by its short name here."""
    return cluster_client


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


async def test_cordon_is_marked_and_uncordon_lifts_only_our_own(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Our cordon carries our mark and is lifted (mark included); twice is
    harmless. An operator's cordon (no mark) is reported as theirs, never
    claimed and never lifted."""
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_US
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_US
    node = cluster.get("Node", GPU_NODE, "")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][CORDON_ANNOTATION] == "handoff gaming-1"
    assert (await client.node_view(GPU_NODE)).cordon_owner == CORDON_OWNER_US
    assert await client.uncordon(GPU_NODE) is True
    assert await client.uncordon(GPU_NODE) is False
    node = cluster.get("Node", GPU_NODE, "")
    assert not node["spec"].get("unschedulable")
    assert CORDON_ANNOTATION not in (node["metadata"].get("annotations") or {})
    assert (await client.node_view(GPU_NODE)).cordon_owner is None

    # kubectl cordon: a plain patch of spec.unschedulable, no mark.
    _operator_cordon(cluster)
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_OTHER
    assert await client.uncordon(GPU_NODE) is False
    node = cluster.get("Node", GPU_NODE, "")
    assert node["spec"]["unschedulable"] is True
    assert CORDON_ANNOTATION not in (node["metadata"].get("annotations") or {})
    assert (await client.node_view(GPU_NODE)).cordon_owner == CORDON_OWNER_OTHER


def _operator_cordon(cluster: K8sEmulator, cordoned: bool = True) -> None:
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=cordoned),
    )


async def test_cordon_never_claims_a_cordon_placed_meanwhile(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The operator cordons between our read and our patch: the patch carries
    the resourceVersion we read, the API server answers 409, and the cordon
    found on the second look is reported as theirs, without our mark."""
    original = client.core.read_node

    async def read_then_operator_cordons(*args: object, **kwargs: object) -> object:
        node = await original(*args, **kwargs)
        if not cluster.get("Node", GPU_NODE, "")["spec"].get("unschedulable"):
            _operator_cordon(cluster)
        return node

    client.core.read_node = read_then_operator_cordons  # type: ignore[method-assign]
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_OTHER
    node = cluster.get("Node", GPU_NODE, "")
    assert node["spec"]["unschedulable"] is True
    assert CORDON_ANNOTATION not in (node["metadata"].get("annotations") or {})
    assert [r.status for r in cluster.requests_for(verb="patch")] == [409]


async def test_cordon_and_uncordon_survive_the_controllers_taint_write(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The node lifecycle controller writes the cordon's taint a moment after
    the cordon (and takes it off after the uncordon): when that write lands
    between our read and our patch, the patch gets 409 and is made again on
    a fresh read; the node ends as wanted, with the controller's taint."""
    # the taint added after our cordon lands between the uncordon's read and
    # its patch
    cluster.hold_cordon_taint()
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_US
    assert await client.uncordon(GPU_NODE) is True
    assert [r.status for r in cluster.requests_for(verb="patch")] == [200, 409, 200]
    # the taint taken off after our uncordon lands between the next cordon's
    # read and its patch
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_US
    cluster.hold_cordon_taint()
    assert await client.uncordon(GPU_NODE) is True
    assert await client.cordon(GPU_NODE, "handoff gaming-1") == CORDON_OWNER_US
    statuses = [r.status for r in cluster.requests_for(verb="patch")]
    assert statuses == [200, 409, 200, 200, 200, 409, 200]
    node = cluster.get("Node", GPU_NODE, "")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][CORDON_ANNOTATION] == "handoff gaming-1"
    await asyncio.sleep(0)
    node = cluster.get("Node", GPU_NODE, "")
    assert [t["key"] for t in node["spec"]["taints"]] == [
        "node.kubernetes.io/unschedulable"
    ]


async def test_uncordon_after_the_operator_uncordoned_removes_only_the_mark(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Someone uncordoned our node by hand: lifting ours removes the stale
    mark and leaves the node schedulable."""
    await client.cordon(GPU_NODE, "handoff gaming-1")
    _operator_cordon(cluster, cordoned=False)
    assert (await client.node_view(GPU_NODE)).cordon_owner is None
    assert await client.uncordon(GPU_NODE) is True
    node = cluster.get("Node", GPU_NODE, "")
    assert not node["spec"].get("unschedulable")
    assert CORDON_ANNOTATION not in (node["metadata"].get("annotations") or {})


async def test_a_throttled_cordon_is_retried_not_taken_for_a_budget(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """429 and 503 on the node's read and patch are transient: retried with
    backoff until the cordon is placed."""
    cluster.fail_next(1, 429, verb="get", resource="nodes")
    cluster.fail_next(1, 503, verb="patch", resource="nodes")
    assert await client.cordon(GPU_NODE, "m") == CORDON_OWNER_US
    assert cluster.get("Node", GPU_NODE, "")["spec"]["unschedulable"] is True


async def test_drain_refused_by_a_pdb_until_the_timeout(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The trainer's PDB refuses its eviction: the drain retries, then fails with
    the node still cordoned; DaemonSet and mirror pods were never touched."""
    seen: list[int] = []
    await client.cordon(GPU_NODE, "m")
    with pytest.raises(DrainError) as err:
        await NodeDrain(client).run(
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
    result = await NodeDrain(client).run(
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
    result = await NodeDrain(client).run(GPU_NODE, timeout=10, poll_interval=0.05)
    assert result.pods_left == 0
    cluster.add_pod("stuck", "default", node=GPU_NODE, refuse_termination=True)
    with pytest.raises(DrainError, match="1 pod"):
        await NodeDrain(client).run(GPU_NODE, timeout=0.5, poll_interval=0.05)


async def test_drain_refuses_pods_that_nothing_recreates(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """kubectl drain (filters.go: unreplicatedFilter, daemonSetFilter) refuses
    a pod with no controller and a pod whose DaemonSet is gone unless --force:
    the drain fails before any eviction, naming both pods."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.delete("DaemonSet", "nvidia-device-plugin-daemonset", "kube-system")
    cluster.add_pod("debug", "default", node=GPU_NODE)
    with pytest.raises(UnmanagedPodsError) as err:
        await NodeDrain(client).run(GPU_NODE, timeout=10, poll_interval=0.05)
    assert set(err.value.pods) == {
        "kube-system/nvidia-device-plugin-daemonset-x7k2p",
        "default/debug",
    }
    assert "default/debug" in str(err.value)
    assert cluster.requests_for(resource="pods/eviction") == []
    assert "debug" in _on_node(cluster)


async def test_drain_with_force_evicts_them_and_finished_pods(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """With the option (kubectl's --force) they are evicted with the others;
    finished pods are evicted too, as kubectl does (their eviction deletes
    them without a budget check)."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.delete("DaemonSet", "nvidia-device-plugin-daemonset", "kube-system")
    cluster.add_pod("debug", "default", node=GPU_NODE)
    cluster.add_pod("finished", "default", node=GPU_NODE, phase="Succeeded")
    await NodeDrain(client).run(GPU_NODE, timeout=10, poll_interval=0.05, force=True)
    assert _on_node(cluster) == {f"gpu-exporter-{GPU_NODE}"}


async def test_a_finished_bare_pod_is_no_reason_to_refuse(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """unreplicatedFilter lets finished pods through: a completed `kubectl
    run` pod does not block a drain without --force."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.add_pod("done", "default", node=GPU_NODE, phase="Failed")
    await NodeDrain(client).run(GPU_NODE, timeout=10, poll_interval=0.05)
    assert "done" not in _on_node(cluster)


async def test_transient_errors_do_not_abort_the_drain(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """500 and 503 on evictions, a 503 on the listing and one on a
    wait-for-delete read are retried with backoff: the drain completes."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.fail_next(1, 503, verb="list", resource="pods")
    cluster.fail_next(2, 500, resource="pods/eviction")
    cluster.fail_next(1, 503, resource="pods/eviction")
    cluster.fail_next(1, 503, verb="get", resource="pods")
    cluster.deletion_grace = 0.2
    result = await NodeDrain(client).run(GPU_NODE, timeout=20, poll_interval=0.05)
    assert result.pods_left == 0
    assert result.evicted == 2
    statuses = [r.status for r in cluster.requests_for(resource="pods/eviction")]
    assert statuses.count(201) == 2
    assert {500, 503} <= set(statuses)


async def test_a_pod_stuck_terminating_on_a_dead_kubelet_counts_as_gone(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """kubectl's --skip-wait-for-delete-timeout (drain.go shouldSkipPod): a pod
    whose deletionTimestamp is more than the bound in the past is skipped,
    both when listed and while waiting for it."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.add_replicaset("stale", "default", labels={"app": "stale"}, image="app:1")
    owner = cluster.owner_ref(cluster.get("ReplicaSet", "stale", "default"))
    cluster.add_pod(
        "stale-1", "default", node=GPU_NODE, owner=owner, refuse_termination=True
    )
    cluster.modify(
        "Pod",
        "stale-1",
        "default",
        mutate=lambda pod: pod["metadata"].update(
            deletionTimestamp="2026-01-01T00:00:00Z", deletionGracePeriodSeconds=30
        ),
    )
    cluster.add_pod(
        "slow", "default", node=GPU_NODE, owner=owner, refuse_termination=True
    )
    # Its deletionTimestamp will be the eviction's time + its grace period.
    cluster.modify(
        "Pod",
        "slow",
        "default",
        mutate=lambda pod: pod["spec"].update(terminationGracePeriodSeconds=1),
    )
    with pytest.raises(DrainError, match="default/slow"):
        await NodeDrain(client).run(
            GPU_NODE, timeout=2.0, poll_interval=0.05, skip_after=60
        )
    # Once its deletion is overdue by the bound, the waiting ends.
    result = await NodeDrain(client).run(
        GPU_NODE, timeout=10, poll_interval=0.05, skip_after=0.3
    )
    assert result.pods_left == 0
    assert {"stale-1", "slow"} <= _on_node(cluster)  # still Terminating there
    assert [r.name for r in cluster.requests_for(resource="pods/eviction")].count(
        "stale-1"
    ) == 0


async def test_drain_errors(client: ClusterClient, cluster: K8sEmulator) -> None:
    """A refused verb (403 without a NamespaceTerminating cause) aborts at once;
    a server that stays away fails the drain once its time is up."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.fail_next(1, 403, resource="pods/eviction")
    with pytest.raises(ClusterAuthError):
        await NodeDrain(client).run(GPU_NODE, timeout=5)
    await cluster.stop()
    with pytest.raises(ClusterConnectionError):
        await NodeDrain(client).run(GPU_NODE, timeout=1.5)


async def test_drain_lists_pods_page_by_page(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """More pods than one page: all are found and evicted (bare pods, so
    with the option to evict them; without it, the refusal names ten)."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    for n in range(260):
        cluster.add_pod(f"batch-{n}", "default", node=GPU_NODE)
    with pytest.raises(UnmanagedPodsError, match=r"and 250 more$"):
        await NodeDrain(client).run(GPU_NODE, timeout=30, poll_interval=0.05)
    result = await NodeDrain(client).run(
        GPU_NODE, timeout=30, poll_interval=0.05, force=True
    )
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

    result = await NodeDrain(client).run(GPU_NODE, timeout=10, progress=delete_it)
    assert result.pods_left == 0
    statuses = {
        r.name: r.status for r in cluster.requests_for(resource="pods/eviction")
    }
    assert statuses["trainer-7c6d5e4f3-m2n9v"] == 404


# --- failures a real API server produces (see tests/k8semu for the sources) --


async def test_a_pod_in_a_terminating_namespace_is_waited_for(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """Evictions in a namespace being deleted answer 403 with cause
    NamespaceTerminating (NamespaceLifecycle admission). kubectl drain
    (evictPods) waits for such a pod, which goes with its namespace, rather
    than failing on a 403 as if it were RBAC."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.create(make_namespace("scratch-ns"))
    cluster.add_replicaset("job", "scratch-ns", labels={"app": "job"}, image="j")
    owner = cluster.owner_ref(cluster.get("ReplicaSet", "job", "scratch-ns"))
    cluster.add_pod("job-1", "scratch-ns", node=GPU_NODE, owner=owner)
    cluster.set_pod_stop_seconds("job-1", "scratch-ns", 0.5)
    cluster.terminate_namespace("scratch-ns")
    result = await NodeDrain(client).run(
        GPU_NODE, timeout=10, retry_interval=0.1, poll_interval=0.05
    )
    assert result.pods_left == 0
    assert cluster.get("Pod", "job-1", "scratch-ns") is None
    statuses = [
        r.status
        for r in cluster.requests_for(resource="pods/eviction", namespace="scratch-ns")
    ]
    assert 403 in statuses


async def test_a_pod_replaced_under_its_name_is_evicted_in_its_new_form(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A StatefulSet-like controller recreates the trainer under the same name
    between the drain's fresh read of it (after a budget refusal) and its next
    eviction: that eviction carries the old UID as precondition and gets 409,
    checked at delete time after the budget (eviction.go). The pod we meant is
    gone; the drain lists the node again and evicts the new one."""
    trainer = "trainer-7c6d5e4f3-m2n9v"
    old = cluster.get("Pod", trainer, "ai")
    # The 409's eviction spent the budget under the pod's name
    # (status.disruptedPods), which keeps the new pod of that name out of
    # currentHealthy until the entry expires: 2 minutes upstream
    # (disruption.go DeletionTimeout), shortened here.
    cluster.pdb_deletion_timeout = 0.5
    original = client.core.read_namespaced_pod
    replaced: list[str] = []

    async def read_then_replace(*args: Any, **kwargs: Any) -> Any:
        pod = await original(*args, **kwargs)
        if args[0] == trainer and not replaced:
            # The moment between the read and the next eviction.
            cluster.remove_pod(trainer, "ai")
            cluster.add_pod(
                trainer,
                "ai",
                node=GPU_NODE,
                labels=old["metadata"]["labels"],
                owner=old["metadata"]["ownerReferences"][0],
            )
            replaced.append(cluster.get("Pod", trainer, "ai")["metadata"]["uid"])
            cluster.modify(
                "PodDisruptionBudget",
                "trainer",
                "ai",
                mutate=lambda pdb: pdb["spec"].update(minAvailable=0),
            )
        return pod

    client.core.read_namespaced_pod = read_then_replace  # type: ignore[method-assign]
    result = await NodeDrain(client).run(
        GPU_NODE, timeout=15, retry_interval=0.2, poll_interval=0.05
    )
    assert replaced
    assert result.pods_left == 0
    assert cluster.get("Pod", trainer, "ai") is None
    answers = [
        (r.status, r.body["deleteOptions"]["preconditions"]["uid"])
        for r in cluster.requests_for(resource="pods/eviction", name=trainer)
    ]
    assert answers[0] == (429, old["metadata"]["uid"])
    assert (409, old["metadata"]["uid"]) in answers
    assert answers[-1] == (201, replaced[0])


async def test_throttling_is_not_a_budget_refusal(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """API Priority and Fairness answers 429 without a DisruptionBudget cause
    (and 504 on a deadline): on the listing, the evictions and the waits they
    are retried as transient, never counted as refused evictions."""
    cluster.delete("PodDisruptionBudget", "trainer", "ai")
    cluster.throttle(1, verb="list", resource="pods", retry_after=0)
    cluster.throttle(2, resource="pods/eviction", retry_after=0)
    cluster.throttle(1, resource="pods/eviction", status=504)
    refused: list[int] = []
    result = await NodeDrain(client).run(
        GPU_NODE,
        timeout=20,
        progress=lambda p: refused.append(p.evictions_refused),
        poll_interval=0.05,
    )
    assert result.pods_left == 0
    assert max(refused) == 0


async def test_a_budget_still_being_processed_is_waited_for(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A budget edited a moment ago answers 429 "still being processed" with
    Retry-After until the disruption controller catches up; the drain waits
    and then evicts."""
    cluster.pdb_sync_delay = 0.5
    cluster.modify(
        "PodDisruptionBudget",
        "trainer",
        "ai",
        mutate=lambda pdb: pdb["spec"].update(minAvailable=0),
    )
    result = await NodeDrain(client).run(
        GPU_NODE, timeout=30, retry_interval=0.1, poll_interval=0.05
    )
    assert result.pods_left == 0


async def test_a_legacy_ca_is_verified_as_kubectl_verifies_it(
    socket_enabled: None,
) -> None:
    """A cluster CA without keyUsage and key identifiers works with kubectl
    (Go's verifier); Python 3.13+'s default context refuses it
    (VERIFY_X509_STRICT; the emulator's own tests show the refusal). The
    client verifies chain, expiry and host name as kubectl does, without the
    strict extras, so it connects."""
    async with K8sEmulator(legacy_ca=True) as emulator:
        emulator.add_node("n1")
        text = kubeconfig_text(emulator)
        client = await ClusterClient.create(text)
        try:
            assert await client.node_names() == ["n1"]
        finally:
            await client.close()
        # Still verified: the chain against the pasted CA, and the host name.
        context = build_ssl_context(parse_kubeconfig(text))
        assert context.verify_mode is ssl.CERT_REQUIRED
        assert context.check_hostname
        assert not context.verify_flags & ssl.VERIFY_X509_STRICT
        assert context.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN


@pytest.mark.parametrize(
    ("toleration", "expected"),
    [
        ({"operator": "Exists"}, True),
        ({"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}, True),
        ({"key": "node.kubernetes.io/unschedulable"}, True),
        ({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}, True),
        ({"key": "node.kubernetes.io/unschedulable", "effect": "NoExecute"}, False),
        ({"key": "node.kubernetes.io/unschedulable", "value": "yes"}, False),
        ({"key": "node.kubernetes.io/unreachable", "operator": "Exists"}, False),
        ({"key": "node.kubernetes.io/unschedulable", "operator": "Gt"}, False),
        (None, False),
    ],
)
def test_tolerates_cordon_reads_tolerations_as_the_scheduler_does(
    toleration: dict[str, str] | None, expected: bool
) -> None:
    """NodeUnschedulable's Filter with core/v1 ToleratesTaint's rules (the
    emulator's twin, tests/k8semu/test_scheduling.py, cites them)."""
    pod = V1Pod(
        metadata=V1ObjectMeta(name="p", namespace="ai"),
        spec=V1PodSpec(
            containers=[V1Container(name="main")],
            tolerations=[V1Toleration(**toleration)] if toleration else None,
        ),
    )
    assert tolerates_cordon(pod) is expected
    assert tolerates_cordon(V1Pod(metadata=V1ObjectMeta(name="p"))) is False


def _expression(key: str, operator: str, *values: str) -> V1LabelSelectorRequirement:
    return V1LabelSelectorRequirement(
        key=key, operator=operator, values=list(values) or None
    )


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (None, False),
        (V1LabelSelector(), False),  # empty: nothing, as the eviction API reads it
        (V1LabelSelector(match_labels={"app": "trainer"}), True),
        (V1LabelSelector(match_labels={"app": "web"}), False),
        (V1LabelSelector(match_expressions=[_expression("tier", "In", "gpu")]), True),
        (V1LabelSelector(match_expressions=[_expression("tier", "In", "web")]), False),
        (V1LabelSelector(match_expressions=[_expression("zone", "In", "a")]), False),
        (
            V1LabelSelector(match_expressions=[_expression("tier", "NotIn", "web")]),
            True,
        ),
        (
            V1LabelSelector(match_expressions=[_expression("tier", "NotIn", "gpu")]),
            False,
        ),
        (V1LabelSelector(match_expressions=[_expression("zone", "NotIn", "a")]), True),
        (V1LabelSelector(match_expressions=[_expression("app", "Exists")]), True),
        (V1LabelSelector(match_expressions=[_expression("zone", "Exists")]), False),
        (
            V1LabelSelector(match_expressions=[_expression("zone", "DoesNotExist")]),
            True,
        ),
        (
            V1LabelSelector(match_expressions=[_expression("app", "DoesNotExist")]),
            False,
        ),
        (V1LabelSelector(match_expressions=[_expression("app", "Gt", "1")]), False),
        (
            V1LabelSelector(
                match_labels={"app": "trainer"},
                match_expressions=[_expression("tier", "In", "gpu", "cpu")],
            ),
            True,
        ),
    ],
)
def test_selects_is_a_label_selector_as_the_eviction_api_reads_it(
    selector: V1LabelSelector | None, expected: bool
) -> None:
    """metav1.LabelSelectorAsSelector and Matches; a nil or empty selector
    and an invalid operator select nothing (getPodDisruptionBudgets)."""
    assert selects(selector, {"app": "trainer", "tier": "gpu"}) is expected
