"""A node around a stop and a boot of its VM, as a real k3s node shows it: the
emulator playing the control plane, tests/support/kubelet.py the kubelet.

Upstream (kubernetes/kubernetes unless said otherwise):

- pkg/controller/nodelifecycle/node_lifecycle_controller.go, tryUpdateNodeHealth:
  the controller's probeTimestamp moves when the Ready condition's
  lastHeartbeatTime changes or the node's Lease is renewed; once it is older
  than nodeMonitorGracePeriod, Ready, MemoryPressure, DiskPressure and
  PIDPressure turn Unknown, reason "NodeStatusUnknown", message "Kubelet
  stopped posting node status.", lastTransitionTime now, lastHeartbeatTime
  left as the kubelet posted it. Until then nothing changes: the node shows
  the Ready=True its kubelet last posted. monitorNodeHealth runs every
  nodeMonitorPeriod and marks the node's pods not Ready (MarkPodsNotReady)
  when Ready leaves True; doNoScheduleTaintingPass maps Ready=Unknown to the
  ``node.kubernetes.io/unreachable`` NoSchedule taint
  (nodeConditionToTaintKeyStatusMap) and processTaintBaseEviction /
  markNodeForTainting adds UnreachableTaintTemplate (NoExecute);
  markNodeAsReachable takes them off once Ready is True again.
- pkg/controller/nodelifecycle/config/v1alpha1/defaults.go,
  RecommendedDefaultNodeLifecycleControllerConfiguration: NodeMonitorGracePeriod
  40 s until 1.31; kubernetes/kubernetes#126287 ("The default value for
  node-monitor-grace-period has been increased to 50s (earlier 40s)") made it
  50 s from 1.32, which is why node_lifecycle_controller.go now asks for more
  than HTTP2_PING_TIMEOUT_SECONDS + HTTP2_READ_IDLE_TIMEOUT_SECONDS (45 s).
  The flag: cmd/kube-controller-manager/app/options/nodelifecyclecontroller.go
  AddFlags, ``--node-monitor-grace-period``. nodeMonitorPeriod: 5 s. The
  emulator's defaults are 50 s and 5 s (its nodes run k3s v1.34).
- staging/src/k8s.io/component-helpers/apimachinery/lease/controller.go (the
  kubelet's node lease controller): renews every leaseDurationSeconds / 4
  (10 s of 40) while the kubelet runs; nothing renews it while it is off.
- pkg/kubelet/nodeshutdown: graceful node shutdown, the only path on which a
  stopping kubelet posts NotReady, is off while shutdownGracePeriod is 0 (the
  kubelet default, and k3s sets none).
- pkg/kubelet/nodestatus/setters.go MachineInfo: ``nodeInfo.bootID`` is the
  machine's boot id (cadvisor reads /proc/sys/kernel/random/boot_id, a new
  random UUID at each boot); the new kubelet's first status post
  (kubelet_node_status.go tryUpdateNodeStatus) carries it with Ready=True.
- pkg/kubelet/cm/devicemanager/manager.go, GetCapacity: after a kubelet
  restart the device manager has its resources back from its checkpoint
  with no healthy device ("device plugin resource capacities can temporarily
  drop to zero till corresponding device plugins re-register"): capacity
  and allocatable ``nvidia.com/gpu`` present and 0 until the plugin
  registers, then the device count.

The emulator fixture runs the control plane a hundred times faster (grace
0.5 s, node monitor every 0.05 s, leases every 0.05 s) and the kubelet at
``FAST`` (first post 0.1 s after the boot, GPUs 0.2 s later): the same order
as a real node. The tests wait on the store's change events, not on sleeps.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.kubelet import FAST, Kubelet
from tests.towersim import Tower

from . import GPU, GPU_NODE, K8sEmulator
from .nodelog import NodeLog, Seen
from .objects import new_boot_id

UNREACHABLE = {
    ("node.kubernetes.io/unreachable", "NoSchedule"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
}


def _node(emulator: K8sEmulator, name: str = GPU_NODE) -> dict[str, Any]:
    node = emulator.get("Node", name, "")
    assert node is not None
    return node


def _conditions(seen: Seen) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in seen.node["status"]["conditions"]}


def _pods_ready(emulator: K8sEmulator) -> dict[str, str]:
    return {
        pod["metadata"]["name"]: next(
            c["status"] for c in pod["status"]["conditions"] if c["type"] == "Ready"
        )
        for pod in emulator.list_objects("Pod")
        if pod["spec"].get("nodeName") == GPU_NODE and pod["status"].get("conditions")
    }


async def _renewed(log: NodeLog, count: int) -> None:
    """Until the node's Lease was renewed ``count`` times since the log began."""
    await log.until(lambda: len(log.renewals) >= count)


def _boot(sim: Tower) -> None:
    """Start the GPU node VM with every card it defines."""
    sim.start_live("gpu-node", sim.defined_hostdevs("gpu-node"))


# --- the control plane: the emulator --------------------------------------------------


