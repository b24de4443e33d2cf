"""The emulated API server: an aiohttp application over the versioned store,
plus the Python control API that tests use to shape the cluster."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
import contextlib
import copy
from dataclasses import dataclass
import json
import math
from pathlib import Path
from typing import Any, Self

from aiohttp import ClientConnectionResetError, web
import yaml

from . import objects
from .auth import ALL_RULES, PRODUCT_RULES, Rule, User, forbidden_message
from .patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch
from .resources import (
    SUBRESOURCES,
    ResourceType,
    api_group,
    api_group_list,
    api_resource_list,
    find_resource,
    resource_for_kind,
)
from .selectors import (
    FieldRequirement,
    Requirement,
    SelectorError,
    check_field_selector,
    fields_match,
    label_selector_object_matches,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)
from .store import ExpiredError, Store, StoredEvent, now_micro, now_rfc3339
from .tls import TlsMaterial, make_tls

JsonObj = dict[str, Any]

DEFAULT_TOKEN = "gpu-handoff-test-token"  # noqa: S105 - a test credential
DEFAULT_USER = "system:serviceaccount:gpu-handoff:gpu-handoff"
ANONYMOUS_PATHS = frozenset({"/version", "/healthz", "/livez", "/readyz"})
PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)
EVICTION_PDB_MESSAGE = (
    "Cannot evict pod as it would violate the pod's disruption budget."
)
MULTIPLE_PDB_MESSAGE = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
EXPIRED_CONTINUE_MESSAGE = (
    "The provided continue parameter is too old to display a consistent list result. "
    "You can start a new list without the continue parameter, or use the continue token "
    "in this response to retrieve the remainder of the results. Continuing with the "
    "provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may "
    "show up in the list."
)
REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An error the API returns as a metav1.Status."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = "",
        details: JsonObj | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = REASONS.get(code, "") if reason == "" else reason
        self.details = details

    def status(self) -> JsonObj:
        """The Status object."""
        body: JsonObj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
        }
        if self.reason:
            body["reason"] = self.reason
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(rt: ResourceType, name: str | None) -> JsonObj:
    details: JsonObj = {}
    if name:
        details["name"] = name
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.plural
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    """404 for a missing object."""
    return ApiError(
        404, f'{rt.group_resource} "{name}" not found', details=_details(rt, name)
    )


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    """409 Conflict, upstream wording."""
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}',
        details=_details(rt, name),
    )


MODIFIED_WHY = "the object has been modified; please apply your changes to the latest version and try again"


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server answered."""

    method: str
    path: str
    query: dict[str, str]
    verb: str | None
    resource: str | None  # "pods", "pods/eviction", "daemonsets"...
    group: str | None
    namespace: str | None
    name: str | None
    user: str | None
    status: int
    body: Any = None


@dataclass
class _Fault:
    remaining: int
    status: int
    message: str
    verb: str | None
    resource: str | None


@dataclass
class _Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    sub: str | None

    @property
    def resource(self) -> str:
        return f"{self.rt.plural}/{self.sub}" if self.sub else self.rt.plural


def _strip_list_item(obj: JsonObj) -> JsonObj:
    obj.pop("apiVersion", None)
    obj.pop("kind", None)
    return obj


