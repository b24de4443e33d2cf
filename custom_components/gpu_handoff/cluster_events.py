"""Kubernetes Events about the GPU node: the cluster is told why.

An operator running ``kubectl describe node gpu-node`` or ``kubectl get events
--field-selector involvedObject.name=gpu-node`` reads what GPU Handoff did to
the node and why: cordoned for a gaming VM, pods evicted or refused by a
budget, the GPU node shutting down, back and uncordoned.

Events are posted as client-go's events recorder posts them
(``k8s.io/client-go/tools/events``, event_recorder.go and
event_broadcaster.go), through events.k8s.io/v1:

- ``makeEvent``: named ``<regarding name>.<nanoseconds in hex>``, in the
  regarding object's namespace or ``default`` for a cluster-scoped one (a
  Node), with ``eventTime`` now, ``reportingController`` and
  ``reportingInstance`` (the controller's name, a dash, the host name);
- ``recordToSink``: events with the same type, action, reason, reporting
  controller and instance, regarding and related object are one series: the
  second is posted as a strategic merge patch of ``series`` (count 2,
  ``lastObservedTime``), later ones only counted;
- ``finishSeries`` (every 6 minutes): a series not seen for 6 minutes is
  posted once more with its final count and forgotten, and so is a single
  event that old;
- ``recordEvent``: a patch that finds no event (404) creates it; a refusal
  of the server is not retried; a connection error is, a few times.

Posting never holds an operation up nor fails it: ``record`` only queues
(``maxQueuedEvents``: a full queue drops), a background task posts. A refused
event (no RBAC grant for events.k8s.io, a validation error) is logged once
as a warning, and at debug level after that until an event is accepted again.
The API server's limits (pkg/apis/core/validation/events.go): reason and
action up to 128 bytes, note up to 1024 (a longer one is cut).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
import datetime as dt
import logging
import random
import socket
import time
from typing import Any, Final

from .cluster_client import (
    ClusterAuthError,
    ClusterClient,
    ClusterConnectionError,
    ClusterError,
    ConflictError,
    NodeNotFoundError,
    PodRef,
)

_LOGGER = logging.getLogger(__name__)

# A qualified name (``IsQualifiedName``): the prefix names the product, as
# the cordon annotation's does.
REPORTING_CONTROLLER: Final = "gpu-handoff.io/controller"
EVENT_NAMESPACE: Final = "default"  # metav1.NamespaceDefault
NORMAL: Final = "Normal"
WARNING: Final = "Warning"
# pkg/apis/core/validation/events.go
NAME_LIMIT: Final = (
    128  # ReasonLengthLimit, ActionLengthLimit, ReportingInstanceLengthLimit
)
NOTE_LIMIT: Final = 1024  # bytes: NoteLengthLimit
# k8s.io/client-go/tools/events/event_broadcaster.go
FINISH_TIME: Final = 6 * 60.0  # finishTime
MAX_QUEUED: Final = 1000  # maxQueuedEvents
TRIES: Final = 3  # of a post a connection error cut (client-go: 12, 10 s apart)
RETRY_PAUSE: Final = 2.0  # seconds, jittered by 25 % as wait.Jitter does


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` bytes of UTF-8, as the API server counts
    them (Go's len); an ellipsis marks a cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    mark = "…"
    kept = data[: limit - len(mark.encode())].decode(errors="ignore")
    return kept + mark


def micro_time(moment: float) -> str:
    """metav1.MicroTime's RFC 3339 form with microseconds (RFC3339Micro)."""
    return dt.datetime.fromtimestamp(moment, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class _Key:
    """client-go's eventKey: what makes two events one series."""

    type: str
    action: str
    reason: str
    related: tuple[str, str, str] | None  # kind, namespace, name


@dataclass
class _Seen:
    """The event of a key as first posted, and its series so far
    (recordToSink's eventCache)."""

    body: dict[str, Any]
    event_time: float
    count: int = 1  # 1: no series yet
    last_observed: float = 0.0


@dataclass
class _Post:
    """One post for the worker: a create, or a series patch."""

    body: dict[str, Any]
    series: tuple[int, float] | None = None


@dataclass
class NodeEvents:
    """The events of one Kubernetes node (the GPU node's), posted in the
    background by ``run``."""

    cluster: ClusterClient
    node: str
    instance: str = field(
        default_factory=lambda: cut(f"gpu-handoff-{socket.gethostname()}", NAME_LIMIT)
    )
    clock: Callable[[], float] = time.time
    _queue: asyncio.Queue[_Post] = field(
        default_factory=lambda: asyncio.Queue(MAX_QUEUED)
    )
    _seen: dict[_Key, _Seen] = field(default_factory=dict)
    _node_uid: str | None = None
    _last_ns: int = 0
    _refused: bool = False

    # --- recording (never waits) -------------------------------------------------

    def normal(
        self, reason: str, action: str, note: str, related: PodRef | None = None
    ) -> None:
        """A Normal event about the node."""
        self.record(NORMAL, reason, action, note, related)

    def warning(
        self, reason: str, action: str, note: str, related: PodRef | None = None
    ) -> None:
        """A Warning event about the node."""
        self.record(WARNING, reason, action, note, related)

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        related: PodRef | None = None,
    ) -> None:
        """Queue the event (recordToSink): a repeat of the last one of the
        same key joins its series."""
        now = self.clock()
        key = _Key(
            type_,
            action,
            reason,
            None if related is None else ("Pod", related.namespace, related.name),
        )
        seen = self._seen.get(key)
        if seen is not None:
            seen.last_observed = now
            seen.count += 1
            if seen.count > 2:
                return  # counted; posted when the series finishes
            self._queue_post(_Post(seen.body, (seen.count, now)))
            return
        body = self._body(type_, reason, action, note, related=related, now=now)
        self._seen[key] = _Seen(body, now)
        self._queue_post(_Post(body))

    def _queue_post(self, post: _Post) -> None:
        try:
            self._queue.put_nowait(post)
        except asyncio.QueueFull:
            _LOGGER.debug("Too many events queued; dropped: %s", post.body["note"])

    def _body(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        *,
        related: PodRef | None,
        now: float,
    ) -> dict[str, Any]:
        """makeEvent's event (the regarding object's uid is added when posted)."""
        body: dict[str, Any] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {
                "name": f"{self.node}.{self._name_ns(now):x}",
                "namespace": EVENT_NAMESPACE,
            },
            "eventTime": micro_time(now),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": self.instance,
            "action": cut(action, NAME_LIMIT),
            "reason": cut(reason, NAME_LIMIT),
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": self.node},
            "note": cut(note, NOTE_LIMIT),
            "type": type_,
        }
        if related is not None:
            body["related"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": related.namespace,
                "name": related.name,
                "uid": related.uid,
            }
        return body

    def _name_ns(self, now: float) -> int:
        """GenerateEventName's nanoseconds: now's, or one past the last name's
        (two events within a tick of the clock get two names)."""
        self._last_ns = max(int(now * 1e9), self._last_ns + 1)
        return self._last_ns

    # --- posting (the background task) ------------------------------------------

    async def run(self) -> None:
        """Post what is queued; every FINISH_TIME, finish the series (runs
        until cancelled)."""
        next_finish = self.clock() + FINISH_TIME
        while True:
            try:
                async with asyncio.timeout(max(0.0, next_finish - self.clock())):
                    post = await self._queue.get()
            except TimeoutError:
                await self.finish_series()
                next_finish = self.clock() + FINISH_TIME
                continue
            await self.post(post)

    async def finish_series(self) -> None:
        """finishSeries: a series last seen FINISH_TIME ago is posted with
        its final count and forgotten; a single event that old is forgotten."""
        horizon = self.clock() - FINISH_TIME
        for key, seen in list(self._seen.items()):
            if seen.count >= 2 and seen.last_observed < horizon:
                await self.post(_Post(seen.body, (seen.count, seen.last_observed)))
                self._seen.pop(key, None)
            elif seen.count < 2 and seen.event_time < horizon:
                self._seen.pop(key, None)

    async def post(self, post: _Post) -> None:
        """recordEvent: patch a series (or create it when the patch finds no
        event), create a new event; connection errors are tried again."""
        for attempt in range(TRIES):
            try:
                await self._send(post)
            except ClusterConnectionError as err:
                if attempt + 1 == TRIES:
                    _LOGGER.debug(
                        "Could not post an event (%s): %s", err, post.body["note"]
                    )
                    return
                await asyncio.sleep(RETRY_PAUSE * random.uniform(1.0, 1.25))  # noqa: S311
                continue
            except ConflictError as err:
                # recordEvent: AlreadyExists is not retried, and only said
                # at a verbose level.
                _LOGGER.debug("Event not posted: %s", err)
                return
            except ClusterError as err:
                self._refusal(err)
                return
            if self._refused:
                _LOGGER.info("The cluster accepts GPU Handoff's events again")
            self._refused = False
            return

    async def _send(self, post: _Post) -> None:
        api = self.cluster.events
        name = post.body["metadata"]["name"]
        if post.series is not None:
            count, observed = post.series
            patch = {
                "series": {"count": count, "lastObservedTime": micro_time(observed)}
            }
            try:
                await self.cluster.call(
                    api.patch_namespaced_event, name, EVENT_NAMESPACE, patch
                )
            except NodeNotFoundError:
                pass  # the event is gone (its TTL): create it, series and all
            else:
                return
        # reference.GetReference: the regarding object's uid (read once).
        if self._node_uid is None:
            node = await self.cluster.call(self.cluster.core.read_node, self.node)
            self._node_uid = str(node.metadata.uid)
        body = post.body | {
            "regarding": post.body["regarding"] | {"uid": self._node_uid}
        }
        if post.series is not None:
            count, observed = post.series
            body["series"] = {"count": count, "lastObservedTime": micro_time(observed)}
        await self.cluster.call(api.create_namespaced_event, EVENT_NAMESPACE, body)

    def _refusal(self, err: ClusterError) -> None:
        """Log a refused event once (RBAC, validation), then quietly."""
        if self._refused:
            _LOGGER.debug("The cluster refused an event: %s", err)
            return
        self._refused = True
        hint = (
            " (GPU Handoff's ClusterRole needs create and patch on events in "
            "the events.k8s.io API group)"
            if isinstance(err, ClusterAuthError)
            else ""
        )
        _LOGGER.warning("The cluster refused GPU Handoff's event: %s%s", err, hint)