def test_the_default_grace_period_is_upstreams() -> None:
    """RecommendedDefaultNodeLifecycleControllerConfiguration: 50 s since
    1.32 (kubernetes/kubernetes#126287, 40 s before); --node-monitor-period
    5 s."""
    emulator = K8sEmulator()
    assert emulator.node_monitor_grace_period == 50.0
    assert emulator.node_monitor_period == 5.0


def test_the_node_monitor_waits_for_the_grace_period() -> None:
    """tryUpdateNodeHealth: a silent node is left alone while its last
    heartbeat is younger than the grace period; then Unknown. A node whose
    kubelet posts is never marked."""
    emulator = K8sEmulator(node_monitor_grace_period=3600.0)
    emulator.add_node("posting")
    emulator.add_node("silent")
    emulator.stop_node_heartbeats("silent")
    assert emulator.node_monitor_pass() == []
    assert emulator.node_ready_status("silent") == "True"
    emulator.node_monitor_grace_period = 0.0
    assert emulator.node_monitor_pass() == ["silent"]
    assert emulator.node_ready_status("silent") == "Unknown"
    assert emulator.node_ready_status("posting") == "True"
    assert emulator.node_monitor_pass() == []  # marked once


async def test_a_silent_node_stays_ready_through_the_grace_period(
    emulator: K8sEmulator, log: NodeLog
) -> None:
    """tryUpdateNodeHealth, doNoScheduleTaintingPass, markNodeForTainting,
    MarkPodsNotReady: the kubelet falls silent; the node shows Ready=True as
    last posted until the grace period has passed since its last heartbeat
    (the last Lease renewal), then Ready and the pressure conditions are
    Unknown with NodeStatusUnknown, the heartbeat is still the kubelet's,
    both unreachable taints are on and its pods are not Ready."""
    await log.until(lambda: len(log.renewals) >= 2)  # the Lease renews
    before = _conditions(log.last)
    assert set(_pods_ready(emulator).values()) == {"True"}
    emulator.stop_node_heartbeats(GPU_NODE)
    stopped = time.monotonic()
    assert not emulator.node_is_up(GPU_NODE)
    last_heartbeat = log.renewals[-1]

    await log.until(lambda: log.last.ready == "Unknown")
    unknown_at = log.last.at
    grace = emulator.node_monitor_grace_period
    assert unknown_at - last_heartbeat > grace
    assert unknown_at - stopped < grace + 1.0
    # Until then the node did not change at all.
    assert [seen.ready for seen in log.seen] == ["True", "Unknown"]
    assert log.renewals[-1] == last_heartbeat  # no renewal while silent

    conditions = _conditions(log.last)
    for kind in ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure"):
        assert conditions[kind]["status"] == "Unknown"
        assert conditions[kind]["reason"] == "NodeStatusUnknown"
        assert conditions[kind]["message"] == "Kubelet stopped posting node status."
        assert (
            conditions[kind]["lastHeartbeatTime"] == before[kind]["lastHeartbeatTime"]
        )
    assert log.last.taints >= UNREACHABLE
    assert set(_pods_ready(emulator).values()) == {"False"}
    assert log.last.boot_id == log.seen[0].boot_id


async def test_a_status_post_brings_the_node_back(
    emulator: K8sEmulator, log: NodeLog
) -> None:
    """The new kubelet's first post (tryUpdateNodeStatus with the nodestatus
    setters): Ready=True with a heartbeat now, the new bootID, the device
    manager's GPUs (0 from its checkpoint), all in one write; the Lease
    renews again; markNodeAsReachable takes the unreachable taints off; the
    running pods are Ready again."""
    emulator.set_node_up(GPU_NODE, False)
    assert log.last.ready == "Unknown"
    renewals = len(log.renewals)
    boot_id = new_boot_id()
    emulator.post_node_status(GPU_NODE, boot_id=boot_id, gpus=0)
    writes = [seen for seen in log.seen if seen.boot_id == boot_id]
    assert len(writes) == 1
    [back] = writes
    assert (back.ready, back.capacity, back.allocatable) == ("True", "0", "0")
    assert not back.taints & UNREACHABLE
    assert len(log.renewals) == renewals + 1
    assert emulator.node_is_up(GPU_NODE)
    assert set(_pods_ready(emulator).values()) == {"True"}


# --- the kubelet: tests/support/kubelet.py --------------------------------------------


