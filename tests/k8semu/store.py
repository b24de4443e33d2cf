"""Versioned object storage: one global revision (like etcd), an event history
for watches and consistent paged lists, and compaction (410 Gone)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
import copy
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
import uuid

from .resources import ResourceType

JsonObj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name); namespace "" when cluster-scoped


def now_rfc3339() -> str:
    """A metav1.Time: seconds precision, Z suffix."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """A metav1.MicroTime, as in Lease renewTime."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def etcd_order(key: Key) -> str:
    """Sort like etcd keys: ``namespace/name`` (``ai-x/a`` before ``ai/z``)."""
    return f"{key[0]}/{key[1]}" if key[0] else key[1]


def object_key(obj: JsonObj) -> Key:
    """The storage key of an object."""
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta["name"])


@dataclass(frozen=True)
class StoredEvent:
    """One change: its revision, type, resource, and the objects before/after."""

    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    resource: ResourceType
    old: JsonObj | None
    new: JsonObj | None

    @property
    def object(self) -> JsonObj:
        """The object to send in a watch event (the last state for DELETED)."""
        if self.new is not None:
            return self.new
        assert self.old is not None
        final = copy.deepcopy(self.old)
        final["metadata"]["resourceVersion"] = str(self.revision)
        return final


class ExpiredError(Exception):
    """The requested revision was compacted."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested = requested
        self.oldest = oldest


class Watcher:
    """A subscription to every stored event after its creation."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[StoredEvent | None] = asyncio.Queue()

    def close(self) -> None:
        """Ends the watch (the server is stopping)."""
        self.queue.put_nowait(None)


class Store:
    """All objects of the emulated cluster."""

    def __init__(self, history_limit: int = 10_000) -> None:
        self.revision = 1
        self.compacted = 1  # events with revision <= compacted are gone
        self._objects: dict[ResourceType, dict[Key, JsonObj]] = {}
        self._history: deque[StoredEvent] = deque()
        self._history_limit = history_limit
        self._watchers: set[Watcher] = set()
        # Called after every write, once the write is complete: the
        # emulator's controllers (kubelet, namespace, disruption) react
        # there, as real controllers react to watch events.
        self.listeners: list[Callable[[StoredEvent], None]] = []

    # -- reads ---------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str, name: str) -> JsonObj | None:
        """A copy of one object, or None."""
        obj = self._objects.get(rt, {}).get((namespace if rt.namespaced else "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def list_objects(
        self, rt: ResourceType, namespace: str | None = None
    ) -> list[JsonObj]:
        """Copies of the objects, sorted by key like etcd (namespace, name)."""
        objs = self._objects.get(rt, {})
        return [
            copy.deepcopy(objs[key])
            for key in sorted(objs, key=etcd_order)
            if namespace is None or not rt.namespaced or key[0] == namespace
        ]

    def list_at(self, rt: ResourceType, revision: int) -> list[JsonObj]:
        """The objects as they were at a revision (for continue tokens)."""
        if revision < self.compacted:
            raise ExpiredError(revision, self.compacted + 1)
        state = dict(self._objects.get(rt, {}).items())
        for event in reversed(self._history):
            if event.revision <= revision:
                break
            if event.resource != rt:
                continue
            key = object_key(event.new if event.new is not None else event.object)
            if event.old is None:
                state.pop(key, None)
            else:
                state[key] = event.old
        return [copy.deepcopy(state[key]) for key in sorted(state, key=etcd_order)]

    def events_since(self, revision: int) -> list[StoredEvent]:
        """Every event after a revision; ExpiredError when compacted."""
        if revision < self.compacted:
            raise ExpiredError(revision, self.compacted + 1)
        return [e for e in self._history if e.revision > revision]

    # -- writes --------------------------------------------------------------

    def _commit(
        self, rt: ResourceType, etype: str, old: JsonObj | None, new: JsonObj | None
    ) -> StoredEvent:
        self.revision += 1
        if new is not None:
            new["metadata"]["resourceVersion"] = str(self.revision)
        event = StoredEvent(
            self.revision, etype, rt, copy.deepcopy(old), copy.deepcopy(new)
        )
        self._history.append(event)
        while len(self._history) > self._history_limit:
            self.compacted = self._history.popleft().revision
        for watcher in self._watchers:
            watcher.queue.put_nowait(event)
        return event

    def _notify(self, event: StoredEvent) -> None:
        for listener in list(self.listeners):
            listener(event)

    def create(self, rt: ResourceType, obj: JsonObj) -> JsonObj:
        """Store a new object (the caller checked it does not exist)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not rt.namespaced:
            meta.pop("namespace", None)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        if "spec" in obj and rt.kind not in ("Pod", "Node", "Lease", "Namespace"):
            meta["generation"] = 1
        obj["apiVersion"] = rt.api_version
        obj["kind"] = rt.kind
        self._objects.setdefault(rt, {})[object_key(obj)] = obj
        event = self._commit(rt, "ADDED", None, obj)
        result = copy.deepcopy(obj)
        self._notify(event)
        return result

    def update(self, rt: ResourceType, obj: JsonObj) -> JsonObj:
        """Replace a stored object (bumps resourceVersion; generation on spec change)."""
        obj = copy.deepcopy(obj)
        key = object_key(obj)
        if not rt.namespaced:
            key = ("", key[1])
        old = self._objects[rt][key]
        if obj == old:
            return copy.deepcopy(old)  # no-op updates do not bump the revision
        if "generation" in old["metadata"] and obj.get("spec") != old.get("spec"):
            obj["metadata"]["generation"] = old["metadata"]["generation"] + 1
        obj["apiVersion"] = rt.api_version
        obj["kind"] = rt.kind
        self._objects[rt][key] = obj
        event = self._commit(rt, "MODIFIED", old, obj)
        result = copy.deepcopy(obj)
        self._notify(event)
        return result

    def delete(self, rt: ResourceType, namespace: str, name: str) -> JsonObj | None:
        """Remove an object; returns its last state."""
        old = self._objects.get(rt, {}).pop(
            (namespace if rt.namespaced else "", name), None
        )
        if old is None:
            return None
        event = self._commit(rt, "DELETED", old, None)
        final = event.object
        self._notify(event)
        return final

    def compact(self) -> None:
        """Forget the whole history: older resourceVersions now get 410 Gone."""
        self._history.clear()
        self.compacted = self.revision

    # -- watches -------------------------------------------------------------

    def subscribe(self) -> Watcher:
        """A watcher that receives every later event."""
        watcher = Watcher()
        self._watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        """Stop delivering events to a watcher."""
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """End every open watch."""
        for watcher in list(self._watchers):
            watcher.close()
