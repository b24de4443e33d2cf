"""Client for the Kubernetes side; knows nothing about Home Assistant.

Wraps kubernetes_asyncio with the care Home Assistant needs: the kubeconfig is
parsed from text (never a file Home Assistant must read), certificates stay in
memory where the ``ssl`` module allows and the SSL context is built off the event
loop, the client never touches kubernetes_asyncio's process-wide default
configuration, and every call carries a request timeout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
import datetime as dt
import json
import logging
import os
import ssl
import tempfile
from typing import Any, Final

import aiohttp
from kubernetes_asyncio.client import (
    ApiClient,
    AppsV1Api,
    Configuration,
    CoordinationV1Api,
    CoreV1Api,
    EventsV1Api,
    PolicyV1Api,
    rest,
)
from kubernetes_asyncio.client.exceptions import ApiException
import yaml

from .cluster_model import (
    CORDON_OWNER_OTHER,
    CORDON_OWNER_US,
    DrainProgress,
    NodeView,
)

_LOGGER = logging.getLogger(__name__)

REQUEST_TIMEOUT: Final = 15.0
# The names the NVIDIA device plugin advertises a card's devices under
# (NVIDIA/k8s-device-plugin README): one nvidia.com/gpu per card; with
# time-slicing each card `replicas` times, renamed nvidia.com/gpu.shared by
# renameByDefault; with the mixed MIG strategy one nvidia.com/mig-<profile>
# per MIG device (a time-sliced one renamed nvidia.com/mig-<profile>.shared).
GPU_RESOURCE: Final = "nvidia.com/gpu"
GPU_RESOURCE_SHARED: Final = "nvidia.com/gpu.shared"
MIG_RESOURCE_PREFIX: Final = "nvidia.com/mig-"
LEASE_NAMESPACE: Final = "kube-node-lease"
MIRROR_ANNOTATION: Final = "kubernetes.io/config.mirror"
# The mark on a Node that says the cordon is GPU Handoff's own: only a cordon
# carrying it is ever lifted by GPU Handoff (an operator's cordon is theirs).
CORDON_ANNOTATION: Final = "gpu-handoff.io/cordoned-by"
# The taint kube-controller-manager keeps on a cordoned node.
UNSCHEDULABLE_TAINT: Final = "node.kubernetes.io/unschedulable"
FINISHED_PHASES: Final = frozenset({"Succeeded", "Failed"})
HTTP_UNAUTHORIZED: Final = 401
HTTP_FORBIDDEN: Final = 403
HTTP_NOT_FOUND: Final = 404
HTTP_CONFLICT: Final = 409
HTTP_TOO_MANY_REQUESTS: Final = 429
HTTP_SERVER_ERROR: Final = 500
# StatusCause types (their JSON field is "reason") the drain tells apart.
CAUSE_DISRUPTION_BUDGET: Final = "DisruptionBudget"
CAUSE_NAMESPACE_TERMINATING: Final = "NamespaceTerminating"
# The eviction API's 500 for a pod that several budgets select, word for word
# (pkg/registry/core/pod/storage/eviction.go).
MULTIPLE_BUDGETS_MESSAGE: Final = (
    "This pod has more than one PodDisruptionBudget, "
    "which the eviction subresource does not support."
)
PAGE_SIZE: Final = 250
# kubectl drain's EvictErrorRetryDelay and its wait-for-delete poll.
# Backoff for transient errors (5xx, 429/504 throttling, timeouts, resets).
RETRY_START: Final = 0.5
RETRY_MAX: Final = 5.0
CORDON_RETRY_WINDOW: Final = 30.0
# Waiting for a node to turn Ready: one watch lasts at most this long, and
# when watching fails the node is read this often.
NODE_WATCH_CHUNK: Final = 60.0
NODE_POLL_FALLBACK: Final = 1.0
# The pod condition the kubelet sets True once the pod's sandbox is up with
# its network, before any image is pulled (pkg/kubelet/status/generate.go,
# GeneratePodReadyToStartContainersCondition): PodReadyToStartContainers from
# Kubernetes 1.28 (on by default from 1.29), PodHasNetwork in 1.25-1.27.
SANDBOX_CONDITIONS: Final = ("PodReadyToStartContainers", "PodHasNetwork")
# The reasons a kubelet gives a container it has not created yet
# (pkg/kubelet/kubelet_pods.go): an image being pulled shows them too.
CREATING_REASONS: Final = frozenset({"ContainerCreating", "PodInitializing"})
# Warning events the kubelet records on a pod whose sandbox it cannot make
# (pkg/kubelet/events/event.go).
SANDBOX_EVENT_REASONS: Final = frozenset(
    {
        "FailedCreatePodSandBox",
        "FailedPodSandBoxStatus",
        "FailedCreatePodContainer",
        "NetworkNotReady",
    }
)
# A refresh reads the events of at most this many not-yet-started pods.
EVENT_PODS_MAX: Final = 5
# What the kubelet's event recorder puts before the message of an event it
# made of similar ones: from the tenth within ten minutes that differ only in
# their message (a sandbox failure names its sandbox, a new one each time),
# they go to one Event, counted there (client-go tools/record/events_cache.go,
# EventAggregatorByReasonMessageFunc).
COMBINED_PREFIX: Final = "(combined from similar events): "


class ClusterError(Exception):
    """Base of every cluster error."""


class KubeconfigError(ClusterError):
    """The kubeconfig cannot be used (syntax, missing parts, unsupported auth)."""


class ClusterConnectionError(ClusterError):
    """Transient: the API server cannot be reached, timed out, answered with a
    server error (5xx) or asked the client to slow down (429 without a
    disruption budget behind it). Worth retrying with backoff."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClusterAuthError(ClusterError):
    """The API server refused the credentials (401) or the verb (403)."""