async def test_a_stopped_vm_leaves_the_node_ready_until_the_grace_period_ends(
    sim: Tower, emulator: K8sEmulator, kubelet: Kubelet, log: NodeLog
) -> None:
    """pkg/kubelet/nodeshutdown (off on k3s) and the node lease controller:
    the VM powers off and its kubelet posts nothing, not even NotReady; the
    Lease stops renewing; the node keeps Ready=True, its bootID and its GPUs
    until tryUpdateNodeHealth marks it Unknown with the unreachable taints
    (doNoScheduleTaintingPass, markNodeForTainting) after the grace period."""
    old = log.last
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    await log.until(lambda: not emulator.node_is_up(GPU_NODE))
    silent_at = time.monotonic()
    assert emulator.node_ready_status(GPU_NODE) == "True"
    renewals = len(log.renewals)

    await log.until(lambda: log.last.ready == "Unknown")
    assert log.last.at - silent_at >= emulator.node_monitor_grace_period - 0.1
    assert len(log.renewals) == renewals
    stale = [seen for seen in log.seen if seen.ready == "True"]
    assert {(s.boot_id, s.allocatable) for s in stale} == {(old.boot_id, "3")}
    assert log.last.taints >= UNREACHABLE
    assert (log.last.boot_id, log.last.allocatable) == (old.boot_id, "3")


async def test_each_boot_has_a_new_boot_id_and_its_gpus_after_the_plugin(
    sim: Tower, emulator: K8sEmulator, kubelet: Kubelet, log: NodeLog
) -> None:
    """tryUpdateNodeStatus and the MachineInfo setter, then devicemanager
    GetCapacity: boot_delay after the VM starts, the first post of the new
    kubelet says Ready=True with a bootID never seen before and
    nvidia.com/gpu present and 0 (capacity and allocatable); the Lease
    renews again from then on; plugin_delay later the cards the VM runs
    with. Twice: a boot id per boot, and a VM started with two of its three
    cards advertises two."""
    first = log.last.boot_id
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    await log.until(lambda: log.last.ready == "Unknown")
    seen_ids = {first}

    for functions, cards in (
        (sim.defined_hostdevs("gpu-node"), "3"),
        (
            [
                a
                for a in sim.defined_hostdevs("gpu-node")
                if not a.startswith("0000:01")
            ],
            "2",
        ),
    ):
        silent_renewals = len(log.renewals)
        started = time.monotonic()
        sim.start_live("gpu-node", functions)
        await log.until(lambda: log.last.ready == "True")
        ready = log.last
        assert ready.at - started >= FAST["boot_delay"]
        assert ready.boot_id not in seen_ids
        seen_ids.add(ready.boot_id)
        assert (ready.capacity, ready.allocatable) == ("0", "0")
        assert not ready.taints & UNREACHABLE
        assert len(log.renewals) > silent_renewals
        assert kubelet.boot_ids[-1] == ready.boot_id

        await log.until(lambda: log.last.allocatable != "0")
        assert (log.last.capacity, log.last.allocatable) == (cards, cards)
        assert log.last.at - ready.at >= FAST["plugin_delay"]
        assert log.last.boot_id == ready.boot_id
        await _renewed(log, silent_renewals + 3)

        sim.guest_shutdown("gpu-node")
        sim.advance(60)
        await log.until(lambda: log.last.ready == "Unknown")


async def test_a_restart_within_the_grace_period_shows_ready_with_the_old_boot_id(
    sim: Tower, emulator: K8sEmulator, kubelet: Kubelet, log: NodeLog
) -> None:
    """The moment a product must not take for "back": the VM stops and starts
    again before the grace period ends (tryUpdateNodeHealth has no reason to
    act), so the node is Ready=True all along; until the new kubelet posts it
    still shows the previous boot's bootID and GPUs (and its Lease does not
    renew: no kubelet runs)."""
    emulator.node_monitor_grace_period = 3.0  # ample on a loaded machine
    old = log.last
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    await log.until(lambda: not emulator.node_is_up(GPU_NODE))
    _boot(sim)
    # Booting: no kubelet yet, the node as the previous boot left it.
    node = _node(emulator)
    assert emulator.node_ready_status(GPU_NODE) == "True"
    assert node["status"]["nodeInfo"]["bootID"] == old.boot_id
    assert node["status"]["allocatable"][GPU] == "3"

    await log.until(lambda: log.last.boot_id != old.boot_id)
    new = log.last
    assert [seen.ready for seen in log.seen] == ["True"] * len(log.seen)
    assert all(seen.boot_id == old.boot_id for seen in log.seen[:-1])
    assert (new.ready, new.allocatable) == ("True", "0")
    await log.until(lambda: log.last.allocatable == "3")
    assert {seen.ready for seen in log.seen} == {"True"}


async def test_a_restart_between_two_looks_is_a_new_boot(
    sim: Tower, emulator: K8sEmulator
) -> None:
    """The simulator's domain id changes at each boot: a kubelet that missed
    the stop still sees a new boot, falls silent and posts a new bootID."""
    stand_in = Kubelet(sim, emulator, boot_delay=0.0, plugin_delay=None)
    stand_in.step()
    [first] = stand_in.boot_ids
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    _boot(sim)
    stand_in.step()  # boot_delay 0: the new kubelet posts at once
    assert len(stand_in.boot_ids) == 2
    assert stand_in.boot_ids[-1] != first
    node = _node(emulator)
    assert node["status"]["nodeInfo"]["bootID"] == stand_in.boot_ids[-1]
    assert node["status"]["allocatable"][GPU] == "0"  # no plugin ever
