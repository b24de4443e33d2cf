"""The emulated API server: an aiohttp application over the versioned store,
plus the Python control API that tests use to shape the cluster."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
import contextlib
import copy
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
import json
import math
from pathlib import Path
import ssl
import time
from typing import Any, Literal, Self
import uuid

from aiohttp import ClientConnectionResetError, web
import yaml

from . import objects
from .auth import ALL_RULES, PRODUCT_RULES, Rule, User, forbidden_message
from .events import (
    CORE_V1,
    ApiEvent,
    DecodeError,
    FieldError,
    decode_event,
    encode_event,
    event_selectable,
    events_v1_field_selector,
    go_fmt_v,
    go_json,
    go_quote,
    required,
    stored_event,
    validate_event_create,
    validate_event_update,
)
from .patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch
from .recorder import EventCorrelator
from .resources import (
    EVENTS_V1,
    RESOURCES,
    SUBRESOURCES,
    ResourceType,
    api_group,
    api_group_list,
    api_resource_list,
    find_resource,
    resource_for_kind,
    stored_resource,
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
# eviction.go createTooManyRequestsError: the budget's status is older than its
# spec (or a delete raced with it); clients are asked to come back in 10 s.
PDB_PROCESSING_RETRY_SECONDS = 10
# eviction.go MaxDisruptedPodSize.
MAX_DISRUPTED_POD_SIZE = 2000
# filters/maxinflight.go tooManyRequests (used by priority-and-fairness.go):
# http.Error writes this line as text/plain, not a Status.
APF_MESSAGE = "Too many requests, please try again later."
# handlers/finisher/finisher.go: the request's deadline passed.
TIMEOUT_MESSAGE = (
    "Timeout: request did not complete within requested timeout - "
    "context deadline exceeded"
)
# pkg/registry/core/namespace/storage/storage.go Delete, second call.
NAMESPACE_PURGE_WHY = (
    "The system is ensuring all content is removed from this namespace.  Upon "
    "completion, this namespace will automatically be purged by the system."
)
# The NamespaceLifecycle admission plugin's immortal namespaces.
IMMORTAL_NAMESPACES = frozenset({"default", "kube-system", "kube-public"})
TERMINAL_PHASES = ("Succeeded", "Failed")
# A budget before the disruption controller's first sync (the int32 fields of
# PodDisruptionBudgetStatus are not omitempty).
EMPTY_PDB_STATUS: dict[str, int] = {
    "disruptionsAllowed": 0,
    "currentHealthy": 0,
    "desiredHealthy": 0,
    "expectedPods": 0,
}
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


def _time_text(moment: datetime) -> str:
    """A metav1.Time (seconds precision, Z suffix)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _kind_conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    """409 as BeforeDelete and the eviction's getLatestPod build it: the
    resource in the message is the Kind (``Pod``), not the plural."""
    resource = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    details: JsonObj = {"name": name}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.kind
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {resource} "{name}": {why}',
        details=details,
    )


def pdb_still_processing(name: str) -> ApiError:
    """eviction.go createTooManyRequestsError."""
    return ApiError(
        429,
        EVICTION_PDB_MESSAGE,
        details={
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": f"The disruption budget {name} is still being processed by the server.",
                }
            ],
            "retryAfterSeconds": PDB_PROCESSING_RETRY_SECONDS,
        },
    )


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
    # "status": a Status body where the handler would run (fail_next);
    # "apf": API Priority and Fairness rejecting the request before
    # authorization; "timeout": the request deadline passing in the handler.
    style: Literal["status", "apf", "timeout"] = "status"
    retry_after: int = 0
    applied: bool = False  # a timed-out request still took effect


class _SyncFailedError(Exception):
    """The disruption controller could not compute a budget's status."""


@dataclass
class _Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    sub: str | None

    @property
    def resource(self) -> str:
        return f"{self.rt.plural}/{self.sub}" if self.sub else self.rt.plural

    @property
    def stored(self) -> ResourceType:
        """Where the objects are kept (events.k8s.io/v1 Events: the core ones)."""
        return stored_resource(self.rt)


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


def _set_condition(
    conditions: list[JsonObj],
    ctype: str,
    *,
    status: str,
    reason: str,
    message: str,
    observed_generation: int,
) -> list[JsonObj]:
    """apimeta.SetStatusCondition: lastTransitionTime moves only when the
    status does."""
    previous = next((c for c in conditions if c.get("type") == ctype), None)
    condition: JsonObj = {"type": ctype, "status": status}
    if observed_generation:
        condition["observedGeneration"] = observed_generation
    condition["lastTransitionTime"] = (
        previous["lastTransitionTime"]
        if previous is not None and previous.get("status") == status
        else now_rfc3339()
    )
    condition["reason"] = reason
    condition["message"] = message
    return [
        *(c for c in conditions if c.get("type") != ctype),
        condition,
    ]


def _disruption_allowed_conditions(
    conditions: list[JsonObj], allowed: int, observed_generation: int
) -> list[JsonObj]:
    """poddisruptionbudget.UpdateDisruptionAllowedCondition."""
    if allowed > 0:
        return _set_condition(
            conditions,
            "DisruptionAllowed",
            status="True",
            reason="SufficientPods",
            message="",
            observed_generation=observed_generation,
        )
    return _set_condition(
        conditions,
        "DisruptionAllowed",
        status="False",
        reason="InsufficientPods",
        message="",
        observed_generation=observed_generation,
    )


def _set_unreachable_taints(node: JsonObj, on: bool) -> None:
    """Add (keeping those already there) or remove the node's
    ``node.kubernetes.io/unreachable`` taints, NoSchedule and NoExecute."""
    spec = node.setdefault("spec", {})
    taints = list(spec.get("taints") or [])
    if on:
        have = {(t["key"], t["effect"]) for t in taints}
        taints.extend(
            {**t, "timeAdded": now_rfc3339()}
            for t in objects.UNREACHABLE_TAINTS
            if (t["key"], t["effect"]) not in have
        )
    else:
        taints = [t for t in taints if t["key"] != "node.kubernetes.io/unreachable"]
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)


