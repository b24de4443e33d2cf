"""Whether the GPU node works, judged from what the cluster shows; no Home
Assistant imports.

A node can answer pings, report Ready and renew its Lease on time while it
cannot start a single container: a kernel module load hung at boot (say,
br_netfilter never loaded), a container runtime or network plugin that never
came up. Every pod sandbox then times out, and neither Ready nor the Lease
tells. The GPU node is judged on what it does instead:

- ``containers_not_starting``: pods on it have waited longer than
  STUCK_BOUND for their sandbox (PodReadyToStartContainers False; on a kubelet
  that does not report it, a container still being created *and* a sandbox
  failure event, since pulling a large image looks the same otherwise), and
  no container on the node started within that bound (a node that starts
  containers is no ghost: what holds those pods is theirs). A pod pulling an
  image slowly has its sandbox: it never counts.
- ``gpus_missing``: the node has advertised fewer allocatable
  ``nvidia.com/gpu`` than the cards the GPU node holds (per the tower) for
  longer than GPUS_BOUND since it became Ready: the device plugin did not
  register them, or a card is unhealthy (capacity minus allocatable).

Nothing is judged while the GPU node is not running or not Ready, while a
tower job acts on it, or while it carries GPU Handoff's own cordon (a handoff
drains it; a return lifts the cordon last): an operation has it then.
"""

from __future__ import annotations

from dataclasses import dataclass
import datetime as dt
from typing import Final

from .cluster_client import (
    CORDON_OWNER_US,
    NodeReading,
    NodeView,
    PodEvent,
    PodStart,
    not_started,
)
from .protocol import RUNNING, TowerStatus

# How long a pod may wait for its sandbox, and a node may lack GPUs after it
# turned Ready, before the GPU node is called unhealthy. Module variables,
# read at each judgement (tests shorten them).
STUCK_BOUND: float = 300.0
GPUS_BOUND: float = 300.0

CONTAINERS_NOT_STARTING: Final = "containers_not_starting"
GPUS_MISSING: Final = "gpus_missing"
NO_PROBLEM: Final = "none"
# Every reason, the one closest to the cause first (a node that cannot start
# containers cannot start its device plugin either).
REASONS: Final = (CONTAINERS_NOT_STARTING, GPUS_MISSING)

# What a repair issue shows at most.
PODS_SHOWN: Final = 10
EVENTS_SHOWN: Final = 5
MESSAGE_CHARS: Final = 240


@dataclass(frozen=True, kw_only=True)
class StuckPod:
    """A pod that has waited for its sandbox past the bound."""

    namespace: str
    name: str
    # Since when it counts as waiting: when it began to wait, or when the
    # node turned Ready if that came later.
    since: dt.datetime
    events: tuple[PodEvent, ...]

    @property
    def label(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, kw_only=True)
class NodeHealth:
    """The judgement of one refresh: the problems seen (REASONS, in that
    order) and what shows them."""

    problems: tuple[str, ...] = ()
    stuck_pods: tuple[StuckPod, ...] = ()
    gpus_expected: int = 0
    gpus_allocatable: int = 0
    gpus_capacity: int = 0
    # When this side first saw fewer allocatable GPUs than expected, carried
    # from one judgement to the next (None: not short).
    gpus_short_since: dt.datetime | None = None

    @property
    def problem(self) -> bool:
        """Whether the GPU node is unhealthy."""
        return bool(self.problems)

    @property
    def reason(self) -> str:
        """The problem closest to the cause, or NO_PROBLEM."""
        return self.problems[0] if self.problems else NO_PROBLEM


def watched(tower: TowerStatus, node: NodeView | None) -> bool:
    """Whether the GPU node should work now: it runs, no tower job acts on
    it, its node is Ready and carries no cordon of GPU Handoff's."""
    gpu = tower.domains.get(tower.gpu_node)
    return (
        gpu is not None
        and gpu.state == RUNNING
        and tower.job_for(tower.gpu_node) is None
        and node is not None
        and node.ready is True
        and node.cordon_owner != CORDON_OWNER_US
    )


def judge(
    reading: NodeReading,
    tower: TowerStatus,
    now: dt.datetime,
    previous: NodeHealth | None = None,
) -> NodeHealth:
    """The GPU node's health from one reading of the cluster, the tower's
    state (the cards the GPU node holds) and the previous judgement."""
    gpu = tower.domains.get(tower.gpu_node)
    view = reading.view
    if gpu is None or gpu.state != RUNNING or view.ready is not True:
        return NodeHealth()
    expected = tower.gpus_held_by(tower.gpu_node)
    short = expected > 0 and view.gpu_allocatable < expected
    short_since: dt.datetime | None = None
    if short:
        carried = previous.gpus_short_since if previous is not None else None
        short_since = carried or now
    stuck = _stuck_pods(reading, now)
    problems: list[str] = []
    if watched(tower, view):
        if stuck:
            problems.append(CONTAINERS_NOT_STARTING)
        if short_since is not None:
            onset = max(short_since, reading.ready_since or short_since)
            if _seconds(now - onset) >= GPUS_BOUND:
                problems.append(GPUS_MISSING)
    return NodeHealth(
        problems=tuple(problems),
        stuck_pods=stuck if CONTAINERS_NOT_STARTING in problems else (),
        gpus_expected=expected,
        gpus_allocatable=view.gpu_allocatable,
        gpus_capacity=view.gpu_capacity,
        gpus_short_since=short_since,
    )


