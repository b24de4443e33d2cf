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
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
import datetime as dt
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
    V1DeleteOptions,
    V1Eviction,
    V1ObjectMeta,
    V1Preconditions,
    rest,
)
from kubernetes_asyncio.client.exceptions import ApiException
import yaml

REQUEST_TIMEOUT: Final = 15.0
GPU_RESOURCE: Final = "nvidia.com/gpu"
LEASE_NAMESPACE: Final = "kube-node-lease"
MIRROR_ANNOTATION: Final = "kubernetes.io/config.mirror"
FINISHED_PHASES: Final = frozenset({"Succeeded", "Failed"})
HTTP_UNAUTHORIZED: Final = 401
HTTP_FORBIDDEN: Final = 403
HTTP_NOT_FOUND: Final = 404
HTTP_TOO_MANY_REQUESTS: Final = 429
PAGE_SIZE: Final = 250
EVICTION_RETRY: Final = 5.0
GONE_POLL: Final = 1.0


class ClusterError(Exception):
    """Base of every cluster error."""


class KubeconfigError(ClusterError):
    """The kubeconfig cannot be used (syntax, missing parts, unsupported auth)."""


class ClusterConnectionError(ClusterError):
    """The API server cannot be reached, or answered with a server error."""


class ClusterAuthError(ClusterError):
    """The API server refused the credentials (401) or the verb (403)."""


class NodeNotFoundError(ClusterError):
    """The node (or another object asked for) does not exist."""


class EvictionRefusedError(ClusterError):
    """429: a PodDisruptionBudget forbids the eviction now."""


class DrainError(ClusterError):
    """The drain could not finish; the node stays cordoned."""

    def __init__(self, message: str, progress: DrainProgress) -> None:
        super().__init__(message)
        self.progress = progress


@dataclass(frozen=True, kw_only=True)
class DrainProgress:
    """How far a drain is: pods still on the node, how many of them a
    PodDisruptionBudget refuses to evict right now, how many are gone."""

    pods_left: int
    evictions_refused: int
    evicted: int


@dataclass(frozen=True)
class _PodRef:
    namespace: str
    name: str
    uid: str


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


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """What the integration shows about the GPU node's Kubernetes node."""

    name: str
    ready: bool | None
    unschedulable: bool
    lease_age: float | None
    gpu_capacity: int
    gpu_allocatable: int
    gpu_requested: int
    pods: int
    evictable_pods: int


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except TypeError, ValueError:
        return 0


def _pod_gpu_request(pod: Any) -> int:
    total = 0
    for container in pod.spec.containers or []:
        resources = container.resources
        if resources is None:
            continue
        requests = resources.requests or {}
        limits = resources.limits or {}
        total += _quantity(requests.get(GPU_RESOURCE, limits.get(GPU_RESOURCE, 0)))
    return total


def is_evictable(pod: Any) -> bool:
    """Whether a drain would evict this pod (kubectl's filters, first skip wins):
    not DaemonSet-owned, not a mirror pod, not finished."""
    if _daemonset_owner(pod) is not None:
        return False
    if MIRROR_ANNOTATION in (pod.metadata.annotations or {}):
        return False
    return pod.status is None or pod.status.phase not in FINISHED_PHASES


def _daemonset_owner(pod: Any) -> str | None:
    for owner in pod.metadata.owner_references or []:
        if owner.kind == "DaemonSet" and owner.controller:
            return str(owner.name)
    return None