def _terminated_status(status: JsonObj, killed: bool) -> JsonObj:
    """What the kubelet reports once a deleted pod's containers stopped: a
    terminal phase (Failed when it had to kill them at the end of the grace
    period), terminated containers, Ready false with reason PodCompleted."""
    status = copy.deepcopy(status)
    now = now_rfc3339()
    status["phase"] = "Failed" if killed else "Succeeded"
    for condition in status.get("conditions") or []:
        if condition.get("type") in ("Ready", "ContainersReady"):
            if condition.get("status") != "False":
                condition["lastTransitionTime"] = now
            condition["status"] = "False"
            condition["reason"] = "PodCompleted"
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        started = (state.get("running") or {}).get("startedAt", now)
        container["state"] = {
            "terminated": {
                "exitCode": 137 if killed else 0,
                "reason": "Error" if killed else "Completed",
                "startedAt": started,
                "finishedAt": now,
            }
        }
        container["ready"] = False
        container["started"] = False
    return status


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
        pdb_sync_delay: float = 0.0,
        lease_interval: float = 10.0,
        lease_duration: int = 40,
        node_monitor_grace_period: float = 50.0,
        node_monitor_period: float = 5.0,
        toleration_scale: float = 1.0,
        history_limit: int = 10_000,
        server_hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
        legacy_ca: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.legacy_ca = legacy_ca
        self.default_token = token
        # Seconds a pod's containers take to stop after a graceful delete
        # (the kubelet's part), capped at the pod's grace period; then the
        # pod turns Succeeded (Failed if killed at the end of the grace
        # period) and is removed. 0: at once. Per pod: ``stop_seconds``.
        self.deletion_grace = deletion_grace
        # Seconds the disruption controller lags behind changes of budgets,
        # pods and their controllers. 0: it has caught up before anyone
        # looks; more: budgets answer evictions from their stored status,
        # and an edited spec is "still being processed" until it catches up.
        self.pdb_sync_delay = pdb_sync_delay
        # disruption.go DeletionTimeout: how long an eviction's entry in
        # status.disruptedPods keeps a pod out of currentHealthy.
        self.pdb_deletion_timeout = 120.0
        self.lease_interval = lease_interval
        self.lease_duration = lease_duration
        # The node lifecycle controller (kube-controller-manager): a node
        # whose kubelet is silent longer than the grace period is marked
        # Unknown at its next pass (see node_monitor_pass).
        self._monitor_wake = asyncio.Event()
        self._grace = node_monitor_grace_period
        self._monitor_period = node_monitor_period
        self._probe: dict[str, float] = {}  # node -> its last heartbeat seen
        # The taint eviction controller: real seconds per second of a pod's
        # tolerationSeconds (the fixture's hundredfold pace: 0.01), and when
        # each node got its NoExecute unreachable taint.
        self.toleration_scale = toleration_scale
        self._no_execute_since: dict[str, float] = {}
        # hold_cordon_taint: the next cordon-taint write waits for a read
        self._taint_hold = False
        self._taint_held: set[str] = set()
        self._monitor_task: asyncio.Task[None] | None = None
        self.store = Store(history_limit)
        self.store.listeners.append(self._on_store_event)
        self.requests: list[RecordedRequest] = []
        self._server_hosts = server_hosts
        self._tokens: dict[str, User] = {token: User(user, rules)}
        self._faults: list[_Fault] = []
        self._down: set[str] = set()
        # node -> how its NVIDIA device plugin advertises its cards
        self._device_plugins: dict[str, objects.DevicePlugin] = {}
        self._refusing: set[str] = set()  # pod uids that never finish terminating
        self._stop_seconds: dict[str, float] = {}  # pod uid -> container stop time
        self._timers: dict[str, asyncio.TimerHandle] = {}  # kubelet, by pod uid
        self._pdb_timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._pdb_rechecks: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._pdb_writing = False  # the disruption controller is writing
        self._ns_sweeping: set[str] = set()  # namespace controller running
        self._watches_hung = False
        # The event recorders of the components the tests play (client-go
        # tools/record: one EventCorrelator per broadcaster), by source
        # component and host; their clock (aggregation interval, spam
        # filter refill) is read when one is made.
        self.recorder_clock: Callable[[], float] = time.monotonic
        self._recorders: dict[tuple[str, str], EventCorrelator] = {}
        self._runner: web.AppRunner | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._tls: TlsMaterial | None = None
        self._server_ssl: ssl.SSLContext | None = None
        self._handler: tuple[asyncio.AbstractEventLoop, Any, Any] | None = None
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
            self._tls = make_tls(
                [*self._server_hosts, self.host], legacy_ca=self.legacy_ca
            )
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=2.0
        )
        await self._runner.setup()
        self._server_ssl = self._tls.server_context() if self._tls else None
        site = web.TCPSite(
            self._runner, self.host, self.port, ssl_context=self._server_ssl
        )
        await site.start()
        self._absorb_handshake_errors(asyncio.get_running_loop())
        self.port = int(self._runner.addresses[0][1])
        self._lease_task = asyncio.get_running_loop().create_task(
            self._lease_loop(), name="k8semu-leases"
        )
        self._monitor_task = asyncio.get_running_loop().create_task(
            self._node_monitor_loop(), name="k8semu-node-monitor"
        )
        # Work that waited for an event loop: pods deleted before start and
        # budgets a lagging controller has not seen yet.
        for pod in self.store.list_objects(resource_for_kind("Pod")):
            if pod["metadata"].get("deletionTimestamp"):
                self._kubelet_schedule(pod)
        if self.pdb_sync_delay > 0:
            for pdb in self.store.list_objects(
                resource_for_kind("PodDisruptionBudget")
            ):
                meta = pdb["metadata"]
                self._pdb_enqueue(meta["namespace"], meta["name"])

    async def stop(self) -> None:
        """Stop serving: end watches, timers and lease renewals."""
        for task in (self._lease_task, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._lease_task = self._monitor_task = None
        for timers in (self._timers, self._pdb_timers, self._pdb_rechecks):
            for timer in timers.values():
                timer.cancel()
            timers.clear()
        self.store.close_watchers()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._handler is not None:
            loop, previous, ours = self._handler
            if loop.get_exception_handler() is ours:
                loop.set_exception_handler(previous)
            self._handler = None

    def _absorb_handshake_errors(self, loop: asyncio.AbstractEventLoop) -> None:
        """A client refusing the server's certificate resets the connection;
        a real apiserver logs "TLS handshake error" and serves on. asyncio
        (in debug mode, as test harnesses run it) reports it to the loop's
        exception handler instead, which some harnesses turn into a failed
        test: drop those reports for this server's connections only."""
        if self._server_ssl is None:
            return
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            transport = context.get("transport")
            if (
                context.get("message")
                == "Error on transport creation for incoming connection"
                and transport is not None
                and transport.get_extra_info("sslcontext") is self._server_ssl
            ):
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)
        self._handler = (loop, previous, handler)

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
            # Objects live in namespaces that exist (the API refuses creates
            # elsewhere): make the namespace as kubectl create ns would.
            ns_rt = resource_for_kind("Namespace")
            if self.store.get(ns_rt, "", meta["namespace"]) is None:
                self.store.create(ns_rt, objects.make_namespace(meta["namespace"]))
        if self.store.get(rt, meta.get("namespace", ""), meta["name"]) is not None:
            raise ValueError(f"{rt.plural} {meta['name']} already exists")
        if rt.kind == "PodDisruptionBudget":
            obj.setdefault("status", dict(EMPTY_PDB_STATUS))
        if rt.kind == "Pod":
            _daemon_pod_tolerations(obj)
            _default_toleration_seconds(obj)
        return self.store.create(rt, obj)

    def get(self, kind: str, name: str, namespace: str = "default") -> JsonObj | None:
        """The current object (a copy), or None."""
        return self.store.get(resource_for_kind(kind), namespace, name)

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
        """A node (see ``objects.make_node`` for options) and its Lease. Its
        ``device_plugin`` (default ``objects.PLAIN``) says how its GPUs are
        advertised from then on (``set_node_gpus``, ``post_node_status``)."""
        node = self.create(objects.make_node(name, **kwargs))
        self._device_plugins[name] = kwargs.get("device_plugin", objects.PLAIN)
        self.create(
            objects.make_lease(
                name, duration=self.lease_duration, node_uid=node["metadata"]["uid"]
            )
        )
        self._probe[name] = time.monotonic()
        if not kwargs.get("up", True):
            self._down.add(name)
        return node

    def remove_node(self, name: str) -> None:
        """Delete a node and its Lease."""
        self.delete("Node", name, "")
        self.delete("Lease", name, objects.NODE_LEASE_NAMESPACE)
        self._down.discard(name)
        self._probe.pop(name, None)

    def set_node_up(
        self, name: str, up: bool = True, *, boot_id: str | None = None
    ) -> JsonObj:
        """The shortcut of the node's whole story. Up: its kubelet posts
        Ready (``post_node_status``; ``boot_id`` as there, None keeps the
        bootID). Down: its kubelet falls silent and the grace period is
        taken as already over (``stop_node_heartbeats``, then
        ``mark_node_unknown``): Ready=Unknown, unreachable taints, its pods
        not Ready."""
        if up:
            return self.post_node_status(name, boot_id=boot_id)
        self.stop_node_heartbeats(name)
        return self.mark_node_unknown(name)

    def post_node_status(
        self,
        name: str,
        *,
        boot_id: str | None = None,
        gpus: int | None = None,
        unhealthy_gpus: int = 0,
    ) -> JsonObj:
        """A status post of the node's kubelet (pkg/kubelet/kubelet_node_status.go
        tryUpdateNodeStatus with the pkg/kubelet/nodestatus setters): every
        condition it owns healthy (Ready=True KubeletReady, no pressure) with
        its heartbeat now, the transition time kept where the status did not
        change; ``boot_id`` into ``status.nodeInfo.bootID`` (None keeps it);
        ``gpus``/``unhealthy_gpus`` the device manager's counts as
        ``set_node_gpus`` writes them, in the same write (None leaves them).
        Its Lease is renewed now and from then on (the kubelet's node lease
        controller). The node lifecycle controller takes the unreachable
        taints off once it sees Ready=True (markNodeAsReachable,
        doNoScheduleTaintingPass): here in the same write.

        A kubelet that was silent (or a node not Ready) also takes its pods
        up again: the running ones Ready, the ones deleted meanwhile finished
        (pod_workers.go: a restarted kubelet resumes terminating pods)."""
        returning = name in self._down or self.node_ready_status(name) != "True"

        def mutate(node: JsonObj) -> None:
            now = now_rfc3339()
            status = node.setdefault("status", {})
            conditions = status.setdefault("conditions", [])
            for kind in objects.KUBELET_CONDITIONS:
                new = objects.kubelet_condition(kind, now)
                for index, old in enumerate(conditions):
                    if old.get("type") == kind:
                        if old.get("status") == new["status"]:
                            new["lastTransitionTime"] = old.get(
                                "lastTransitionTime", now
                            )
                        conditions[index] = new
                        break
                else:
                    conditions.append(new)
            if boot_id is not None:
                status.setdefault("nodeInfo", {})["bootID"] = boot_id
            if gpus is not None:
                self._write_gpus(name, status, gpus, unhealthy_gpus)
            _set_unreachable_taints(node, False)

        node = self.modify("Node", name, "", mutate=mutate)
        self._down.discard(name)
        self._no_execute_since.pop(name, None)
        self.renew_lease(name)
        if returning:
            for pod in self.store.list_objects(resource_for_kind("Pod")):
                if (pod.get("spec") or {}).get("nodeName") != name:
                    continue
                meta = pod["metadata"]
                if meta.get("deletionTimestamp"):
                    self._kubelet_schedule(pod)
                elif (pod.get("status") or {}).get("phase") == "Running":
                    self.set_pod_status(meta["name"], meta["namespace"], ready=True)
        return node

    def stop_node_heartbeats(self, name: str) -> None:
        """The node's kubelet falls silent (its VM stopped or crashed): no
        status post, no Lease renewal, and the node keeps what it showed -
        Ready=True as last posted, the old bootID, the old GPUs. A k3s
        kubelet that is shut down posts no NotReady (graceful node shutdown,
        pkg/kubelet/nodeshutdown, is off while shutdownGracePeriod is 0, the
        default). Pods deleted meanwhile stay Terminating. The node monitor
        marks the node Unknown ``node_monitor_grace_period`` seconds after
        its last heartbeat (``node_monitor_pass``)."""
        self._down.add(name)

    def mark_node_unknown(self, name: str) -> JsonObj:
        """What the node lifecycle controller does to a node whose kubelet
        stopped posting longer than the grace period ago
        (pkg/controller/nodelifecycle/node_lifecycle_controller.go):
        tryUpdateNodeHealth sets Ready, MemoryPressure, DiskPressure and
        PIDPressure to Unknown ("NodeStatusUnknown", "Kubelet stopped posting
        node status."; the heartbeat stays the kubelet's last);
        doNoScheduleTaintingPass adds ``node.kubernetes.io/unreachable``
        NoSchedule and the NoExecute tainter (processTaintBaseEviction,
        markNodeForTainting) the NoExecute one; monitorNodeHealth marks the
        node's pods not Ready (MarkPodsNotReady) when Ready was True. Here
        all in one pass, at once."""
        was_ready = self.node_ready_status(name) == "True"

        def mutate(node: JsonObj) -> None:
            now = now_rfc3339()
            for condition in node.setdefault("status", {}).get("conditions") or []:
                if condition.get("type") in objects.KUBELET_CONDITIONS:
                    objects.mark_unknown(condition, now)
            _set_unreachable_taints(node, True)

        node = self.modify("Node", name, "", mutate=mutate)
        self._no_execute_since.setdefault(name, time.monotonic())
        if was_ready:
            for pod in self.store.list_objects(resource_for_kind("Pod")):
                if (pod.get("spec") or {}).get("nodeName") == name:
                    meta = pod["metadata"]
                    self.set_pod_status(meta["name"], meta["namespace"], ready=False)
        return node

    def node_ready_status(self, name: str) -> str | None:
        """The node's Ready condition status ("True", "False", "Unknown"),
        None for a missing node or condition."""
        node = self.store.get(resource_for_kind("Node"), "", name)
        for condition in ((node or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready":
                return str(condition.get("status"))
        return None

    def node_monitor_pass(self) -> list[str]:
        """One pass of the node lifecycle controller's monitorNodeHealth
        (every ``node_monitor_period`` s while serving): a node whose kubelet
        is silent and whose last heartbeat (status post or Lease renewal, the
        controller's probeTimestamp) is more than
        ``node_monitor_grace_period`` s old is marked Unknown
        (``mark_node_unknown``). The nodes it marked."""
        now = time.monotonic()
        marked = []
        for node in self.store.list_objects(resource_for_kind("Node")):
            name = node["metadata"]["name"]
            if name not in self._down or self.node_ready_status(name) == "Unknown":
                continue
            probe = self._probe.setdefault(name, now)
            if now - probe > self._grace:
                self.mark_node_unknown(name)
                marked.append(name)
        self.taint_eviction_pass()
        return marked

    def taint_eviction_pass(self) -> list[str]:
        """The taint eviction controller (pkg/controller/tainteviction,
        taint_eviction.go) for the unreachable NoExecute taint: a pod on a
        tainted node that does not tolerate it is deleted at once; one that
        tolerates it for tolerationSeconds (DefaultTolerationSeconds gives
        every pod 300) is deleted that long after the taint came
        (getMinTolerationTime: the least of its matching tolerations); one
        tolerating it with no limit stays. Deleted as the controller does
        (addConditionAndDeletePod): a DisruptionTarget condition
        (DeletionByTaintManager), then a graceful delete; on a node whose
        kubelet is silent the pod stays Terminating until it is back. The
        pods it deleted ("namespace/name")."""
        now = time.monotonic()
        deleted = []
        for node, since in list(self._no_execute_since.items()):
            for pod in self.store.list_objects(resource_for_kind("Pod")):
                spec = pod.get("spec") or {}
                if spec.get("nodeName") != node or pod["metadata"].get(
                    "deletionTimestamp"
                ):
                    continue
                seconds = _toleration_seconds(spec.get("tolerations"))
                if seconds is None or now < since + seconds * self.toleration_scale:
                    continue
                self._taint_delete(pod)
                deleted.append(
                    f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                )
        return deleted

    def _taint_delete(self, pod: JsonObj) -> None:
        meta = pod["metadata"]

        def mutate(obj: JsonObj) -> None:
            conditions = obj.setdefault("status", {}).setdefault("conditions", [])
            conditions[:] = [
                c for c in conditions if c.get("type") != "DisruptionTarget"
            ]
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByTaintManager",
                    "message": "Taint manager: deleting due to NoExecute taint",
                    "lastProbeTime": None,
                    "lastTransitionTime": now_rfc3339(),
                }
            )

        current = self.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)
        self._delete_pod(current, {})

    @property
    def node_monitor_grace_period(self) -> float:
        """Seconds without a heartbeat before a node is marked Unknown
        (kube-controller-manager --node-monitor-grace-period: 50 s since
        Kubernetes 1.32, 40 s before)."""
        return self._grace

    @node_monitor_grace_period.setter
    def node_monitor_grace_period(self, seconds: float) -> None:
        self._grace = seconds
        self._monitor_wake.set()

    @property
    def node_monitor_period(self) -> float:
        """Seconds between two passes of the node monitor
        (--node-monitor-period, 5 s)."""
        return self._monitor_period

    @node_monitor_period.setter
    def node_monitor_period(self, seconds: float) -> None:
        self._monitor_period = seconds
        self._monitor_wake.set()

    async def _node_monitor_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._monitor_wake.wait(), timeout=self._monitor_period
                )
            self._monitor_wake.clear()
            self.node_monitor_pass()

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

    def set_node_gpus(self, name: str, healthy: int, unhealthy: int = 0) -> JsonObj:
        """The node's GPUs as its kubelet posts them from the device plugin's
        devices (pkg/kubelet/cm/devicemanager/manager.go, GetCapacity):
        capacity counts healthy and unhealthy devices, allocatable the
        healthy ones. ``healthy`` and ``unhealthy`` count cards; each is
        advertised as its node's device plugin says (``objects.DevicePlugin``:
        one ``nvidia.com/gpu``, ``replicas`` ``nvidia.com/gpu.shared``, or
        its ``nvidia.com/mig-*`` devices). ``set_node_gpus(node, 0)`` is a kubelet
        just restarted, before the device plugin registered again (its
        capacity "can temporarily drop to zero till corresponding device
        plugins re-register")."""

        def mutate(node: JsonObj) -> None:
            self._write_gpus(name, node.setdefault("status", {}), healthy, unhealthy)

        return self.modify("Node", name, "", mutate=mutate)

    def _write_gpus(
        self, name: str, status: JsonObj, healthy: int, unhealthy: int
    ) -> None:
        """``healthy`` and ``unhealthy`` cards into a node status, each card
        as the devices its device plugin advertises it as (every device of
        an unhealthy card unhealthy)."""
        plugin = self._device_plugins.get(name, objects.PLAIN)
        status.setdefault("capacity", {}).update(plugin.resources(healthy + unhealthy))
        status.setdefault("allocatable", {}).update(plugin.resources(healthy))

    def device_plugin(self, name: str) -> objects.DevicePlugin:
        """How the node's NVIDIA device plugin advertises its cards."""
        return self._device_plugins.get(name, objects.PLAIN)

    def node_is_up(self, name: str) -> bool:
        """Whether the node's kubelet runs: it posts status and renews its
        Lease (its Ready condition may say otherwise for a while: a silent
        node stays Ready until the grace period ends)."""
        return name not in self._down

    def renew_lease(self, name: str) -> None:
        """Renew a node's Lease now (the renewal loop does this every interval)."""
        lease = self.store.get(
            resource_for_kind("Lease"), objects.NODE_LEASE_NAMESPACE, name
        )
        if lease is not None:
            lease["spec"]["renewTime"] = now_micro()
            self.store.update(resource_for_kind("Lease"), lease)
        self._probe[name] = time.monotonic()

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
        stop_seconds: float | None = None,
        termination_grace: int | None = None,
        **kwargs: Any,
    ) -> JsonObj:
        """A pod (see ``objects.make_pod`` for options).

        ``stop_seconds``: how long its containers take to exit once deleted
        (default: ``deletion_grace``); ``termination_grace``: its
        spec.terminationGracePeriodSeconds (default 30).
        """
        manifest = objects.make_pod(name, namespace, **kwargs)
        if termination_grace is not None:
            manifest["spec"]["terminationGracePeriodSeconds"] = termination_grace
        pod = self.create(manifest)
        if refuse_termination:
            self._refusing.add(pod["metadata"]["uid"])
        if stop_seconds is not None:
            self._stop_seconds[pod["metadata"]["uid"]] = stop_seconds
        return pod

    def remove_pod(self, name: str, namespace: str = "default") -> None:
        """Delete a pod at once (as if its kubelet confirmed it)."""
        self.delete("Pod", name, namespace)

    def set_pod_refuse_termination(
        self, name: str, namespace: str = "default", refuse: bool = True
    ) -> None:
        """A refusing pod stays Terminating (deletionTimestamp set) after
        eviction or deletion, even a forced one (as with a finalizer nobody
        removes), until released."""
        pod = self.get("Pod", name, namespace)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name}")
        uid = pod["metadata"]["uid"]
        if refuse:
            self._refusing.add(uid)
        else:
            self._refusing.discard(uid)
            if pod["metadata"].get("deletionTimestamp"):
                self._kubelet_schedule(pod)

    def set_pod_stop_seconds(
        self, name: str, namespace: str = "default", seconds: float | None = None
    ) -> None:
        """How long this pod's containers take to exit after a graceful
        delete (None: ``deletion_grace``). Capped at the pod's grace period:
        a pod still running then is killed (phase Failed, exit code 137)."""
        pod = self.get("Pod", name, namespace)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name}")
        uid = pod["metadata"]["uid"]
        if seconds is None:
            self._stop_seconds.pop(uid, None)
        else:
            self._stop_seconds[uid] = seconds

    def start_pod_containers(self, name: str, namespace: str = "default") -> JsonObj:
        """The kubelet got the pod's sandbox up and started its containers:
        the sandbox condition turns True (generate.go), every container runs
        (``state.running.startedAt`` now) and is ready, the pod is Running
        with an IP (the node's on the host network), Ready and
        ContainersReady True."""
        now = now_rfc3339()

        def mutate(pod: JsonObj) -> None:
            status = pod.setdefault("status", {})
            status["phase"] = "Running"
            ip = "10.42.0.18"
            if (pod.get("spec") or {}).get("hostNetwork"):
                ip = status.get("hostIP") or objects.HOST_IP
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
            for cond in status.get("conditions") or []:
                if cond["type"] in (
                    objects.SANDBOX_CONDITION,
                    "PodHasNetwork",
                    "Ready",
                    "ContainersReady",
                ):
                    if cond["status"] != "True":
                        cond["lastTransitionTime"] = now
                    cond["status"] = "True"
                    cond.pop("reason", None)
            for container in status.get("containerStatuses") or []:
                image = container["image"]
                digest = uuid.uuid5(uuid.NAMESPACE_URL, image).hex * 2
                container["imageID"] = f"{image}@sha256:{digest}"
                container["ready"] = True
                container["started"] = True
                container["state"] = {"running": {"startedAt": now}}

        return self.modify("Pod", name, namespace, mutate=mutate)

    def lose_pod_sandbox(self, name: str, namespace: str = "default") -> JsonObj:
        """The pod's sandbox is gone (its node rebooted) and its kubelet has
        not made a new one: the status it posts (generate.go
        GeneratePodReadyToStartContainersCondition False, no reason; every
        container waiting in ContainerCreating, not ready; Pending, no pod
        IP). What its containers ran before is not kept: the runtime that
        knew them is gone with the boot."""
        now = now_rfc3339()

        def mutate(pod: JsonObj) -> None:
            status = pod.setdefault("status", {})
            status["phase"] = "Pending"
            status.pop("podIP", None)
            status.pop("podIPs", None)
            conditions = status.setdefault("conditions", [])
            if not any(
                c["type"] in (objects.SANDBOX_CONDITION, "PodHasNetwork")
                for c in conditions
            ):
                conditions.insert(
                    0, {"type": objects.SANDBOX_CONDITION, "lastProbeTime": None}
                )
            for cond in conditions:
                if cond["type"] in (
                    objects.SANDBOX_CONDITION,
                    "PodHasNetwork",
                    "Ready",
                    "ContainersReady",
                ):
                    if cond.get("status") != "False":
                        cond["lastTransitionTime"] = now
                    cond["status"] = "False"
                    cond.pop("reason", None)
                    if cond["type"] in ("Ready", "ContainersReady"):
                        cond["reason"] = "ContainersNotReady"
            for container in status.get("containerStatuses") or []:
                container.update(
                    ready=False,
                    started=False,
                    state={"waiting": {"reason": "ContainerCreating"}},
                )
                container.pop("lastState", None)

        return self.modify("Pod", name, namespace, mutate=mutate)

    # ------------------------------------------------------ control: namespaces

    def terminate_namespace(self, name: str) -> JsonObj:
        """Delete a namespace as the API does: it turns Terminating (with a
        deletionTimestamp), creates in it are refused with 403
        NamespaceTerminating, the namespace controller removes its content
        (pods gracefully, each with its own grace period), and the namespace
        disappears once no pod is left. Returns it as marked."""
        rt = resource_for_kind("Namespace")
        namespace = self.store.get(rt, "", name)
        if namespace is None:
            raise KeyError(f"namespace {name}")
        if not namespace["metadata"].get("deletionTimestamp"):
            namespace["metadata"]["deletionTimestamp"] = now_rfc3339()
            namespace.setdefault("status", {})["phase"] = "Terminating"
            namespace = self.store.update(rt, namespace)
        self._namespace_sweep(name)
        return namespace

    def namespace_phase(self, name: str) -> str | None:
        """Active, Terminating, or None when the namespace does not exist."""
        namespace = self.store.get(resource_for_kind("Namespace"), "", name)
        if namespace is None:
            return None
        return str((namespace.get("status") or {}).get("phase", "Active"))

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

    def record_event(
        self,
        involved: JsonObj,
        *,
        reason: str,
        message: str,
        event_type: str = "Warning",
        component: str = "kubelet",
        host: str | None = None,
    ) -> JsonObj | None:
        """An event as the legacy recorder of ``component`` on ``host``
        reports it (client-go tools/record; see recorder.py): a new Event
        named ``<object>.<hex of the time in ns>`` in the object's namespace;
        the same again (object, reason, message, type, source) patches it,
        count + 1 and lastTimestamp now; ten similar ones (differing only in
        their message) within ten minutes go to one Event whose message
        begins "(combined from similar events): ". Returns the Event as
        stored, or None when the recorder's spam filter dropped it."""
        meta = involved["metadata"]
        namespace = meta.get("namespace") or "default"
        event = objects.make_event(
            f"{meta['name']}.{time.time_ns():x}",
            namespace,
            involved=involved,
            reason=reason,
            message=message,
            event_type=event_type,
            component=component,
            host=host,
        )
        source = (component, host or "")
        recorder = self._recorders.get(source)
        if recorder is None:
            recorder = self._recorders[source] = EventCorrelator(self.recorder_clock)
        written = recorder.correlate(event)
        if written is None:
            return None
        if written.patch:
            update = {
                key: written.event[key] for key in ("count", "lastTimestamp", "message")
            }
            with contextlib.suppress(KeyError):  # removed: created again
                return self.modify(
                    "Event",
                    written.event["metadata"]["name"],
                    namespace,
                    mutate=lambda stored: stored.update(update),
                )
        return self.create(written.event)

    # ----------------------------------------------------- control: recording

    def fail_next(
        self,
        n: int,
        status: int,
        *,
        verb: str | None = None,
        resource: str | None = None,
        message: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """The next ``n`` resource requests (optionally only this verb and/or
        resource, e.g. ``"pods/eviction"``) fail with ``status``: a Status
        after authorization, where the handler would run. ``retry_after``
        adds details.retryAfterSeconds and the Retry-After header, as the
        apiserver does for any Status carrying it (e.g. 429 "storage is
        (re)initializing" from the watch cache)."""
        self._faults.append(
            _Fault(
                n,
                status,
                message or f"injected failure ({status})",
                verb,
                resource,
                retry_after=retry_after or 0,
            )
        )

    def throttle(
        self,
        n: int = 1,
        *,
        verb: str | None = None,
        resource: str | None = None,
        status: int = 429,
        retry_after: int = 1,
        applied: bool = False,
    ) -> None:
        """The next ``n`` matching resource requests (any verb; a watch too
        for 429) are turned away as a loaded kube-apiserver does.

        429: API Priority and Fairness rejects them after authentication and
        before authorization: a text/plain body ``Too many requests, please
        try again later.``, a ``Retry-After: retry_after`` header, no Status
        and so no DisruptionBudget cause. 504: the request's deadline passes
        in the handler (a Status with reason Timeout); with ``applied`` the
        change was still made, as the handler keeps running after the
        timeout. Watches have no deadline and are never answered 504.
        """
        if status not in (429, 504):
            raise ValueError("throttle answers 429 (APF) or 504 (timeout)")
        self._faults.append(
            _Fault(
                n,
                status,
                APF_MESSAGE if status == 429 else TIMEOUT_MESSAGE,
                verb,
                resource,
                style="apf" if status == 429 else "timeout",
                retry_after=retry_after,
                applied=applied,
            )
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

    # ---------------------------------------------------- reacting to writes

    def _on_store_event(self, event: StoredEvent) -> None:
        """Controllers watching the store: the disruption controller resyncs
        the budgets of a namespace whose pods or workload controllers
        changed; the namespace controller finishes a Terminating namespace
        once its last pod is gone."""
        obj = event.new if event.new is not None else event.old
        assert obj is not None
        meta = obj["metadata"]
        namespace = meta.get("namespace") or ""
        kind = event.resource.kind
        if kind == "PodDisruptionBudget":
            if event.new is None:
                for timers in (self._pdb_timers, self._pdb_rechecks):
                    timer = timers.pop((namespace, meta["name"]), None)
                    if timer is not None:
                        timer.cancel()
            elif not self._pdb_writing:
                # Any other write (spec edit, an eviction's status update)
                # wakes the controller, as its informer's update event does.
                self._pdb_enqueue(namespace, meta["name"])
        elif kind in ("Pod", "ReplicaSet", "StatefulSet", "Deployment"):
            for pdb in self.store.list_objects(
                resource_for_kind("PodDisruptionBudget"), namespace
            ):
                self._pdb_enqueue(namespace, pdb["metadata"]["name"])
            if kind == "Pod" and event.new is None:
                self._namespace_sweep(namespace)
        elif kind == "Node" and event.new is not None:
            self._taint_cordon_later(meta["name"])

    # ------------------------------------------------------ namespace controller

    def _namespace_sweep(self, name: str) -> None:
        """pkg/controller/namespace/deletion: delete all content of a
        Terminating namespace (pods gracefully), report what remains, and
        remove the namespace once nothing does."""
        ns_rt = resource_for_kind("Namespace")
        namespace = self.store.get(ns_rt, "", name)
        if (
            namespace is None
            or not namespace["metadata"].get("deletionTimestamp")
            or name in self._ns_sweeping
        ):
            return
        self._ns_sweeping.add(name)
        try:
            pod_rt = resource_for_kind("Pod")
            for rt in RESOURCES:
                if not rt.namespaced or rt == pod_rt:
                    continue
                for obj in self.store.list_objects(rt, name):
                    self.store.delete(rt, name, obj["metadata"]["name"])
            for pod in self.store.list_objects(pod_rt, name):
                if not pod["metadata"].get("deletionTimestamp"):
                    # The kubelet may finish an earlier pod synchronously:
                    # delete what is stored now, not the listing's copy.
                    current = self.store.get(pod_rt, name, pod["metadata"]["name"])
                    if current is not None and not current["metadata"].get(
                        "deletionTimestamp"
                    ):
                        self._delete_pod(current, {})
            remaining = len(self.store.list_objects(pod_rt, name))
        finally:
            self._ns_sweeping.discard(name)
        namespace = self.store.get(ns_rt, "", name)
        if namespace is None:
            return
        if remaining == 0:
            # The "kubernetes" finalizer is removed, then the namespace goes.
            self.store.delete(ns_rt, "", name)
            return
        status = namespace.setdefault("status", {})
        conditions = [
            c
            for c in status.get("conditions") or []
            if c.get("type") != "NamespaceContentRemaining"
        ]
        previous = next(
            (
                c
                for c in status.get("conditions") or []
                if c.get("type") == "NamespaceContentRemaining"
            ),
            None,
        )
        message = (
            f"Some resources are remaining: pods. has {remaining} resource instances"
        )
        conditions.append(
            {
                "type": "NamespaceContentRemaining",
                "status": "True",
                "lastTransitionTime": (previous or {}).get(
                    "lastTransitionTime", now_rfc3339()
                ),
                "reason": "SomeResourcesRemain",
                "message": message,
            }
        )
        status["conditions"] = conditions
        self.store.update(ns_rt, namespace)

    def _admit_create(self, target: _Target, name: str) -> None:
        """The NamespaceLifecycle admission plugin for creates (subresources
        such as pods/eviction included): 404 when the namespace does not
        exist, 403 NamespaceTerminating while it is being deleted."""
        if not target.rt.namespaced or target.namespace is None:
            return
        ns_rt = resource_for_kind("Namespace")
        namespace = self.store.get(ns_rt, "", target.namespace)
        if namespace is None:
            raise not_found(ns_rt, target.namespace)
        if (namespace.get("status") or {}).get("phase") != "Terminating":
            return
        raise ApiError(
            403,
            f'{target.rt.group_resource} "{name}" is forbidden: unable to create new '
            f"content in namespace {target.namespace} because it is being terminated",
            details={
                **_details(target.rt, name),
                "causes": [
                    {
                        "reason": "NamespaceTerminating",
                        "message": f"namespace {target.namespace} is being terminated",
                        "field": "metadata.namespace",
                    }
                ],
            },
        )

    # ---------------------------------------------------- disruption controller

    def _matching_pdbs(self, pod: JsonObj) -> list[JsonObj]:
        """eviction.go getPodDisruptionBudgets (policy/v1: an empty selector
        matches every pod of the namespace)."""
        rt = resource_for_kind("PodDisruptionBudget")
        labels = pod["metadata"].get("labels") or {}
        return [
            pdb
            for pdb in self.store.list_objects(rt, pod["metadata"]["namespace"])
            if label_selector_object_matches(
                (pdb.get("spec") or {}).get("selector"), labels
            )
        ]

    def sync_pdbs(self, namespace: str | None = None) -> None:
        """Let the disruption controller catch up now (every budget, or this
        namespace's), whatever ``pdb_sync_delay`` says."""
        for pdb in self.store.list_objects(
            resource_for_kind("PodDisruptionBudget"), namespace
        ):
            meta = pdb["metadata"]
            timer = self._pdb_timers.pop((meta["namespace"], meta["name"]), None)
            if timer is not None:
                timer.cancel()
            self._sync_pdb(meta["namespace"], meta["name"])

    def _pdb_enqueue(self, namespace: str, name: str) -> None:
        if self.pdb_sync_delay <= 0:
            self._sync_pdb(namespace, name)
            return
        key = (namespace, name)
        if key in self._pdb_timers:
            return  # the work queue holds a key once
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # start() enqueues every budget
        self._pdb_timers[key] = loop.call_later(
            self.pdb_sync_delay, self._pdb_timer_fired, key
        )

    def _pdb_timer_fired(self, key: tuple[str, str]) -> None:
        self._pdb_timers.pop(key, None)
        self._sync_pdb(*key)

    def _sync_pdb(self, namespace: str, name: str) -> None:
        """disruption.go sync/trySync: recompute and store a budget's status;
        on failure, failSafe (disruptionsAllowed 0, condition SyncFailed,
        observedGeneration left as it was)."""
        rt = resource_for_kind("PodDisruptionBudget")
        pdb = self.store.get(rt, namespace, name)
        if pdb is None:
            return
        old: JsonObj = pdb.get("status") or dict(EMPTY_PDB_STATUS)
        spec = pdb.get("spec") or {}
        pods = [
            p
            for p in self.store.list_objects(resource_for_kind("Pod"), namespace)
            if label_selector_object_matches(
                spec.get("selector"), p["metadata"].get("labels")
            )
        ]
        now = datetime.now(UTC)
        status: JsonObj
        try:
            expected, desired = self._expected_pod_count(spec, pods)
        except _SyncFailedError as err:
            status = copy.deepcopy(old)
            status["disruptionsAllowed"] = 0
            status["conditions"] = _set_condition(
                status.get("conditions") or [],
                "DisruptionAllowed",
                status="False",
                reason="SyncFailed",
                message=str(err),
                observed_generation=status.get("observedGeneration", 0),
            )
        else:
            disrupted, recheck = self._live_disruptions(
                pods, old.get("disruptedPods") or {}, now
            )
            healthy = sum(
                1
                for p in pods
                if not p["metadata"].get("deletionTimestamp")
                and p["metadata"]["name"] not in disrupted
                and pod_is_ready(p)
            )
            allowed = healthy - desired
            if expected <= 0 or allowed <= 0:
                # Budgets matching nothing yet stay safe (updatePdbStatus).
                allowed = 0
            generation = pdb["metadata"].get("generation", 1)
            status = {
                "observedGeneration": generation,
                "disruptionsAllowed": allowed,
                "currentHealthy": healthy,
                "desiredHealthy": desired,
                "expectedPods": expected,
            }
            if disrupted:
                status["disruptedPods"] = disrupted
            status["conditions"] = _disruption_allowed_conditions(
                old.get("conditions") or [], allowed, generation
            )
            if recheck is not None:
                self._pdb_recheck(namespace, name, recheck - now)
        if status == old:
            return
        pdb["status"] = status
        self._pdb_writing = True
        try:
            self.store.update(rt, pdb)
        finally:
            self._pdb_writing = False

    def _pdb_recheck(self, namespace: str, name: str, after: timedelta) -> None:
        """The recheck queue: an entry of disruptedPods expires."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # any later sync sees the expiry
        key = (namespace, name)
        existing = self._pdb_rechecks.pop(key, None)
        if existing is not None:
            existing.cancel()

        def fired() -> None:
            self._pdb_rechecks.pop(key, None)
            self._pdb_enqueue(*key)

        self._pdb_rechecks[key] = loop.call_later(
            max(after.total_seconds(), 0.0) + 0.01, fired
        )

    def _live_disruptions(
        self, pods: list[JsonObj], recorded: dict[str, str], now: datetime
    ) -> tuple[dict[str, str], datetime | None]:
        """disruption.go buildDisruptedPodMap: evictions the controller has
        not seen carried out yet, minus expired ones and pods now deleting."""
        result: dict[str, str] = {}
        recheck: datetime | None = None
        timeout = timedelta(seconds=self.pdb_deletion_timeout)
        for pod in pods:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") or meta["name"] not in recorded:
                continue
            expires = _parse_time(recorded[meta["name"]]) + timeout
            if expires < now:
                continue  # "Pod was expected by PDB ... to be deleted but it wasn't"
            result[meta["name"]] = recorded[meta["name"]]
            if recheck is None or expires < recheck:
                recheck = expires
        return result, recheck

    def _expected_pod_count(
        self, spec: JsonObj, pods: list[JsonObj]
    ) -> tuple[int, int]:
        """disruption.go getExpectedPodCount: (expectedPods, desiredHealthy)."""
        max_unavailable = spec.get("maxUnavailable")
        min_available = spec.get("minAvailable")
        if max_unavailable is not None:
            expected = self._expected_scale(pods)
            unavailable = _scaled(max_unavailable, expected, round_up=True)
            return expected, max(0, expected - unavailable)
        if isinstance(min_available, int):
            # An integer needs no controller: every selected pod counts.
            return len(pods), min_available
        if min_available is not None:
            expected = self._expected_scale(pods)
            return expected, _scaled(min_available, expected, round_up=True)
        return 0, 0

    def _expected_scale(self, pods: list[JsonObj]) -> int:
        """disruption.go getExpectedScale: the sum of the scales of the pods'
        controllers. Pods without a controllerRef are unmanaged and left out
        (the controller only warns); a controllerRef that resolves to no
        scalable controller fails the sync."""
        scales: dict[str, int] = {}
        for pod in pods:
            ref = next(
                (
                    o
                    for o in pod["metadata"].get("ownerReferences") or []
                    if o.get("controller")
                ),
                None,
            )
            if ref is None or ref.get("uid") in scales:
                continue
            found = self._controller_scale(ref, pod["metadata"]["namespace"])
            if found is None:
                raise _SyncFailedError(
                    f'found no controllers for pod "{pod["metadata"]["name"]}"'
                )
            scales[found[0]] = found[1]
        return sum(scales.values())

    def _controller_scale(self, ref: JsonObj, namespace: str) -> tuple[str, int] | None:
        """The finders of disruption.go (Deployment through its ReplicaSet,
        ReplicaSet, StatefulSet, then any /scale): (uid, replicas) or None."""
        kind = ref.get("kind", "")
        group = str(ref.get("apiVersion", "")).rpartition("/")[0]

        def lookup(kind: str, name: str) -> JsonObj | None:
            return self.store.get(resource_for_kind(kind), namespace, name)

        if kind in ("ReplicaSet", "StatefulSet", "Deployment"):
            owner = lookup(kind, ref["name"])
            if owner is None or owner["metadata"]["uid"] != ref.get("uid"):
                return None
            if kind == "ReplicaSet":
                parent = next(
                    (
                        o
                        for o in owner["metadata"].get("ownerReferences") or []
                        if o.get("controller") and o.get("kind") == "Deployment"
                    ),
                    None,
                )
                deployment = lookup("Deployment", parent["name"]) if parent else None
                if (
                    deployment is not None
                    and parent is not None
                    and deployment["metadata"]["uid"] == parent.get("uid")
                ):
                    owner = deployment
            replicas = (owner.get("spec") or {}).get("replicas", 1)
            return owner["metadata"]["uid"], int(replicas)
        if kind == "ReplicationController":
            return None  # scalable, but the emulator stores none
        without_scale = {
            "DaemonSet": "daemonsets.apps",
            "Job": "jobs.batch",
            "CronJob": "cronjobs.batch",
            "Node": "nodes",
            "Pod": "pods",
        }
        if kind in without_scale:
            raise _SyncFailedError(
                f"{without_scale[kind]} does not implement the scale subresource"
            )
        raise _SyncFailedError(
            f'no matches for kind "{kind}" in version "{ref.get("apiVersion", "")}"'
            if group
            else f'no matches for kind "{kind}" in group ""'
        )

    # ------------------------------------------------------- pod termination

    def _cancel_timer(self, uid: str) -> None:
        timer = self._timers.pop(uid, None)
        if timer is not None:
            timer.cancel()

    def _kubelet_alive(self, node: str | None) -> bool:
        """Whether a kubelet runs for the node: it exists and is up."""
        return (
            bool(node)
            and node not in self._down
            and self.store.get(resource_for_kind("Node"), "", str(node)) is not None
        )

    def _kubelet_schedule(self, pod: JsonObj) -> None:
        """The kubelet sees a pod with a deletionTimestamp: it stops the
        containers (taking the pod's stop time, at most its grace period),
        reports the terminal phase, then deletes the pod for good. Nothing
        happens on a node that is down: the pod stays Terminating there."""
        meta = pod["metadata"]
        uid = meta["uid"]
        if uid in self._refusing or uid in self._timers:
            return
        if not self._kubelet_alive((pod.get("spec") or {}).get("nodeName")):
            return
        grace = float(meta.get("deletionGracePeriodSeconds") or 0)
        stop = self._stop_seconds.get(uid, self.deletion_grace)
        killed = stop > grace
        delay = min(stop, grace)
        args = (uid, meta["namespace"], meta["name"], killed)
        if delay <= 0:
            self._kubelet_finish(*args)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # start() schedules the pods deleted before it
        self._timers[uid] = loop.call_later(delay, self._kubelet_finish, *args)

    def _kubelet_finish(
        self, uid: str, namespace: str, name: str, killed: bool
    ) -> None:
        self._timers.pop(uid, None)
        rt = resource_for_kind("Pod")
        pod = self.store.get(rt, namespace, name)
        if pod is None or pod["metadata"]["uid"] != uid or uid in self._refusing:
            return
        if not self._kubelet_alive((pod.get("spec") or {}).get("nodeName")):
            return  # the node went down meanwhile; it resumes when back up
        if pod["metadata"].get("deletionGracePeriodSeconds"):
            pod["status"] = _terminated_status(pod.get("status") or {}, killed)
            self.store.update(rt, pod)
        # The kubelet's own delete, with grace period 0.
        self.store.delete(rt, namespace, name)

    def _remove_pod_now(self, pod: JsonObj) -> JsonObj:
        """Grace period 0: gone from storage at once (no kubelet involved);
        a refusing pod keeps a deletionTimestamp as if held by a finalizer."""
        rt = resource_for_kind("Pod")
        meta = pod["metadata"]
        if meta["uid"] in self._refusing:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now_rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                return self.store.update(rt, pod)
            return pod
        self._cancel_timer(meta["uid"])
        return self.store.delete(rt, meta["namespace"], meta["name"]) or pod

    def _delete_pod(self, pod: JsonObj, options: JsonObj) -> JsonObj:
        """A pod DELETE as the apiserver does it (rest/delete.go BeforeDelete
        with the pod strategy's CheckGracefulDelete); returns the object to
        send back."""
        rt = resource_for_kind("Pod")
        self._check_preconditions(rt, pod, options)
        meta = pod["metadata"]
        requested = options.get("gracePeriodSeconds")
        if requested is not None:
            # Negative values count as 1 s on the delete path.
            requested = int(requested) if int(requested) >= 0 else 1
        if meta.get("deletionTimestamp"):
            current = meta.get("deletionGracePeriodSeconds")
            if not current:
                return self._remove_pod_now(pod)
            if requested is None or requested >= current:
                # Graceful deletion pending: nothing changes (the kubelet
                # is on it, or takes it up if it has not seen it yet).
                self._kubelet_schedule(pod)
                return pod
            # Only a shorter grace period may be asked for.
            now = datetime.now(UTC).replace(microsecond=0)
            moment = (
                _parse_time(meta["deletionTimestamp"])
                - timedelta(seconds=current)
                + timedelta(seconds=requested)
            )
            period = requested
            if moment < now:
                moment = now
                period = 1 if requested else 0
            if period == 0:
                return self._remove_pod_now(pod)
            meta["deletionTimestamp"] = _time_text(moment)
            meta["deletionGracePeriodSeconds"] = period
            self._cancel_timer(meta["uid"])
            updated = self.store.update(rt, pod)
            self._kubelet_schedule(updated)
            return updated
        spec = pod.get("spec") or {}
        period = (
            requested
            if requested is not None
            # Defaulting gives every pod 30 s when the manifest has none.
            else int(spec.get("terminationGracePeriodSeconds", 30))
        )
        if (
            not spec.get("nodeName")
            or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES
        ):
            period = 0  # unscheduled or finished: nothing to stop
        if period == 0:
            return self._remove_pod_now(pod)
        meta["deletionTimestamp"] = _time_text(
            datetime.now(UTC) + timedelta(seconds=period)
        )
        meta["deletionGracePeriodSeconds"] = period
        if meta.get("generation"):
            meta["generation"] += 1
        updated = self.store.update(rt, pod)
        self._kubelet_schedule(updated)
        return updated

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
            retry_after = (err.details or {}).get("retryAfterSeconds")
            if retry_after:
                # responsewriters.ErrorNegotiated turns it into the header.
                response.headers["Retry-After"] = str(retry_after)
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
        # API Priority and Fairness sits between authentication and
        # authorization: a throttled request never learns it was forbidden.
        apf = self._take_fault("apf", verb, target.resource)
        if apf is not None:
            return self._apf_rejection(apf)
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
        fault = self._take_fault("status", verb, target.resource)
        if fault is not None:
            raise ApiError(
                fault.status,
                fault.message,
                details={"retryAfterSeconds": fault.retry_after}
                if fault.retry_after
                else {},
            )
        # Long-running requests (watches) have no deadline.
        timeout = (
            None
            if verb == "watch"
            else self._take_fault("timeout", verb, target.resource)
        )
        if timeout is not None:
            if timeout.applied:
                # The handler runs on after the deadline and may still
                # store its result (finisher.go); the client never sees it.
                with contextlib.suppress(ApiError):
                    await self._serve(request, target, verb, body, info)
            raise ApiError(504, TIMEOUT_MESSAGE, reason="Timeout", details={})
        return await self._serve(request, target, verb, body, info)

    async def _serve(
        self,
        request: web.Request,
        target: _Target,
        verb: str,
        body: Any,
        info: dict[str, Any],
    ) -> web.StreamResponse:
        match verb:
            case "get":
                return web.json_response(self._api_get(target))
            case "list":
                return web.json_response(self._api_list(target, request.query))
            case "watch":
                return await self._api_watch(request, target, info)
            case "create":
                return web.json_response(
                    self._api_create(target, body, request.query.getall("dryRun", [])),
                    status=201,
                )
            case "update" if target.rt.kind == "Event" and target.name is not None:
                updated, created = self._event_update(target, body)
                return web.json_response(updated, status=201 if created else 200)
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

    def _take_fault(self, style: str, verb: str, resource: str) -> _Fault | None:
        """The first pending fault of this style matching the request (used up)."""
        for fault in self._faults:
            if (
                fault.style == style
                and fault.remaining > 0
                and fault.verb in (None, verb)
                and fault.resource in (None, resource)
            ):
                fault.remaining -= 1
                if fault.remaining == 0:
                    self._faults.remove(fault)
                return fault
        return None

    @staticmethod
    def _apf_rejection(fault: _Fault) -> web.Response:
        """priority-and-fairness.go: setResponseHeaders, then tooManyRequests
        (Go's http.Error: text/plain, nosniff, the message and a newline)."""
        return web.Response(
            status=429,
            text=APF_MESSAGE + "\n",
            content_type="text/plain",
            charset="utf-8",
            headers={
                "Retry-After": str(fault.retry_after),
                "X-Content-Type-Options": "nosniff",
                "X-Kubernetes-Pf-Flowschema-Uid": str(
                    uuid.uuid5(uuid.NAMESPACE_URL, "flowschema/service-accounts")
                ),
                "X-Kubernetes-Pf-Prioritylevel-Uid": str(
                    uuid.uuid5(uuid.NAMESPACE_URL, "prioritylevel/workload-low")
                ),
            },
        )

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
        """The stored object (404 in the request's group's words)."""
        assert target.name is not None
        obj = self.store.get(target.stored, target.namespace or "", target.name)
        if obj is None:
            raise not_found(target.rt, target.name)
        return obj

    @staticmethod
    def _present(rt: ResourceType, obj: JsonObj) -> JsonObj:
        """A stored object as ``rt`` serves it: as stored (controllers write
        status), an Event through events.k8s.io/v1 converted from its core
        form (Convert_core_Event_To_v1_Event)."""
        if rt == EVENTS_V1:
            return encode_event(stored_event(obj), rt.api_version)
        return obj

    def _present_written(self, rt: ResourceType, obj: JsonObj) -> JsonObj:
        """The answer to a write. With an instant disruption controller
        (``pdb_sync_delay`` 0) a budget is answered as synced, the way it
        reads right after; with a lagging one, as written (status stale)."""
        if rt.kind == "PodDisruptionBudget" and self.pdb_sync_delay <= 0:
            meta = obj["metadata"]
            current = self.store.get(rt, meta["namespace"], meta["name"])
            if current is not None and current["metadata"]["uid"] == meta["uid"]:
                return current
        return obj

    def _api_get(self, target: _Target) -> JsonObj:
        if target.name is None or target.sub == "eviction":
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        found = self._present(target.rt, self._load(target))
        if target.rt.kind == "Node":
            self._release_held_taint(target.name)
        return found

    def _selectors(
        self, target: _Target, query: Any
    ) -> tuple[list[Requirement], list[FieldRequirement]]:
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""))
            if target.rt == EVENTS_V1:
                fields = events_v1_field_selector(fields)
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
        if target.rt.kind == "Event" and any(f.field == "source" for f in fields):
            obj = event_selectable(obj)
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
                objs = self.store.list_at(target.stored, revision)
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
                objs = self.store.list_at(target.stored, revision)
            except ExpiredError as err:
                raise ApiError(410, str(err), reason="Expired") from err
        else:
            revision, start = self.store.revision, ""
            objs = self.store.list_objects(target.stored)
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
            if event.resource != target.stored:
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
                    for o in self.store.list_objects(target.stored)
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

    def _api_create(
        self, target: _Target, body: Any, dry_run: list[str] | None = None
    ) -> JsonObj:
        if target.sub == "eviction":
            if not isinstance(body, dict):
                raise ApiError(400, "the body of the request is not an Eviction object")
            assert target.name is not None
            self._admit_create(target, target.name)
            return self._evict(target, body, _create_dry_run(dry_run or []))
        if target.name is not None or target.sub is not None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        if target.rt.kind == "Event":
            return self._event_create(target, body)
        obj = self._check_body(target, body)
        meta = obj["metadata"]
        self._admit_create(
            target, meta.get("name") or meta.get("generateName") or "Unknown"
        )
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
        _drop_server_fields(meta)
        if self.store.get(target.rt, target.namespace or "", meta["name"]) is not None:
            raise ApiError(
                409,
                f'{target.rt.group_resource} "{meta["name"]}" already exists',
                reason="AlreadyExists",
                details=_details(target.rt, meta["name"]),
            )
        if target.rt.kind == "PodDisruptionBudget":
            obj["status"] = dict(EMPTY_PDB_STATUS)  # PrepareForCreate
        if target.rt.kind == "Namespace":
            # The namespace strategy's PrepareForCreate and defaulting.
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        created = self.store.create(target.rt, obj)
        return self._present_written(target.rt, created)

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
            spec = result.setdefault("spec", {})
            if "unschedulable" in spec and not spec["unschedulable"]:
                spec.pop("unschedulable")  # omitempty, as the apiserver serializes it
        return result

    # ------------------------------------------- the cordon's taint, a write apart

    def hold_cordon_taint(self) -> None:
        """Make the node lifecycle controller's next cordon-taint write land
        right after the next API read of that node: between a client's read
        and its write, as the real controller's may (a conflict the client
        must survive). Otherwise it lands on the loop's next turn."""
        self._taint_hold = True

    def _taint_cordon_later(self, name: str) -> None:
        """A node was written: doNoScheduleTaintingPass (node_lifecycle_
        controller.go) reacts to the update and swaps the
        ``node.kubernetes.io/unschedulable:NoSchedule`` taint to match
        spec.unschedulable in a write of its own (SwapNodeControllerTaint),
        moments after the cordon or uncordon, not in it."""
        node = self.store.get(resource_for_kind("Node"), "", name)
        if node is None or self._cordon_taint(node) is None:
            return
        if self._taint_hold:
            self._taint_held.add(name)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._taint_cordon(name)  # no loop (a control call before start)
            return
        loop.call_soon(self._taint_cordon, name)

    def _release_held_taint(self, name: str) -> None:
        """After an API read of ``name``: a held taint write lands now."""
        if name in self._taint_held:
            self._taint_held.discard(name)
            self._taint_hold = False
            self._taint_cordon(name)

    def _taint_cordon(self, name: str) -> None:
        node = self.store.get(resource_for_kind("Node"), "", name)
        if node is None or name in self._taint_held:
            return
        taints = self._cordon_taint(node)
        if taints is None:
            return
        spec = node.setdefault("spec", {})
        if taints:
            spec["taints"] = taints
        else:
            spec.pop("taints", None)
        self.store.update(resource_for_kind("Node"), node)

    @staticmethod
    def _cordon_taint(node: JsonObj) -> list[JsonObj] | None:
        """The node's taints with the cordon's taint as spec.unschedulable
        wants it, or None when they are so already."""
        spec = node.get("spec") or {}
        had = any(
            t.get("key") == "node.kubernetes.io/unschedulable"
            for t in spec.get("taints") or []
        )
        if had == bool(spec.get("unschedulable")):
            return None
        taints = [
            t
            for t in spec.get("taints") or []
            if t.get("key") != "node.kubernetes.io/unschedulable"
        ]
        if not had:
            taints.append(
                {
                    "key": "node.kubernetes.io/unschedulable",
                    "effect": "NoSchedule",
                    "timeAdded": now_rfc3339(),
                }
            )
        return taints

    def _api_update(self, target: _Target, body: Any) -> JsonObj:
        if target.name is None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        old = self._load(target)
        new = self._check_body(target, body)
        result = self._merge_update(target, old, new)
        return self._present_written(target.rt, self.store.update(target.rt, result))

    @staticmethod
    def _patch_media(content_type: str) -> str:
        """The patch flavour, or 415."""
        media = content_type.split(";", maxsplit=1)[0].strip().lower()
        if media not in PATCH_TYPES:
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: {', '.join(PATCH_TYPES)}",
                details={},
            )
        return media

    @staticmethod
    def _apply_patch(media: str, current: JsonObj, body: Any) -> JsonObj:
        """The current object with the patch applied."""
        try:
            if media == "application/json-patch+json":
                patched = json_patch(current, body)
            elif not isinstance(body, dict):
                raise ApiError(400, "the body of the request was not a JSON object")
            elif media == "application/merge-patch+json":
                patched = json_merge_patch(current, body)
            else:
                patched = strategic_merge_patch(current, body)
        except PatchError as err:
            raise ApiError(422, str(err)) from err
        if not isinstance(patched, dict):
            raise ApiError(422, "the patch did not result in an object")
        return patched

    def _api_patch(self, target: _Target, content_type: str, body: Any) -> JsonObj:
        if target.name is None or target.sub == "eviction":
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        media = self._patch_media(content_type)
        if target.rt.kind == "Event":
            return self._event_patch(target, media, body)
        old = self._load(target)
        patched = self._apply_patch(media, old, body)
        meta = patched.setdefault("metadata", {})
        if isinstance(body, dict):
            # A resourceVersion in the patch is a precondition.
            rv = (body.get("metadata") or {}).get("resourceVersion")
            meta["resourceVersion"] = rv or old["metadata"]["resourceVersion"]
        else:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        result = self._merge_update(target, old, patched)
        return self._present_written(target.rt, self.store.update(target.rt, result))

    # ------------------------------------------- Events (core/v1, events.k8s.io/v1)

    @staticmethod
    def _decode_event_body(target: _Target, body: Any) -> ApiEvent:
        """The create and update handlers' decoding (handlers/create.go,
        update.go): a body that does not decode is 400 (transformDecodeError:
        '<kind> in version "<version>" cannot be handled as a <kind>: ...'),
        and so is one of another API version."""
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request is not a JSON object")
        version = target.rt.api_version
        try:
            event = decode_event(body, version)
        except DecodeError as err:
            raise ApiError(
                400, f'Event in version "v1" cannot be handled as a Event: {err}'
            ) from err
        data_version = body.get("apiVersion")
        if data_version and data_version != version:
            raise ApiError(
                400,
                f"the API version in the data ({data_version}) does not match the "
                f"expected API version ({version})",
            )
        return event

    def _event_create(self, target: _Target, body: Any) -> JsonObj:
        """POST an Event (either group): decoded, admitted, validated by
        ValidateEventCreate for the request's version (rest.BeforeCreate:
        422 Invalid), then the generic metadata check (a name), then stored
        in its core/v1 form (409 if it exists)."""
        event = self._decode_event_body(target, body)
        obj = self._check_body(target, body)
        meta = obj["metadata"]
        name = meta.get("name") or ""
        self._admit_create(target, name or meta.get("generateName") or "Unknown")
        _drop_server_fields(meta)
        event.metadata = copy.deepcopy(meta)
        errors = validate_event_create(event, target.rt.api_version)
        if not errors and not name:
            # ValidateObjectMetaAccessor, after the strategy's validation.
            errors = [required("metadata.name", "name or generateName is required")]
        if errors:
            raise _event_invalid(name, errors)
        if self.store.get(target.stored, target.namespace or "", name) is not None:
            raise ApiError(
                409,
                f'{target.rt.group_resource} "{name}" already exists',
                reason="AlreadyExists",
                details=_details(target.rt, name),
            )
        created = self.store.create(target.stored, encode_event(event, CORE_V1))
        return self._present(target.rt, created)

    def _event_update(self, target: _Target, body: Any) -> tuple[JsonObj, bool]:
        """PUT an Event: the event strategy allows create on update (a
        missing Event is created, 201); otherwise the body replaces it,
        checked by ValidateEventUpdate for the request's version."""
        assert target.name is not None
        old = self.store.get(target.stored, target.namespace or "", target.name)
        if old is None:
            if isinstance(body, dict):
                meta = body.setdefault("metadata", {})
                if meta.get("name", target.name) != target.name:
                    raise ApiError(
                        400, "the name of the object does not match the name on the URL"
                    )
                meta["name"] = target.name
            return self._event_create(target, body), True
        event = self._decode_event_body(target, body)
        merged = self._merge_update(target, old, self._check_body(target, body))
        event.metadata = merged["metadata"]
        return self._event_write(target, old, event), False

    def _event_patch(self, target: _Target, media: str, body: Any) -> JsonObj:
        """PATCH an Event: the patch applies to the Event in the request's
        version (a strategic merge patch of ``series`` is what client-go's
        events broadcaster sends: event_broadcaster.go
        createPatchBytesForSeries), the result is decoded (a value that does
        not decode: 422 on field ``patch``, as handlers/patch.go reports it)
        and checked by ValidateEventUpdate."""
        old = self._load(target)
        version = target.rt.api_version
        current = encode_event(stored_event(old), version)
        patched = self._apply_patch(media, current, body)
        try:
            event = decode_event(patched, version)
        except DecodeError as err:
            shown = (
                go_fmt_v(body)
                if media == "application/strategic-merge-patch+json"
                else go_json(patched, sort_keys=True)
            )
            raise _invalid_status(
                "",
                "",
                [FieldError("FieldValueInvalid", "patch", go_quote(shown), str(err))],
            ) from err
        meta = patched.setdefault("metadata", {})
        # A resourceVersion in the patch is a precondition.
        rv = (
            (body.get("metadata") or {}).get("resourceVersion")
            if isinstance(body, dict)
            else None
        )
        meta["resourceVersion"] = rv or old["metadata"]["resourceVersion"]
        event.metadata = self._merge_update(target, old, patched)["metadata"]
        return self._event_write(target, old, event)

    def _event_write(self, target: _Target, old: JsonObj, event: ApiEvent) -> JsonObj:
        """rest.BeforeUpdate: ValidateEventUpdate against the stored Event
        (422 Invalid), then the Event stored in its core/v1 form."""
        assert target.name is not None
        errors = validate_event_update(event, stored_event(old), target.rt.api_version)
        if errors:
            raise _event_invalid(target.name, errors)
        updated = self.store.update(target.stored, encode_event(event, CORE_V1))
        return self._present(target.rt, updated)

    def _api_delete(self, target: _Target, body: Any) -> JsonObj:
        if target.name is None or target.sub is not None:
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        if target.rt.kind == "Namespace" and target.name in IMMORTAL_NAMESPACES:
            # NamespaceLifecycle admission, before the object is even read.
            raise ApiError(
                403,
                f'namespaces "{target.name}" is forbidden: this namespace may not be deleted',
                details=_details(target.rt, target.name),
            )
        obj = self._load(target)
        options = body if isinstance(body, dict) else {}
        if target.rt.kind == "Pod":
            return self._delete_pod(obj, options)
        # BeforeDelete names the stored object's kind (core Event for both).
        self._check_preconditions(target.stored, obj, options)
        if target.rt.kind == "Namespace":
            if obj["metadata"].get("deletionTimestamp"):
                raise conflict(target.rt, target.name, NAMESPACE_PURGE_WHY)
            # The namespace is answered as marked; its controller follows.
            return self.terminate_namespace(target.name)
        self.store.delete(target.stored, target.namespace or "", target.name)
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
        if target.rt.kind == "Namespace":
            raise ApiError(
                405, "the server does not allow this method on the requested resource"
            )
        labels, fields = self._selectors(target, query)
        deleted = []
        for obj in self.store.list_objects(target.stored):
            if self._matches(target, labels, fields, obj):
                meta = obj["metadata"]
                current = self.store.get(
                    target.stored, meta.get("namespace", ""), meta["name"]
                )
                if current is None:
                    continue  # gone while the collection was being deleted
                if target.rt.kind == "Pod":
                    deleted.append(self._delete_pod(current, {}))
                else:
                    deleted.append(
                        self.store.delete(
                            target.stored, meta.get("namespace", ""), meta["name"]
                        )
                        or current
                    )
        return {
            "kind": f"{target.rt.kind}List",
            "apiVersion": target.rt.api_version,
            "metadata": {"resourceVersion": str(self.store.revision)},
            "items": [_strip_list_item(self._present(target.rt, o)) for o in deleted],
        }

    @staticmethod
    def _check_preconditions(rt: ResourceType, obj: JsonObj, options: JsonObj) -> None:
        """rest/delete.go BeforeDelete: preconditions fail early, with the
        object's Kind in the message."""
        pre = options.get("preconditions") or {}
        meta = obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise _kind_conflict(
                rt,
                meta["name"],
                f"the UID in the precondition ({pre['uid']}) does not match the UID in "
                f"record ({meta['uid']}). The object might have been deleted and then recreated",
            )
        if (
            pre.get("resourceVersion")
            and pre["resourceVersion"] != meta["resourceVersion"]
        ):
            raise _kind_conflict(
                rt,
                meta["name"],
                f"the ResourceVersion in the precondition ({pre['resourceVersion']}) does "
                f"not match the ResourceVersion in record ({meta['resourceVersion']}). "
                "The object might have been modified",
            )

    # ---------------------------------------------------------------- eviction

    def _evict(self, target: _Target, body: JsonObj, dry_run: list[str]) -> JsonObj:
        """The pods/eviction subresource, as pkg/registry/core/pod/storage/
        eviction.go Create: pods that can ignore budgets are deleted at once;
        otherwise the budget is checked and decremented (checkAndDecrement)
        and only then is the pod deleted, so the caller's UID or
        resourceVersion precondition fails (409) after the budget was spent.
        A dry run (``?dryRun=All`` or the body's ``deleteOptions.dryRun``,
        propagateDryRun) checks everything and changes nothing: the budget
        is not spent, no condition is added, the pod is not deleted."""
        assert target.name is not None
        if (body.get("metadata") or {}).get("name") not in (None, target.name):
            raise ApiError(400, "name in URL does not match name in Eviction object")
        pod_target = _Target(target.rt, target.namespace, target.name, None)
        pod = self._load(pod_target)
        options: JsonObj = _propagate_dry_run(body.get("deleteOptions") or {}, dry_run)
        client_rv = (options.get("preconditions") or {}).get("resourceVersion")
        success: JsonObj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }
        phase = (pod.get("status") or {}).get("phase")
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if phase in (*TERMINAL_PHASES, "Pending") or deleting:
            # canIgnorePDB; shouldEnforceResourceVersion guards a Pending pod
            # against turning Running meanwhile.
            if phase == "Pending" and not deleting and not client_rv:
                options = _with_rv_precondition(options, pod)
            self._add_condition_and_delete(pod_target, options)
            return success
        pdbs = self._matching_pdbs(pod)
        if len(pdbs) > 1:
            raise ApiError(500, MULTIPLE_PDB_MESSAGE, reason=None)
        unhealthy_may_go = False
        pdb_name = ""
        if pdbs:
            pdb = pdbs[0]
            pdb_name = pdb["metadata"]["name"]
            status = pdb.get("status") or {}
            if not pod_is_ready(pod):
                policy = (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy")
                # An unready pod does not count towards currentHealthy: it
                # may go without spending the budget, if the policy allows
                # (AlwaysAllow) or the guarded application is healthy.
                unhealthy_may_go = policy == "AlwaysAllow" or (
                    status.get("currentHealthy", 0) >= status.get("desiredHealthy", 0)
                    and status.get("desiredHealthy", 0) > 0
                )
            if not unhealthy_may_go:
                self._check_and_decrement(pod, pdb, dry_run=bool(options.get("dryRun")))
        if unhealthy_may_go:
            # The pod must not have turned ready since the budget was read.
            options = _with_rv_precondition(options, pod)
        try:
            self._add_condition_and_delete(pod_target, options)
        except ApiError as err:
            if err.code == 409 and unhealthy_may_go and not client_rv:
                raise pdb_still_processing(pdb_name) from err
            raise
        return success

    def _check_and_decrement(
        self, pod: JsonObj, pdb: JsonObj, *, dry_run: bool = False
    ) -> None:
        """eviction.go checkAndDecrement, on the budget as stored (a dry run
        stops after the checks: the budget is not written)."""
        status: JsonObj = copy.deepcopy(pdb.get("status") or {})
        name = pdb["metadata"]["name"]
        if status.get("observedGeneration", 0) < pdb["metadata"].get("generation", 1):
            raise pdb_still_processing(name)
        allowed = int(status.get("disruptionsAllowed", 0))
        disrupted: dict[str, str] = status.get("disruptedPods") or {}
        for why, refused in (
            ("pdb disruptions allowed is negative", allowed < 0),
            (
                "DisruptedPods map too big - too many evictions not confirmed by PDB controller",
                len(disrupted) > MAX_DISRUPTED_POD_SIZE,
            ),
        ):
            if refused:
                raise ApiError(
                    403,
                    f'poddisruptionbudget.policy "{name}" is forbidden: {why}',
                    details={
                        "name": name,
                        "group": "policy",
                        "kind": "poddisruptionbudget",
                    },
                )
        if allowed == 0:
            raise ApiError(
                429,
                EVICTION_PDB_MESSAGE,
                details={
                    "causes": [
                        {
                            "reason": "DisruptionBudget",
                            "message": (
                                f"The disruption budget {name} needs "
                                f"{status.get('desiredHealthy', 0)} healthy pods and has "
                                f"{status.get('currentHealthy', 0)} currently"
                            ),
                        }
                    ]
                },
            )
        if dry_run:
            return
        status["disruptionsAllowed"] = allowed - 1
        if allowed - 1 == 0:
            status["conditions"] = _disruption_allowed_conditions(
                status.get("conditions") or [], 0, status.get("observedGeneration", 0)
            )
        # Tell the controller the pod is about to go, so that it does not
        # count it healthy before its deletion shows (disruptedPods).
        status["disruptedPods"] = {**disrupted, pod["metadata"]["name"]: now_rfc3339()}
        pdb["status"] = status
        self.store.update(resource_for_kind("PodDisruptionBudget"), pdb)

    def _add_condition_and_delete(self, target: _Target, options: JsonObj) -> None:
        """eviction.go addConditionAndDeletePod: on the latest pod, check the
        preconditions, add the DisruptionTarget condition, then delete."""
        rt = target.rt
        pod = self._load(target)
        self._check_preconditions(rt, pod, options)
        if options.get("dryRun"):
            return  # the store's dry-run delete: checked, not done
        status = pod.setdefault("status", {})
        conditions: list[JsonObj] = status.setdefault("conditions", [])
        previous = next(
            (c for c in conditions if c.get("type") == "DisruptionTarget"), None
        )
        condition: JsonObj = {
            "type": "DisruptionTarget",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": previous["lastTransitionTime"]
            if previous is not None and previous.get("status") == "True"
            else now_rfc3339(),
            "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
        }
        if previous != condition:
            status["conditions"] = [
                *(c for c in conditions if c.get("type") != "DisruptionTarget"),
                condition,
            ]
            pod = self.store.update(rt, pod)
            if (options.get("preconditions") or {}).get("resourceVersion"):
                # The condition's update is the eviction's own change.
                options = _with_rv_precondition(options, pod)
        self._delete_pod(pod, options)


# The DefaultTolerationSeconds admission plugin's two tolerations
# (plugin/pkg/admission/defaulttolerationseconds/admission.go, both 300 s by
# default): a pod stays bound to a node that is not ready or unreachable this
# long before the taint manager evicts it.
DEFAULT_TOLERATION_SECONDS = 300
DEFAULT_TOLERATION_KEYS = (
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
)


def _default_toleration_seconds(pod: JsonObj) -> None:
    """DefaultTolerationSeconds' Admit on a pod's create: for each of the two
    keys, unless a toleration already matches it (its key, or none, with the
    NoExecute effect, or none), add ``{key, Exists, NoExecute, 300}``."""
    spec = pod.setdefault("spec", {})
    tolerations = list(spec.get("tolerations") or [])
    for key in DEFAULT_TOLERATION_KEYS:
        if not any(
            (t.get("key") or "") in ("", key)
            and (t.get("effect") or "") in ("", "NoExecute")
            for t in tolerations
        ):
            tolerations.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
                }
            )
    spec["tolerations"] = tolerations