class NodeNotFoundError(ClusterError):
    """The node (or another object asked for) does not exist."""


class ClusterRequestError(ClusterError):
    """The API server rejected the request itself (a 4xx not handled otherwise)."""


class ConflictError(ClusterError):
    """409: a precondition (UID or resourceVersion) no longer holds."""


class NamespaceTerminatingError(ClusterError):
    """403 with cause NamespaceTerminating: the namespace is being deleted, so
    nothing can be created in it (evictions included); its pods go with it."""


class EvictionRefusedError(ClusterError):
    """429 with a DisruptionBudget cause: a PodDisruptionBudget forbids the
    eviction now (or is still being processed)."""

    def __init__(
        self, message: str, retry_after: float | None = None, cause: str = ""
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        # The cause's message, naming the budget (eviction.go: "The
        # disruption budget NAME needs 1 healthy pods and has 1 currently").
        self.cause = cause


class DrainError(ClusterError):
    """The drain could not finish; the node stays cordoned."""

    def __init__(self, message: str, progress: DrainProgress) -> None:
        super().__init__(message)
        self.progress = progress


class BudgetOverlapError(ClusterRequestError):
    """500 from the eviction API: more than one PodDisruptionBudget selects
    the pod (pkg/registry/core/pod/storage/eviction.go refuses it, whatever
    the budgets allow). Not transient: kubectl drain fails at once on it."""


class MultipleBudgetsError(DrainError):
    """A pod on the node cannot be evicted by anyone while more than one
    PodDisruptionBudget selects it: the drain fails at once, naming them."""

    def __init__(
        self, pod: str, budgets: tuple[str, ...], progress: DrainProgress
    ) -> None:
        named = (
            f": {', '.join(budgets)}"
            if budgets
            else " (GPU Handoff may not list PodDisruptionBudgets to name them)"
        )
        super().__init__(
            f"{pod} cannot be evicted: the eviction API refuses a pod that more "
            f"than one PodDisruptionBudget selects{named}; leave one budget per pod",
            progress,
        )
        self.pod = pod
        self.budgets = budgets


class UnmanagedPodsError(DrainError):
    """Pods that nothing would recreate are on the node (no controller, or an
    orphaned DaemonSet pod): kubectl drain refuses them without --force, and so
    does GPU Handoff without its option. Raised before any eviction."""

    def __init__(
        self, node: str, pods: tuple[str, ...], progress: DrainProgress
    ) -> None:
        super().__init__(
            f"{len(pods)} pod(s) on {node} have no controller and would be lost "
            f"if evicted: {_some(pods)}",
            progress,
        )
        self.pods = pods


def _some(names: tuple[str, ...] | list[str], most: int = 10) -> str:
    """Names for a message: the first ``most``, then how many more."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str
    deletion: dt.datetime | None = None

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, kw_only=True)
class Kubeconfig:
    """What a kubeconfig's current context says, held in memory."""

    server: str
    ca_data: bytes | None = field(default=None, repr=False)
    insecure: bool = False
    token: str | None = field(default=None, repr=False)
    client_cert_data: bytes | None = field(default=None, repr=False)
    client_key_data: bytes | None = field(default=None, repr=False)
    tls_server_name: str | None = None


def _b64(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as err:
        raise KubeconfigError(f"{what} is not valid base64") from err


def _named(items: Any, name: Any, kind: str) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(kind)
            if isinstance(value, dict):
                return value
    raise KubeconfigError(f"the kubeconfig has no {kind} named {name!r}")


def parse_kubeconfig(text: str) -> Kubeconfig:
    """The current context's server and credentials, from a kubeconfig's text.

    Only what can be held in memory is accepted: certificate and key *data*,
    tokens. File paths and exec/auth-provider plugins would make Home Assistant
    read files or run programs, so they are refused with a clear message.
    """
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise KubeconfigError(f"not YAML: {err}") from err
    if not isinstance(config, dict):
        raise KubeconfigError("not a kubeconfig (expected a mapping)")
    context_name = config.get("current-context")
    contexts = config.get("contexts") or []
    if context_name is None and len(contexts) == 1:
        context_name = contexts[0].get("name")
    context = _named(contexts, context_name, "context")
    cluster = _named(config.get("clusters"), context.get("cluster"), "cluster")
    user = _named(config.get("users"), context.get("user"), "user")

    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise KubeconfigError("the cluster has no https:// server address")
    _refuse_files_and_plugins(cluster, user)
    ca = cluster.get("certificate-authority-data")
    cert = user.get("client-certificate-data")
    key = user.get("client-key-data")
    token = user.get("token")
    if token is None and (cert is None or key is None):
        raise KubeconfigError(
            "the user has neither a token nor client certificate and key data"
        )
    return Kubeconfig(
        server=server.rstrip("/"),
        ca_data=_b64(ca, "certificate-authority-data") if ca else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        token=str(token) if token is not None else None,
        client_cert_data=_b64(cert, "client-certificate-data") if cert else None,
        client_key_data=_b64(key, "client-key-data") if key else None,
        tls_server_name=cluster.get("tls-server-name"),
    )


def _refuse_files_and_plugins(cluster: dict[str, Any], user: dict[str, Any]) -> None:
    """Credentials Home Assistant would have to read from a file or get by
    running a program are refused, each with what to paste instead."""
    if "certificate-authority" in cluster:
        raise KubeconfigError(
            "certificate-authority points to a file; paste certificate-authority-data"
        )
    if "exec" in user or "auth-provider" in user:
        raise KubeconfigError(
            "exec and auth-provider credentials are not supported; use a ServiceAccount token"
        )
    if "client-certificate" in user or "client-key" in user or "tokenFile" in user:
        raise KubeconfigError(
            "the user's credentials point to files; paste the *-data fields or a token"
        )


def build_ssl_context(kubeconfig: Kubeconfig) -> ssl.SSLContext:
    """The TLS context for the API server. Blocking: run it in an executor.

    The CA is loaded from memory. ``ssl`` can load a client certificate only
    from files, so cert and key go to a private temporary directory that is
    removed before this returns.
    """
    try:
        if kubeconfig.ca_data is not None:
            context = ssl.create_default_context(cadata=kubeconfig.ca_data.decode())
        else:
            context = ssl.create_default_context()
        # Python 3.13+ adds RFC 5280 strictness (a CA must carry keyUsage, an
        # authority key id...) that Go's verifier, and so kubectl, does not
        # apply: clusters with such CAs exist and work with kubectl. Chain,
        # expiry and host name are still verified, as kubectl does.
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
        if kubeconfig.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if kubeconfig.client_cert_data and kubeconfig.client_key_data:
            with tempfile.TemporaryDirectory(prefix="gpu-handoff-") as directory:
                cert = os.path.join(directory, "cert.pem")  # noqa: PTH118
                key = os.path.join(directory, "key.pem")  # noqa: PTH118
                for path, data in (
                    (cert, kubeconfig.client_cert_data),
                    (key, kubeconfig.client_key_data),
                ):
                    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                    with os.fdopen(descriptor, "wb") as handle:
                        handle.write(data)
                context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as err:
        raise KubeconfigError(
            f"the kubeconfig's certificates are unusable: {err}"
        ) from err
    return context


class _RestClient(rest.RESTClientObject):
    """kubernetes_asyncio's REST client with an SSL context built elsewhere.

    The library's own constructor builds its SSL context (reading CA files) on
    the event loop; this one takes the context ready-made and sets the same
    attributes the library's methods use.
    """

    def __init__(self, configuration: Configuration, context: ssl.SSLContext) -> None:
        # The library's attributes are typed for its own constructor's values.
        self.server_hostname = configuration.tls_server_name  # type: ignore[assignment]
        self.proxy = None  # type: ignore[assignment]
        self.proxy_headers = None  # type: ignore[assignment]
        self.pool_manager = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=4, ssl=context),
            trust_env=False,
            read_bufsize=2**21,
        )


