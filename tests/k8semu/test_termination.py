"""Graceful pod deletion: each pod's own grace period, the kubelet's part, and
pods that stay Terminating while their node is NotReady."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
import pytest

from . import GPU_NODE, K8sEmulator
from .client import status_of
from .test_eviction import LLM, TRAINER, evict_status

T = 10


def when(text: str) -> datetime:
    """A metav1.Time as an aware datetime."""
    return datetime.fromisoformat(text)


def pod_events(emulator: K8sEmulator, since: int, name: str) -> list[tuple[str, Any]]:
    """(type, object) of the stored changes of one pod after a revision."""
    return [
        (e.type, e.object)
        for e in emulator.store.events_since(since)
        if e.resource.kind == "Pod" and e.object["metadata"]["name"] == name
    ]


async def until_gone(emulator: K8sEmulator, name: str, namespace: str) -> None:
    """Wait (bounded) until the pod is no longer stored."""
    async with asyncio.timeout(5):
        while emulator.get("Pod", name, namespace) is not None:  # noqa: ASYNC110 - the emulator's timers remove it
            await asyncio.sleep(0.02)


async def test_deletion_uses_the_pods_own_grace_period(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """pkg/registry/core/pod/strategy.go CheckGracefulDelete with
    rest/delete.go BeforeDelete: deletionTimestamp = now + grace and
    deletionGracePeriodSeconds = grace, from the pod's
    terminationGracePeriodSeconds or the DeleteOptions; the pod stays
    readable (200 with the object) until the kubelet is done."""
    emulator.deletion_grace = 5  # containers take long: the pods stay visible
    emulator.add_pod("quick", "ai", node=GPU_NODE, termination_grace=7)
    core = client.CoreV1Api(admin_api)
    before = datetime.now(UTC).replace(microsecond=0)
    own = await core.delete_namespaced_pod("quick", "ai", _request_timeout=T)
    told = await core.delete_namespaced_pod(
        LLM,
        "ai",
        body=client.V1DeleteOptions(grace_period_seconds=3),
        _request_timeout=T,
    )
    default = await core.delete_namespaced_pod(TRAINER, "ai", _request_timeout=T)
    for pod, grace in ((own, 7), (told, 3), (default, 30)):
        assert pod.metadata.deletion_grace_period_seconds == grace
        moment = pod.metadata.deletion_timestamp
        assert (
            before + timedelta(seconds=grace)
            <= moment
            <= datetime.now(UTC) + timedelta(seconds=grace)
        )
        read = await core.read_namespaced_pod(
            pod.metadata.name, "ai", _request_timeout=T
        )
        assert read.metadata.deletion_timestamp == moment
        assert read.status.phase == "Running"  # the containers still stop


async def test_kubelet_stops_then_removes(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """The kubelet (pkg/kubelet status manager, then its grace-0 delete):
    once the containers exited the pod turns Succeeded with terminated
    containers and Ready False (PodCompleted), then it is removed. Stored
    changes: DisruptionTarget (eviction.go addConditionAndDeletePod), the
    deletionTimestamp, the terminal status, the deletion."""
    emulator.set_pod_stop_seconds(LLM, "ai", 0.2)
    since = emulator.store.revision
    assert (await evict_status(api, LLM, "ai"))[0] == 201
    assert emulator.get("Pod", LLM, "ai") is not None
    await until_gone(emulator, LLM, "ai")
    events = pod_events(emulator, since, LLM)
    assert [e[0] for e in events] == ["MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    disrupted = next(
        c
        for c in events[0][1]["status"]["conditions"]
        if c["type"] == "DisruptionTarget"
    )
    assert (disrupted["status"], disrupted["reason"], disrupted["message"]) == (
        "True",
        "EvictionByEvictionAPI",
        "Eviction API: evicting",
    )
    assert events[1][1]["metadata"]["deletionGracePeriodSeconds"] == 30
    assert events[1][1]["status"]["phase"] == "Running"
    finished = events[2][1]["status"]
    assert finished["phase"] == "Succeeded"
    assert finished["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    ready = next(c for c in finished["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PodCompleted")


async def test_containers_outliving_the_grace_period_are_killed(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """pkg/kubelet/kuberuntime killContainer waits at most the grace period,
    then kills (exit code 137); kubelet_pods.go getPhase makes a terminal pod
    with a failed container Failed; then the pod is removed."""
    emulator.add_pod("stubborn", "ai", node=GPU_NODE, stop_seconds=60)
    core = client.CoreV1Api(admin_api)
    since = emulator.store.revision
    await core.delete_namespaced_pod(
        "stubborn",
        "ai",
        body=client.V1DeleteOptions(grace_period_seconds=1),
        _request_timeout=T,
    )
    await until_gone(emulator, "stubborn", "ai")
    [(_, terminal)] = [
        e for e in pod_events(emulator, since, "stubborn") if e[0] == "MODIFIED"
    ][1:]
    assert terminal["status"]["phase"] == "Failed"
    state = terminal["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (state["exitCode"], state["reason"]) == (137, "Error")


async def test_a_second_delete_may_only_shorten_the_grace_period(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """rest/delete.go BeforeDelete on a pod already being deleted: a longer
    or no grace period changes nothing; a shorter one moves the
    deletionTimestamp back; 0 removes it at once (kubectl delete --force)."""
    emulator.deletion_grace = 60
    core = client.CoreV1Api(admin_api)
    first = await core.delete_namespaced_pod(LLM, "ai", _request_timeout=T)
    again = await core.delete_namespaced_pod(
        LLM,
        "ai",
        body=client.V1DeleteOptions(grace_period_seconds=45),
        _request_timeout=T,
    )
    assert again.metadata.deletion_timestamp == first.metadata.deletion_timestamp
    assert again.metadata.resource_version == first.metadata.resource_version
    shorter = await core.delete_namespaced_pod(
        LLM,
        "ai",
        body=client.V1DeleteOptions(grace_period_seconds=10),
        _request_timeout=T,
    )
    assert shorter.metadata.deletion_grace_period_seconds == 10
    assert shorter.metadata.deletion_timestamp == first.metadata.deletion_timestamp - (
        timedelta(seconds=20)
    )
    await core.delete_namespaced_pod(
        LLM,
        "ai",
        body=client.V1DeleteOptions(grace_period_seconds=0),
        _request_timeout=T,
    )
    assert emulator.get("Pod", LLM, "ai") is None


async def test_unscheduled_and_finished_pods_go_at_once(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """pkg/registry/core/pod/strategy.go CheckGracefulDelete: no nodeName or
    a terminal phase means grace 0, even with a slow kubelet."""
    emulator.deletion_grace = 60
    emulator.add_pod("nowhere", "ai", phase="Pending")
    emulator.add_pod("done", "ai", node=GPU_NODE, phase="Succeeded")
    core = client.CoreV1Api(admin_api)
    for name in ("nowhere", "done"):
        await core.delete_namespaced_pod(name, "ai", _request_timeout=T)
        assert emulator.get("Pod", name, "ai") is None


async def test_delete_preconditions_fail_early(
    emulator: K8sEmulator, admin_api: client.ApiClient
) -> None:
    """rest/delete.go BeforeDelete: 409 naming the Kind, with upstream's
    wording for a UID and a resourceVersion precondition."""
    core = client.CoreV1Api(admin_api)
    pod = emulator.get("Pod", LLM, "ai")
    assert pod is not None
    uid, rv = pod["metadata"]["uid"], pod["metadata"]["resourceVersion"]
    for preconditions, why in (
        (
            client.V1Preconditions(uid="0000"),
            (
                f"the UID in the precondition (0000) does not match the UID in record ({uid}). "
                "The object might have been deleted and then recreated"
            ),
        ),
        (
            client.V1Preconditions(resource_version="1"),
            (
                "the ResourceVersion in the precondition (1) does not match the "
                f"ResourceVersion in record ({rv}). The object might have been modified"
            ),
        ),
    ):
        with pytest.raises(ApiException) as err:
            await core.delete_namespaced_pod(
                LLM,
                "ai",
                body=client.V1DeleteOptions(preconditions=preconditions),
                _request_timeout=T,
            )
        assert err.value.status == 409
        body = status_of(err.value)
        assert body["reason"] == "Conflict"
        assert body["message"] == f'Operation cannot be fulfilled on Pod "{LLM}": {why}'
        assert body["details"] == {"name": LLM, "kind": "Pod"}
    assert emulator.get("Pod", LLM, "ai") is not None


async def test_pods_on_a_notready_node_stay_terminating(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """No kubelet, no final delete: a pod evicted while its node is down
    keeps its deletionTimestamp (201 all the same) for as long as the node
    stays down; once it is back, the kubelet finishes it (kubelet
    syncTerminatingPod; only a force delete or PodGC would otherwise)."""
    emulator.set_node_up(GPU_NODE, False)
    assert (await evict_status(api, LLM, "ai"))[0] == 201
    await asyncio.sleep(0.2)
    core = client.CoreV1Api(api)
    pod = await core.read_namespaced_pod(LLM, "ai", _request_timeout=T)
    assert pod.metadata.deletion_timestamp is not None
    assert pod.status.phase == "Running"
    # Evicting it again is fine: a terminating pod skips budgets.
    assert (await evict_status(api, LLM, "ai"))[0] == 201
    emulator.set_node_up(GPU_NODE, True)
    assert emulator.get("Pod", LLM, "ai") is None


async def test_a_slow_kubelet_that_goes_down_resumes_when_back(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """A pod whose containers were still stopping when the node went down
    is finished by the kubelet after the node is back up (pkg/kubelet
    pod_workers.go: a restarted kubelet resumes terminating pods)."""
    emulator.set_pod_stop_seconds(LLM, "ai", 0.2)
    assert (await evict_status(api, LLM, "ai"))[0] == 201
    emulator.set_node_up(GPU_NODE, False)
    await asyncio.sleep(0.4)
    assert emulator.get("Pod", LLM, "ai") is not None
    emulator.set_node_up(GPU_NODE, True)
    await until_gone(emulator, LLM, "ai")