def _seconds(delta: dt.timedelta) -> float:
    return delta.total_seconds()


def _waiting_since(pod: PodStart) -> dt.datetime | None:
    """When the pod began to wait: the sandbox condition's last change, or
    (without one) when the kubelet took the pod on."""
    if pod.sandbox_ready is False:
        return pod.sandbox_changed or pod.start_time
    return pod.start_time


def _stuck_pods(reading: NodeReading, now: dt.datetime) -> tuple[StuckPod, ...]:
    """Pods past the bound without a sandbox, unless a container on the node
    started within the bound (then the node can start containers, and what
    holds those pods is theirs)."""
    stuck: list[StuckPod] = []
    for pod in reading.pods:
        if not not_started(pod):
            continue
        since = _waiting_since(pod) or now
        if reading.ready_since is not None:
            since = max(since, reading.ready_since)
        if _seconds(now - since) < STUCK_BOUND:
            continue
        events = tuple(event for event in reading.events if event.uid == pod.uid)
        if pod.sandbox_ready is None and not events:
            continue  # without the condition, this may be an image being pulled
        stuck.append(
            StuckPod(namespace=pod.namespace, name=pod.name, since=since, events=events)
        )
    if not stuck:
        return ()
    window = now - dt.timedelta(seconds=STUCK_BOUND)
    if any(
        pod.last_container_start is not None and pod.last_container_start > window
        for pod in reading.pods
    ):
        return ()
    return tuple(sorted(stuck, key=lambda pod: (pod.since, pod.label)))


# --- words for a repair issue ---------------------------------------------------


def _when(moment: dt.datetime, zone: dt.tzinfo) -> str:
    return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")


def _plain(text: str) -> str:
    """A cluster's text made safe inside a repair's Markdown: one line, no
    code fences, bounded."""
    line = " ".join(text.replace("`", "'").split())
    return line if len(line) <= MESSAGE_CHARS else f"{line[: MESSAGE_CHARS - 1]}…"


def describe_pods(health: NodeHealth, zone: dt.tzinfo) -> str:
    """The stuck pods, each with the time it began to count as waiting."""
    pods = health.stuck_pods
    lines = [f"- `{pod.label}`: {_when(pod.since, zone)}" for pod in pods[:PODS_SHOWN]]
    if len(pods) > PODS_SHOWN:
        lines.append(f"- … (+{len(pods) - PODS_SHOWN})")
    return "\n".join(lines)


def describe_events(health: NodeHealth, zone: dt.tzinfo) -> str:
    """The latest sandbox failures recorded for the stuck pods: reason, how
    often (in parentheses), when last, and the kubelet's message; '-' when
    there are none."""
    events = sorted(
        (event for pod in health.stuck_pods for event in pod.events),
        key=lambda event: (
            event.last or event.first or dt.datetime.min.replace(tzinfo=dt.UTC)
        ),
        reverse=True,
    )
    if not events:
        return "-"
    return "\n".join(
        f"- `{event.namespace}/{event.pod}` {event.reason} ({event.count})"
        + (f" {_when(event.last, zone)}" if event.last is not None else "")
        + f": {_plain(event.message)}"
        for event in events[:EVENTS_SHOWN]
    )


def issue_placeholders(
    health: NodeHealth, node: str, zone: dt.tzinfo
) -> dict[str, str]:
    """What a repair issue about ``health`` says (its translation key is the
    reason prefixed with ``node_``)."""
    return {
        "node": node,
        "minutes": f"{STUCK_BOUND / 60:g}"
        if health.reason == CONTAINERS_NOT_STARTING
        else f"{GPUS_BOUND / 60:g}",
        "pods": describe_pods(health, zone),
        "events": describe_events(health, zone),
        "expected": str(health.gpus_expected),
        "allocatable": str(health.gpus_allocatable),
        "capacity": str(health.gpus_capacity),
    }


@dataclass(frozen=True, kw_only=True)
class UnhealthyReturn:
    """A return whose GPU node came back without advertising its cards."""

    reason: str
    expected: int
    allocatable: int
    capacity: int

    @property
    def message(self) -> str:
        """What happened, for the log, the event and ``last_error``."""
        return (
            f"the cards went back, but the node advertises {self.allocatable} "
            f"allocatable GPU(s) (capacity {self.capacity}) of the "
            f"{self.expected} the GPU node holds"
        )