class _ApiClient(ApiClient):
    """An ApiClient around ``_RestClient``, never the process-wide default."""

    def __init__(self, configuration: Configuration, context: ssl.SSLContext) -> None:
        self.configuration = configuration
        self.pool_threads = 1
        self.rest_client = _RestClient(configuration, context)
        self.default_headers: dict[str, str] = {}
        self.cookie = None  # type: ignore[assignment]
        self.user_agent = "gpu-handoff"
        self.client_side_validation = configuration.client_side_validation


def boot_id_of(node: Any) -> str | None:
    """A Node's ``status.nodeInfo.bootID`` (None when it reports none)."""
    info = node.status.node_info if node.status else None
    return (info.boot_id or None) if info else None


def new_boot(view: NodeView, not_boot: str | None) -> bool:
    """Whether what ``view`` shows was posted after the boot ``not_boot``
    (always, when there is no boot to leave out)."""
    return not_boot is None or view.boot_id != not_boot


def is_gpu_resource(name: str) -> bool:
    """Whether ``name`` is a resource the NVIDIA device plugin advertises a
    card's devices under (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
    ``nvidia.com/mig-*``)."""
    return name in (GPU_RESOURCE, GPU_RESOURCE_SHARED) or name.startswith(
        MIG_RESOURCE_PREFIX
    )


