"""The recording side of core/v1 Events: what a kubelet's event recorder
does to an event before the API server sees it.

Upstream the aggregation happens in the CLIENT: each event broadcaster (a
kubelet has one) runs every event it records through an EventCorrelator
(client-go tools/record/events_cache.go, NewEventCorrelatorWithOptions with
the defaults), then creates the Event, or patches the one it wrote before
(tools/record/event.go recordToSink / recordEvent; a patch of an Event that
was removed meanwhile becomes a create). The API server stores what it is
sent. So the emulator's HTTP side stores Events as posted, and its control
call ``K8sEmulator.record_event`` (the recorder of the kubelet or of any
component a test plays) runs this correlator, one per source (component and
host), as each kubelet has its own:

- EventAggregator (EventAggregatorByReasonFunc and
  EventAggregatorByReasonMessageFunc): events that differ only in their
  message (same source, involved object, type, reason, reporting controller
  and instance) are similar. It keeps the distinct messages seen and the time
  of the last similar event; one more than ``max_interval`` (600 s) after the
  last starts the record over. Once it holds ``max_events`` (10) distinct
  messages, the event is replaced by an aggregate one: a new Event named
  ``<object>.<hex ns>``, count 1, message "(combined from similar events): "
  plus the event's own, counted under the aggregate key (so each later
  similar event patches that one Event: count + 1, its message, its
  lastTimestamp), and one distinct message is forgotten (``PopAny``) so the
  next new message aggregates again. A kubelet's FailedCreatePodSandBox
  carries the sandbox id, a new one each attempt: the first nine failures of
  a pod are nine Events with count 1, every later one goes to the combined
  Event.
- eventLogger (``eventObserve``): keyed by the full key (source, object with
  its fieldPath, type, reason, message), or the aggregate key: a key seen
  before patches that Event (its name, its firstTimestamp, count + 1).
- EventSourceObjectSpamFilter: after both, a token bucket per source and
  object (``burst`` 25, refilled one every 300 s) drops what exceeds it. The
  logger has counted the dropped event all the same, so the next Event
  written jumps by the dropped ones.

Not modelled: the LRU bound of the caches (4096 keys) and the recorder's
retries of a failed write.
"""

from __future__ import annotations

from collections.abc import Callable
import copy
from dataclasses import dataclass, field
import time
from typing import Any, Final

from .store import now_rfc3339

JsonObj = dict[str, Any]

# events_cache.go: defaultAggregateMaxEvents, defaultAggregateIntervalInSeconds,
# defaultSpamBurst, defaultSpamQPS and EventAggregatorByReasonMessageFunc.
AGGREGATE_MAX_EVENTS: Final = 10
AGGREGATE_INTERVAL: Final = 600.0
SPAM_BURST: Final = 25
SPAM_QPS: Final = 1.0 / 300.0
COMBINED_PREFIX: Final = "(combined from similar events): "


def _source(event: JsonObj) -> tuple[str, str]:
    source = event.get("source") or {}
    return source.get("component") or "", source.get("host") or ""


def _object(event: JsonObj, *, field_path: bool) -> tuple[str, ...]:
    ref = event.get("involvedObject") or {}
    parts = [ref.get("kind"), ref.get("namespace"), ref.get("name")]
    if field_path:
        parts.append(ref.get("fieldPath"))
    parts += [ref.get("uid"), ref.get("apiVersion")]
    return tuple(part or "" for part in parts)


def event_key(event: JsonObj) -> tuple[str, ...]:
    """getEventKey: source, involved object, type, reason and message."""
    return (
        *_source(event),
        *_object(event, field_path=True),
        event.get("type") or "",
        event.get("reason") or "",
        event.get("message") or "",
    )


def spam_key(event: JsonObj) -> tuple[str, ...]:
    """getSpamKey: source and involved object."""
    return (*_source(event), *_object(event, field_path=False))


