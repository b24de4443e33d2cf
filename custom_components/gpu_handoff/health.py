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
  no container of a pod on the pod network started on the node within that
  bound (a node that starts those is no ghost: what holds the waiting pods
  is theirs). A pod on the host network proves nothing: its sandbox needs no
  network plugin, so on a node whose pod network never came (flannel never
  wrote its subnet file) the device plugin and a crash-looping node exporter
  on the host network still start. A pod pulling an image slowly has its
  sandbox: it never counts. The burst of sandbox failures after a reboot,
  before the network plugin is ready, lasts seconds: far less than the bound.
- ``gpus_missing``: for longer than GPUS_BOUND since it became Ready, the
  node has advertised fewer allocatable NVIDIA GPU devices (under any of
  their names: ``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
  ``nvidia.com/mig-*``) than the cards the GPU node holds (per the tower),
  as when the device plugin did not register them, or a device its plugin
  reports unhealthy (capacity above allocatable); see
  ``cluster_client.gpus_short``.

Nothing is judged while the GPU node is not running or not Ready, while a
tower job acts on it, or while it carries GPU Handoff's own cordon (a handoff
drains it; a return lifts the cordon last): an operation has it then.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
import datetime as dt
import re
from typing import Final

from .cluster_client import (
    NodeReading,
    PodEvent,
    PodStart,
    gpus_short,
    not_started,
)
from .cluster_model import CORDON_OWNER_US, NodeView
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

# What a repair issue shows at most (a message long enough for a sandbox
# failure with flannel's cause whole, its sandbox id shortened).
PODS_SHOWN: Final = 10
EVENTS_SHOWN: Final = 5
MESSAGE_CHARS: Final = 320
# A container or sandbox id in a message (64 hex digits), shown as crictl
# shows it: its first 13 (cri-tools cmd/crictl/util.go truncatedIDLen; crictl
# takes it as a prefix).
LONG_ID: Final = re.compile(r"\b([0-9a-f]{13})[0-9a-f]{51}\b")


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
    short = gpus_short(view, expected)
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
        events = _merged(event for event in reading.events if event.uid == pod.uid)
        if pod.sandbox_ready is None and not events:
            continue  # without the condition, this may be an image being pulled
        stuck.append(
            StuckPod(namespace=pod.namespace, name=pod.name, since=since, events=events)
        )
    if not stuck:
        return ()
    # Only a pod on the pod network shows that the node can start what the
    # stuck pods wait for: a host-network pod's sandbox skips the network
    # plugin. One that waits still counts as stuck above (a runtime that
    # is down stops it too), but its starts prove nothing.
    window = now - dt.timedelta(seconds=STUCK_BOUND)
    if any(
        not pod.host_network
        and pod.last_container_start is not None
        and pod.last_container_start > window
        for pod in reading.pods
    ):
        return ()
    return tuple(sorted(stuck, key=lambda pod: (pod.since, pod.label)))


def _merged(events: Iterable[PodEvent]) -> tuple[PodEvent, ...]:
    """One event per reason: the kubelet's recorder writes a pod's first
    nine sandbox failures as Events of their own (each names another
    sandbox) and counts the later ones in one combined Event, so together
    they are every failure: their counts added, the first and last seen,
    the latest message. Timestamps have whole seconds: within one, the
    combined Event is the latest, then the last listed (the API lists a
    namespace's Events by name, ``<pod>.<hex of the time>``)."""
    by_reason: dict[str, list[PodEvent]] = {}
    for event in events:
        by_reason.setdefault(event.reason, []).append(event)
    merged: list[PodEvent] = []
    for same in by_reason.values():
        latest = max(
            reversed(same), key=lambda event: (_last_seen(event), event.combined)
        )
        firsts = [event.first for event in same if event.first is not None]
        lasts = [event.last for event in same if event.last is not None]
        merged.append(
            replace(
                latest,
                count=sum(event.count for event in same),
                first=min(firsts, default=None),
                last=max(lasts, default=None),
                combined=any(event.combined for event in same),
            )
        )
    return tuple(merged)


def _last_seen(event: PodEvent) -> dt.datetime:
    return event.last or event.first or dt.datetime.min.replace(tzinfo=dt.UTC)


# --- words for a repair issue ---------------------------------------------------


def _when(moment: dt.datetime, zone: dt.tzinfo) -> str:
    return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")


def _plain(text: str) -> str:
    """A cluster's text made safe inside a repair's Markdown: one line, no
    code fences, long ids shortened, bounded."""
    line = LONG_ID.sub(r"\1", " ".join(text.replace("`", "'").split()))
    return line if len(line) <= MESSAGE_CHARS else f"{line[: MESSAGE_CHARS - 1]}…"


def describe_pods(health: NodeHealth, zone: dt.tzinfo) -> str:
    """The stuck pods, each with the time it began to count as waiting."""
    pods = health.stuck_pods
    lines = [f"- `{pod.label}`: {_when(pod.since, zone)}" for pod in pods[:PODS_SHOWN]]
    if len(pods) > PODS_SHOWN:
        lines.append(f"- … (+{len(pods) - PODS_SHOWN})")
    return "\n".join(lines)


def describe_events(health: NodeHealth, zone: dt.tzinfo) -> str:
    """The latest sandbox failures recorded for the stuck pods, one line per
    pod and reason: how often in all (in parentheses, the recorder's
    combined events included), when last, and the kubelet's latest message;
    '-' when there are none."""
    events = sorted(
        (event for pod in health.stuck_pods for event in pod.events),
        key=_last_seen,
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
