"""kubectl drain, as its own code does it; knows nothing about Home Assistant.

``NodeDrain(client).run`` evicts a node's pods with ``kubectl drain --ignore-daemonsets
--delete-emptydir-data --skip-wait-for-delete-timeout`` semantics (plus
``--force`` on request), through the eviction API of a ClusterClient.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
import datetime as dt
import logging
from typing import Any, Final

from kubernetes_asyncio.client import (
    V1DeleteOptions,
    V1Eviction,
    V1ObjectMeta,
    V1Preconditions,
)

from .cluster_client import (
    MIRROR_ANNOTATION,
    PAGE_SIZE,
    REQUEST_TIMEOUT,
    RETRY_MAX,
    RETRY_START,
    BudgetOverlapError,
    ClusterClient,
    ClusterConnectionError,
    ClusterError,
    ConflictError,
    DrainError,
    EvictionRefusedError,
    MultipleBudgetsError,
    NamespaceTerminatingError,
    NodeNotFoundError,
    PodRef,
    UnmanagedPodsError,
    controller_of,
    is_evictable,
    pod_finished,
    pod_ref,
    selects,
    tolerates_cordon,
)
from .cluster_events import NodeEvents
from .cluster_model import SKIP_WAIT_FOR_DELETE, DrainProgress

_LOGGER = logging.getLogger(__name__)

EVICTION_RETRY: Final = 5.0
GONE_POLL: Final = 1.0


def should_skip(pod: PodRef, skip_after: float) -> bool:
    """kubectl's shouldSkipPod: the pod's deletionTimestamp is more than
    ``skip_after`` seconds in the past, so its kubelet is not finishing it."""
    return (
        skip_after > 0
        and pod.deletion is not None
        and (dt.datetime.now(dt.UTC) - pod.deletion).total_seconds() > skip_after
    )


@dataclass(frozen=True)
class _Pace:
    """A drain's clock: its deadline (loop time) and its intervals."""

    deadline: float
    skip_after: float
    retry_interval: float
    poll_interval: float


class _DrainTimeoutError(Exception):
    """A pod's eviction or deletion did not finish before the drain's deadline."""


_REFUSED: Final = "refused by a PodDisruptionBudget"


@dataclass
class _DrainState:
    """Each pod's place in the drain, for progress and the final message."""

    waiting: dict[PodRef, str] = field(default_factory=dict)
    evicted: int = 0
    report: Callable[[DrainProgress], None] | None = None
    # uids of the pods the first listing found; None before it
    listed: set[str] | None = None
    came_back: list[str] = field(default_factory=list)

    def progress(self) -> DrainProgress:
        return DrainProgress(
            pods_left=len(self.waiting),
            evictions_refused=sum(
                1 for why in self.waiting.values() if why == _REFUSED
            ),
            evicted=self.evicted,
            came_back=tuple(self.came_back),
        )

    def chased(self, pods: list[Any]) -> list[Any]:
        """The pods of a listing the drain goes after. The first listing's
        all; in a later one, a pod that arrived since and tolerates the
        cordon is left be, as ``kubectl drain`` (which lists once) leaves
        it: kube-scheduler binds such a pod to the cordoned node again as
        soon as its controller recreates it, so chasing it never ends. It
        stops with the node. Other newcomers (a pod replaced under the same
        name, bound before the cordon) are chased."""
        if self.listed is None:
            self.listed = {pod.metadata.uid for pod in pods}
            return pods
        chased = []
        for pod in pods:
            if pod.metadata.uid in self.listed or not tolerates_cordon(pod):
                chased.append(pod)
                continue
            label = pod_ref(pod).label
            if is_evictable(pod) and label not in self.came_back:
                self.came_back.append(label)
                self.announce()
        return chased

    def set(self, pod: PodRef, why: str) -> None:
        if self.waiting.get(pod) != why:
            self.waiting[pod] = why
            self.announce()

    def gone(self, pod: PodRef) -> None:
        if self.waiting.pop(pod, None) is not None:
            self.evicted += 1
            self.announce()

    def announce(self) -> None:
        """Tell the caller how far the drain is."""
        if self.report is not None:
            self.report(self.progress())

    def describe(self) -> str:
        return ", ".join(
            f"{pod.label} ({why})"
            for pod, why in sorted(self.waiting.items(), key=lambda i: i[0].label)
        )


def _eviction(pod: PodRef) -> V1Eviction:
    """The eviction of exactly this pod (its UID as precondition)."""
    return V1Eviction(
        metadata=V1ObjectMeta(name=pod.name, namespace=pod.namespace),
        delete_options=V1DeleteOptions(preconditions=V1Preconditions(uid=pod.uid)),
    )


