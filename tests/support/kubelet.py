"""A stand-in for the k3s agent inside a simulated GPU node VM.

No real kubelet runs here, so nothing would ever mark the emulator's node
NotReady when the simulated VM stops, or Ready when it starts again. This
task does: it watches the tower simulator and keeps the node's Ready
condition (and its Lease) equal to "the VM runs", as a real node's kubelet
and the node lifecycle controller together would.

With ``reschedule`` it also plays the scheduler and the ReplicaSet
controller for the node's own workloads: a pod the drain evicted comes back
on the node once the node is schedulable again, so a demo can hand the cards
over and back as often as it likes.

The tests' ``kubelet`` fixture (tests/conftest.py) and the demo
(scripts/gpu_handoff_demo) both run this one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
import secrets
import time
from typing import Any

from tests.k8semu import GPU, GPU_NODE, K8sEmulator
from tests.k8semu.objects import make_pod
from tests.towersim import Tower


@dataclass(frozen=True)
class Workload:
    """A pod on the node that its ReplicaSet would recreate after an eviction."""

    namespace: str
    owner: str
    labels: dict[str, str]
    image: str
    gpus: int


def _owner_name(pod: dict[str, Any]) -> str | None:
    refs = pod["metadata"].get("ownerReferences") or []
    return next((r["name"] for r in refs if r.get("kind") == "ReplicaSet"), None)


def _gpus(pod: dict[str, Any]) -> int:
    limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


class Kubelet:
    """Keeps ``node`` Ready exactly while the tower's ``vm`` runs."""

    def __init__(
        self,
        tower: Tower,
        cluster: K8sEmulator,
        *,
        node: str = GPU_NODE,
        vm: str = "gpu-node",
        interval: float = 0.05,
        reschedule: bool = False,
        plugin_delay: float | None = 0.2,
    ) -> None:
        self.tower = tower
        self.cluster = cluster
        self.node = node
        self.vm = vm
        self.interval = interval
        # After a boot the kubelet posts no GPUs until the NVIDIA device
        # plugin registered again, this long later (None: it never does).
        self.plugin_delay = plugin_delay
        self._plugin_at: float | None = None
        self.up = cluster.node_is_up(node)
        self.workloads = self._workloads() if reschedule else []
        self._task: asyncio.Task[None] | None = None

    def _workloads(self) -> list[Workload]:
        """The ReplicaSet-owned pods on the node now (DaemonSet and mirror
        pods are never evicted, so they need no scheduler)."""
        found = []
        for pod in self.cluster.list_objects("Pod"):
            owner = _owner_name(pod)
            if pod["spec"].get("nodeName") != self.node or owner is None:
                continue
            found.append(
                Workload(
                    namespace=pod["metadata"]["namespace"],
                    owner=owner,
                    labels=dict(pod["metadata"].get("labels", {})),
                    image=pod["spec"]["containers"][0]["image"],
                    gpus=_gpus(pod),
                )
            )
        return found

    def follow_workloads(self) -> None:
        """From now on, play the scheduler for the node's workloads as they
        are now (what ``reschedule=True`` does at the start)."""
        self.workloads = self._workloads()

    def _free_gpus(self, node: dict[str, Any]) -> int:
        """Allocatable GPUs minus what the pods bound to the node request, as
        kube-scheduler's NodeResourcesFit counts them."""
        allocatable = int(node["status"].get("allocatable", {}).get(GPU, 0))
        used = sum(
            _gpus(pod)
            for pod in self.cluster.list_objects("Pod")
            if pod["spec"].get("nodeName") == self.node
            and pod["status"].get("phase") not in ("Succeeded", "Failed")
        )
        return allocatable - used

    def _schedule(self) -> None:
        """Recreate the node's evicted workloads once it takes pods again. A
        pod that needs more GPUs than the node has free is left Pending and
        unbound, as kube-scheduler leaves it (PodScheduled False,
        Unschedulable: "Insufficient nvidia.com/gpu"), and bound as soon as
        they are free."""
        node = self.cluster.get("Node", self.node, "")
        if node is None or node["spec"].get("unschedulable"):
            return
        free = self._free_gpus(node)
        for workload in self.workloads:
            mine = [
                pod
                for pod in self.cluster.list_objects("Pod", workload.namespace)
                if _owner_name(pod) == workload.owner
                and not pod["metadata"].get("deletionTimestamp")
            ]
            if mine:
                for pod in mine:
                    if not pod["spec"].get("nodeName") and workload.gpus <= free:
                        self._bind(pod)
                        free -= workload.gpus
                continue
            owner = self.cluster.get("ReplicaSet", workload.owner, workload.namespace)
            if owner is None:
                continue
            fits = workload.gpus <= free
            pod = self.cluster.add_pod(
                f"{workload.owner}-{secrets.token_hex(3)}",
                workload.namespace,
                node=self.node if fits else None,
                phase="Running" if fits else "Pending",
                labels=workload.labels,
                owner=self.cluster.owner_ref(owner),
                image=workload.image,
                gpu_request=workload.gpus,
            )
            if fits:
                free -= workload.gpus
            else:
                self._unschedulable(pod)

    def _unschedulable(self, pod: dict[str, Any]) -> None:
        """The status kube-scheduler writes for a pod no node can take."""

        def mutate(obj: dict[str, Any]) -> None:
            obj["status"] = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/2 nodes are available: 1 Insufficient "
                        "nvidia.com/gpu, 1 node(s) had untolerated taint "
                        "{node-role.kubernetes.io/control-plane: }.",
                    }
                ],
                "qosClass": "Burstable",
            }

        meta = pod["metadata"]
        self.cluster.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)

    def _bind(self, pod: dict[str, Any]) -> None:
        """Bind a waiting pod to the node (kube-scheduler), and run it (the
        kubelet): the status a fresh running pod has."""
        meta = pod["metadata"]
        running = make_pod(meta["name"], meta["namespace"], node=self.node)

        def mutate(obj: dict[str, Any]) -> None:
            obj["spec"]["nodeName"] = self.node
            obj["status"] = running["status"]

        self.cluster.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)

    def step(self) -> None:
        """Look once: the node follows the VM; workloads come back if asked."""
        # The simulator writes its state file while we may read it; a torn
        # read is simply tried again on the next look.
        with contextlib.suppress(OSError, ValueError, KeyError):
            running = self.tower.is_running(self.vm)
            if running != self.up:
                self.cluster.set_node_up(self.node, running)
                self.up = running
                if running:
                    # A kubelet just started: capacity drops to zero until
                    # the device plugin re-registers (devicemanager).
                    self.cluster.set_node_gpus(self.node, 0)
                    self._plugin_at = (
                        None
                        if self.plugin_delay is None
                        else time.monotonic() + self.plugin_delay
                    )
            if (
                self.up
                and self._plugin_at is not None
                and time.monotonic() >= self._plugin_at
            ):
                self._plugin_at = None
                self.cluster.set_node_gpus(self.node, self._cards())
        if self.up and self.workloads:
            self._schedule()

    def _cards(self) -> int:
        """The cards the running VM holds (its live definition's), one GPU
        each, as the device plugin advertises them."""
        functions = self.tower.live_hostdevs(self.vm) or []
        return len({address.rsplit(".", 1)[0] for address in functions})

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled."""
        while True:
            self.step()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        """Run in a task of the running loop (``stop`` ends it)."""
        self._task = asyncio.create_task(self.run(), name=f"kubelet {self.node}")

    async def stop(self) -> None:
        """End the task started by ``start``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