def aggregate_key(event: JsonObj) -> tuple[str, ...]:
    """EventAggregatorByReasonFunc's aggregate key (its local key is the
    message)."""
    return (
        *_source(event),
        *_object(event, field_path=False),
        event.get("type") or "",
        event.get("reason") or "",
        event.get("reportingComponent") or "",
        event.get("reportingInstance") or "",
    )


@dataclass
class _Aggregate:
    messages: set[str] = field(default_factory=set)
    last: float = float("-inf")


@dataclass
class _Logged:
    count: int
    first: str | None
    name: str


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass(frozen=True)
class Correlated:
    """What the recorder writes: ``event``, as a new Event, or (``patch``)
    as a patch of the Event of that name it wrote before (count,
    lastTimestamp and message)."""

    event: JsonObj
    patch: bool


class EventCorrelator:
    """One recorder's EventCorrelator (see the module's docstring).
    ``clock``: seconds, for the aggregation interval and the spam filter's
    refill (the Events' timestamps are the wall clock's)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_events: int = AGGREGATE_MAX_EVENTS,
        max_interval: float = AGGREGATE_INTERVAL,
        burst: int = SPAM_BURST,
        qps: float = SPAM_QPS,
    ) -> None:
        self.clock = clock
        self.max_events = max_events
        self.max_interval = max_interval
        self.burst = burst
        self.qps = qps
        self._aggregates: dict[tuple[str, ...], _Aggregate] = {}
        self._logged: dict[tuple[str, ...], _Logged] = {}
        self._buckets: dict[tuple[str, ...], _Bucket] = {}

    def correlate(self, event: JsonObj) -> Correlated | None:
        """EventCorrelate: the event to write, or None when the spam filter
        drops it."""
        now = self.clock()
        aggregated, key = self._aggregate(event, now)
        observed, patch = self._observe(aggregated, key)
        if not self._accept(observed, now):
            return None
        return Correlated(event=observed, patch=patch)

    def _aggregate(self, event: JsonObj, now: float) -> tuple[JsonObj, tuple[str, ...]]:
        """EventAggregate: the event itself under its full key, or an
        aggregate event under the aggregate key."""
        key = aggregate_key(event)
        record = self._aggregates.get(key)
        if record is None or now - record.last > self.max_interval:
            record = self._aggregates[key] = _Aggregate()
        record.messages.add(event.get("message") or "")
        record.last = now
        if len(record.messages) < self.max_events:
            return event, event_key(event)
        record.messages.pop()  # sets.String.PopAny: any one of them
        stamp = now_rfc3339()
        name = (event.get("involvedObject") or {}).get("name") or ""
        combined = copy.deepcopy(event)
        combined["metadata"] = {
            "name": f"{name}.{time.time_ns():x}",
            "namespace": event["metadata"]["namespace"],
        }
        combined.update(
            count=1,
            firstTimestamp=stamp,
            lastTimestamp=stamp,
            message=COMBINED_PREFIX + (event.get("message") or ""),
        )
        return combined, key

    def _observe(self, event: JsonObj, key: tuple[str, ...]) -> tuple[JsonObj, bool]:
        """eventObserve: a key seen before continues that Event."""
        observed = copy.deepcopy(event)
        last = self._logged.get(key)
        if last is not None:
            observed["metadata"]["name"] = last.name
            observed["firstTimestamp"] = last.first
            observed["count"] = last.count + 1
        self._logged[key] = _Logged(
            count=int(observed.get("count") or 1),
            first=observed.get("firstTimestamp"),
            name=observed["metadata"]["name"],
        )
        return observed, last is not None

    def _accept(self, event: JsonObj, now: float) -> bool:
        """EventSourceObjectSpamFilter.Filter, inverted: a token bucket per
        source and object (golang.org/x/time/rate: full at first)."""
        key = spam_key(event)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(tokens=float(self.burst), at=now)
        bucket.tokens = min(
            float(self.burst), bucket.tokens + (now - bucket.at) * self.qps
        )
        bucket.at = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True
