"""Ghost-node detection: the GPU node is judged on what it does, not only on
what it reports.

The seed story's first wall was a GPU node that answered pings, reported
Ready and renewed its lease on time, and could not start a single container
(a wedged modprobe: br_netfilter never loaded, every pod sandbox timed out).

Three layers: the judgement itself (pure, with simulated time, including a
long quiet run that must never raise an alarm); the cluster client reading
pods, events and the device plugin's GPUs from the Kubernetes API emulator
over HTTPS; and stories with the whole product (Home Assistant, sshd forcing
the real agent on the tower simulator, the emulator, the kubelet stand-in):
a ghost node raises the problem within the bound and clears when pods start
again, a return waits for the GPUs and reports a device plugin that does not
come back, and a healthy node with pods starting normally never raises it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
import datetime as dt
import json
from pathlib import Path
import random
import re
import time
from typing import Any
from zoneinfo import ZoneInfo

from homeassistant.core import Event, EventStateChangedData, HomeAssistant, callback
from homeassistant.helpers import entity_registry as er, issue_registry as ir
from homeassistant.helpers.event import async_track_state_change_event
from homeassistant.setup import async_setup_component
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)
from pytest_homeassistant_custom_component.typing import ClientSessionGenerator

from custom_components.gpu_handoff import health
from custom_components.gpu_handoff.cluster_client import (
    EVENT_PODS_MAX,
    ClusterClient,
    NodeReading,
    PodEvent,
    PodStart,
)
from custom_components.gpu_handoff.cluster_model import (
    CORDON_OWNER_OTHER,
    CORDON_OWNER_US,
    NodeView,
)
from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_STEP,
    EVENT_RETURN_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
    EVENT_STOP_SUCCEEDED,
)
from custom_components.gpu_handoff.health import (
    CONTAINERS_NOT_STARTING,
    GPUS_MISSING,
    NodeHealth,
    judge,
)
from custom_components.gpu_handoff.logbook import describe
from custom_components.gpu_handoff.protocol import TowerStatus, parse_status
from tests.conftest import kubeconfig_text
from tests.k8semu import GPU, GPU_NODE, PRODUCT_RULES, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.stories import (
    BOUND,
    SWITCH_1,
    cordoned,
    idle,
    play,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

HEALTH = "binary_sensor.gpu_node_health"
READY = "binary_sensor.gpu_node_kubernetes_node"
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SANDBOX_TIMEOUT = (
    "Failed to create pod sandbox: rpc error: code = DeadlineExceeded desc = "
    "context deadline exceeded"
)


def ago(seconds: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=seconds)


# --- the judgement, with simulated time ------------------------------------------


def tower(
    *, state: str = "running", cards: int = 2, job: str | None = None
) -> TowerStatus:
    """A tower whose GPU node holds ``cards`` cards (a GPU and its HDMI
    audio each), optionally with a tower job of kind ``job`` running."""
    functions = [
        f"0000:0{card + 1}:00.{function}"
        for card in range(cards)
        for function in (0, 1)
    ]
    return parse_status(
        {
            "uri": "qemu:///system",
            "gpu_node": "gpu-node",
            "gaming": [],
            "domains": [
                {
                    "name": "gpu-node",
                    "title": "GPU node",
                    "role": "gpu_node",
                    "exists": True,
                    "state": state,
                    "reason": None,
                    "agent_channel": True,
                    "agent_ready": True,
                    "hostdevs": [
                        {"address": address, "managed": True, "rom_bar": "off"}
                        for address in functions
                    ],
                }
            ],
            "cards": [
                {
                    "address": address,
                    "held_by": "gpu-node" if state == "running" else None,
                    "claimed_by": ["gpu-node"],
                }
                for address in functions
            ],
            "findings": [],
            "hook_requests": [],
            "active_jobs": []
            if job is None
            else [
                {
                    "id": "j1",
                    "kind": job,
                    "args": {"domain": None},
                    "state": "running",
                    "step": "start",
                    "request_id": None,
                    "requested_by": "ssh",
                    "created": "t",
                    "finished": None,
                    "error": None,
                }
            ],
            "virsh_calls": 1,
        }
    )


def node(**changes: Any) -> NodeView:
    view = NodeView(
        name="gpu-node",
        ready=True,
        unschedulable=False,
        cordon_owner=None,
        lease_age=2.0,
        gpu_capacity=2,
        gpu_allocatable=2,
        gpu_requested=0,
        pods=0,
        evictable_pods=0,
    )
    return replace(view, **changes)


def waiting(name: str, seconds: float, **changes: Any) -> PodStart:
    """A pod whose sandbox has not come for ``seconds``."""
    pod = PodStart(
        namespace="ai",
        name=name,
        uid=f"uid-{name}",
        finished=False,
        terminating=False,
        sandbox_ready=False,
        sandbox_changed=ago(seconds),
        creating=True,
        start_time=ago(seconds),
        last_container_start=None,
    )
    return replace(pod, **changes)


def running(name: str, started: float) -> PodStart:
    """A pod whose containers started ``started`` seconds ago."""
    return replace(
        waiting(name, started),
        sandbox_ready=True,
        creating=False,
        last_container_start=ago(started),
    )


def failure(pod: PodStart, count: int = 4, last: float = 30) -> PodEvent:
    return PodEvent(
        namespace=pod.namespace,
        pod=pod.name,
        uid=pod.uid,
        reason="FailedCreatePodSandBox",
        message=SANDBOX_TIMEOUT,
        count=count,
        first=ago(last + 240),
        last=ago(last),
    )


def reading(
    *pods: PodStart,
    events: tuple[PodEvent, ...] = (),
    ready_since: dt.datetime | None = None,
    **view: Any,
) -> NodeReading:
    return NodeReading(
        view=node(**view),
        ready_since=ready_since or ago(7200),
        pods=pods,
        events=events,
    )


def test_a_ghost_node_is_unhealthy() -> None:
    """Ready, every sandbox failing for ten minutes, nothing started since:
    containers do not start, and the health says which pods and events."""
    plugin = waiting("nvidia-device-plugin", 600)
    llm = waiting("llm", 590)
    old = running("exporter", 7000)
    verdict = judge(
        reading(plugin, llm, old, events=(failure(plugin), failure(llm, count=2))),
        tower(),
        NOW,
    )
    assert verdict.problems == (CONTAINERS_NOT_STARTING,)
    assert verdict.reason == CONTAINERS_NOT_STARTING
    assert [pod.label for pod in verdict.stuck_pods] == [
        "ai/nvidia-device-plugin",
        "ai/llm",
    ]
    assert verdict.stuck_pods[0].since == ago(600)
    assert [event.count for event in verdict.stuck_pods[1].events] == [2]


@pytest.mark.parametrize(
    ("seconds", "unhealthy"), [(299, False), (300, True), (900, True)]
)
def test_the_stuck_bound(seconds: float, unhealthy: bool) -> None:
    """Waiting for a sandbox is normal for a while; past the bound it is not."""
    verdict = judge(reading(waiting("p", seconds)), tower(), NOW)
    assert verdict.problem is unhealthy


@pytest.mark.parametrize(
    ("started", "host_network", "unhealthy"),
    [(100, False, False), (700, False, True), (100, True, True)],
)
def test_a_container_started_meanwhile_means_the_node_starts_containers(
    started: float, host_network: bool, unhealthy: bool
) -> None:
    """A container of a pod on the pod network that started after the pod
    began to wait shows the node can start containers: what holds that pod
    is its own. One on the host network shows nothing of the kind: its
    sandbox needs no network plugin (containerd's RunPodSandbox sets up the
    pod network only for the others; the kubelet's SyncPod starts
    host-network pods while the runtime's network is not ready), so a
    crash-looping node exporter starts again and again on a node whose pod
    network never came."""
    other = replace(running("other", started), host_network=host_network)
    verdict = judge(reading(waiting("p", 600), other), tower(), NOW)
    assert verdict.problem is unhealthy


def test_a_host_network_pod_can_be_stuck_too() -> None:
    """A pod on the host network that waits for its sandbox past the bound
    is stuck all the same (a container runtime that is down holds it too),
    and named; only its starts prove nothing."""
    exporter = replace(waiting("node-exporter", 600), host_network=True)
    verdict = judge(reading(exporter), tower(), NOW)
    assert [pod.label for pod in verdict.stuck_pods] == ["ai/node-exporter"]


def test_the_failures_of_a_pod_are_one_line_however_the_recorder_split_them() -> None:
    """The kubelet's recorder writes the first nine sandbox failures of a pod
    as Events of their own (each names another sandbox) and counts the later
    ones in one combined Event (client-go events_cache.go): the health keeps
    one event per pod and reason, with every failure counted, the first and
    last seen, and the latest message."""
    pod = waiting("llm", 900)
    single = [
        replace(failure(pod, count=1, last=800 - 10 * i), message=f"sandbox {i}")
        for i in range(9)
    ]
    combined = replace(
        failure(pod, count=7, last=20), message="sandbox 15", combined=True
    )
    verdict = judge(reading(pod, events=(*single, combined)), tower(), NOW)
    [event] = verdict.stuck_pods[0].events
    assert (event.count, event.message, event.combined) == (16, "sandbox 15", True)
    assert event.last == ago(20)
    assert event.first == ago(800 + 240)


def test_a_slow_image_pull_is_no_stuck_sandbox() -> None:
    """Pulling a large image for hours: ContainerCreating, but the sandbox is
    up (the kubelet pulls only then)."""
    pulling = waiting("trainer", 7200, sandbox_ready=True)
    assert not judge(reading(pulling), tower(), NOW).problem


def test_without_the_condition_a_sandbox_failure_is_needed() -> None:
    """An older kubelet sets no sandbox condition: ContainerCreating alone may
    be an image pull, so only a sandbox failure recorded for that very pod
    makes it stuck."""
    old = waiting("p", 900, sandbox_ready=None, sandbox_changed=None)
    other = waiting("q", 900)
    assert not judge(reading(old), tower(), NOW).problem
    assert not judge(
        reading(old, running("r", 9000), events=(failure(other),)), tower(), NOW
    ).problem
    verdict = judge(reading(old, events=(failure(old),)), tower(), NOW)
    assert verdict.problems == (CONTAINERS_NOT_STARTING,)
    assert verdict.stuck_pods[0].since == ago(900)


def test_the_bound_counts_from_when_the_node_turned_ready() -> None:
    """Pods that waited through a reboot count from the node's Ready."""
    pod = waiting("p", 7200)
    assert not judge(reading(pod, ready_since=ago(100)), tower(), NOW).problem
    verdict = judge(reading(pod, ready_since=ago(400)), tower(), NOW)
    assert verdict.stuck_pods[0].since == ago(400)


def test_finished_and_terminating_pods_do_not_count() -> None:
    """A finished pod's sandbox is gone for good, a deleted one's is going."""
    done = waiting("done", 3600, finished=True)
    going = waiting("going", 3600, terminating=True)
    assert not judge(reading(done, going), tower(), NOW).problem


@pytest.mark.parametrize(
    ("status", "view", "judged"),
    [
        (tower(), {}, True),
        (tower(), {"cordon_owner": CORDON_OWNER_OTHER, "unschedulable": True}, True),
        (tower(), {"cordon_owner": CORDON_OWNER_US, "unschedulable": True}, False),
        (tower(), {"ready": False}, False),
        (tower(state="shut_off"), {}, False),
        (tower(job="release"), {}, False),
    ],
)
def test_nothing_is_judged_while_an_operation_has_the_gpu_node(
    status: TowerStatus, view: dict[str, Any], judged: bool
) -> None:
    """A handoff drains it under GPU Handoff's cordon, a tower job stops or
    starts it, a return lifts the cordon last: no alarm meanwhile. An
    operator's cordon does not stop the GPU node from having to work."""
    pod = waiting("p", 3600)
    verdict = judge(
        reading(pod, events=(failure(pod),), gpu_allocatable=0, **view),
        status,
        NOW,
        NodeHealth(gpus_short_since=ago(3600)),
    )
    assert verdict.problem is judged
    assert verdict.problems == (
        (CONTAINERS_NOT_STARTING, GPUS_MISSING) if judged else ()
    )


def test_gpus_missing_for_longer_than_the_bound() -> None:
    """Expected: the cards the GPU node holds, per card (a GPU and its audio
    function are one). Short for the bound since first seen: missing. Back:
    healthy, and the clock starts again the next time."""
    status = tower(cards=2)
    assert status.gpus_held_by("gpu-node") == 2
    short = reading(gpu_allocatable=1, gpu_capacity=2)
    first = judge(short, status, NOW)
    assert not first.problem
    assert first.gpus_short_since == NOW
    later = judge(short, status, NOW + dt.timedelta(seconds=299), first)
    assert not later.problem
    assert later.gpus_short_since == NOW
    late = judge(short, status, NOW + dt.timedelta(seconds=300), later)
    assert late.problems == (GPUS_MISSING,)
    assert (late.gpus_expected, late.gpus_allocatable, late.gpus_capacity) == (2, 1, 2)
    back = judge(reading(), status, NOW + dt.timedelta(seconds=330), late)
    assert not back.problem
    assert back.gpus_short_since is None
    again = judge(short, status, NOW + dt.timedelta(seconds=360), back)
    assert again.gpus_short_since == NOW + dt.timedelta(seconds=360)
    assert not again.problem


def test_gpus_count_from_ready_too() -> None:
    """Short since long ago by this side's count, but Ready only since a
    moment: the device plugin still has time to register."""
    previous = NodeHealth(gpus_short_since=ago(3600))
    fresh = reading(gpu_allocatable=0, ready_since=ago(30))
    assert not judge(fresh, tower(), NOW, previous).problem
    settled = reading(gpu_allocatable=0, ready_since=ago(301))
    assert judge(settled, tower(), NOW, previous).problems == (GPUS_MISSING,)


def test_time_sliced_gpus_are_enough() -> None:
    """Time-slicing multiplies allocatable: more than the cards is fine."""
    assert not judge(
        reading(gpu_allocatable=8, gpu_capacity=8), tower(), NOW, NodeHealth()
    ).problem


class QuietCluster:
    """A simulated GPU node that works: pods come and go, each sandbox takes
    seconds, some images take many minutes to pull, jobs finish, pods are
    deleted, the node restarts once and its device plugin registers a little
    after Ready. Everything a refresh could see, every 30 s, for a day."""

    def __init__(self, seed: int, ghost_from: float | None = None) -> None:
        self.random = random.Random(seed)  # noqa: S311 - a simulation
        self.pods: dict[str, dict[str, Any]] = {}
        self.ready_since = ago(3600)
        self.gpus = 2
        self.counter = 0
        # From this many seconds on, no new sandbox comes (the control).
        self.ghost_from = ghost_from

    def add_pod(self, t: dt.datetime) -> None:
        self.counter += 1
        ghost = self.ghost_from is not None and t >= ago(-self.ghost_from)
        self.pods[f"p{self.counter}"] = {
            "created": t,
            "sandbox_at": None
            if ghost
            else t + dt.timedelta(seconds=self.random.uniform(1, 40)),
            "pull": dt.timedelta(seconds=self.random.choice([0, 5, 60, 900])),
            "finish": dt.timedelta(minutes=self.random.choice([2, 30, 600])),
            "deleted": None,
        }

    def pod_at(self, name: str, p: dict[str, Any], t: dt.datetime) -> PodStart:
        start = max(p["created"], self.ready_since)
        sandbox = p["sandbox_at"] is not None and t >= max(
            p["sandbox_at"], self.ready_since + dt.timedelta(seconds=20)
        )
        started_at = (
            max(p["sandbox_at"], self.ready_since) + p["pull"]
            if p["sandbox_at"] is not None
            else None
        )
        started = started_at is not None and sandbox and t >= started_at
        finished = started and started_at is not None and t >= started_at + p["finish"]
        return PodStart(
            namespace="ai",
            name=name,
            uid=name,
            finished=finished,
            terminating=p["deleted"] is not None,
            sandbox_ready=sandbox and not finished,
            sandbox_changed=(
                max(p["sandbox_at"], self.ready_since) if sandbox else start
            ),
            creating=not started,
            start_time=start,
            last_container_start=started_at if started else None,
        )

    def step(self, t: dt.datetime) -> NodeReading:
        if self.random.random() < 0.3:
            self.add_pod(t)
        for name, p in list(self.pods.items()):
            if p["deleted"] is not None and t - p["deleted"] > dt.timedelta(minutes=1):
                del self.pods[name]
            elif p["deleted"] is None and self.random.random() < 0.01:
                p["deleted"] = t  # its sandbox goes first: not a problem
        if t == ago(-12 * 3600):
            self.ready_since = t  # a reboot: every sandbox comes again
            self.gpus = 0
        if t >= self.ready_since + dt.timedelta(seconds=45):
            self.gpus = 2
        return NodeReading(
            view=node(gpu_allocatable=self.gpus, gpu_capacity=self.gpus),
            ready_since=self.ready_since,
            pods=tuple(self.pod_at(name, p, t) for name, p in self.pods.items()),
            events=(),
        )


def quiet_day(cluster: QuietCluster, hours: float = 24) -> Iterator[NodeHealth]:
    verdict: NodeHealth | None = None
    for step in range(int(hours * 3600 / 30)):
        t = NOW + dt.timedelta(seconds=30 * step)
        verdict = judge(cluster.step(t), tower(), t, verdict)
        yield verdict


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_long_quiet_run_never_raises_an_alarm(seed: int) -> None:
    """A day of a working GPU node, judged every 30 s: never a problem. The
    same day with the node turning into a ghost after three hours (no new
    sandbox comes) raises it once the first pod waited past the bound and
    the images already being pulled have started (so this run can tell)."""
    verdicts = list(quiet_day(QuietCluster(seed)))
    assert len(verdicts) == 2880
    assert [v for v in verdicts if v.problem] == []

    control = QuietCluster(seed, ghost_from=3 * 3600)
    raised = next((i for i, v in enumerate(quiet_day(control)) if v.problem), None)
    assert raised is not None
    longest_pull = 900 + 40
    assert (
        3 * 3600 + health.STUCK_BOUND
        <= raised * 30
        <= 3 * 3600 + longest_pull + health.STUCK_BOUND + 60
    )
    assert verdicts[raised].problem is False


# --- the repair's words ------------------------------------------------------------


def test_the_repair_says_which_pods_since_when_and_which_events() -> None:
    """Pods with the time they began to wait (Home Assistant's time zone),
    the newest events first with their count and message made safe for
    Markdown; a long list is cut and says how many more."""
    pods = [waiting(f"p{i:02}", 600 + i) for i in range(12)]
    noisy = replace(
        failure(pods[0], count=7, last=10),
        message="rpc error: `modprobe br_netfilter`\nhung " + "x" * 400,
    )
    verdict = judge(
        reading(*pods, events=(failure(pods[1], last=50), noisy)), tower(), NOW
    )
    zone = ZoneInfo("Europe/Paris")
    words = health.issue_placeholders(verdict, "gpu-node", zone)
    lines = words["pods"].splitlines()
    assert lines[0] == "- `ai/p11`: 2026-12-01 12:49:49"
    assert len(lines) == health.PODS_SHOWN + 1
    assert lines[-1] == "- … (+2)"
    first, second = words["events"].splitlines()
    assert first.startswith(
        "- `ai/p00` FailedCreatePodSandBox (7) 2026-12-01 12:59:50: "
        "rpc error: 'modprobe br_netfilter' hung xxx"
    )
    assert first.endswith("…")
    assert len(first.split(": ", 1)[1]) == health.MESSAGE_CHARS
    assert second.startswith(
        "- `ai/p01` FailedCreatePodSandBox (4) 2026-12-01 12:59:10"
    )
    assert words["minutes"] == "5"
    assert health.describe_events(NodeHealth(), zone) == "-"


# --- the cluster client against the emulator ---------------------------------------


@pytest.fixture
async def client(cluster: K8sEmulator) -> Any:
    api = await ClusterClient.create(kubeconfig_text(cluster))
    yield api
    await api.close()


def ghost_pod(cluster: K8sEmulator, name: str, age: float) -> dict[str, Any]:
    """A pod on the GPU node whose sandbox failed for ``age`` seconds."""
    pod = cluster.add_pod(
        name,
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
        age=age,
    )
    cluster.record_event(
        pod, reason="FailedCreatePodSandBox", message=SANDBOX_TIMEOUT, host=GPU_NODE
    )
    return pod


async def test_a_working_node_is_read_without_events(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The refresh's one pod list tells every pod started: no event is read."""
    cluster.clear_requests()
    reading = await client.node_reading(GPU_NODE)
    assert reading.view.pods == 4
    assert reading.ready_since is not None
    assert all(pod.last_container_start is not None for pod in reading.pods)
    assert {pod.sandbox_ready for pod in reading.pods} == {True}
    assert reading.events == ()
    assert cluster.requests_for(resource="events") == []
    assert len(cluster.requests_for(verb="list", resource="pods")) == 1


async def test_a_ghost_node_is_read_with_its_sandbox_failures(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """The events of the longest-waiting pods only (at most EVENT_PODS_MAX),
    each asked by the pod's UID and type Warning; an aggregated event counts
    its repeats, an events.k8s.io/v1 one its series; Normal events and other
    reasons stay out."""
    pods = [ghost_pod(cluster, f"ghost-{i}", age=100 * (i + 1)) for i in range(7)]
    cluster.record_event(
        pods[6], reason="FailedCreatePodSandBox", message=SANDBOX_TIMEOUT, host=GPU_NODE
    )
    cluster.record_event(pods[6], reason="Scheduled", message="ok", event_type="Normal")
    cluster.record_event(pods[5], reason="FailedMount", message="no such volume")
    cluster.add_event(
        "ghost-5.series",
        "ai",
        involved=pods[5],
        reason="FailedCreatePodSandBox",
        message="new recorder",
        event_type="Warning",
        count=9,
        series=True,
        age=300,
    )
    cluster.clear_requests()
    reading = await client.node_reading(GPU_NODE)
    asked = cluster.requests_for(verb="list", resource="events")
    assert len(asked) == EVENT_PODS_MAX
    oldest = [pods[i]["metadata"]["uid"] for i in (6, 5, 4, 3, 2)]
    assert [r.query["fieldSelector"] for r in asked] == [
        f"involvedObject.uid={uid},type=Warning" for uid in oldest
    ]
    by_pod = {(e.pod, e.message): e for e in reading.events}
    assert set(by_pod) == {
        ("ghost-6", SANDBOX_TIMEOUT),
        ("ghost-5", SANDBOX_TIMEOUT),
        ("ghost-5", "new recorder"),
        ("ghost-4", SANDBOX_TIMEOUT),
        ("ghost-3", SANDBOX_TIMEOUT),
        ("ghost-2", SANDBOX_TIMEOUT),
    }
    assert by_pod["ghost-6", SANDBOX_TIMEOUT].count == 2
    series = by_pod["ghost-5", "new recorder"]
    assert series.count == 9
    assert series.first is not None
    assert series.last is not None
    assert series.last > series.first
    waiting_pods = {pod.name: pod for pod in reading.pods if pod.name.startswith("g")}
    assert waiting_pods["ghost-6"].sandbox_ready is False
    assert waiting_pods["ghost-6"].creating is True
    assert waiting_pods["ghost-6"].last_container_start is None
    verdict = judge(reading, _tower_of(reading), dt.datetime.now(dt.UTC))
    assert verdict.problems == ()  # under 5 minutes since the node turned Ready


def _tower_of(reading: NodeReading) -> TowerStatus:
    return tower(cards=reading.view.gpu_allocatable)


async def test_events_refused_leave_them_out(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A ClusterRole from before events were needed: the reading goes on."""
    ghost_pod(cluster, "ghost", age=600)
    cluster.set_rules(tuple(r for r in PRODUCT_RULES if "events" not in r.resources))
    reading = await client.node_reading(GPU_NODE)
    assert reading.events == ()
    assert any(pod.name == "ghost" for pod in reading.pods)
    assert [r.status for r in cluster.requests_for(resource="events")] == [403]


async def test_waiting_for_the_gpus(
    client: ClusterClient, cluster: K8sEmulator
) -> None:
    """A kubelet just restarted advertises none; the wait ends when the
    device plugin registers them, or at its bound."""
    cluster.set_node_gpus(GPU_NODE, 0)
    with pytest.raises(TimeoutError):
        await client.wait_gpus(GPU_NODE, 3, 0.5)
    registered: list[bool] = []

    def plugin_registers() -> None:
        cluster.set_node_gpus(GPU_NODE, 3)
        registered.append(True)

    asyncio.get_running_loop().call_later(0.3, plugin_registers)
    view = await client.wait_gpus(GPU_NODE, 3, 10)
    assert registered  # the wait ended because the GPUs came, not before
    assert view.gpu_allocatable == 3


# --- the whole product ---------------------------------------------------------------


def _issue(hass: HomeAssistant, entry: MockConfigEntry) -> ir.IssueEntry | None:
    return ir.async_get(hass).async_get_issue(DOMAIN, f"node_health_{entry.entry_id}")


async def _refresh(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


async def _refresh_until(
    hass: HomeAssistant, entry: MockConfigEntry, what: Callable[[], bool], bound: float
) -> None:
    """Refresh (as the poll would, only faster) until ``what`` holds."""
    async with asyncio.timeout(bound):
        while True:
            await _refresh(hass, entry)
            if what():
                return
            await asyncio.sleep(0.2)


def _health(hass: HomeAssistant) -> tuple[str, str]:
    state = hass.states.get(HEALTH)
    assert state is not None
    return state.state, state.attributes["reason"]


async def test_a_ghost_node_raises_the_problem_within_the_bound_and_clears(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    cluster: K8sEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ready, its lease renewing, and every new sandbox failing: not an
    alarm at first, the Health problem and a repair once the pods waited
    longer than the bound; both gone once the pods start."""
    monkeypatch.setattr(health, "STUCK_BOUND", 3.0)
    await setup_entry(hass, entry)
    assert _health(hass) == ("off", "none")
    lease = cluster.get("Lease", GPU_NODE, "kube-node-lease")["spec"]["renewTime"]
    began = time.monotonic()
    for name in ("llm-inference-new", "trainer-new"):
        ghost_pod(cluster, name, age=0)
    await _refresh(hass, entry)
    assert _health(hass) == ("off", "none")
    assert _issue(hass, entry) is None

    await _refresh_until(hass, entry, lambda: _health(hass)[0] == "on", 3.0 + 5)
    # Timestamps have whole seconds: the bound may be met up to 1 s early.
    assert time.monotonic() - began >= 3.0 - 1
    assert hass.states.get(READY).state == "on"
    assert (
        cluster.get("Lease", GPU_NODE, "kube-node-lease")["spec"]["renewTime"] != lease
    )
    state = hass.states.get(HEALTH)
    assert state.attributes["reason"] == CONTAINERS_NOT_STARTING
    assert state.attributes["pods_not_starting"] == [
        "ai/llm-inference-new",
        "ai/trainer-new",
    ]
    issue = _issue(hass, entry)
    assert issue is not None
    assert issue.translation_key == "node_containers_not_starting"
    assert issue.severity is ir.IssueSeverity.ERROR
    words = issue.translation_placeholders or {}
    assert "`ai/trainer-new`" in words["pods"]
    assert "FailedCreatePodSandBox (1)" in words["events"]
    assert "context deadline exceeded" in words["events"]

    for name in ("llm-inference-new", "trainer-new"):
        cluster.start_pod_containers(name, "ai")
    await _refresh(hass, entry)
    assert _health(hass) == ("off", "none")
    assert hass.states.get(HEALTH).attributes["pods_not_starting"] == []
    assert _issue(hass, entry) is None


async def _hand_off(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, cluster: K8sEmulator
) -> None:
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    await until(lambda: not cluster.node_is_up(GPU_NODE))
    # The GPU node's kubelet starts again with the VM; until its device
    # plugin registers the cards it advertises none.
    cluster.set_node_gpus(GPU_NODE, 0)


async def test_a_device_plugin_that_does_not_come_back_after_a_return(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    kubelet: Kubelet,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node comes back Ready without its GPUs: the return waits for
    them (bounded), gives the node back all the same (uncordoned) and is
    reported as returned but unhealthy, never as cards returned; the Health
    problem and a repair say GPUs are missing, until they are back."""
    monkeypatch.setattr(health, "GPUS_BOUND", 1.5)
    stopped = async_capture_events(hass, EVENT_STOP_SUCCEEDED)
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    steps = async_capture_events(hass, EVENT_HANDOFF_STEP)
    await _hand_off(hass, entry, sim, cluster)
    kubelet.plugin_delay = None  # the device plugin never registers again
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(unhealthy))
    await until(lambda: idle(entry))
    # the wait for the GPUs shows as a step of its own, after Ready
    shown = [e.data["step"] for e in steps]
    assert shown[-3:] == ["waiting_for_node", "waiting_for_gpus", "uncordoning"]
    assert returned == []
    assert [e.data["vm"] for e in stopped] == ["gaming-1"]
    [event] = unhealthy
    assert event.data["vm"] == "gpu-node"
    assert event.data["kind"] == "stop"
    assert event.data["reason"] == GPUS_MISSING
    assert (event.data["gpus_expected"], event.data["gpus_allocatable"]) == (3, 0)
    assert sim.is_running("gpu-node")
    assert not cordoned(cluster)
    assert "0 allocatable GPU(s)" in hass.states.get(SWITCH_1).attributes["last_error"]
    assert describe(event) == (
        "is back, but unhealthy: the cards went back, but the node advertises "
        "0 allocatable GPU(s) (capacity 0) of the 3 the GPU node holds"
    )

    await _refresh_until(hass, entry, lambda: _health(hass)[0] == "on", 1.5 + 5)
    assert hass.states.get(HEALTH).attributes["reason"] == GPUS_MISSING
    issue = _issue(hass, entry)
    assert issue is not None
    assert issue.translation_key == "node_gpus_missing"
    words = issue.translation_placeholders or {}
    assert (words["expected"], words["allocatable"], words["capacity"]) == (
        "3",
        "0",
        "0",
    )

    cluster.set_node_gpus(GPU_NODE, 3)
    await _refresh(hass, entry)
    assert _health(hass) == ("off", "none")
    assert _issue(hass, entry) is None


async def test_a_return_succeeds_once_the_gpus_are_back(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Ready is not the end of a return: the cards are back with the cluster
    when the node advertises them, a while after Ready here."""
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    seen_at_return: list[str] = []

    @callback
    def at_return(_event: Event) -> None:
        seen_at_return.append(
            cluster.get("Node", GPU_NODE, "")["status"]["allocatable"][GPU]
        )

    hass.bus.async_listen(EVENT_CARDS_RETURNED, at_return)
    await _hand_off(hass, entry, sim, cluster)
    registered: list[float] = []

    async def device_plugin() -> None:
        await until(lambda: cluster.node_is_up(GPU_NODE), BOUND)
        await asyncio.sleep(1.0)
        registered.append(time.monotonic())
        cluster.set_node_gpus(GPU_NODE, 3)

    plugin = asyncio.create_task(device_plugin())
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(returned))
    await plugin
    assert seen_at_return == ["3"]
    assert unhealthy == []
    assert registered
    await until(lambda: idle(entry))
    assert not cordoned(cluster)


async def test_a_return_action_reports_a_return_short_of_gpus(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The return_cards action on a GPU node that serves without its GPUs:
    not a success, but returned-but-unhealthy with the reason."""
    monkeypatch.setattr(health, "GPUS_BOUND", 0.5)
    succeeded = async_capture_events(hass, EVENT_RETURN_SUCCEEDED)
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    await setup_entry(hass, entry)
    cluster.set_node_gpus(GPU_NODE, 2, unhealthy=1)
    await hass.services.async_call(
        DOMAIN,
        "return_cards",
        {"config_entry_id": entry.entry_id},
        blocking=True,
    )
    await until(lambda: bool(unhealthy))
    await until(lambda: idle(entry))
    assert succeeded == []
    [event] = unhealthy
    assert event.data["kind"] == "return"
    assert (event.data["gpus_expected"], event.data["gpus_allocatable"]) == (3, 2)


async def test_a_healthy_node_never_raises_it(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    cluster: K8sEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pods keep arriving and start within a moment, then nothing happens
    for longer than the bound; one image takes the whole run to pull, a job
    finished long ago, refreshes come fast with short bounds: the Health
    sensor never turns on and no repair is raised. Then one pod waits for a
    sandbox that never comes: it does turn on, for that pod alone (the run
    could have told)."""
    monkeypatch.setattr(health, "STUCK_BOUND", 3.0)
    monkeypatch.setattr(health, "GPUS_BOUND", 3.0)
    await setup_entry(hass, entry)
    turned_on: list[tuple[str, list[str]]] = []
    issues: list[str] = []

    @callback
    def follow(event: Event[EventStateChangedData]) -> None:
        new = event.data["new_state"]
        if new is not None and new.state == "on":
            turned_on.append(
                (new.attributes["reason"], new.attributes["pods_not_starting"])
            )

    @callback
    def issue_seen(event: Event[ir.EventIssueRegistryUpdatedData]) -> None:
        if event.data["issue_id"].startswith("node_health"):
            issues.append(event.data["action"])

    unsubscribe = async_track_state_change_event(hass, HEALTH, follow)
    hass.bus.async_listen(ir.EVENT_REPAIRS_ISSUE_REGISTRY_UPDATED, issue_seen)
    cluster.add_pod(
        "big-image",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
        sandbox_ready=True,
        age=3600,
    )
    cluster.add_pod(
        "batch-done",
        "ai",
        node=GPU_NODE,
        phase="Succeeded",
        sandbox_ready=False,
        age=7200,
    )
    began = time.monotonic()
    n = 0
    while time.monotonic() - began < 10:
        n += 1
        name = f"web-{n}"
        cluster.add_pod(
            name,
            "ai",
            node=GPU_NODE,
            phase="Pending",
            waiting_reason="ContainerCreating",
        )
        await _refresh(hass, entry)
        await asyncio.sleep(0.3)
        cluster.start_pod_containers(name, "ai")
        await _refresh(hass, entry)
    quiet = time.monotonic()
    while time.monotonic() - quiet < 3.0 + 2:
        await _refresh(hass, entry)
        await asyncio.sleep(0.2)
    assert n >= 10
    health_now = entry.runtime_data.coordinator.data.health
    assert health_now is not None
    assert health_now.gpus_expected == 3
    assert turned_on == []
    assert issues == []

    cluster.add_pod(
        "stuck",
        "ai",
        node=GPU_NODE,
        phase="Pending",
        waiting_reason="ContainerCreating",
    )
    await _refresh_until(hass, entry, lambda: bool(turned_on), 3.0 + 5)
    assert turned_on == [(CONTAINERS_NOT_STARTING, ["ai/stuck"])]
    assert issues == ["create"]
    unsubscribe()


def test_every_reason_has_words_and_a_repair() -> None:
    """The Health sensor's reason attribute shows words, never a code, and
    each reason has its repair issue, in English and in French."""
    component = Path(health.__file__).parent
    for name in ("strings.json", "translations/en.json", "translations/fr.json"):
        strings = json.loads((component / name).read_text(encoding="utf-8"))
        sensor = strings["entity"]["binary_sensor"]["node_health"]
        shown = sensor["state_attributes"]["reason"]["state"]
        assert set(shown) == {health.NO_PROBLEM, *health.REASONS}, name
        for reason in health.REASONS:
            issue = strings["issues"][f"node_{reason}"]
            assert "title" in issue, name
            # A fixable issue is shown by its fix flow: the words are its
            # step's, which also shows the screen.
            screen = issue["fix_flow"]["step"]["screen"]["description"]
            assert "{node}" in screen, name
            assert "{screen}" in screen, name


async def test_the_health_repair_shows_the_gpu_nodes_screen(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    cluster: K8sEmulator,
    sim: Tower,
    hass_client: ClientSessionGenerator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair of a ghost node opens on the GPU node's screen, fetched
    when the user opens it, through the Screen entity's URL: a PNG."""
    monkeypatch.setattr(health, "STUCK_BOUND", 0.5)
    await setup_entry(hass, entry)
    ghost_pod(cluster, "ghost", age=60)
    await _refresh_until(hass, entry, lambda: _health(hass)[0] == "on", 10)
    issue = _issue(hass, entry)
    assert issue is not None
    assert issue.is_fixable
    screenshots = len(sim.calls("screenshot", "gpu-node"))

    assert await async_setup_component(hass, "repairs", {})
    client = await hass_client()
    response = await client.post(
        "/api/repairs/issues/fix",
        json={"handler": DOMAIN, "issue_id": issue.issue_id},
    )
    flow = await response.json()
    assert flow["step_id"] == "screen"
    screen = flow["description_placeholders"]["screen"]
    url = re.fullmatch(r"!\[GPU node Screen\]\((/api/image_proxy/[^)]+)\)", screen)
    assert url is not None, screen
    assert flow["description_placeholders"]["node"] == GPU_NODE
    # Nothing is fetched until the picture is shown.
    assert len(sim.calls("screenshot", "gpu-node")) == screenshots
    picture = await client.get(url.group(1))
    assert picture.status == 200
    assert (await picture.read()).startswith(b"\x89PNG\r\n\x1a\n")
    assert len(sim.calls("screenshot", "gpu-node")) == screenshots + 1

    done = await client.post(f"/api/repairs/issues/fix/{flow['flow_id']}")
    assert (await done.json())["type"] == "create_entry"


async def test_the_health_repair_says_when_there_is_no_screen(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a Screen entity (removed by the user), the repair still opens,
    with a dash where the picture would be."""
    monkeypatch.setattr(health, "STUCK_BOUND", 0.5)
    await setup_entry(hass, entry)
    registry = er.async_get(hass)
    screen_id = registry.async_get_entity_id(
        "image", DOMAIN, f"{entry.entry_id}_gpu-node_screen"
    )
    assert screen_id is not None
    registry.async_update_entity(screen_id, disabled_by=er.RegistryEntryDisabler.USER)
    await hass.async_block_till_done()
    ghost_pod(cluster, "ghost", age=60)
    await _refresh_until(hass, entry, lambda: _health(hass)[0] == "on", 10)
    issue = _issue(hass, entry)
    assert issue is not None
    assert await async_setup_component(hass, "repairs", {})
    client = await hass_client()
    response = await client.post(
        "/api/repairs/issues/fix",
        json={"handler": DOMAIN, "issue_id": issue.issue_id},
    )
    flow = await response.json()
    assert flow["description_placeholders"]["screen"] == "—"
