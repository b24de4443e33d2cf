"""A stand-in for the k3s agent inside a simulated GPU node VM.

No real kubelet runs here: this task watches the tower simulator and plays
the GPU node's kubelet around each stop and boot of its VM, as a real k3s
node behaves (the Kubernetes API emulator plays the control plane):

- the VM stops: the kubelet falls silent. It posts no NotReady (on k3s
  graceful node shutdown is off), its Lease is no longer renewed, and the
  node keeps showing what it last posted: Ready=True, the old bootID, the
  old GPUs. The emulator's node monitor marks it Unknown, with the
  unreachable taints, once its grace period has passed since the last
  heartbeat (``K8sEmulator.node_monitor_grace_period``);
- the VM boots: ``boot_delay`` later the new kubelet's first status post,
  Ready=True with a NEW ``status.nodeInfo.bootID`` and ``nvidia.com/gpu``
  present and 0 (the device manager's checkpoint, no healthy device yet);
  the Lease renews again;
- ``plugin_delay`` after that the NVIDIA device plugin has registered: the
  cards the VM runs with, one GPU each.

A VM stopped and started again within the grace period therefore shows
Ready=True all along, with the old bootID until the new kubelet posts.

The delays are seconds or callables drawing them (a seeded random
generator's), drawn at each boot. The defaults are a real k3s node's pace;
``FAST`` is the tests' (the same order, about a hundred times faster).

With ``reschedule`` it also plays the scheduler and the ReplicaSet
controller for the node's own workloads: a pod the drain evicted comes back
on the node once the node serves again, so a demo can hand the cards over
and back as often as it likes.

The tests' ``kubelet`` fixture (tests/conftest.py), the chaos soak
(tests/chaos/harness.py) and the demo (scripts/gpu_handoff_demo) all run this
one implementation; tests/k8semu/test_node_lifecycle.py pins it to upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import contextlib
from dataclasses import dataclass
import secrets
import time
from typing import Any, Final, TypedDict

from tests.k8semu import GPU, GPU_NODE, K8sEmulator
from tests.k8semu.objects import make_pod, new_boot_id
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


# A delay in seconds, or what draws one (at each boot).
Delay = float | Callable[[], float]

# A real k3s node's pace, in seconds after the VM starts: the k3s agent and
# its kubelet are up and post the node's status ...
BOOT_DELAY: Final = 15.0
# ... and this long after that the NVIDIA device plugin's pod runs and has
# registered its GPUs with the kubelet.
PLUGIN_DELAY: Final = 25.0


# The tests' pace: the same order, about a hundred times faster (with the
# emulator fixture's grace period of 0.5 s).
class Pace(TypedDict):
    """A kubelet's pace, for ``Kubelet(..., **pace)``."""

    boot_delay: float
    plugin_delay: float


FAST: Final[Pace] = {"boot_delay": 0.1, "plugin_delay": 0.2}


def _draw(delay: Delay) -> float:
    return delay() if callable(delay) else float(delay)


@dataclass(frozen=True)
class _Look:
    """The VM as one look at the simulator saw it."""

    running: bool
    boot: int | None  # the domain id: a new one each boot
    cards: int  # the cards its running definition holds


_FIRST: Final = -1  # no look yet