async def _all[T](calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run calls concurrently; on the first error cancel the rest and raise it
    (``gather`` would leave the others running behind the caller's back)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except* ClusterError as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


class ClusterClient:
    """One cluster: an ApiClient of its own, closed on ``close``."""

    def __init__(self, api: ApiClient) -> None:
        """Use ``create`` to build one."""
        self._api = api
        self._core = CoreV1Api(api)
        self._apps = AppsV1Api(api)
        self._coordination = CoordinationV1Api(api)

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

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except ApiException as err:
            if err.status in (HTTP_UNAUTHORIZED, HTTP_FORBIDDEN):
                raise ClusterAuthError(f"{err.status} {err.reason}") from err
            if err.status == HTTP_NOT_FOUND:
                raise NodeNotFoundError(str(err.reason)) from err
            if err.status == HTTP_TOO_MANY_REQUESTS:
                raise EvictionRefusedError(str(err.reason)) from err
            raise ClusterConnectionError(f"{err.status} {err.reason}") from err
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise ClusterConnectionError(str(err) or type(err).__name__) from err

    async def node_names(self) -> list[str]:
        """Every node's name, sorted."""
        nodes = await self._call(self._core.list_node)
        return sorted(node.metadata.name for node in nodes.items)

    async def node_view(self, name: str) -> NodeView:
        """The node's readiness, cordon, lease, GPUs and pods."""
        node = await self._call(self._core.read_node, name)
        pods = await self._call(
            self._core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={name}",
        )
        lease_age: float | None = None
        try:
            lease = await self._call(
                self._coordination.read_namespaced_lease, name, LEASE_NAMESPACE
            )
        except NodeNotFoundError:
            lease = None
        if lease is not None and lease.spec.renew_time is not None:
            renewed = lease.spec.renew_time
            lease_age = max(0.0, (dt.datetime.now(dt.UTC) - renewed).total_seconds())
        ready: bool | None = None
        for condition in (node.status.conditions or []) if node.status else []:
            if condition.type == "Ready":
                ready = condition.status == "True"
        status = node.status
        running = [
            pod
            for pod in pods.items
            if pod.status is None or pod.status.phase not in FINISHED_PHASES
        ]
        return NodeView(
            name=name,
            ready=ready,
            unschedulable=bool(node.spec.unschedulable) if node.spec else False,
            lease_age=lease_age,
            gpu_capacity=_quantity((status.capacity or {}).get(GPU_RESOURCE, 0))
            if status
            else 0,
            gpu_allocatable=_quantity((status.allocatable or {}).get(GPU_RESOURCE, 0))
            if status
            else 0,
            gpu_requested=sum(_pod_gpu_request(pod) for pod in running),
            pods=len(running),
            evictable_pods=sum(1 for pod in running if is_evictable(pod)),
        )

    async def cordon(self, name: str) -> None:
        """Mark the node unschedulable (idempotent)."""
        await self._call(self._core.patch_node, name, {"spec": {"unschedulable": True}})

    async def uncordon(self, name: str) -> None:
        """Let the node take pods again (idempotent)."""
        await self._call(self._core.patch_node, name, {"spec": {"unschedulable": None}})

    async def _pods_on(self, name: str) -> list[Any]:
        pods: list[Any] = []
        token: str | None = None
        while True:
            page = await self._call(
                self._core.list_pod_for_all_namespaces,
                field_selector=f"spec.nodeName={name}",
                limit=PAGE_SIZE,
                **({"_continue": token} if token else {}),
            )
            pods.extend(page.items)
            token = page.metadata._continue  # noqa: SLF001 - the model's field name
            if not token:
                return pods

    async def _to_evict(self, pods: list[Any]) -> list[_PodRef]:
        """kubectl's drain filters. A DaemonSet pod is skipped only while its
        DaemonSet exists (an orphan is evicted like any other pod)."""
        refs: list[_PodRef] = []
        for pod in pods:
            if MIRROR_ANNOTATION in (pod.metadata.annotations or {}):
                continue
            if pod.status is not None and pod.status.phase in FINISHED_PHASES:
                continue
            daemonset = _daemonset_owner(pod)
            if daemonset is not None:
                try:
                    await self._call(
                        self._apps.read_namespaced_daemon_set,
                        daemonset,
                        pod.metadata.namespace,
                    )
                except NodeNotFoundError:
                    pass
                else:
                    continue
            refs.append(
                _PodRef(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid)
            )
        return refs

    async def _evict(self, pod: _PodRef) -> bool:
        """Ask to evict; False when a PodDisruptionBudget refuses it for now."""
        body = V1Eviction(
            metadata=V1ObjectMeta(name=pod.name, namespace=pod.namespace),
            delete_options=V1DeleteOptions(preconditions=V1Preconditions(uid=pod.uid)),
        )
        try:
            await self._call(
                self._core.create_namespaced_pod_eviction, pod.name, pod.namespace, body
            )
        except EvictionRefusedError:
            return False
        except NodeNotFoundError:
            pass  # the pod is gone already
        return True

    async def _is_gone(self, pod: _PodRef) -> bool:
        try:
            current = await self._call(
                self._core.read_namespaced_pod, pod.name, pod.namespace
            )
        except NodeNotFoundError:
            return True
        return bool(current.metadata.uid != pod.uid)

    async def drain(
        self,
        name: str,
        timeout: float,
        progress: Callable[[DrainProgress], None] | None = None,
        *,
        retry_interval: float = EVICTION_RETRY,
        poll_interval: float = GONE_POLL,
    ) -> DrainProgress:
        """Cordon the node and evict its pods as ``kubectl drain`` does
        (--ignore-daemonsets --delete-emptydir-data): evictions a
        PodDisruptionBudget refuses are retried every ``retry_interval`` seconds,
        and evicted pods are waited for until gone, all within ``timeout``.
        On failure the node stays cordoned; the caller decides what to undo."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self.cordon(name)
        pending = await self._to_evict(await self._pods_on(name))
        evicting: list[_PodRef] = []
        evicted = 0
        refused = 0

        def report() -> DrainProgress:
            state = DrainProgress(
                pods_left=len(pending) + len(evicting),
                evictions_refused=refused,
                evicted=evicted,
            )
            if progress is not None:
                progress(state)
            return state

        report()
        while pending or evicting:
            results = await _all(self._evict(pod) for pod in pending)
            refused_now = [
                pod for pod, ok in zip(pending, results, strict=True) if not ok
            ]
            evicting += [pod for pod, ok in zip(pending, results, strict=True) if ok]
            refused = len(refused_now)
            pending = refused_now
            gone = await _all(self._is_gone(pod) for pod in evicting)
            evicted += sum(gone)
            evicting = [
                pod for pod, done in zip(evicting, gone, strict=True) if not done
            ]
            state = report()
            if not (pending or evicting):
                break
            if loop.time() >= deadline:
                raise DrainError(
                    f"{state.pods_left} pod(s) still on {name} after {timeout:.0f} s"
                    f" ({len(pending)} refused by a PodDisruptionBudget)",
                    state,
                )
            await asyncio.sleep(
                min(
                    retry_interval if pending else poll_interval,
                    max(0.0, deadline - loop.time()),
                )
            )
        return report()