class NodeDrain:
    """The drain of a node through one cluster's client."""

    def __init__(self, client: ClusterClient, events: NodeEvents | None = None) -> None:
        """Nothing is evicted until ``run``; ``events`` tells the cluster
        what the drain did (cluster_events)."""
        self.client = client
        self.events = events

    async def run(
        self,
        name: str,
        timeout: float,
        progress: Callable[[DrainProgress], None] | None = None,
        *,
        force: bool = False,
        skip_after: float = SKIP_WAIT_FOR_DELETE,
        retry_interval: float = EVICTION_RETRY,
        poll_interval: float = GONE_POLL,
    ) -> DrainProgress:
        """Evict the node's pods as ``kubectl drain --ignore-daemonsets
        --delete-emptydir-data --skip-wait-for-delete-timeout`` does (plus
        ``--force`` when ``force``); the caller cordons first.

        Pods that nothing recreates make the drain fail before any eviction
        (UnmanagedPodsError) unless ``force``. Evictions a budget refuses are
        retried every ``retry_interval`` s, transient errors with backoff, and
        evicted pods are waited for until gone; all within ``timeout``. The
        node is listed again once its pods are gone, so a pod replaced under
        the same name meanwhile is evicted too; a pod that came back to the
        cordoned node tolerating its cordon is not (``came_back`` names it).
        On failure the node stays cordoned: the caller decides what to
        undo.
        """
        deadline = self.client.deadline(timeout)
        pace = _Pace(deadline, skip_after, retry_interval, poll_interval)
        state = _DrainState(report=progress)
        first_round = True
        while True:
            pods = state.chased(await self._pods_on(name, deadline))
            evict, refused = await self._to_evict(
                pods, force=force, skip_after=skip_after, deadline=deadline
            )
            if refused:
                error = UnmanagedPodsError(name, tuple(refused), state.progress())
                self._warn("DrainRefused", "Drain", f"Not drained: {error}")
                raise error
            if not evict:
                break
            if first_round and self.events is not None:
                self.events.normal(
                    "Draining",
                    "Drain",
                    f"Evicting {len(evict)} pod(s): "
                    + ", ".join(pod.label for pod in evict),
                )
            first_round = False
            try:
                await self._evict_round(name, evict, state, pace, timeout)
            except DrainError as err:
                self._warn("DrainFailed", "Drain", str(err))
                raise
        state.announce()
        if self.events is not None:
            self.events.normal(
                "Drained", "Drain", f"Drained: {state.evicted} pod(s) evicted"
            )
        return state.progress()

    def _warn(
        self, reason: str, action: str, note: str, related: PodRef | None = None
    ) -> None:
        if self.events is not None:
            self.events.warning(reason, action, note, related)

    async def _evict_round(
        self,
        name: str,
        evict: list[Any],
        state: _DrainState,
        pace: _Pace,
        timeout: float,
    ) -> None:
        """Evict ``evict`` together and wait until each is gone."""
        for pod in evict:
            state.waiting[pod] = "evicting"
        state.announce()
        try:
            async with asyncio.TaskGroup() as group:
                for pod in evict:
                    group.create_task(self._evict_and_wait(pod, state, pace))
        except* _DrainTimeoutError:
            raise DrainError(
                f"{len(state.waiting)} pod(s) still on {name} after "
                f"{timeout:.0f} s: {state.describe()}",
                state.progress(),
            ) from None
        except* ClusterError as errors:
            raise errors.exceptions[0] from None

    async def _pods_on(self, name: str, deadline: float) -> list[Any]:
        pods: list[Any] = []
        token: str | None = None
        while True:
            page = await self.client.retrying(
                deadline,
                self.client.core.list_pod_for_all_namespaces,
                field_selector=f"spec.nodeName={name}",
                limit=PAGE_SIZE,
                **({"_continue": token} if token else {}),
            )
            pods.extend(page.items)
            token = page.metadata._continue  # noqa: SLF001 - the model's field name
            if not token:
                return pods

    async def _to_evict(
        self, pods: list[Any], *, force: bool, skip_after: float, deadline: float
    ) -> tuple[list[PodRef], list[str]]:
        """kubectl drain's filters, in its order, first skip wins, as with
        --ignore-daemonsets --delete-emptydir-data (and --force when ``force``):
        pods to evict, and pods refused because nothing would recreate them."""
        evict: list[PodRef] = []
        refused: list[str] = []
        for pod in pods:
            ref = pod_ref(pod)
            if should_skip(ref, skip_after):
                continue
            owner = controller_of(pod)
            if (
                owner is not None
                and owner.kind == "DaemonSet"
                and not pod_finished(pod)
            ):
                try:
                    await self.client.retrying(
                        deadline,
                        self.client.apps.read_namespaced_daemon_set,
                        owner.name,
                        ref.namespace,
                    )
                except NodeNotFoundError:
                    # An orphaned DaemonSet pod: nothing recreates it.
                    if force:
                        evict.append(ref)
                    else:
                        refused.append(ref.label)
                continue
            if MIRROR_ANNOTATION in (pod.metadata.annotations or {}):
                continue
            if owner is None and not pod_finished(pod):
                if force:
                    evict.append(ref)
                else:
                    refused.append(ref.label)
                continue
            evict.append(ref)
        return evict, refused

    async def _evict_and_wait(
        self, pod: PodRef, state: _DrainState, pace: _Pace
    ) -> None:
        """One pod: evict it (retrying what kubectl retries), then wait until
        it is gone, replaced, or stuck terminating past ``skip_after``."""
        evicted = await self._evict(pod, state, pace)
        if evicted is not None:
            state.set(evicted, "terminating")
            await self._wait_gone(evicted, state, pace)

    async def _evict(
        self, pod: PodRef, state: _DrainState, pace: _Pace
    ) -> PodRef | None:
        """Evict the pod, retrying what kubectl retries: the pod as it is
        now once evicted (or already terminating with its namespace), None
        when it is gone or replaced already."""
        loop = asyncio.get_running_loop()
        deadline = pace.deadline
        delay = RETRY_START
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _DrainTimeoutError
            try:
                await self.client.call(
                    self.client.core.create_namespaced_pod_eviction,
                    pod.name,
                    pod.namespace,
                    _eviction(pod),
                    timeout=max(1.0, min(REQUEST_TIMEOUT, remaining)),
                )
            except NodeNotFoundError, ConflictError:
                # Gone already, or the UID precondition failed: the pod we
                # meant is gone and another has its name (the drain lists
                # the node again).
                state.gone(pod)
                return None
            except BudgetOverlapError:
                raise MultipleBudgetsError(
                    pod.label, await self._budgets_of(pod), state.progress()
                ) from None
            except EvictionRefusedError as err:
                state.set(pod, _REFUSED)
                self._warn(
                    "EvictionRefused",
                    "Evict",
                    f"Cannot evict pod {pod.label}: {err.cause or err}; tried again "
                    "until the drain's timeout",
                    pod,
                )
                wait = max(pace.retry_interval, err.retry_after or 0.0)
            except NamespaceTerminatingError:
                if pod.deletion is not None:
                    return pod  # already going, with its namespace: wait for it
                state.set(pod, "namespace terminating")
                wait = pace.retry_interval
            except ClusterConnectionError as err:
                state.set(pod, f"retrying: {err}")
                wait = err.retry_after if err.retry_after is not None else delay
                delay = min(delay * 2, RETRY_MAX)
            else:
                if self.events is not None:
                    self.events.normal(
                        "Evicted", "Evict", f"Evicted pod {pod.label}", pod
                    )
                return pod
            await asyncio.sleep(max(0.0, min(wait, deadline - loop.time())))
            fresh = await self._current(pod, state)
            if fresh is None:
                return None
            pod = fresh

    async def _current(self, pod: PodRef, state: _DrainState) -> PodRef | None:
        """As kubectl does after a retryable error: the pod as it is now, to
        evict again (it may have started terminating meanwhile); None when it
        is gone or replaced. One failed read is no reason to stop: the pod
        as it was."""
        try:
            current = await self.client.call(
                self.client.core.read_namespaced_pod, pod.name, pod.namespace
            )
        except NodeNotFoundError:
            state.gone(pod)
            return None
        except ClusterConnectionError:
            return pod
        fresh = pod_ref(current)
        if fresh.uid != pod.uid:
            state.gone(pod)
            return None
        state.waiting[fresh] = state.waiting.pop(pod)
        return fresh

    async def _budgets_of(self, pod: PodRef) -> tuple[str, ...]:
        """The PodDisruptionBudgets selecting the pod ("namespace/name"), as
        the eviction API finds them (getPodDisruptionBudgets: its namespace's
        budgets whose selector is valid, not empty, and matches its labels);
        none if they cannot be read (a ClusterRole without the list)."""
        try:
            current = await self.client.call(
                self.client.core.read_namespaced_pod, pod.name, pod.namespace
            )
            budgets = await self.client.call(
                self.client.policy.list_namespaced_pod_disruption_budget, pod.namespace
            )
        except ClusterError as err:
            _LOGGER.warning("Could not read the budgets of %s: %s", pod.label, err)
            return ()
        labels = current.metadata.labels or {}
        return tuple(
            sorted(
                f"{pod.namespace}/{budget.metadata.name}"
                for budget in budgets.items
                if budget.spec is not None and selects(budget.spec.selector, labels)
            )
        )

    async def _wait_gone(self, pod: PodRef, state: _DrainState, pace: _Pace) -> None:
        """kubectl's waitForDelete: gone when 404 or the UID changed; a pod
        whose deletion is ``skip_after`` seconds overdue is skipped."""
        loop = asyncio.get_running_loop()
        deadline = pace.deadline
        while True:
            try:
                current = await self.client.call(
                    self.client.core.read_namespaced_pod,
                    pod.name,
                    pod.namespace,
                    timeout=max(1.0, min(REQUEST_TIMEOUT, deadline - loop.time())),
                )
            except NodeNotFoundError:
                state.gone(pod)
                return
            except ClusterConnectionError:
                current = None  # one failed read is no reason to stop
            if current is not None:
                fresh = pod_ref(current)
                if fresh.uid != pod.uid or should_skip(fresh, pace.skip_after):
                    state.gone(pod)
                    return
            if loop.time() >= deadline:
                raise _DrainTimeoutError
            await asyncio.sleep(
                max(0.0, min(pace.poll_interval, deadline - loop.time()))
            )