def gpus_short(view: NodeView, cards: int) -> bool:
    """Whether the node advertises less than ``cards`` cards: fewer healthy
    devices than cards, or any device its plugin reports unhealthy.

    Every form the device plugin has gives each card at least one device (a
    card shared by time-slicing ``replicas`` >= 2 devices, a MIG card one per
    MIG device), and it registers a resource's devices in one go: so the
    cards are back once there are as many devices as cards and none is
    unhealthy. How many devices a card makes is the operator's configuration
    and is not guessed; a card missing altogether while the others' devices
    outnumber the cards held is not seen.
    """
    return cards > 0 and (
        view.gpu_allocatable < cards or view.gpu_allocatable < view.gpu_capacity
    )


@dataclass(frozen=True, kw_only=True)
class PodStart:
    """How far one pod on the node got towards running its containers, as its
    kubelet reports it."""

    namespace: str
    name: str
    uid: str
    finished: bool
    terminating: bool
    # PodReadyToStartContainers (PodHasNetwork before 1.28): the sandbox is
    # up. None when the kubelet sets neither (older than 1.25, or gated off).
    sandbox_ready: bool | None
    # When that condition last changed.
    sandbox_changed: dt.datetime | None
    # A container (or init container) still waits to be created.
    creating: bool
    # status.startTime: when the kubelet took the pod on.
    start_time: dt.datetime | None
    # The latest startedAt of any of its containers, running or finished.
    last_container_start: dt.datetime | None
    # spec.hostNetwork: its sandbox needs no network plugin (containerd sets
    # up the pod network only for the others; the kubelet starts host-network
    # pods while the runtime's network is not ready).
    host_network: bool = False

    @property
    def label(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, kw_only=True)
class PodEvent:
    """A Warning event about a pod's sandbox (core/v1 Event, aggregated by
    the recorder: a repeat raises ``count`` and moves ``last``; similar ones
    are ``combined``, and the message is then the latest's, without the
    recorder's prefix)."""

    namespace: str
    pod: str
    uid: str
    reason: str
    message: str
    count: int
    first: dt.datetime | None
    last: dt.datetime | None
    combined: bool = False


@dataclass(frozen=True, kw_only=True)
class NodeReading:
    """The node and what its pods and their events say, from one refresh."""

    view: NodeView
    # When the node's Ready condition last turned True (None: not Ready).
    ready_since: dt.datetime | None
    pods: tuple[PodStart, ...]
    events: tuple[PodEvent, ...]


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except TypeError, ValueError:
        return 0


def _gpu_devices(resources: dict[str, Any] | None) -> int:
    """The NVIDIA GPU devices in a node's capacity or allocatable."""
    return sum(
        _quantity(count)
        for name, count in (resources or {}).items()
        if is_gpu_resource(name)
    )


def _pod_gpu_request(pod: Any) -> int:
    """The NVIDIA GPU devices the pod's containers request, under any name
    (an extended resource's request defaults to its limit)."""
    total = 0
    for container in pod.spec.containers or []:
        resources = container.resources
        if resources is None:
            continue
        requests = resources.requests or {}
        limits = resources.limits or {}
        for name in sorted({*requests, *limits}):
            if is_gpu_resource(name):
                total += _quantity(requests.get(name, limits.get(name, 0)))
    return total


def controller_of(pod: Any) -> Any:
    """The pod's controller ownerReference (metav1.GetControllerOf), or None."""
    for owner in pod.metadata.owner_references or []:
        if owner.controller:
            return owner
    return None


def pod_finished(pod: Any) -> bool:
    return pod.status is not None and pod.status.phase in FINISHED_PHASES


def is_evictable(pod: Any) -> bool:
    """Whether a drain would have to evict this pod: not DaemonSet-owned, not
    a mirror pod, not finished."""
    owner = controller_of(pod)
    if owner is not None and owner.kind == "DaemonSet":
        return False
    if MIRROR_ANNOTATION in (pod.metadata.annotations or {}):
        return False
    return not pod_finished(pod)


def tolerates_cordon(pod: Any) -> bool:
    """Whether kube-scheduler may bind the pod to a cordoned node: one of its
    tolerations tolerates ``node.kubernetes.io/unschedulable:NoSchedule``
    (the NodeUnschedulable plugin's Filter, with core/v1's ToleratesTaint:
    an empty effect or key matches all, Exists any value, Equal or no
    operator the taint's empty value)."""
    for toleration in (pod.spec.tolerations if pod.spec is not None else None) or []:
        if toleration.effect and toleration.effect != "NoSchedule":
            continue
        if toleration.key and toleration.key != UNSCHEDULABLE_TAINT:
            continue
        operator = toleration.operator or "Equal"
        if operator == "Exists" or (operator == "Equal" and not toleration.value):
            return True
    return False