def _daemon_pod_tolerations(pod: JsonObj) -> None:
    """A DaemonSet's pod as its controller makes it (NewPod:
    pkg/controller/daemon/util/daemonset_util.go,
    AddOrUpdateDaemonPodTolerations): not-ready and unreachable tolerated
    for ever (NoExecute), the pressure conditions and the cordon
    (NoSchedule), and a missing network for a host-network pod. The tests
    create DaemonSet pods themselves, standing in for that controller."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    if not any(o.get("kind") == "DaemonSet" and o.get("controller") for o in owners):
        return
    spec = pod.setdefault("spec", {})
    wanted = [
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
    ]
    if spec.get("hostNetwork"):
        wanted.append(("node.kubernetes.io/network-unavailable", "NoSchedule"))
    tolerations = list(spec.get("tolerations") or [])
    for key, effect in wanted:
        toleration = {"key": key, "operator": "Exists", "effect": effect}
        if toleration not in tolerations:
            tolerations.append(toleration)
    spec["tolerations"] = tolerations


def _toleration_seconds(tolerations: list[JsonObj] | None) -> float | None:
    """tainteviction's getMinTolerationTime for the unreachable NoExecute
    taint: 0 when no toleration tolerates it (evict now), None when one
    tolerates it for ever (no tolerationSeconds), else the least of their
    tolerationSeconds (a negative one counts as 0)."""
    matching = [
        t
        for t in tolerations or []
        if objects.tolerates([t], objects.UNREACHABLE_NO_EXECUTE)
    ]
    if not matching:
        return 0.0
    limits = [t.get("tolerationSeconds") for t in matching]
    if any(limit is None for limit in limits):
        return None
    return float(max(0, min(int(limit) for limit in limits if limit is not None)))


def _create_dry_run(values: list[str]) -> list[str]:
    """A create's ``dryRun`` query values, as ValidateCreateOptions checks
    them (apimachinery validation.ValidateDryRun): only "All"; 422 else."""
    for value in values:
        if value != "All":
            raise ApiError(
                422,
                'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: '
                f'"{value}": supported values: "All"',
            )
    return values


def _propagate_dry_run(options: JsonObj, dry_run: list[str]) -> JsonObj:
    """eviction.go propagateDryRun: the request's dryRun goes into the
    eviction's delete options; both given and different: 400."""
    body_dry_run = list(options.get("dryRun") or [])
    if not body_dry_run:
        return {**options, "dryRun": dry_run} if dry_run else options
    if dry_run and dry_run != body_dry_run:
        raise ApiError(
            400,
            "Non-matching dry-run options in request and content: "
            f"[{' '.join(dry_run)}] and [{' '.join(body_dry_run)}]",
        )
    return options