def _encode_continue(revision: int, start: str) -> str:
    raw = json.dumps(
        {"v": "meta.k8s.io/v1", "rv": revision, "start": start + "\x00"},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        version, revision, start = raw["v"], int(raw["rv"]), str(raw["start"])
    except (ValueError, KeyError, TypeError) as err:
        raise ApiError(400, f"continue key is not valid: {err}") from err
    if version != "meta.k8s.io/v1":
        raise ApiError(
            400,
            f"continue key is not valid: incorrect encoded start resourceVersion (version {version})",
        )
    return revision, start.rstrip("\x00")


def _sort_key(obj: JsonObj) -> str:
    meta = obj["metadata"]
    ns = meta.get("namespace")
    return f"{ns}/{meta['name']}" if ns else meta["name"]


def pod_is_ready(pod: JsonObj) -> bool:
    """Running with a Ready=True condition."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _scaled(value: int | str, total: int, *, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    if not value.endswith("%"):
        return int(value)
    fraction = int(value[:-1]) * total / 100
    return math.ceil(fraction) if round_up else math.floor(fraction)


class K8sEmulator:
    """A Kubernetes API server emulator (HTTPS on 127.0.0.1 by default).

    Use ``async with K8sEmulator() as emu`` or ``await emu.start()`` /
    ``await emu.stop()``. Shape the cluster with the control methods (no HTTP).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: bool = True,
        token: str = DEFAULT_TOKEN,
        user: str = DEFAULT_USER,
        rules: tuple[Rule, ...] = PRODUCT_RULES,
        deletion_grace: float = 0.0,
        lease_interval: float = 10.0,
        lease_duration: int = 40,
        history_limit: int = 10_000,
        server_hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.default_token = token
        self.deletion_grace = deletion_grace
        self.lease_interval = lease_interval
        self.lease_duration = lease_duration
        self.store = Store(history_limit)
        self.requests: list[RecordedRequest] = []
        self._server_hosts = server_hosts
        self._tokens: dict[str, User] = {token: User(user, rules)}
        self._faults: list[_Fault] = []
        self._down: set[str] = set()
        self._refusing: set[str] = set()  # pod uids that never finish terminating
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._watches_hung = False
        self._runner: web.AppRunner | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._tls: TlsMaterial | None = None
        for ns in (
            "default",
            "kube-system",
            "kube-public",
            objects.NODE_LEASE_NAMESPACE,
        ):
            self.create(objects.make_namespace(ns))

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        """Serve; the bound port is in ``port`` afterwards."""
        if self.tls:
            self._tls = make_tls([*self._server_hosts, self.host])
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=2.0
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.host,
            self.port,
            ssl_context=self._tls.server_context() if self._tls else None,
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._lease_task = asyncio.get_running_loop().create_task(
            self._lease_loop(), name="k8semu-leases"
        )

    async def stop(self) -> None:
        """Stop serving: end watches, timers and lease renewals."""
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
            self._lease_task = None
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.store.close_watchers()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """The server URL for kubeconfigs."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def ca_pem(self) -> bytes:
        """The cluster CA certificate (PEM)."""
        assert self._tls is not None, "start() the emulator with tls=True first"
        return self._tls.ca_pem

    # ------------------------------------------------------------ kubeconfig

    def add_token(
        self,
        token: str,
        rules: tuple[Rule, ...] = ALL_RULES,
        user: str = "kubernetes-admin",
    ) -> None:
        """Accept another bearer token with its own rules."""
        self._tokens[token] = User(user, rules)

    def set_rules(self, rules: tuple[Rule, ...], token: str | None = None) -> None:
        """Replace what a token (the default one by default) may do."""
        self._tokens[token or self.default_token].rules = rules

    def kubeconfig(self, token: str | None = None, *, name: str = "k8semu") -> JsonObj:
        """A kubeconfig dict like a real cluster's (server URL, CA data, token)."""
        cluster: JsonObj = {"server": self.url}
        if self._tls is not None:
            cluster["certificate-authority-data"] = base64.b64encode(
                self._tls.ca_pem
            ).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [{"name": name, "cluster": cluster}],
            "users": [
                {"name": f"{name}-user", "user": {"token": token or self.default_token}}
            ],
            "contexts": [
                {
                    "name": name,
                    "context": {
                        "cluster": name,
                        "user": f"{name}-user",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": name,
        }

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """Write ``kubeconfig()`` as YAML (mode 0600)."""
        path.write_text(yaml.safe_dump(self.kubeconfig(token), sort_keys=False))
        path.chmod(0o600)
        return path

    # -------------------------------------------------------- control: generic

    def create(self, obj: JsonObj) -> JsonObj:
        """Store any object (kind + metadata.name required); returns it."""
        rt = resource_for_kind(obj["kind"])
        meta = obj.setdefault("metadata", {})
        if rt.namespaced:
            meta.setdefault("namespace", "default")
        if self.store.get(rt, meta.get("namespace", ""), meta["name"]) is not None:
            raise ValueError(f"{rt.plural} {meta['name']} already exists")
        return self.store.create(rt, obj)

    def get(self, kind: str, name: str, namespace: str = "default") -> JsonObj | None:
        """The current object (a copy), or None."""
        rt = resource_for_kind(kind)
        obj = self.store.get(rt, namespace, name)
        if obj is not None and rt.kind == "PodDisruptionBudget":
            obj["status"] = self._pdb_status(obj)
        return obj

    def list_objects(self, kind: str, namespace: str | None = None) -> list[JsonObj]:
        """Every object of a kind (copies)."""
        return self.store.list_objects(resource_for_kind(kind), namespace)

    def modify(
        self,
        kind: str,
        name: str,
        namespace: str = "default",
        *,
        mutate: Callable[[JsonObj], None],
    ) -> JsonObj:
        """Change an object in place through ``mutate`` (emits MODIFIED)."""
        rt = resource_for_kind(kind)
        obj = self.store.get(rt, namespace, name)
        if obj is None:
            raise KeyError(f"{kind} {namespace}/{name}")
        mutate(obj)
        return self.store.update(rt, obj)

    def delete(self, kind: str, name: str, namespace: str = "default") -> None:
        """Remove an object at once (no grace period)."""
        rt = resource_for_kind(kind)
        old = self.store.delete(rt, namespace, name)
        if old is not None:
            self._cancel_timer(old["metadata"]["uid"])

    def hang_watches(self, hung: bool = True) -> None:
        """Open and new watch streams stay connected but deliver nothing (not
        even their timeoutSeconds end), like the silent hangs of a dead
        connection; events during the hang are lost. ``False`` resumes."""
        self._watches_hung = hung

    def compact(self) -> None:
        """Compact the history: watches/continues from before now get 410."""
        self.store.compact()

    # ---------------------------------------------------------- control: nodes

    def add_node(self, name: str, **kwargs: Any) -> JsonObj:
        """A node (see ``objects.make_node`` for options) and its Lease."""
        node = self.create(objects.make_node(name, **kwargs))
        self.create(
            objects.make_lease(
                name, duration=self.lease_duration, node_uid=node["metadata"]["uid"]
            )
        )
        if not kwargs.get("up", True):
            self._down.add(name)
        return node

    def remove_node(self, name: str) -> None:
        """Delete a node and its Lease."""
        self.delete("Node", name, "")
        self.delete("Lease", name, objects.NODE_LEASE_NAMESPACE)
        self._down.discard(name)

    def set_node_up(self, name: str, up: bool = True) -> JsonObj:
        """Up: Ready=True and the Lease renews. Down: Ready=Unknown, unreachable
        taints (as the node lifecycle controller sets them), no renewals."""
        was_up = name not in self._down

        def mutate(node: JsonObj) -> None:
            conditions = node["status"]["conditions"]
            for index, cond in enumerate(conditions):
                if cond["type"] == "Ready":
                    new = objects.ready_condition(up)
                    if was_up == up:
                        new["lastTransitionTime"] = cond.get(
                            "lastTransitionTime", new["lastTransitionTime"]
                        )
                    conditions[index] = new
            taints = [
                t
                for t in node["spec"].get("taints", [])
                if t["key"] != "node.kubernetes.io/unreachable"
            ]
            if not up:
                taints.extend(
                    {**t, "timeAdded": now_rfc3339()}
                    for t in objects.UNREACHABLE_TAINTS
                )
            if taints:
                node["spec"]["taints"] = taints
            else:
                node["spec"].pop("taints", None)

        node = self.modify("Node", name, "", mutate=mutate)
        if up:
            self._down.discard(name)
            self.renew_lease(name)
        else:
            self._down.add(name)
        if was_up != up:
            # Down: the node lifecycle controller marks its pods not Ready.
            # Up: the kubelet reports its running pods Ready again.
            for pod in self.store.list_objects(resource_for_kind("Pod")):
                if (pod.get("spec") or {}).get("nodeName") == name:
                    meta = pod["metadata"]
                    phase = (pod.get("status") or {}).get("phase")
                    if up and phase != "Running":
                        continue
                    self.set_pod_status(meta["name"], meta["namespace"], ready=up)
        return node

    def set_pod_status(
        self,
        name: str,
        namespace: str = "default",
        *,
        phase: str | None = None,
        ready: bool | None = None,
    ) -> JsonObj:
        """Change a pod's phase and/or its Ready condition (as a kubelet would)."""

        def mutate(pod: JsonObj) -> None:
            status = pod.setdefault("status", {})
            if phase is not None:
                status["phase"] = phase
            if ready is not None:
                for cond in status.get("conditions") or []:
                    if cond["type"] in ("Ready", "ContainersReady"):
                        if cond["status"] != ("True" if ready else "False"):
                            cond["lastTransitionTime"] = now_rfc3339()
                        cond["status"] = "True" if ready else "False"
                        if ready:
                            cond.pop("reason", None)
                        else:
                            cond["reason"] = "ContainersNotReady"
                for container in status.get("containerStatuses") or []:
                    container["ready"] = ready

        return self.modify("Pod", name, namespace, mutate=mutate)

    def node_is_up(self, name: str) -> bool:
        """Whether the node's kubelet is 'running'."""
        return name not in self._down

    def renew_lease(self, name: str) -> None:
        """Renew a node's Lease now (the renewal loop does this every interval)."""
        lease = self.store.get(
            resource_for_kind("Lease"), objects.NODE_LEASE_NAMESPACE, name
        )
        if lease is not None:
            lease["spec"]["renewTime"] = now_micro()
            self.store.update(resource_for_kind("Lease"), lease)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_interval)
            for node in self.store.list_objects(resource_for_kind("Node")):
                name = node["metadata"]["name"]
                if name not in self._down:
                    self.renew_lease(name)

    # ----------------------------------------------------------- control: pods

    def add_pod(
        self,
        name: str,
        namespace: str = "default",
        *,
        refuse_termination: bool = False,
        **kwargs: Any,
    ) -> JsonObj:
        """A pod (see ``objects.make_pod`` for options)."""
        pod = self.create(objects.make_pod(name, namespace, **kwargs))
        if refuse_termination:
            self._refusing.add(pod["metadata"]["uid"])
        return pod

    def remove_pod(self, name: str, namespace: str = "default") -> None:
        """Delete a pod at once (as if its kubelet confirmed it)."""
        self.delete("Pod", name, namespace)

    def set_pod_refuse_termination(
        self, name: str, namespace: str = "default", refuse: bool = True
    ) -> None:
        """A refusing pod stays Terminating (deletionTimestamp set) after eviction."""
        pod = self.get("Pod", name, namespace)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name}")
        uid = pod["metadata"]["uid"]
        if refuse:
            self._refusing.add(uid)
        else:
            self._refusing.discard(uid)
            if pod["metadata"].get("deletionTimestamp"):
                self._schedule_removal(pod)

    def owner_ref(self, obj: JsonObj) -> JsonObj:
        """A controller ownerReference to a stored object."""
        return objects.owner_ref(
            obj["kind"],
            obj["metadata"]["name"],
            obj["metadata"]["uid"],
            obj["apiVersion"],
        )

    def add_daemonset(
        self, name: str, namespace: str = "kube-system", **kwargs: Any
    ) -> JsonObj:
        """A DaemonSet (see ``objects.make_daemonset``)."""
        return self.create(objects.make_daemonset(name, namespace, **kwargs))

    def add_replicaset(
        self, name: str, namespace: str = "default", **kwargs: Any
    ) -> JsonObj:
        """A ReplicaSet (see ``objects.make_replicaset``)."""
        return self.create(objects.make_replicaset(name, namespace, **kwargs))

    def add_pdb(self, name: str, namespace: str = "default", **kwargs: Any) -> JsonObj:
        """A PodDisruptionBudget (see ``objects.make_pdb``)."""
        self.create(objects.make_pdb(name, namespace, **kwargs))
        pdb = self.get("PodDisruptionBudget", name, namespace)
        assert pdb is not None
        return pdb

    def add_event(
        self, name: str, namespace: str = "default", **kwargs: Any
    ) -> JsonObj:
        """A core/v1 Event (see ``objects.make_event``)."""
        return self.create(objects.make_event(name, namespace, **kwargs))

    # ----------------------------------------------------- control: recording

    def fail_next(
        self,
        n: int,
        status: int,
        *,
        verb: str | None = None,
        resource: str | None = None,
        message: str | None = None,
    ) -> None:
        """The next ``n`` resource requests (optionally only this verb and/or
        resource, e.g. ``"pods/eviction"``) fail with ``status``."""
        self._faults.append(
            _Fault(n, status, message or f"injected failure ({status})", verb, resource)
        )

    def requests_for(
        self,
        *,
        verb: str | None = None,
        resource: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
    ) -> list[RecordedRequest]:
        """Recorded requests that match every given filter."""
        return [
            r
            for r in self.requests
            if (verb is None or r.verb == verb)
            and (resource is None or r.resource == resource)
            and (name is None or r.name == name)
            and (namespace is None or r.namespace == namespace)
        ]

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        self.requests.clear()

    # ------------------------------------------------------------- PDB logic

    def _matching_pdbs(self, pod: JsonObj) -> list[JsonObj]:
        rt = resource_for_kind("PodDisruptionBudget")
        labels = pod["metadata"].get("labels") or {}
        return [
            pdb
            for pdb in self.store.list_objects(rt, pod["metadata"]["namespace"])
            if label_selector_object_matches(
                (pdb.get("spec") or {}).get("selector"), labels
            )
        ]

    def _pdb_status(self, pdb: JsonObj) -> JsonObj:
        """What the disruption controller would have written, computed now."""
        spec = pdb.get("spec") or {}
        ns = pdb["metadata"]["namespace"]
        pods = [
            p
            for p in self.store.list_objects(resource_for_kind("Pod"), ns)
            if label_selector_object_matches(
                spec.get("selector"), p["metadata"].get("labels")
            )
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        healthy = sum(
            1
            for p in pods
            if not p["metadata"].get("deletionTimestamp") and pod_is_ready(p)
        )
        min_available = spec.get("minAvailable")
        max_unavailable = spec.get("maxUnavailable")
        if isinstance(min_available, int):
            expected, desired = len(pods), min_available
        else:
            expected = self._expected_scale(pods)
            if min_available is not None:
                desired = _scaled(min_available, expected, round_up=True)
            elif max_unavailable is not None:
                desired = max(
                    0, expected - _scaled(max_unavailable, expected, round_up=True)
                )
            else:
                desired = expected
        allowed = max(0, healthy - desired)
        generation = pdb["metadata"].get("generation", 1)
        return {
            "observedGeneration": generation,
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "disruptionsAllowed": allowed,
            "conditions": [
                {
                    "type": "DisruptionAllowed",
                    "status": "True" if allowed > 0 else "False",
                    "reason": "SufficientPods" if allowed > 0 else "InsufficientPods",
                    "message": "",
                    "observedGeneration": generation,
                    "lastTransitionTime": pdb["metadata"].get(
                        "creationTimestamp", now_rfc3339()
                    ),
                }
            ],
        }

    def _expected_scale(self, pods: list[JsonObj]) -> int:
        """Sum of the owning controllers' replicas (a pod without a stored
        controller counts as one)."""
        total = 0
        seen: set[str] = set()
        for pod in pods:
            owner = next(
                (
                    o
                    for o in pod["metadata"].get("ownerReferences") or []
                    if o.get("controller")
                ),
                None,
            )
            controller = None
            if owner and owner["kind"] in ("ReplicaSet", "StatefulSet"):
                controller = self.store.get(
                    resource_for_kind(owner["kind"]),
                    pod["metadata"]["namespace"],
                    owner["name"],
                )
            if controller is None:
                total += 1
            elif controller["metadata"]["uid"] not in seen:
                seen.add(controller["metadata"]["uid"])
                total += int(controller["spec"].get("replicas", 1))
        return total

    # ------------------------------------------------------- pod termination

    def _cancel_timer(self, uid: str) -> None:
        timer = self._timers.pop(uid, None)
        if timer is not None:
            timer.cancel()

    def _schedule_removal(self, pod: JsonObj) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self._refusing or uid in self._timers:
            return
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]

        def finish() -> None:
            self._timers.pop(uid, None)
            current = self.store.get(resource_for_kind("Pod"), ns, name)
            if (
                current is not None
                and current["metadata"]["uid"] == uid
                and uid not in self._refusing
            ):
                self.store.delete(resource_for_kind("Pod"), ns, name)

        if self.deletion_grace <= 0:
            finish()
        else:
            self._timers[uid] = asyncio.get_running_loop().call_later(
                self.deletion_grace, finish
            )

    def _delete_pod(self, pod: JsonObj, grace: int | None) -> JsonObj:
        """Delete as the apiserver + kubelet would; returns the object to send."""
        rt = resource_for_kind("Pod")
        meta = pod["metadata"]
        uid = meta["uid"]
        phase = (pod.get("status") or {}).get("phase")
        unscheduled = not (pod.get("spec") or {}).get("nodeName")
        immediate = (
            phase in ("Succeeded", "Failed")
            or unscheduled
            or grace == 0
            or self.deletion_grace <= 0
        )
        if immediate and uid not in self._refusing:
            self._cancel_timer(uid)
            return self.store.delete(rt, meta["namespace"], meta["name"]) or pod
        if not meta.get("deletionTimestamp"):
            seconds = (
                grace
                if grace is not None
                else pod["spec"].get("terminationGracePeriodSeconds", 30)
            )
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = seconds
            pod = self.store.update(rt, pod)
        self._schedule_removal(pod)
        return pod

    # ================================================================== HTTP

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        info: dict[str, Any] = {
            "verb": None,
            "resource": None,
            "group": None,
            "namespace": None,
            "name": None,
            "user": None,
            "body": None,
        }
        try:
            response = await self._dispatch(request, info)
        except ApiError as err:
            response = web.json_response(err.status(), status=err.code)
        if not info.pop("recorded", False):
            self._record(request, info, response.status)
        return response

    def _record(self, request: web.Request, info: dict[str, Any], status: int) -> None:
        self.requests.append(
            RecordedRequest(
                method=request.method,
                path=request.path,
                query=dict(request.query),
                status=status,
                **{k: v for k, v in info.items() if k != "recorded"},
            )
        )

    def _authenticate(self, request: web.Request) -> User | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip() in self._tokens:
            return self._tokens[token.strip()]
        return None

    async def _dispatch(
        self, request: web.Request, info: dict[str, Any]
    ) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        user = self._authenticate(request)
        if user is None and path not in ANONYMOUS_PATHS:
            raise ApiError(401, "Unauthorized")
        info["user"] = user.name if user else "system:anonymous"
        if request.method == "GET":
            discovery = self._discovery(path)
            if discovery is not None:
                return web.json_response(discovery)
        target = self._parse_target(path)
        if target is None:
            if path in ("/healthz", "/livez", "/readyz"):
                return web.Response(text="ok")
            raise ApiError(
                404, "the server could not find the requested resource", details={}
            )
        verb = self._verb(request, target)
        info.update(
            verb=verb,
            resource=target.resource,
            group=target.rt.group,
            namespace=target.namespace,
            name=target.name,
        )
        assert user is not None
        if not user.can(verb, target.rt.group, target.resource, target.name):
            raise ApiError(
                403,
                forbidden_message(
                    user=user.name,
                    verb=verb,
                    group=target.rt.group,
                    resource=target.rt.plural,
                    subresource=target.sub,
                    namespace=target.namespace,
                    name=target.name,
                ),
                details=_details(target.rt, target.name),
            )
        body: Any = None
        if request.method in ("POST", "PUT", "PATCH") or (
            request.method == "DELETE" and request.can_read_body
        ):
            raw = await request.read()
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError as err:
                    raise ApiError(400, f"error decoding request body: {err}") from err
            info["body"] = body
        self._inject_fault(verb, target.resource)
        match verb:
            case "get":
                return web.json_response(self._api_get(target))
            case "list":
                return web.json_response(self._api_list(target, request.query))
            case "watch":
                return await self._api_watch(request, target, info)
            case "create":
                return web.json_response(self._api_create(target, body), status=201)
            case "update":
                return web.json_response(self._api_update(target, body))
            case "patch":
                return web.json_response(
                    self._api_patch(
                        target, request.headers.get("Content-Type", ""), body
                    )
                )
            case "delete":
                return web.json_response(self._api_delete(target, body))
            case "deletecollection":
                return web.json_response(
                    self._api_delete_collection(target, request.query)
                )
        raise ApiError(
            405,
            f"the server does not allow this method on the requested resource ({verb})",
        )

    def _inject_fault(self, verb: str, resource: str) -> None:
        for fault in self._faults:
            if (
                fault.remaining > 0
                and fault.verb in (None, verb)
                and fault.resource in (None, resource)
            ):
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                raise ApiError(fault.status, fault.message, details={})

    def _discovery(self, path: str) -> JsonObj | None:
        match path:
            case "/version":
                return {
                    "major": "1",
                    "minor": "34",
                    "gitVersion": "v1.34.2+k3s1",
                    "gitCommit": "0000000000000000000000000000000000000000",
                    "gitTreeState": "clean",
                    "buildDate": "2026-11-01T00:00:00Z",
                    "goVersion": "go1.24.9",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                }
            case "/api":
                return {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {
                            "clientCIDR": "0.0.0.0/0",
                            "serverAddress": f"{self.host}:{self.port}",
                        }
                    ],
                }
            case "/api/v1":
                return api_resource_list("", "v1")
            case "/apis":
                return api_group_list()
        parts = path.strip("/").split("/")
        if parts[0] == "apis" and len(parts) in (2, 3):
            for group in api_group_list()["groups"]:  # type: ignore[attr-defined]
                if group["name"] != parts[1]:
                    continue
                if len(parts) == 2:
                    return {
                        "kind": "APIGroup",
                        "apiVersion": "v1",
                        **api_group(parts[1], group["preferredVersion"]["version"]),
                    }
                if parts[2] == group["preferredVersion"]["version"]:
                    return api_resource_list(parts[1], parts[2])
        return None

    @staticmethod
    def _parse_target(path: str) -> _Target | None:
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 3:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            candidate = find_resource(group, version, rest[2])
            if candidate is not None and candidate.namespaced:
                namespace, rest = rest[1], rest[2:]
        rt = find_resource(group, version, rest[0])
        if rt is None or len(rest) > 3 or (namespace is not None and not rt.namespaced):
            return None
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and (rt.plural, sub) not in SUBRESOURCES:
            return None
        return _Target(rt, namespace, name, sub)

    @staticmethod
    def _verb(request: web.Request, target: _Target) -> str:
        match request.method:
            case "GET" | "HEAD":
                if target.name:
                    return "get"
                return (
                    "watch"
                    if request.query.get("watch")
                    in ("1", "t", "T", "true", "TRUE", "True")
                    else "list"
                )
            case "POST":
                return "create"
            case "PUT":
                return "update"
            case "PATCH":
                return "patch"
            case "DELETE":
                return "delete" if target.name else "deletecollection"
        raise ApiError(
            405, "the server does not allow this method on the requested resource"
        )

    # ----------------------------------------------------------- handlers

    def _load(self, target: _Target) -> JsonObj:
        assert target.name is not None
        obj = self.store.get(target.rt, target.namespace or "", target.name)
        if obj is None:
            raise not_found(target.rt, target.name)
        return obj

    def _present(self, rt: ResourceType, obj: JsonObj) -> JsonObj:
        if rt.kind == "PodDisruptionBudget":
            obj["status"] = self._pdb_status(obj)
        return obj

    def _api_get(self, target: _Target) -> JsonObj:
        if target.name is None or target.sub == "eviction":
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        return self._present(target.rt, self._load(target))

    def _selectors(
        self, target: _Target, query: Any
    ) -> tuple[list[Requirement], list[FieldRequirement]]:
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""))
            check_field_selector(target.rt.plural, fields)
        except SelectorError as err:
            raise ApiError(400, str(err)) from err
        return labels, fields

    def _matches(
        self,
        target: _Target,
        labels: list[Requirement],
        fields: list[FieldRequirement],
        obj: JsonObj,
    ) -> bool:
        meta = obj["metadata"]
        if target.namespace is not None and meta.get("namespace") != target.namespace:
            return False
        return labels_match(labels, meta.get("labels")) and fields_match(
            target.rt.plural, fields, obj
        )

    def _api_list(self, target: _Target, query: Any) -> JsonObj:
        if target.name is not None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        labels, fields = self._selectors(target, query)
        token = query.get("continue", "")
        if token:
            revision, start = _decode_continue(token)
            try:
                objs = self.store.list_at(target.rt, revision)
            except ExpiredError as err:
                raise ApiError(410, EXPIRED_CONTINUE_MESSAGE, reason="Expired") from err
        elif query.get("resourceVersionMatch") == "Exact":
            rv = query.get("resourceVersion", "")
            if not rv.isdigit():
                raise ApiError(
                    400,
                    "resourceVersionMatch is forbidden unless resourceVersion is "
                    "provided and set to a specific version",
                )
            revision, start = int(rv), ""
            if revision > self.store.revision:
                raise ApiError(
                    504,
                    f"Too large resource version: {rv}, current: {self.store.revision}",
                    reason="Timeout",
                )
            try:
                objs = self.store.list_at(target.rt, revision)
            except ExpiredError as err:
                raise ApiError(410, str(err), reason="Expired") from err
        else:
            revision, start = self.store.revision, ""
            objs = self.store.list_objects(target.rt)
        items = [
            o
            for o in objs
            if self._matches(target, labels, fields, o)
            and (not start or _sort_key(o) > start)
        ]
        meta: JsonObj = {"resourceVersion": str(revision)}
        try:
            limit = int(query.get("limit", "0") or 0)
        except ValueError as err:
            raise ApiError(400, f"invalid limit: {err}") from err
        if 0 < limit < len(items):
            remaining = len(items) - limit
            items = items[:limit]
            meta["continue"] = _encode_continue(revision, _sort_key(items[-1]))
            if not labels and not fields:
                meta["remainingItemCount"] = remaining
        return {
            "kind": f"{target.rt.kind}List",
            "apiVersion": target.rt.api_version,
            "metadata": meta,
            "items": [_strip_list_item(self._present(target.rt, o)) for o in items],
        }

    async def _api_watch(
        self, request: web.Request, target: _Target, info: dict[str, Any]
    ) -> web.StreamResponse:
        labels, fields = self._selectors(target, request.query)
        rv_text = request.query.get("resourceVersion", "")
        since: int | None = None
        if rv_text not in ("", "0"):
            try:
                since = int(rv_text)
            except ValueError as err:
                raise ApiError(
                    400,
                    f'resourceVersion: Invalid value: "{rv_text}": must be a number',
                ) from err
        timeout: float | None = None
        if request.query.get("timeoutSeconds"):
            try:
                timeout = float(request.query["timeoutSeconds"])
            except ValueError as err:
                raise ApiError(400, f"invalid timeoutSeconds: {err}") from err

        def translate(event: StoredEvent) -> tuple[str, JsonObj] | None:
            if event.resource != target.rt:
                return None
            old_ok = event.old is not None and self._matches(
                target, labels, fields, event.old
            )
            new_ok = event.new is not None and self._matches(
                target, labels, fields, event.new
            )
            obj = self._present(target.rt, event.object)
            if event.type == "ADDED":
                return ("ADDED", obj) if new_ok else None
            if event.type == "DELETED":
                return ("DELETED", obj) if old_ok else None
            if old_ok and new_ok:
                return ("MODIFIED", obj)
            if new_ok:
                return ("ADDED", obj)
            if old_ok:
                return ("DELETED", obj)
            return None

        watcher = self.store.subscribe()
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "application/json"}
        )
        response.enable_chunked_encoding()

        async def send(etype: str, obj: JsonObj) -> None:
            line = (
                json.dumps({"type": etype, "object": obj}, separators=(",", ":")) + "\n"
            )
            await response.write(line.encode())

        try:
            # No await between reading the state and subscribing: no gap.
            start = self.store.revision
            initial: list[tuple[str, JsonObj]] = []
            expired: ExpiredError | None = None
            if since is None:
                initial = [
                    ("ADDED", self._present(target.rt, o))
                    for o in self.store.list_objects(target.rt)
                    if self._matches(target, labels, fields, o)
                ]
            else:
                try:
                    initial = [
                        t
                        for e in self.store.events_since(since)
                        if (t := translate(e)) is not None
                    ]
                except ExpiredError as err:
                    expired = err
            await response.prepare(request)
            self._record(request, info, 200)  # a watch is recorded when it starts
            info["recorded"] = True
            if expired is not None:
                await send(
                    "ERROR", ApiError(410, str(expired), reason="Expired").status()
                )
                return response
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            if not self._watches_hung:
                for etype, obj in initial:
                    await send(etype, obj)
            stalled = False  # a stream that ever hung never ends by itself
            while True:
                stalled = stalled or self._watches_hung
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    if not stalled:
                        break  # timeoutSeconds: a clean end of the stream
                    remaining = None
                try:
                    async with asyncio.timeout(remaining):
                        event = await watcher.queue.get()
                except TimeoutError:
                    continue
                if event is None:
                    break
                if event.revision <= start or self._watches_hung:
                    continue
                translated = translate(event)
                if translated is not None:
                    await send(*translated)
        except ClientConnectionResetError, ConnectionResetError:
            pass
        finally:
            self.store.unsubscribe(watcher)
        with contextlib.suppress(ClientConnectionResetError, ConnectionResetError):
            await response.write_eof()
        return response

    def _check_body(self, target: _Target, body: Any) -> JsonObj:
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request is not a JSON object")
        meta = body.setdefault("metadata", {})
        if target.namespace is not None:
            if meta.get("namespace") not in (None, "", target.namespace):
                raise ApiError(
                    400,
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = target.namespace
        return body

    def _api_create(self, target: _Target, body: Any) -> JsonObj:
        if target.sub == "eviction":
            return self._evict(target, body)
        if target.name is not None or target.sub is not None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        obj = self._check_body(target, body)
        meta = obj["metadata"]
        if not meta.get("name"):
            raise ApiError(
                422,
                f'{target.rt.kind} "" is invalid: metadata.name: Required value: name or generateName is required',
                details={
                    "kind": target.rt.kind,
                    "causes": [
                        {
                            "reason": "FieldValueRequired",
                            "message": "Required value: name or generateName is required",
                            "field": "metadata.name",
                        }
                    ],
                },
            )
        for key in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
        ):
            meta.pop(key, None)
        if self.store.get(target.rt, target.namespace or "", meta["name"]) is not None:
            raise ApiError(
                409,
                f'{target.rt.group_resource} "{meta["name"]}" already exists',
                reason="AlreadyExists",
                details=_details(target.rt, meta["name"]),
            )
        if target.rt.kind == "PodDisruptionBudget":
            obj.pop("status", None)
        return self._present(target.rt, self.store.create(target.rt, obj))

    def _merge_update(self, target: _Target, old: JsonObj, new: JsonObj) -> JsonObj:
        """Apply main-resource vs status-subresource rules and preconditions."""
        assert target.name is not None
        new_meta = new.setdefault("metadata", {})
        if new_meta.get("name", target.name) != target.name:
            raise ApiError(
                400, "the name of the object does not match the name on the URL"
            )
        rv = new_meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(target.rt, target.name, MODIFIED_WHY)
        if target.sub == "status":
            result = copy.deepcopy(old)
            result["status"] = new.get("status")
            return result
        result = copy.deepcopy(new)
        # Server-owned metadata is kept.
        for key in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
            "name",
            "namespace",
        ):
            if key in old["metadata"]:
                result["metadata"][key] = old["metadata"][key]
            else:
                result["metadata"].pop(key, None)
        if target.rt.kind in (
            "Node",
            "Pod",
            "PodDisruptionBudget",
            "DaemonSet",
            "ReplicaSet",
            "Deployment",
            "StatefulSet",
            "Namespace",
        ):
            # The main resource ignores status changes (status strategy).
            if "status" in old:
                result["status"] = old["status"]
            else:
                result.pop("status", None)
        if target.rt.kind == "Node":
            self._sync_unschedulable_taint(result)
        return result

    @staticmethod
    def _sync_unschedulable_taint(node: JsonObj) -> None:
        """The node lifecycle controller's TaintNodeByCondition for cordons."""
        spec = node.setdefault("spec", {})
        if spec.get("unschedulable") is False or (
            "unschedulable" in spec and spec["unschedulable"] is None
        ):
            spec.pop("unschedulable")  # omitempty, as the apiserver serializes it
        taints = [
            t
            for t in spec.get("taints") or []
            if t.get("key") != "node.kubernetes.io/unschedulable"
        ]
        had = any(
            t.get("key") == "node.kubernetes.io/unschedulable"
            for t in spec.get("taints") or []
        )
        if spec.get("unschedulable"):
            previous = next(
                (
                    t
                    for t in spec.get("taints") or []
                    if t.get("key") == "node.kubernetes.io/unschedulable"
                ),
                {
                    "key": "node.kubernetes.io/unschedulable",
                    "effect": "NoSchedule",
                    "timeAdded": now_rfc3339(),
                },
            )
            taints.append(previous)
        if taints:
            spec["taints"] = taints
        elif had or "taints" in spec:
            spec.pop("taints", None)

    def _api_update(self, target: _Target, body: Any) -> JsonObj:
        if target.name is None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        old = self._load(target)
        new = self._check_body(target, body)
        result = self._merge_update(target, old, new)
        return self._present(target.rt, self.store.update(target.rt, result))

    def _api_patch(self, target: _Target, content_type: str, body: Any) -> JsonObj:
        if target.name is None or target.sub == "eviction":
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        media = content_type.split(";", maxsplit=1)[0].strip().lower()
        if media not in PATCH_TYPES:
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: {', '.join(PATCH_TYPES)}",
                details={},
            )
        old = self._load(target)
        try:
            if media == "application/json-patch+json":
                patched = json_patch(old, body)
            elif not isinstance(body, dict):
                raise ApiError(400, "the body of the request was not a JSON object")
            elif media == "application/merge-patch+json":
                patched = json_merge_patch(old, body)
            else:
                patched = strategic_merge_patch(old, body)
        except PatchError as err:
            raise ApiError(422, str(err)) from err
        if not isinstance(patched, dict):
            raise ApiError(422, "the patch did not result in an object")
        meta = patched.setdefault("metadata", {})
        if isinstance(body, dict):
            # A resourceVersion in the patch is a precondition.
            rv = (body.get("metadata") or {}).get("resourceVersion")
            meta["resourceVersion"] = rv or old["metadata"]["resourceVersion"]
        else:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        result = self._merge_update(target, old, patched)
        return self._present(target.rt, self.store.update(target.rt, result))

    def _api_delete(self, target: _Target, body: Any) -> JsonObj:
        if target.name is None or target.sub is not None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        obj = self._load(target)
        options = body if isinstance(body, dict) else {}
        self._check_preconditions(target, obj, options)
        if target.rt.kind == "Pod":
            return self._delete_pod(obj, options.get("gracePeriodSeconds"))
        self.store.delete(target.rt, target.namespace or "", target.name)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                **_details(target.rt, target.name),
                "uid": obj["metadata"]["uid"],
            },
        }

    def _api_delete_collection(self, target: _Target, query: Any) -> JsonObj:
        labels, fields = self._selectors(target, query)
        deleted = []
        for obj in self.store.list_objects(target.rt):
            if self._matches(target, labels, fields, obj):
                meta = obj["metadata"]
                if target.rt.kind == "Pod":
                    deleted.append(self._delete_pod(obj, None))
                else:
                    deleted.append(
                        self.store.delete(
                            target.rt, meta.get("namespace", ""), meta["name"]
                        )
                        or obj
                    )
        return {
            "kind": f"{target.rt.kind}List",
            "apiVersion": target.rt.api_version,
            "metadata": {"resourceVersion": str(self.store.revision)},
            "items": [_strip_list_item(o) for o in deleted],
        }

    @staticmethod
    def _check_preconditions(target: _Target, obj: JsonObj, options: JsonObj) -> None:
        pre = options.get("preconditions") or {}
        meta = obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(
                target.rt,
                meta["name"],
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
            )
        if (
            pre.get("resourceVersion")
            and pre["resourceVersion"] != meta["resourceVersion"]
        ):
            raise conflict(
                target.rt,
                meta["name"],
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                f"ResourceVersion in object meta: {meta['resourceVersion']}",
            )

    def _evict(self, target: _Target, body: Any) -> JsonObj:
        """The pods/eviction subresource, as pkg/registry/core/pod/storage/eviction.go."""
        assert target.name is not None
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request is not an Eviction object")
        if (body.get("metadata") or {}).get("name") not in (None, target.name):
            raise ApiError(400, "name in URL does not match name in Eviction object")
        pod_target = _Target(target.rt, target.namespace, target.name, None)
        pod = self._load(pod_target)
        options = body.get("deleteOptions") or {}
        self._check_preconditions(pod_target, pod, options)
        grace = options.get("gracePeriodSeconds")
        success: JsonObj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed", "Pending") or pod["metadata"].get(
            "deletionTimestamp"
        ):
            self._delete_pod(pod, grace)
            return success
        pdbs = self._matching_pdbs(pod)
        if len(pdbs) > 1:
            raise ApiError(500, MULTIPLE_PDB_MESSAGE, reason=None)
        if pdbs:
            pdb = pdbs[0]
            status = self._pdb_status(pdb)
            policy = (pdb.get("spec") or {}).get(
                "unhealthyPodEvictionPolicy"
            ) or "IfHealthyBudget"
            unhealthy = not pod_is_ready(pod)
            budget_healthy = (
                status["currentHealthy"] >= status["desiredHealthy"]
                and status["desiredHealthy"] > 0
            )
            if (
                not (unhealthy and (policy == "AlwaysAllow" or budget_healthy))
                and status["disruptionsAllowed"] <= 0
            ):
                raise ApiError(
                    429,
                    EVICTION_PDB_MESSAGE,
                    details={
                        "causes": [
                            {
                                "reason": "DisruptionBudget",
                                "message": (
                                    f"The disruption budget {pdb['metadata']['name']} needs "
                                    f"{status['desiredHealthy']} healthy pods and has "
                                    f"{status['currentHealthy']} currently"
                                ),
                            }
                        ]
                    },
                )
        self._delete_pod(pod, grace)
        return success