def selects(selector: Any, labels: dict[str, str]) -> bool:
    """metav1.LabelSelectorAsSelector(selector).Matches(labels), where a nil
    or empty selector matches nothing (as the eviction API reads a budget's)
    and an invalid one (an unknown operator) matches nothing either."""
    if selector is None:
        return False
    match_labels = selector.match_labels or {}
    expressions = selector.match_expressions or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in expressions:
        values = expression.values or []
        present = expression.key in labels
        match expression.operator:
            case "In":
                ok = present and labels[expression.key] in values
            case "NotIn":
                ok = not present or labels[expression.key] not in values
            case "Exists":
                ok = present
            case "DoesNotExist":
                ok = not present
            case _:
                return False
        if not ok:
            return False
    return True


def is_unmanaged(pod: Any) -> bool:
    """Whether nothing would recreate this pod once evicted (kubectl drain's
    "not managed by a controller" filter): a running pod with no controller
    that is not a mirror pod."""
    return (
        controller_of(pod) is None
        and MIRROR_ANNOTATION not in (pod.metadata.annotations or {})
        and not pod_finished(pod)
    )


def cordon_owner(node: Any) -> str | None:
    """Whose cordon the node carries: ours (marked), another's, or none."""
    if not (node.spec is not None and node.spec.unschedulable):
        return None
    annotations = node.metadata.annotations or {}
    return CORDON_OWNER_US if CORDON_ANNOTATION in annotations else CORDON_OWNER_OTHER


def has_stale_mark(node: Any) -> bool:
    """Our mark on a node that is not cordoned."""
    annotations = (node.metadata.annotations or {}) if node.metadata else {}
    unschedulable = node.spec is not None and bool(node.spec.unschedulable)
    return CORDON_ANNOTATION in annotations and not unschedulable


def ready_since(node: Any) -> dt.datetime | None:
    """When the node's Ready condition turned True (None while it is not
    Ready, or if the condition carries no time)."""
    for condition in (node.status.conditions or []) if node.status else []:
        if condition.type == "Ready" and condition.status == "True":
            return _aware(condition.last_transition_time)
    return None


def _aware(moment: dt.datetime | None) -> dt.datetime | None:
    """A timestamp from the API in UTC (metav1.Time is always UTC)."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=dt.UTC)


def _starts(status: Any) -> list[dt.datetime]:
    """When each container of a pod (init containers too) started, as far as
    its current and last state tell."""
    found: list[dt.datetime] = []
    for container in [
        *(status.init_container_statuses or []),
        *(status.container_statuses or []),
    ]:
        for state in (container.state, container.last_state):
            if state is None:
                continue
            for phase in (state.running, state.terminated):
                started = _aware(phase.started_at) if phase is not None else None
                if started is not None:
                    found.append(started)
    return found


def _creating(status: Any) -> bool:
    """Whether a container (or init container) still waits to be created."""
    return any(
        container.state is not None
        and container.state.waiting is not None
        and container.state.waiting.reason in CREATING_REASONS
        for container in [
            *(status.init_container_statuses or []),
            *(status.container_statuses or []),
        ]
    )


def pod_start(pod: Any) -> PodStart:
    """How far the pod got towards running its containers."""
    status = pod.status
    sandbox_ready: bool | None = None
    sandbox_changed: dt.datetime | None = None
    conditions = {c.type: c for c in (status.conditions or [])} if status else {}
    for kind in SANDBOX_CONDITIONS:
        if kind in conditions:
            sandbox_ready = conditions[kind].status == "True"
            sandbox_changed = _aware(conditions[kind].last_transition_time)
            break
    starts = _starts(status) if status is not None else []
    return PodStart(
        namespace=pod.metadata.namespace,
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        finished=pod_finished(pod),
        terminating=pod.metadata.deletion_timestamp is not None,
        sandbox_ready=sandbox_ready,
        sandbox_changed=sandbox_changed,
        creating=status is not None and _creating(status),
        start_time=_aware(status.start_time) if status is not None else None,
        last_container_start=max(starts, default=None),
        host_network=bool(pod.spec is not None and pod.spec.host_network),
    )


def not_started(pod: PodStart) -> bool:
    """Whether the pod waits for its sandbox (or, on a kubelet that does not
    report the sandbox, for its containers to be created)."""
    if pod.finished or pod.terminating:
        return False
    if pod.sandbox_ready is None:
        return pod.creating
    return not pod.sandbox_ready


def pod_event(event: Any) -> PodEvent:
    """A pod's event as core/v1 serves it: from the legacy recorder
    (firstTimestamp, lastTimestamp, count; a combined event's message
    without the recorder's prefix) or from events.k8s.io/v1 (eventTime,
    series.count, series.lastObservedTime)."""
    series = event.series
    involved = event.involved_object
    first = _aware(event.first_timestamp) or _aware(event.event_time)
    last = (
        (_aware(series.last_observed_time) if series is not None else None)
        or _aware(event.last_timestamp)
        or first
    )
    count = (series.count if series is not None else None) or event.count or 1
    message = event.message or ""
    return PodEvent(
        namespace=involved.namespace or event.metadata.namespace,
        pod=involved.name or "",
        uid=involved.uid or "",
        reason=event.reason or "",
        message=message.removeprefix(COMBINED_PREFIX),
        count=int(count),
        first=first,
        last=last,
        combined=message.startswith(COMBINED_PREFIX),
    )


def pod_ref(pod: Any) -> PodRef:
    return PodRef(
        pod.metadata.namespace,
        pod.metadata.name,
        pod.metadata.uid,
        pod.metadata.deletion_timestamp,
    )


def _status_of(err: ApiException) -> dict[str, Any]:
    """The metav1.Status the API server sent with an error, if any."""
    try:
        body = json.loads(err.body or "{}")
    except TypeError, ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _causes(status: dict[str, Any]) -> dict[str, str]:
    """Each cause's reason and message."""
    details = status.get("details") or {}
    return {
        str(cause.get("reason")): str(cause.get("message") or "")
        for cause in details.get("causes") or []
        if isinstance(cause, dict)
    }


