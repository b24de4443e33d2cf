"""The pod network after a boot, and the kubelet's events about it, as the
rigs play them: the kubelet stand-in (tests/support/kubelet.py) makes the
sandboxes of a new boot, the emulator's recorder (recorder.py) writes its
events as client-go's does.

Upstream sources:

- containerd internal/cri/server/sandbox_run.go, RunPodSandbox: the network
  namespace and the CNI ADD only ``if !hostNetwork(config)``; a failure is
  "failed to setup network for sandbox %q: %w" with the sandbox id, new at
  each attempt.
- kubernetes/kubernetes pkg/kubelet/kubelet.go SyncPod: "If the network
  plugin is not ready, only start the pod if it uses the host network"
  (``!kubecontainer.IsHostNetworkPod(pod)``);
  pkg/kubelet/kuberuntime/kuberuntime_manager.go SyncPod: a failed
  createPodSandbox is recorded as a Warning FailedCreatePodSandBox, "Failed
  to create pod sandbox: %v"; pkg/kubelet/pod_workers.go requeues a failed
  sync after backOffPeriod (10 s); pkg/kubelet/kubelet.go backOffPeriod
  and MaxContainerBackOff (300 s) pace CrashLoopBackOff, whose waiting
  message kuberuntime_manager.go doBackOff writes ("back-off %s restarting
  failed container=%s pod=%s").
- containernetworking/cni libcni/api.go AddNetworkList: "plugin %s failed
  (add): %w" (``type="flannel"``); flannel-io/cni-plugin flannel.go cmdAdd:
  "failed to load flannel 'subnet.env' file: %w. Check the flannel pod log
  for this node." while /run/flannel/subnet.env does not exist.
- kubernetes/client-go tools/record/events_cache.go: EventAggregator
  (defaultAggregateMaxEvents 10 in defaultAggregateIntervalInSeconds 600,
  the aggregate key leaving the message out, EventAggregatorByReasonMessageFunc
  "(combined from similar events): "), eventLogger (count + 1 on the same
  key) and EventSourceObjectSpamFilter (burst 25, one more every 300 s), run
  in that order by EventCorrelate; tools/record/event.go recordToSink
  creates or patches what the correlator returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
import itertools
import re
from typing import Any

from kubernetes_asyncio import client
import pytest

from tests.support.kubelet import FAST, SANDBOX_FAILURE, Kubelet
from tests.towersim import Tower

from . import GPU_NODE, K8sEmulator
from .objects import HOST_IP, SANDBOX_CONDITION, make_event, make_pod
from .recorder import COMBINED_PREFIX, EventCorrelator
from .store import StoredEvent

T = 10
NAMES = itertools.count(0x18A2B3C4D5E6F708)
BOUND = 10.0  # seconds any awaited change may take on a loaded machine
PLUGIN = "nvidia-device-plugin-daemonset-x7k2p"  # on the host network
MIRROR = f"gpu-exporter-{GPU_NODE}"  # on the pod network
FLANNEL = re.compile(
    r"Failed to create pod sandbox: rpc error: code = Unknown desc = failed "
    r'to setup network for sandbox "(?P<sandbox>[0-9a-f]{64})": plugin '
    r'type="flannel" failed \(add\): failed to load flannel \'subnet\.env\' '
    r"file: open /run/flannel/subnet\.env: no such file or directory\. Check "
    r"the flannel pod log for this node\."
)


# --- the recorder: client-go's EventCorrelator -------------------------------------


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failure(pod: dict[str, Any], message: str) -> dict[str, Any]:
    """A FailedCreatePodSandBox from the kubelet on the GPU node, as
    tools/record makeEvent builds it (named after the object and the time)."""
    return make_event(
        f"{pod['metadata']['name']}.{next(NAMES):x}",
        pod["metadata"]["namespace"],
        involved=pod,
        reason="FailedCreatePodSandBox",
        message=message,
        event_type="Warning",
        host=GPU_NODE,
    )


@pytest.fixture
def pod() -> dict[str, Any]:
    made = make_pod("llm", "ai", node=GPU_NODE)
    made["metadata"]["uid"] = "uid-llm"
    return made


def test_ten_similar_events_are_combined(pod: dict[str, Any]) -> None:
    """EventAggregate: nine messages that differ (a new sandbox id each) are
    nine Events; the tenth within ten minutes of the last is a new Event
    whose message is prefixed "(combined from similar events): ", and every
    later similar one patches that Event (count + 1, its own message)."""
    recorder = EventCorrelator(Clock())
    written = [recorder.correlate(failure(pod, f"sandbox {i}")) for i in range(1, 13)]
    assert all(w is not None for w in written)
    first_nine = [w for w in written[:9] if w is not None]
    assert [(w.patch, w.event["count"]) for w in first_nine] == [(False, 1)] * 9
    assert [w.event["message"] for w in first_nine] == [
        f"sandbox {i}" for i in range(1, 10)
    ]
    assert len({w.event["metadata"]["name"] for w in first_nine}) == 9
    tenth, eleventh, twelfth = (w for w in written[9:] if w is not None)
    assert not tenth.patch
    assert tenth.event["message"] == COMBINED_PREFIX + "sandbox 10"
    assert tenth.event["count"] == 1
    assert tenth.event["metadata"]["name"].startswith("llm.")
    assert tenth.event["metadata"]["name"] not in {
        w.event["metadata"]["name"] for w in first_nine
    }
    for later, count in ((eleventh, 2), (twelfth, 3)):
        assert later.patch
        assert later.event["metadata"]["name"] == tenth.event["metadata"]["name"]
        assert later.event["count"] == count
        assert later.event["firstTimestamp"] == tenth.event["firstTimestamp"]
    assert twelfth.event["message"] == COMBINED_PREFIX + "sandbox 12"


def test_the_same_event_again_counts_up(pod: dict[str, Any]) -> None:
    """eventObserve: the same key (same message too) patches the Event it
    wrote: same name and firstTimestamp, count + 1."""
    recorder = EventCorrelator(Clock())
    one, two, three = (recorder.correlate(failure(pod, "same")) for _ in range(3))
    assert one is not None
    assert two is not None
    assert three is not None
    assert (one.patch, two.patch, three.patch) == (False, True, True)
    assert {one.event["metadata"]["name"], three.event["metadata"]["name"]} == {
        one.event["metadata"]["name"]
    }
    assert three.event["count"] == 3
    assert three.event["message"] == "same"


def test_similar_events_ten_minutes_apart_start_over(pod: dict[str, Any]) -> None:
    """maxIntervalInSeconds: a similar event more than 600 s after the last
    one starts a fresh record: nine more before anything is combined."""
    clock = Clock()
    recorder = EventCorrelator(clock)
    for i in range(9):
        recorder.correlate(failure(pod, f"early {i}"))
    clock.now += 601
    later = [recorder.correlate(failure(pod, f"late {i}")) for i in range(10)]
    assert [w.event["message"] for w in later[:9] if w is not None] == [
        f"late {i}" for i in range(9)
    ]
    assert later[9] is not None
    assert later[9].event["message"] == COMBINED_PREFIX + "late 9"


def test_the_spam_filter_drops_past_its_burst(pod: dict[str, Any]) -> None:
    """EventSourceObjectSpamFilter after the correlation: 25 Events about one
    object from one source, then one per 300 s; the dropped ones were
    counted by the logger, so the next Event written jumps by them."""
    clock = Clock()
    recorder = EventCorrelator(clock)
    written = [recorder.correlate(failure(pod, "same")) for _ in range(27)]
    assert [w is not None for w in written] == [True] * 25 + [False] * 2
    clock.now += 300
    again = recorder.correlate(failure(pod, "same"))
    assert again is not None
    assert again.event["count"] == 28
    other = make_pod("trainer", "ai", node=GPU_NODE)
    other["metadata"]["uid"] = "uid-trainer"
    assert recorder.correlate(failure(other, "same")) is not None


async def test_the_emulator_serves_what_the_recorder_wrote(
    emulator: K8sEmulator, api: client.ApiClient
) -> None:
    """Through the API as the product reads it: twelve sandbox failures of
    one pod are nine Events with count 1 and one combined Event with count 3
    and the latest message; the kubelet of another node is another recorder."""
    pod = emulator.add_pod(
        "llm", "ai", node=GPU_NODE, phase="Pending", waiting_reason="ContainerCreating"
    )
    for i in range(12):
        emulator.record_event(
            pod,
            reason="FailedCreatePodSandBox",
            message=SANDBOX_FAILURE.format(sandbox=f"{i:064x}"),
            host=GPU_NODE,
        )
    emulator.record_event(
        pod,
        reason="FailedCreatePodSandBox",
        message=SANDBOX_FAILURE.format(sandbox=f"{99:064x}"),
        host="control-plane",
    )
    events = await client.CoreV1Api(api).list_namespaced_event(
        "ai",
        field_selector=f"involvedObject.uid={pod['metadata']['uid']},type=Warning",
        _request_timeout=T,
    )
    mine = [e for e in events.items if e.source.host == GPU_NODE]
    combined = [e for e in mine if e.message.startswith(COMBINED_PREFIX)]
    assert len(mine) == 10
    assert sorted(e.count for e in mine) == [1] * 9 + [3]
    [event] = combined
    assert event.count == 3
    assert event.message == COMBINED_PREFIX + SANDBOX_FAILURE.format(
        sandbox=f"{11:064x}"
    )
    assert [e.count for e in events.items if e.source.host != GPU_NODE] == [1]


# --- the kubelet stand-in: the sandboxes of a boot -----------------------------------


async def _until(done: Callable[[], bool]) -> None:
    async with asyncio.timeout(BOUND):
        while not done():  # noqa: ASYNC110 - the stand-in runs in a task
            await asyncio.sleep(0.02)


def _boot(sim: Tower) -> None:
    sim.start_live("gpu-node", sim.defined_hostdevs("gpu-node"))


def _reboot(sim: Tower, stand_in: Kubelet) -> None:
    """The GPU node VM stops and starts again, the stand-in seeing both."""
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    stand_in.step()
    _boot(sim)


def _pods(emulator: K8sEmulator) -> dict[str, dict[str, Any]]:
    return {
        pod["metadata"]["name"]: pod
        for pod in emulator.list_objects("Pod")
        if pod["spec"].get("nodeName") == GPU_NODE
    }


def _sandbox(pod: dict[str, Any]) -> str:
    return next(
        c["status"]
        for c in pod["status"]["conditions"]
        if c["type"] == SANDBOX_CONDITION
    )


def _failures(emulator: K8sEmulator, name: str) -> list[dict[str, Any]]:
    return [
        event
        for event in emulator.list_objects("Event")
        if event["involvedObject"]["name"] == name
        and event["reason"] == "FailedCreatePodSandBox"
    ]


def _tries(emulator: K8sEmulator, name: str) -> int:
    return sum(int(event["count"]) for event in _failures(emulator, name))


async def test_without_the_pod_network_only_host_network_pods_start(
    sim: Tower, emulator: K8sEmulator
) -> None:
    """A boot whose pod network never comes (flannel never writes its
    subnet file): the device plugin, on the host network, runs at once with
    the node's IP; every pod on the pod network waits for its sandbox
    (PodReadyToStartContainers False, ContainerCreating, Pending, no IP) and
    each try is a FailedCreatePodSandBox with flannel's error and a sandbox
    id never seen before, combined from the tenth on."""
    stand_in = Kubelet(
        sim,
        emulator,
        boot_delay=0.0,
        plugin_delay=None,
        network_delay=None,
        sandbox_retry=0.0,  # a try at each look
    )
    stand_in.step()
    _reboot(sim, stand_in)
    for _ in range(12):
        stand_in.step()

    pods = _pods(emulator)
    plugin = pods.pop(PLUGIN)
    assert plugin["spec"]["hostNetwork"] is True
    assert plugin["status"]["phase"] == "Running"
    assert _sandbox(plugin) == "True"
    assert plugin["status"]["podIP"] == HOST_IP
    assert "running" in plugin["status"]["containerStatuses"][0]["state"]
    assert _failures(emulator, PLUGIN) == []
    assert MIRROR in pods
    sandboxes: set[str] = set()
    for name, pod in pods.items():
        assert not pod["spec"].get("hostNetwork"), name
        assert pod["status"]["phase"] == "Pending"
        assert _sandbox(pod) == "False"
        assert "podIP" not in pod["status"]
        [container] = pod["status"]["containerStatuses"]
        assert container["state"] == {"waiting": {"reason": "ContainerCreating"}}
        events = _failures(emulator, name)
        assert sorted(int(e["count"]) for e in events) == [1] * 9 + [3]
        for event in events:
            assert event["type"] == "Warning"
            assert event["source"] == {"component": "kubelet", "host": GPU_NODE}
            found = FLANNEL.fullmatch(event["message"].removeprefix(COMBINED_PREFIX))
            assert found is not None, event["message"]
            sandboxes.add(found["sandbox"])
    assert len(sandboxes) == 10 * len(pods)


async def test_a_pod_bound_while_the_network_waits_waits_too(
    sim: Tower, emulator: K8sEmulator
) -> None:
    """The kubelet syncs every pod bound to its node: one put there while
    the pod network is not ready (created Running by whoever bound it)
    loses that status at the next look and fails like the others."""
    stand_in = Kubelet(
        sim,
        emulator,
        boot_delay=0.0,
        plugin_delay=None,
        network_delay=None,
        sandbox_retry=0.0,
    )
    stand_in.step()
    _reboot(sim, stand_in)
    stand_in.step()
    emulator.add_pod("late", "ai", node=GPU_NODE)
    stand_in.step()
    late = _pods(emulator)["late"]
    assert (late["status"]["phase"], _sandbox(late)) == ("Pending", "False")
    assert _tries(emulator, "late") == 1


@pytest.fixture
def changes(emulator: K8sEmulator) -> Iterator[list[StoredEvent]]:
    """Every change the store makes from now on."""
    seen: list[StoredEvent] = []
    emulator.store.listeners.append(seen.append)
    yield seen
    emulator.store.listeners.remove(seen.append)


async def test_after_a_reboot_the_network_comes_and_the_pods_start(
    sim: Tower, emulator: K8sEmulator, changes: list[StoredEvent]
) -> None:
    """The ordinary reboot: the node is Ready before flannel wrote its
    subnet file, so a short burst of failed sandboxes, then every pod on the
    pod network gets its sandbox and starts, and the failures stop."""
    stand_in = Kubelet(
        sim, emulator, **(FAST | {"network_delay": 0.4, "sandbox_retry": 0.05})
    )
    stand_in.start()
    try:
        await _until(lambda: stand_in.up)  # the first look adopted the VM
        sim.guest_shutdown("gpu-node")
        sim.advance(60)
        await _until(lambda: not stand_in.up)
        _boot(sim)
        await _until(lambda: len(stand_in.boot_ids) == 2)
        await _until(
            lambda: all(_sandbox(pod) == "True" for pod in _pods(emulator).values())
        )
    finally:
        await stand_in.stop()
    tries = {name: _tries(emulator, name) for name in _pods(emulator)}
    assert tries.pop(PLUGIN) == 0
    assert all(count >= 2 for count in tries.values()), tries
    for _ in range(5):
        stand_in.step()
    assert {name: _tries(emulator, name) for name in tries} == tries
    for name in tries:
        # Each waited (sandbox False) before it started (True), once.
        seen = [
            _sandbox(change.new)
            for change in changes
            if change.resource.kind == "Pod"
            and change.new is not None
            and change.new["metadata"]["name"] == name
        ]
        assert seen[-1] == "True"
        assert "False" in seen
        assert seen[seen.index("False") :].count("True") >= 1
        pod = _pods(emulator)[name]
        assert pod["status"]["phase"] == "Running"


async def test_a_crash_loop_backs_off_doubling_up_to_its_cap(
    sim: Tower, emulator: K8sEmulator, changes: list[StoredEvent]
) -> None:
    """CrashLoopBackOff: the container exits (terminated, exit code 1, in
    lastState with when it ran), waits with the kubelet's back-off message
    (10 s doubling up to 300 s, scaled here), runs again with one more
    restart counted; the pod stays Running but not Ready meanwhile."""
    stand_in = Kubelet(sim, emulator, **FAST)
    stand_in.step()
    stand_in.crash_loop(PLUGIN, "kube-system", runs_for=0.0, backoff=(0.02, 0.08))
    async with asyncio.timeout(BOUND):
        while _restarts(emulator) < 5:
            stand_in.step()
            await asyncio.sleep(0.01)
    waits = [
        state["waiting"]["message"]
        for state in _states(changes)
        if state.get("waiting", {}).get("reason") == "CrashLoopBackOff"
    ]
    uid = _pods(emulator)[PLUGIN]["metadata"]["uid"]
    assert waits[:5] == [
        f"back-off {wait} restarting failed container=nvidia-device-plugin-ctr "
        f"pod={PLUGIN}_kube-system({uid})"
        for wait in ("0.02s", "0.04s", "0.08s", "0.08s", "0.08s")
    ]
    [container] = _pods(emulator)[PLUGIN]["status"]["containerStatuses"]
    last = container["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (1, "Error")
    assert last["startedAt"] <= last["finishedAt"]
    crashed = [
        change.new
        for change in changes
        if change.new is not None
        and change.new["metadata"]["name"] == PLUGIN
        and "waiting" in change.new["status"]["containerStatuses"][0]["state"]
    ]
    assert {pod["status"]["phase"] for pod in crashed} == {"Running"}
    assert {
        c["status"]
        for pod in crashed
        for c in pod["status"]["conditions"]
        if c["type"] == "Ready"
    } == {"False"}


def _states(changes: list[StoredEvent]) -> list[dict[str, Any]]:
    return [
        change.new["status"]["containerStatuses"][0]["state"]
        for change in changes
        if change.new is not None
        and change.resource.kind == "Pod"
        and change.new["metadata"]["name"] == PLUGIN
    ]


def _restarts(emulator: K8sEmulator) -> int:
    [container] = _pods(emulator)[PLUGIN]["status"]["containerStatuses"]
    return int(container["restartCount"])