def _with_rv_precondition(options: JsonObj, pod: JsonObj) -> JsonObj:
    """DeleteOptions with preconditions.resourceVersion set to the pod's."""
    result = copy.deepcopy(options)
    result.setdefault("preconditions", {})
    result["preconditions"] = {
        **(result["preconditions"] or {}),
        "resourceVersion": pod["metadata"]["resourceVersion"],
    }
    return result


def _invalid_status(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    """errors.NewInvalid (k8s.io/apimachinery/pkg/api/errors/errors.go): one
    cause per error, the message their aggregate (duplicates once; in
    brackets when more than one)."""
    lines: list[str] = []
    for err in errors:
        line = f"{err.field}: {err.body()}"
        if line not in lines:
            lines.append(line)
    summary = lines[0] if len(lines) == 1 else "[" + ", ".join(lines) + "]"
    details: JsonObj = {}
    if name:
        details["name"] = name
    if kind:
        details["kind"] = kind
    details["causes"] = [
        {"reason": e.type, "message": e.body(), "field": e.field} for e in errors
    ]
    return ApiError(
        422, f"{kind} {go_quote(name)} is invalid: {summary}", details=details
    )


def _event_invalid(name: str, errors: list[FieldError]) -> ApiError:
    """rest.BeforeCreate / BeforeUpdate: NewInvalid with the internal
    object's kind, core ``Event`` whichever group the request went to."""
    return _invalid_status("Event", name, errors)


def _drop_server_fields(meta: JsonObj) -> None:
    """What a create's body may not set: the server fills it in."""
    for key in (
        "uid",
        "resourceVersion",
        "creationTimestamp",
        "deletionTimestamp",
        "generation",
    ):
        meta.pop(key, None)