def _retry_after(err: ApiException, status: dict[str, Any]) -> float | None:
    headers: Any = err.headers or {}
    header = headers.get("Retry-After")
    seconds = header or (status.get("details") or {}).get("retryAfterSeconds")
    try:
        return float(seconds) if seconds is not None else None
    except TypeError, ValueError:
        return None


def _api_error(err: ApiException) -> ClusterError:
    """The client's error for an API error, told apart as kubectl does
    (apierrors.IsTooManyRequests, HasStatusCause, IsNotFound, IsConflict)."""
    status = _status_of(err)
    causes = _causes(status)
    message = str(status.get("message") or f"{err.status} {err.reason}")
    code = err.status or 0
    if code == HTTP_UNAUTHORIZED:
        return ClusterAuthError(f"{code} {message}")
    if code == HTTP_FORBIDDEN:
        if CAUSE_NAMESPACE_TERMINATING in causes:
            return NamespaceTerminatingError(message)
        return ClusterAuthError(f"{code} {message}")
    if code == HTTP_NOT_FOUND:
        return NodeNotFoundError(message)
    if code == HTTP_CONFLICT:
        return ConflictError(message)
    if code == HTTP_TOO_MANY_REQUESTS:
        # A budget's refusal carries its cause; API Priority and Fairness
        # throttling does not, and is transient like a server error.
        if CAUSE_DISRUPTION_BUDGET in causes:
            return EvictionRefusedError(
                message, _retry_after(err, status), causes[CAUSE_DISRUPTION_BUDGET]
            )
        return ClusterConnectionError(f"{code} {message}", _retry_after(err, status))
    if code == HTTP_SERVER_ERROR and message == MULTIPLE_BUDGETS_MESSAGE:
        return BudgetOverlapError(f"{code} {message}")
    if code >= HTTP_SERVER_ERROR or code == 0:
        return ClusterConnectionError(f"{code} {message}", _retry_after(err, status))
    return ClusterRequestError(f"{code} {message}")


def node_view_of(
    name: str, node: Any, pods: list[Any], lease_age: float | None
) -> NodeView:
    """What GPU Handoff reads of a node: its Ready, cordon, GPUs and pods."""
    ready: bool | None = None
    for condition in (node.status.conditions or []) if node.status else []:
        if condition.type == "Ready":
            ready = condition.status == "True"
    status = node.status
    running = [pod for pod in pods if not pod_finished(pod)]
    return NodeView(
        name=name,
        ready=ready,
        unschedulable=bool(node.spec.unschedulable) if node.spec else False,
        cordon_owner=cordon_owner(node),
        lease_age=lease_age,
        gpu_capacity=_gpu_devices(status.capacity) if status else 0,
        gpu_allocatable=_gpu_devices(status.allocatable) if status else 0,
        gpu_requested=sum(_pod_gpu_request(pod) for pod in running),
        pods=len(running),
        evictable_pods=sum(1 for pod in running if is_evictable(pod)),
        stale_mark=has_stale_mark(node),
        unmanaged=tuple(
            sorted(pod_ref(pod).label for pod in running if is_unmanaged(pod))
        ),
        boot_id=boot_id_of(node),
    )