class Kubelet:
    """The kubelet of the node ``node`` inside the tower's VM ``vm``."""

    def __init__(
        self,
        tower: Tower,
        cluster: K8sEmulator,
        *,
        node: str = GPU_NODE,
        vm: str = "gpu-node",
        interval: float = 0.05,
        reschedule: bool = False,
        boot_delay: Delay = BOOT_DELAY,
        plugin_delay: Delay | None = PLUGIN_DELAY,
        threaded: bool = False,
    ) -> None:
        self.tower = tower
        self.cluster = cluster
        self.node = node
        self.vm = vm
        self.interval = interval
        # After the VM starts, its kubelet's first status post comes this
        # long later; the device plugin registers the GPUs ``plugin_delay``
        # after that (None: it never does). Read at each boot: a test may
        # change them between boots.
        self.boot_delay = boot_delay
        self.plugin_delay = plugin_delay
        # Read the simulator in a worker thread (``run``), off the event loop.
        self.threaded = threaded
        # Each bootID this kubelet posted, the last one last.
        self.boot_ids: list[str] = []
        self._boot: int | None = _FIRST  # the VM boot followed (None: off)
        self._post_at: float | None = None
        self._plugin_at: float | None = None
        self.workloads = self._workloads() if reschedule else []
        self._task: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        """Whether the kubelet of the VM's current boot posts the node's
        status (it posted once and the VM still runs)."""
        return self._boot not in (None, _FIRST) and self._post_at is None

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

    def look(self) -> _Look:
        """One look at the simulated VM (reads the simulator's state file)."""
        dom = self.tower.world().doms[self.vm]
        if not dom.running:
            return _Look(running=False, boot=None, cards=0)
        functions = dom.addresses()
        return _Look(
            running=True,
            boot=dom.id,
            cards=len({address.rsplit(".", 1)[0] for address in functions}),
        )

    def step(self) -> None:
        """Look once and act; the workloads come back if asked."""
        # The simulator writes its state file while we may read it; a torn
        # read is simply tried again on the next look.
        with contextlib.suppress(OSError, ValueError, KeyError):
            self.follow(self.look())

    def follow(self, look: _Look) -> None:
        """Act on one look at the VM: fall silent when it stopped, post the
        new boot's status ``boot_delay`` after it started, the GPUs
        ``plugin_delay`` after that."""
        now = time.monotonic()
        if self._boot == _FIRST:
            self._adopt(look, now)
        elif not look.running:
            if self._boot is not None:
                # The VM stopped: nothing is posted any more, the node keeps
                # its last status; the control plane marks it Unknown after
                # its grace period.
                self.cluster.stop_node_heartbeats(self.node)
                self._boot = self._post_at = self._plugin_at = None
        elif look.boot != self._boot:
            if self._boot is not None:
                # Stopped and started again between two looks: the old
                # kubelet died with its VM all the same.
                self.cluster.stop_node_heartbeats(self.node)
            self._boot = look.boot
            self._post_at = now + _draw(self.boot_delay)
            self._plugin_at = None
        if self._post_at is not None and now >= self._post_at:
            # The new kubelet's first status post: Ready, this boot's id,
            # nvidia.com/gpu restored from the device manager's checkpoint
            # with no healthy device (devicemanager GetCapacity: 0).
            boot_id = new_boot_id()
            self.boot_ids.append(boot_id)
            self.cluster.post_node_status(self.node, boot_id=boot_id, gpus=0)
            self._post_at = None
            plugin = self.plugin_delay
            self._plugin_at = None if plugin is None else now + _draw(plugin)
        if self._plugin_at is not None and now >= self._plugin_at:
            # The device plugin registered: the cards the VM runs with.
            self._plugin_at = None
            self.cluster.set_node_gpus(self.node, look.cards)
        if self.up and self.workloads:
            self._schedule()

    def _adopt(self, look: _Look, now: float) -> None:
        """The first look: the node as it is belongs to the VM as it is. A
        running VM whose node's kubelet posts is the boot it posted from; a
        running VM with a silent node is booting; a VM that is off has a
        silent kubelet."""
        self._boot = look.boot
        node = self.cluster.get("Node", self.node, "")
        boot_id = ((node or {}).get("status") or {}).get("nodeInfo", {}).get("bootID")
        if boot_id:
            self.boot_ids.append(boot_id)
        if not look.running:
            if self.cluster.node_is_up(self.node):
                self.cluster.stop_node_heartbeats(self.node)
        elif not self.cluster.node_is_up(self.node):
            self._post_at = now + _draw(self.boot_delay)

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled."""
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                if self.threaded:
                    look = await asyncio.to_thread(self.look)
                else:
                    look = self.look()
                self.follow(look)
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
