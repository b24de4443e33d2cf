"""Tolerations as the API server, the scheduler and the taint eviction
controller read them: a cordoned node taking back the pods that tolerate its
cordon, an unreachable node's pods deleted after their toleration.

Upstream (kubernetes/kubernetes unless said otherwise):

- k8s.io/api core/v1 toleration.go, ToleratesTaint: an empty effect matches
  every effect, an empty key every key; the operator Exists matches any
  value, Equal (or none) only the same value.
- pkg/scheduler/framework/plugins/nodeunschedulable/node_unschedulable.go,
  Filter: a node whose spec.unschedulable is set takes a pod only if the
  pod's tolerations tolerate ``node.kubernetes.io/unschedulable:NoSchedule``
  ("If pod tolerate unschedulable taint, it's also tolerate
  `node.Spec.Unschedulable`"). So a Deployment whose pods tolerate
  everything (``tolerations: [{operator: Exists}]``, as many monitoring
  agents and GPU operator helpers do) has its evicted pod recreated by its
  ReplicaSet and bound to the cordoned node again.
- plugin/pkg/admission/defaulttolerationseconds/admission.go, Admit: every
  pod created without a toleration for ``node.kubernetes.io/not-ready`` or
  ``node.kubernetes.io/unreachable`` (NoExecute, or an empty key or effect)
  gets ``{key, operator: Exists, effect: NoExecute, tolerationSeconds:
  300}`` for it.
- pkg/controller/daemon/util/daemonset_util.go, AddOrUpdateDaemonPodTolerations
  (NewPod): a DaemonSet's pods tolerate not-ready and unreachable NoExecute
  for ever, and the cordon.
- pkg/controller/tainteviction/taint_eviction.go: on a node tainted
  ``node.kubernetes.io/unreachable:NoExecute`` (the node lifecycle
  controller's, once the node is Unknown), processPodOnNode deletes a pod
  that does not tolerate the taint at once, and one that does
  getMinTolerationTime later (the least tolerationSeconds of the matching
  tolerations; none: never), through addConditionAndDeletePod (condition
  DisruptionTarget, reason DeletionByTaintManager, then a graceful delete).
  With no kubelet to finish it, the pod stays Terminating until the node's
  kubelet is back (pkg/kubelet/pod_workers.go resumes terminating pods).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
import contextlib
import time
from typing import Any

import pytest

from tests.support.kubelet import FAST, Kubelet
from tests.towersim import Tower

from . import GPU_NODE, K8sEmulator
from .objects import UNSCHEDULABLE_TAINT, tolerates
from .store import StoredEvent

EVERYTHING = [{"operator": "Exists"}]
BOUND = 10.0


@pytest.mark.parametrize(
    ("toleration", "taint", "expected"),
    [
        ({"operator": "Exists"}, UNSCHEDULABLE_TAINT, True),
        (
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists"},
            UNSCHEDULABLE_TAINT,
            True,
        ),
        (
            {
                "key": "node.kubernetes.io/unschedulable",
                "operator": "Exists",
                "effect": "NoSchedule",
            },
            UNSCHEDULABLE_TAINT,
            True,
        ),
        (
            {
                "key": "node.kubernetes.io/unschedulable",
                "operator": "Exists",
                "effect": "NoExecute",
            },
            UNSCHEDULABLE_TAINT,
            False,
        ),
        (
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists"},
            UNSCHEDULABLE_TAINT,
            False,
        ),
        # Equal (or no operator) compares values: the cordon's taint has none
        ({"key": "node.kubernetes.io/unschedulable"}, UNSCHEDULABLE_TAINT, True),
        (
            {"key": "node.kubernetes.io/unschedulable", "value": "x"},
            UNSCHEDULABLE_TAINT,
            False,
        ),
        (
            {"key": "dedicated", "operator": "Equal", "value": "gpu"},
            {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
            True,
        ),
        # an unknown operator matches nothing
        (
            {"operator": "Gt", "key": "node.kubernetes.io/unschedulable"},
            UNSCHEDULABLE_TAINT,
            False,
        ),
    ],
)
def test_tolerates_is_toleratestaint(
    toleration: dict[str, Any], taint: dict[str, Any], expected: bool
) -> None:
    assert tolerates([toleration], taint) is expected


def test_no_toleration_tolerates_nothing() -> None:
    assert tolerates(None, UNSCHEDULABLE_TAINT) is False
    assert tolerates([], UNSCHEDULABLE_TAINT) is False


def _tolerations(emulator: K8sEmulator, name: str) -> list[dict[str, Any]]:
    pod = emulator.get("Pod", name, "ai")
    assert pod is not None
    found: list[dict[str, Any]] = pod["spec"].get("tolerations", [])
    return found


def test_admission_adds_the_default_toleration_seconds(emulator: K8sEmulator) -> None:
    """DefaultTolerationSeconds: 300 s for not-ready and unreachable, unless
    the pod tolerates that taint already."""
    emulator.add_pod("plain", "ai", node=GPU_NODE)
    assert _tolerations(emulator, "plain") == [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        }
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    emulator.add_pod("everything", "ai", node=GPU_NODE, tolerations=EVERYTHING)
    assert _tolerations(emulator, "everything") == EVERYTHING
    own = {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "tolerationSeconds": 6000,
    }
    emulator.add_pod("patient", "ai", node=GPU_NODE, tolerations=[own])
    assert _tolerations(emulator, "patient") == [
        own,
        {
            "key": "node.kubernetes.io/not-ready",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        },
    ]


@pytest.fixture
async def scheduler(sim: Tower, emulator: K8sEmulator) -> AsyncIterator[Kubelet]:
    """The GPU node's kubelet, playing the scheduler and the ReplicaSet
    controller for a workload that tolerates everything and one that does
    not."""
    for name, tolerations in (("agent", EVERYTHING), ("plain", None)):
        labels = {"app": name, "pod-template-hash": "abc12"}
        owner = emulator.add_replicaset(
            f"{name}-abc12", "ai", labels=labels, image="registry.example/app:1.0"
        )
        emulator.add_pod(
            f"{name}-abc12-first",
            "ai",
            node=GPU_NODE,
            labels=labels,
            owner=emulator.owner_ref(owner),
            tolerations=tolerations,
        )
    stand_in = Kubelet(sim, emulator, reschedule=True, **FAST)
    stand_in.start()
    yield stand_in
    await stand_in.stop()


def _on_node(emulator: K8sEmulator, app: str) -> list[str]:
    return [
        pod["metadata"]["name"]
        for pod in emulator.list_objects("Pod", "ai")
        if pod["metadata"]["labels"].get("app") == app
        and pod["spec"].get("nodeName") == GPU_NODE
        and not pod["metadata"].get("deletionTimestamp")
    ]


async def _until(emulator: K8sEmulator, done: Callable[[], bool]) -> None:
    """Until ``done`` holds, woken by each change the emulator stores."""
    changed = asyncio.Event()

    def on(_event: StoredEvent) -> None:
        changed.set()

    emulator.store.listeners.append(on)
    try:
        async with asyncio.timeout(BOUND):
            while not done():
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.5)
    finally:
        emulator.store.listeners.remove(on)


def _set_cordon(emulator: K8sEmulator, cordoned: bool) -> None:
    def mutate(node: dict[str, Any]) -> None:
        if cordoned:
            node["spec"]["unschedulable"] = True
        else:
            node["spec"].pop("unschedulable", None)

    emulator.modify("Node", GPU_NODE, "", mutate=mutate)


async def test_a_cordoned_node_takes_back_only_the_pods_tolerating_its_cordon(
    emulator: K8sEmulator, scheduler: Kubelet
) -> None:
    """NodeUnschedulable's Filter: both pods deleted from the cordoned node,
    the ReplicaSets recreate them; the one tolerating everything is bound to
    the cordoned node again at once, the other waits for the uncordon."""
    _set_cordon(emulator, True)
    for app in ("agent", "plain"):
        emulator.remove_pod(f"{app}-abc12-first", "ai")
    await _until(emulator, lambda: len(_on_node(emulator, "agent")) == 1)
    assert _on_node(emulator, "agent") != ["agent-abc12-first"]
    assert _on_node(emulator, "plain") == []
    _set_cordon(emulator, False)
    await _until(emulator, lambda: len(_on_node(emulator, "plain")) == 1)
    assert len(_on_node(emulator, "agent")) == 1


def _pod(emulator: K8sEmulator, name: str) -> dict[str, Any] | None:
    return emulator.get("Pod", name, "ai")


def _deleted(emulator: K8sEmulator, name: str) -> bool:
    pod = _pod(emulator, name)
    return pod is not None and bool(pod["metadata"].get("deletionTimestamp"))


async def test_an_unreachable_nodes_pods_go_after_their_toleration(
    emulator: K8sEmulator,
) -> None:
    """At the fixture's pace (tolerationSeconds a hundred times faster): a
    pod tolerating the unreachable taint for 60 s is deleted 0.6 s after the
    node turned Unknown, one with the default 300 s after 3 s, one that
    tolerates everything never; the deleted ones stay Terminating while the
    node is away, and are gone once its kubelet posts again."""
    emulator.add_pod("default", "ai", node=GPU_NODE)
    emulator.add_pod("forever", "ai", node=GPU_NODE, tolerations=EVERYTHING)
    emulator.add_pod(
        "minute",
        "ai",
        node=GPU_NODE,
        tolerations=[
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 60,
            }
        ],
    )
    daemonset = emulator.add_daemonset(
        "exporter", "ai", labels={"name": "exporter"}, image="registry.example/e:1"
    )
    emulator.add_pod(
        "exporter-x1", "ai", node=GPU_NODE, owner=emulator.owner_ref(daemonset)
    )
    tolerations = _tolerations(emulator, "exporter-x1")
    assert tolerates(tolerations, UNSCHEDULABLE_TAINT)
    assert all("tolerationSeconds" not in t for t in tolerations)
    # (Read before: the node may be marked away at any moment of the call,
    # and a bound from after it would be short by however long it took.)
    away = time.monotonic()
    emulator.set_node_up(GPU_NODE, False)
    await _until(emulator, lambda: _deleted(emulator, "minute"))
    assert time.monotonic() - away >= 0.6
    assert not _deleted(emulator, "default")
    await _until(emulator, lambda: _deleted(emulator, "default"))
    assert time.monotonic() - away >= 3.0
    assert not _deleted(emulator, "forever")
    assert not _deleted(emulator, "exporter-x1")
    terminating = _pod(emulator, "default")
    assert terminating is not None
    [target] = [
        c
        for c in terminating["status"]["conditions"]
        if c["type"] == "DisruptionTarget"
    ]
    assert (target["status"], target["reason"]) == ("True", "DeletionByTaintManager")
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30

    emulator.set_node_up(GPU_NODE, True)
    await _until(
        emulator,
        lambda: _pod(emulator, "default") is None and _pod(emulator, "minute") is None,
    )
    assert not _deleted(emulator, "forever")