class ClusterClient:
    """One cluster: an ApiClient of its own, closed on ``close``."""

    def __init__(self, api: ApiClient) -> None:
        """Use ``create`` to build one."""
        self._api = api
        self.core = CoreV1Api(api)
        self.apps = AppsV1Api(api)
        self._coordination = CoordinationV1Api(api)
        self.policy = PolicyV1Api(api)
        self.events = EventsV1Api(api)

    @classmethod
    async def create(cls, kubeconfig_text: str) -> ClusterClient:
        """A client for the kubeconfig's current context."""
        kubeconfig = parse_kubeconfig(kubeconfig_text)
        loop = asyncio.get_running_loop()
        context = await loop.run_in_executor(None, build_ssl_context, kubeconfig)
        configuration = Configuration(host=kubeconfig.server)
        configuration.tls_server_name = kubeconfig.tls_server_name
        if kubeconfig.token is not None:
            configuration.api_key = {"BearerToken": kubeconfig.token}
            configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return cls(_ApiClient(configuration, context))

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._api.close()

    async def call(
        self, method: Any, *args: Any, timeout: float = REQUEST_TIMEOUT, **kwargs: Any
    ) -> Any:
        try:
            return await method(*args, _request_timeout=timeout, **kwargs)
        except ApiException as err:
            raise _api_error(err) from err
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise ClusterConnectionError(str(err) or type(err).__name__) from err

    async def retrying(
        self, deadline: float, method: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """``_call``, retrying transient errors with backoff until ``deadline``
        (loop time); the last error is raised once the deadline is near."""
        loop = asyncio.get_running_loop()
        delay = RETRY_START
        while True:
            remaining = deadline - loop.time()
            try:
                return await self.call(
                    method,
                    *args,
                    timeout=max(1.0, min(REQUEST_TIMEOUT, remaining)),
                    **kwargs,
                )
            except ClusterConnectionError as err:
                wait = err.retry_after if err.retry_after is not None else delay
                if loop.time() + wait >= deadline:
                    raise
                _LOGGER.debug("Retrying in %.1f s after: %s", wait, err)
                await asyncio.sleep(wait)
                delay = min(delay * 2, RETRY_MAX)

    def deadline(self, seconds: float) -> float:
        return asyncio.get_running_loop().time() + seconds

    async def node_names(self) -> list[str]:
        """Every node's name, sorted."""
        nodes = await self.call(self.core.list_node)
        return sorted(node.metadata.name for node in nodes.items)

    async def node_view(self, name: str) -> NodeView:
        """The node's readiness, cordon, lease, GPUs and pods."""
        return (await self._node_view(name))[0]

    async def boot_id(self, name: str) -> str | None:
        """The node's ``status.nodeInfo.bootID`` (one read of the Node)."""
        return boot_id_of(await self.call(self.core.read_node, name))

    async def node_reading(self, name: str) -> NodeReading:
        """The node view plus what tells whether the node works: how far each
        of its pods got towards running, and the sandbox failures recorded
        for those that have not started. Reuses the view's one pod list; the
        events of at most EVENT_PODS_MAX not-started pods are read (none on
        a node whose pods all run). A refusal to list events (an older
        ClusterRole) leaves them out."""
        node, pods, view = await self._read_node(name)
        starts = tuple(pod_start(pod) for pod in pods)
        waiting = sorted(
            (pod for pod in starts if not_started(pod)),
            key=lambda pod: (
                pod.sandbox_changed
                or pod.start_time
                or dt.datetime.max.replace(tzinfo=dt.UTC)
            ),
        )
        events: list[PodEvent] = []
        for pod in waiting[:EVENT_PODS_MAX]:
            try:
                found = await self.call(
                    self.core.list_namespaced_event,
                    pod.namespace,
                    field_selector=f"involvedObject.uid={pod.uid},type=Warning",
                )
            except ClusterError as err:
                _LOGGER.debug("No events for %s: %s", pod.label, err)
                break
            events.extend(
                pod_event(event)
                for event in found.items
                if event.reason in SANDBOX_EVENT_REASONS
            )
        return NodeReading(
            view=view,
            ready_since=ready_since(node),
            pods=starts,
            events=tuple(events),
        )

    async def wait_ready(
        self, name: str, timeout: float, *, not_boot: str | None = None
    ) -> NodeView:
        """Until the node is Ready; TimeoutError after ``timeout`` seconds.

        ``not_boot``: the bootID of a boot that does not count. A node whose
        machine was just restarted still shows the Ready its old kubelet
        posted, for up to the node monitor grace period: only the new
        kubelet's first post (a new ``status.nodeInfo.bootID``) says it is back.

        Event-driven: between reads it watches the node, so a return is not
        held up by a poll interval; when a watch fails it polls every second.
        A watch is bounded by its own timeoutSeconds and a local timeout (a
        watch can hang silently).
        """
        return await self._wait_node(
            name,
            timeout,
            lambda view: bool(view.ready) and new_boot(view, not_boot),
            f"{name} did not become Ready in {timeout:.0f} s",
        )

    async def wait_gpus(
        self, name: str, cards: int, timeout: float, *, not_boot: str | None = None
    ) -> NodeView:
        """Until the Ready node advertises ``cards`` cards (``gpus_short``:
        its device plugin registered them, under whatever names; after a
        kubelet restart they stay at zero until it does, see the kubelet's
        devicemanager GetCapacity); TimeoutError after ``timeout`` seconds.
        Event-driven as ``wait_ready``."""
        return await self._wait_node(
            name,
            timeout,
            lambda view: (
                bool(view.ready)
                and new_boot(view, not_boot)
                and not gpus_short(view, cards)
            ),
            f"{name} did not advertise {cards} GPU(s) in {timeout:.0f} s",
        )

    async def _wait_node(
        self,
        name: str,
        timeout: float,
        done: Callable[[NodeView], bool],
        why: str,
    ) -> NodeView:
        """Until ``done`` holds for the node: read, then watch for its next
        change (poll every second while watching fails)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                view, version = await self._node_view(name)
            except ClusterError:
                view, version = None, None
            if view is not None and done(view):
                return view
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(why)
            chunk = min(remaining, NODE_WATCH_CHUNK)
            try:
                if version is None:
                    raise ClusterConnectionError("no resourceVersion to watch from")
                await _next_node_event(self, name, version, chunk)
            except ClusterError, aiohttp.ClientError, OSError, ValueError:
                await asyncio.sleep(min(NODE_POLL_FALLBACK, remaining))
            except TimeoutError:
                pass  # nothing happened in this chunk: read again

    async def _node_view(self, name: str) -> tuple[NodeView, str | None]:
        node, _pods, view = await self._read_node(name)
        return view, node.metadata.resource_version

    async def _read_node(self, name: str) -> tuple[Any, list[Any], NodeView]:
        """The node, its pods, and the view made of them (and its Lease)."""
        node = await self.call(self.core.read_node, name)
        pods = await self.call(
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={name}",
        )
        lease_age: float | None = None
        try:
            lease = await self.call(
                self._coordination.read_namespaced_lease, name, LEASE_NAMESPACE
            )
        except NodeNotFoundError:
            lease = None
        if lease is not None and lease.spec.renew_time is not None:
            renewed = lease.spec.renew_time
            lease_age = max(0.0, (dt.datetime.now(dt.UTC) - renewed).total_seconds())
        view = node_view_of(name, node, pods.items, lease_age)
        return node, pods.items, view

    async def cordon(self, name: str, mark: str) -> str:
        """Cordon the node unless it already is; return whose cordon it carries.

        A node GPU Handoff cordons gets ``mark`` in its CORDON_ANNOTATION in the
        same patch, guarded by the node's resourceVersion so an operator's
        cordon placed meanwhile is never claimed as ours. A node already
        cordoned is left exactly as it is.
        """

        def change(node: Any) -> tuple[str, dict[str, Any] | None]:
            owner = cordon_owner(node)
            if owner is not None:
                return owner, None
            return CORDON_OWNER_US, {
                "metadata": {"annotations": {CORDON_ANNOTATION: mark}},
                "spec": {"unschedulable": True},
            }

        return await self._change_node(name, change)

    async def uncordon(self, name: str) -> bool:
        """Lift GPU Handoff's own cordon; never another's. True when the node
        carried our mark (the mark is removed even if someone already
        uncordoned it), False when there was nothing of ours to lift."""

        def change(node: Any) -> tuple[bool, dict[str, Any] | None]:
            if CORDON_ANNOTATION not in (node.metadata.annotations or {}):
                return False, None
            return True, {
                "metadata": {"annotations": {CORDON_ANNOTATION: None}},
                "spec": {"unschedulable": None},
            }

        return await self._change_node(name, change)

    async def forget_stale_mark(self, name: str) -> bool:
        """Remove our mark from a node that is not cordoned (someone lifted
        our cordon), guarded by the resourceVersion like every change: a
        cordon placed meanwhile is read again, and then the mark stays (it
        can no longer be told from ours). True when a mark was removed."""

        def change(node: Any) -> tuple[bool, dict[str, Any] | None]:
            if not has_stale_mark(node):
                return False, None
            return True, {"metadata": {"annotations": {CORDON_ANNOTATION: None}}}

        return await self._change_node(name, change)

    async def _change_node[T](
        self, name: str, change: Callable[[Any], tuple[T, dict[str, Any] | None]]
    ) -> T:
        """Read the node, ask ``change`` for a result and a patch (None: leave
        it), and apply the patch guarded by the resourceVersion read: if the
        node changed meanwhile (409), read it again and ask again."""
        deadline = self.deadline(CORDON_RETRY_WINDOW)
        while True:
            node = await self.retrying(deadline, self.core.read_node, name)
            result, patch = change(node)
            if patch is None:
                return result
            patch["metadata"]["resourceVersion"] = node.metadata.resource_version
            try:
                await self.retrying(deadline, self.core.patch_node, name, patch)
            except ConflictError:
                continue
            return result


async def _next_node_event(
    client: ClusterClient, name: str, version: str, seconds: float
) -> None:
    """Until the node changes after ``version`` (a watch event arrives)."""
    async with asyncio.timeout(seconds + 5):
        response = await client.call(
            client.core.list_node,
            field_selector=f"metadata.name={name}",
            watch=True,
            resource_version=version,
            timeout_seconds=max(1, int(seconds)),
            _preload_content=False,
            timeout=seconds + 5,
        )
        try:
            async for line in response.content:
                if line.strip():
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        raise ClusterConnectionError("the watch ended with an error")
                    return
            raise TimeoutError  # the watch ended with nothing to say
        finally:
            response.release()
