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
  Ready=True with a NEW ``status.nodeInfo.bootID`` and its GPU resources
  present and 0 (the device manager's checkpoint, no healthy device yet);
  the Lease renews again;
- ``plugin_delay`` after that the NVIDIA device plugin has registered: the
  cards the VM runs with, each advertised as the node's device plugin says
  (``K8sEmulator.device_plugin``: one ``nvidia.com/gpu``, ``replicas``
  ``nvidia.com/gpu.shared``, or its ``nvidia.com/mig-*`` devices).

A VM stopped and started again within the grace period therefore shows
Ready=True all along, with the old bootID until the new kubelet posts.

The pods on the node lose their sandboxes with the VM. At the first post
the new kubelet makes new ones:

- at once for a pod on the host network (``spec.hostNetwork``): its sandbox
  needs no network plugin (containerd internal/cri/server/sandbox_run.go,
  RunPodSandbox, sets up the pod network only ``if !hostNetwork(config)``;
  pkg/kubelet/kubelet.go SyncPod lets host-network pods through while the
  runtime's network is not ready);
- for a pod on the pod network, once the network is ready: ``network_delay``
  after the first post, when k3s's flannel has written
  /run/flannel/subnet.env (None: never, as on the seed's ghost, whose
  br_netfilter never loaded). Until then every attempt, one each
  ``sandbox_retry`` (pkg/kubelet/pod_workers.go requeues a failed sync after
  backOffPeriod, 10 s, jittered), fails with a FailedCreatePodSandBox
  Warning (pkg/kubelet/kuberuntime/kuberuntime_manager.go SyncPod: "Failed
  to create pod sandbox: %v") naming the sandbox it tried, a new id each
  time (containerd: "failed to setup network for sandbox %q: %w";
  containernetworking/cni libcni/api.go: "plugin %s failed (add): %w";
  flannel-io/cni-plugin flannel.go cmdAdd: "failed to load flannel
  'subnet.env' file: %w. Check the flannel pod log for this node."),
  recorded through the node's event recorder (``K8sEmulator.record_event``,
  whose EventCorrelator combines them from the tenth on). A pod bound to the
  node meanwhile waits as well.

``crash_loop`` makes a pod's containers exit again and again; the kubelet
restarts them after CrashLoopBackOff's wait (10 s, doubling, at most
MaxContainerBackOff, 300 s: pkg/kubelet/kubelet.go backOffPeriod and
MaxContainerBackOff).

The delays are seconds or callables drawing them (a seeded random
generator's), drawn at each boot. The defaults are a real k3s node's pace;
``FAST`` is the tests' (the same order, about a hundred times faster).

With ``reschedule`` it also plays the scheduler and the ReplicaSet
controller for the node's own workloads: a pod the drain evicted comes back
on the node once the node serves again, so a demo can hand the cards over
and back as often as it likes.

The tests' ``kubelet`` fixture (tests/conftest.py), the chaos soak
(tests/chaos/harness.py) and the demo (scripts/gpu_handoff_demo) all run this
one implementation; tests/k8semu/test_node_lifecycle.py and
tests/k8semu/test_pod_network.py pin it to upstream.
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
from tests.k8semu.objects import (
    UNSCHEDULABLE_TAINT,
    make_pod,
    new_boot_id,
    tolerates,
)
from tests.k8semu.store import now_rfc3339
from tests.towersim import Tower


@dataclass(frozen=True)
class Workload:
    """A pod on the node that its ReplicaSet would recreate after an eviction."""

    namespace: str
    owner: str
    labels: dict[str, str]
    image: str
    gpus: int
    # its pods' spec.tolerations (admission adds nothing to them again)
    tolerations: tuple[dict[str, Any], ...] = ()

    @property
    def tolerates_cordon(self) -> bool:
        """Whether its pods pass kube-scheduler's NodeUnschedulable filter
        on a cordoned node: they tolerate node.kubernetes.io/unschedulable
        with NoSchedule (pkg/scheduler/framework/plugins/nodeunschedulable)."""
        return tolerates(list(self.tolerations), UNSCHEDULABLE_TAINT)


def _owner_name(pod: dict[str, Any]) -> str | None:
    refs = pod["metadata"].get("ownerReferences") or []
    return next((r["name"] for r in refs if r.get("kind") == "ReplicaSet"), None)


def _gpus(pod: dict[str, Any], resource: str = GPU) -> int:
    limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
    return int(limits.get(resource, 0))


# A delay in seconds, or what draws one (at each boot).
Delay = float | Callable[[], float]

# A real k3s node's pace, in seconds after the VM starts: the k3s agent and
# its kubelet are up and post the node's status ...
BOOT_DELAY: Final = 15.0
# ... and this long after that the NVIDIA device plugin's pod runs and has
# registered its GPUs with the kubelet.
PLUGIN_DELAY: Final = 25.0
# The pod network is ready this long after the first post (flannel, inside
# k3s, has written its subnet file) ...
NETWORK_DELAY: Final = 20.0
# ... and until then a pod's sandbox is tried again this long after each
# failure (pod_workers.go: backOffPeriod).
SANDBOX_RETRY: Final = 10.0
# CrashLoopBackOff: the first wait after a crash, and the most it doubles to.
CRASH_BACKOFF: Final = (10.0, 300.0)
# How long a crash-looping container runs before it exits again.
CRASH_RUNS_FOR: Final = 5.0


# The tests' pace: the same order, about a hundred times faster (with the
# emulator fixture's grace period of 0.5 s).
class Pace(TypedDict):
    """A kubelet's pace, for ``Kubelet(..., **pace)``."""

    boot_delay: float
    plugin_delay: float
    network_delay: float
    sandbox_retry: float


FAST: Final[Pace] = {
    "boot_delay": 0.1,
    "plugin_delay": 0.2,
    "network_delay": 0.05,
    "sandbox_retry": 0.1,
}


def _draw(delay: Delay) -> float:
    return delay() if callable(delay) else float(delay)


@dataclass(frozen=True)
class _Look:
    """The VM as one look at the simulator saw it."""

    running: bool
    boot: int | None  # the domain id: a new one each boot
    cards: int  # the cards its running definition holds


_FIRST: Final = -1  # no look yet

# What a pod's sandbox attempt answers while flannel has not written its
# subnet file: the kubelet's event message around the runtime's error (see
# the module's docstring), with the id of the sandbox it tried.
SANDBOX_FAILURE: Final = (
    "Failed to create pod sandbox: rpc error: code = Unknown desc = failed to "
    'setup network for sandbox "{sandbox}": plugin type="flannel" failed '
    "(add): failed to load flannel 'subnet.env' file: open "
    "/run/flannel/subnet.env: no such file or directory. Check the flannel "
    "pod log for this node."
)
FINISHED: Final = ("Succeeded", "Failed")


@dataclass
class _CrashLoop:
    """A pod whose containers exit after ``runs_for``; restarted after the
    back-off, which doubles from ``backoff[0]`` up to ``backoff[1]``."""

    runs_for: Delay
    backoff: tuple[float, float]
    crash_at: float | None = None  # when the running containers exit
    restart_at: float | None = None  # when the kubelet starts them again
    wait: float = 0.0  # the last back-off (0: none yet)


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
        network_delay: Delay | None = NETWORK_DELAY,
        sandbox_retry: Delay = SANDBOX_RETRY,
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
        # The pod network is ready ``network_delay`` after the first post
        # (None: never); a pod's sandbox is tried every ``sandbox_retry``
        # until then. Read at each boot, like the delays above.
        self.network_delay = network_delay
        self.sandbox_retry = sandbox_retry
        self._network_at: float | None = None
        self._network_waits = False  # this boot's pod network is not ready
        self._known: set[str] = set()  # uids of the pods this boot took on
        self._sandbox_tries: dict[str, float] = {}  # waiting pod uid -> next try
        self._crashing: dict[tuple[str, str], _CrashLoop] = {}
        # Read the simulator in a worker thread (``run``), off the event loop.
        self.threaded = threaded
        # Each bootID this kubelet posted, the last one last.
        self.boot_ids: list[str] = []
        self._boot: int | None = _FIRST  # the VM boot followed (None: off)
        self._post_at: float | None = None
        self._plugin_at: float | None = None
        self.workloads = self._workloads() if reschedule else []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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
                    gpus=_gpus(pod, self.gpu_resource),
                    tolerations=tuple(pod["spec"].get("tolerations") or []),
                )
            )
        return found

    def follow_workloads(self) -> None:
        """From now on, play the scheduler for the node's workloads as they
        are now (what ``reschedule=True`` does at the start)."""
        self.workloads = self._workloads()

    @property
    def gpu_resource(self) -> str:
        """The GPU resource the node's workloads ask for: the first its
        device plugin advertises."""
        return self.cluster.device_plugin(self.node).resource

    def _free_gpus(self, node: dict[str, Any]) -> int:
        """Allocatable GPUs minus what the pods bound to the node request, as
        kube-scheduler's NodeResourcesFit counts them."""
        resource = self.gpu_resource
        allocatable = int(node["status"].get("allocatable", {}).get(resource, 0))
        used = sum(
            _gpus(pod, resource)
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
        they are free. A cordoned node takes only the pods that tolerate its
        cordon (NodeUnschedulable's Filter): those come back to it at once,
        the others wait until it is uncordoned."""
        node = self.cluster.get("Node", self.node, "")
        if node is None:
            return
        cordoned = bool(node["spec"].get("unschedulable"))
        free = self._free_gpus(node)
        for workload in self.workloads:
            if cordoned and not workload.tolerates_cordon:
                continue
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
                gpu_resource=self.gpu_resource,
                tolerations=list(workload.tolerations),
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
                        f"{self.gpu_resource}, 1 node(s) had untolerated taint "
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
            # the GPU resources restored from the device manager's checkpoint
            # with no healthy device (devicemanager GetCapacity: 0).
            boot_id = new_boot_id()
            self.boot_ids.append(boot_id)
            self.cluster.post_node_status(self.node, boot_id=boot_id, gpus=0)
            self._post_at = None
            self._new_sandboxes(now)
            plugin = self.plugin_delay
            self._plugin_at = None if plugin is None else now + _draw(plugin)
        if self._plugin_at is not None and now >= self._plugin_at:
            # The device plugin registered: the cards the VM runs with.
            self._plugin_at = None
            self.cluster.set_node_gpus(self.node, look.cards)
        if self.up and self.workloads:
            self._schedule()
        if self.up:
            self._sync_pods(now)

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

    # --- the pods of a boot ----------------------------------------------------

    def crash_loop(
        self,
        name: str,
        namespace: str,
        *,
        runs_for: Delay = CRASH_RUNS_FOR,
        backoff: tuple[float, float] = CRASH_BACKOFF,
    ) -> None:
        """From now on the pod's containers exit with an error ``runs_for``
        after each start, and are started again after CrashLoopBackOff's
        wait (``backoff``: the first wait and the most it doubles to; the
        kubelet's 10 s and 300 s by default)."""
        self._crashing[namespace, name] = _CrashLoop(runs_for, backoff)

    def _pods_here(self) -> list[dict[str, Any]]:
        """The pods bound to the node that run or wait to (not finished, not
        being deleted)."""
        return [
            pod
            for pod in self.cluster.list_objects("Pod")
            if pod["spec"].get("nodeName") == self.node
            and not pod["metadata"].get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") not in FINISHED
        ]

    def _new_sandboxes(self, now: float) -> None:
        """The first post of a boot: every pod on the node needs a new
        sandbox; the pod network is ready ``network_delay`` from now."""
        delay = self.network_delay
        self._network_at = None if delay is None else now + _draw(delay)
        self._network_waits = True
        self._known = set()
        self._sandbox_tries = {}
        for pod in self._pods_here():
            self._take_on(pod, now)

    def _take_on(self, pod: dict[str, Any], now: float) -> None:
        """This boot's kubelet makes the pod's sandbox: on the host network
        at once (its containers start), on the pod network once the network
        is ready (it waits, and the first try is now)."""
        meta = pod["metadata"]
        self._known.add(meta["uid"])
        if pod["spec"].get("hostNetwork"):
            self.cluster.start_pod_containers(meta["name"], meta["namespace"])
        else:
            self.cluster.lose_pod_sandbox(meta["name"], meta["namespace"])
            self._sandbox_tries[meta["uid"]] = now

    def _sync_pods(self, now: float) -> None:
        """While the pod network is not ready, try the waiting pods'
        sandboxes (each try fails); once it is, start them. Then the crash
        loops."""
        if self._network_waits:
            if self._network_at is not None and now >= self._network_at:
                self._network_waits = False
                for pod in self._pods_here():
                    meta = pod["metadata"]
                    if meta["uid"] in self._sandbox_tries:
                        self.cluster.start_pod_containers(
                            meta["name"], meta["namespace"]
                        )
                self._sandbox_tries = {}
            else:
                for pod in self._pods_here():
                    uid = pod["metadata"]["uid"]
                    if uid not in self._known:
                        self._take_on(pod, now)  # bound to the node meanwhile
                    next_try = self._sandbox_tries.get(uid)
                    if next_try is not None and now >= next_try:
                        self._sandbox_failed(pod)
                        self._sandbox_tries[uid] = now + _draw(self.sandbox_retry)
        self._crash_loops(now)

    def _sandbox_failed(self, pod: dict[str, Any]) -> None:
        """One failed sandbox attempt, as the kubelet records it."""
        self.cluster.record_event(
            self.cluster.get(
                "Pod", pod["metadata"]["name"], pod["metadata"]["namespace"]
            )
            or pod,
            reason="FailedCreatePodSandBox",
            message=SANDBOX_FAILURE.format(sandbox=secrets.token_hex(32)),
            host=self.node,
        )

    def _crash_loops(self, now: float) -> None:
        """Each crash-looping pod's containers exit when their time is up and
        start again when the back-off is over."""
        for (namespace, name), loop in self._crashing.items():
            pod = self.cluster.get("Pod", name, namespace)
            if pod is None or pod["spec"].get("nodeName") != self.node:
                continue
            statuses = (pod.get("status") or {}).get("containerStatuses") or []
            if any("running" in (c.get("state") or {}) for c in statuses):
                loop.restart_at = None
                if loop.crash_at is None:
                    loop.crash_at = now + _draw(loop.runs_for)
                elif now >= loop.crash_at:
                    first, most = loop.backoff
                    loop.wait = min(loop.wait * 2, most) if loop.wait else first
                    loop.crash_at = None
                    loop.restart_at = now + loop.wait
                    self._crash(pod, loop.wait)
            elif loop.restart_at is not None and now >= loop.restart_at:
                loop.restart_at = None
                loop.crash_at = now + _draw(loop.runs_for)
                self._restart(pod)

    def _crash(self, pod: dict[str, Any], wait: float) -> None:
        """The containers exited with an error: terminated (exit code 1,
        Error) in lastState, waiting in CrashLoopBackOff with the kubelet's
        message (kuberuntime_manager.go doBackOff), the pod not Ready; its
        phase stays Running (restartPolicy Always)."""
        now = now_rfc3339()
        meta = pod["metadata"]

        def mutate(obj: dict[str, Any]) -> None:
            status = obj["status"]
            for container in status.get("containerStatuses") or []:
                running = (container.get("state") or {}).get("running") or {}
                container["lastState"] = {
                    "terminated": {
                        "exitCode": 1,
                        "reason": "Error",
                        "startedAt": running.get("startedAt", now),
                        "finishedAt": now,
                    }
                }
                container["state"] = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {wait:g}s restarting failed "
                        f"container={container['name']} pod={meta['name']}_"
                        f"{meta['namespace']}({meta['uid']})",
                    }
                }
                container.update(ready=False, started=False)
            for cond in status.get("conditions") or []:
                if cond["type"] in ("Ready", "ContainersReady"):
                    if cond["status"] != "False":
                        cond["lastTransitionTime"] = now
                    cond.update(status="False", reason="ContainersNotReady")

        self.cluster.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)

    def _restart(self, pod: dict[str, Any]) -> None:
        """The back-off is over: the containers run again, one more restart
        counted, the exit they came back from kept in lastState."""
        now = now_rfc3339()
        meta = pod["metadata"]

        def mutate(obj: dict[str, Any]) -> None:
            status = obj["status"]
            for container in status.get("containerStatuses") or []:
                container["state"] = {"running": {"startedAt": now}}
                container["restartCount"] = int(container.get("restartCount", 0)) + 1
                container.update(ready=True, started=True)
            for cond in status.get("conditions") or []:
                if cond["type"] in ("Ready", "ContainersReady"):
                    if cond["status"] != "True":
                        cond["lastTransitionTime"] = now
                    cond["status"] = "True"
                    cond.pop("reason", None)

        self.cluster.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)

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
        self._loop = asyncio.get_running_loop()
        self.cluster.store.listeners.append(self._on_store)
        self._task = asyncio.create_task(self.run(), name=f"kubelet {self.node}")

    async def stop(self) -> None:
        """End the task started by ``start``."""
        with contextlib.suppress(ValueError):
            self.cluster.store.listeners.remove(self._on_store)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _on_store(self, event: Any) -> None:
        """A pod changed: the ReplicaSet controller and the scheduler work
        from watches, so a followed workload's pod marked for deletion (an
        eviction) is replaced and bound within moments, long before the old
        one has stopped; here on the loop's next turn after the write."""
        if event.resource.kind != "Pod" or not self.workloads or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._schedule_now)

    def _schedule_now(self) -> None:
        if self.up and self.workloads:
            with contextlib.suppress(KeyError, ValueError):
                self._schedule()
