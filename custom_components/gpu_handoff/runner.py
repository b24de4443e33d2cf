"""The operation runner: drain, tower job, node back; no Home Assistant imports.

It does the work of one operation with the tower and cluster clients and
tells its host (the controller, which keeps storage, events and repairs) what
happens through a small interface. Tower jobs are asked for under a request
id that the host stores before the request is sent; a reply lost on the way
is followed by a look-up of that id, so a job is never asked for twice and
nothing is rolled back while a job this side asked for may still run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
import contextlib
from dataclasses import dataclass, replace
import logging
import secrets
from typing import Final, Protocol

from . import health
from .cluster_client import ClusterClient, ClusterError, gpus_short
from .cluster_model import CORDON_OWNER_OTHER, DrainProgress, NodeView
from .const import PHASE_DRAINING, PHASE_RETURNING, PHASE_STOPPING
from .core import (
    JobFacts,
    PendingJob,
    Settings,
    returns_after_stop,
    stop_names,
    stop_releases,
)
from .health import UnhealthyReturn
from .protocol import (
    REQUESTED_BY_HOOK,
    RUNNING,
    SHUT_OFF,
    JobKind,
    JobRecord,
    JobState,
    StepName,
    TowerStatus,
)
from .tower_client import AgentCommandError, TowerClient, TowerConnectionError

_LOGGER = logging.getLogger(__name__)

# How long a job may be followed through tower outages before giving up.
JOB_WAIT_MAX: Final = 1800.0
# While the session is down, job progress is polled this often.
JOB_POLL: Final = 1.0
# With the session up, progress is pushed; a job silent this long is re-read.
JOB_SILENCE: Final = 10.0
NODE_READY_TIMEOUT: Final = 900.0
RETRY_START: Final = 0.5
RETRY_MAX: Final = 10.0

# The agent's job steps, as the steps a user sees.
AGENT_STEPS: Final = {
    StepName.WAIT_AGENT: "waiting_for_guest_agent",
    StepName.SHUTDOWN: "stopping",
    StepName.WAIT_SHUT_OFF: "stopping",
    StepName.WAIT_DEVICES_FREE: "waiting_for_cards",
    StepName.START: "starting",
    StepName.START_FREE: "starting",
}


class RunnerError(Exception):
    """An operation cannot go on; ``key`` names the translated message."""

    def __init__(self, key: str, message: str, **placeholders: str) -> None:
        super().__init__(message)
        self.key = key
        self.code = key
        self.placeholders = placeholders


class JobFailedError(Exception):
    """A tower job ended in failure."""

    def __init__(self, record: JobRecord) -> None:
        error = record.job.error
        super().__init__(error.message if error else "the tower job failed")
        self.code = error.code if error else "job_failed"
        self.record = record


@dataclass(frozen=True, kw_only=True)
class DoneJob:
    """A tower job followed to its end, and the GPU node's bootID before it."""

    record: JobRecord
    boot_before: str | None

    def booted(self, gpu_node: str) -> str | None:
        """The boot that no longer counts when the job started the GPU node
        (None when it did not, or the bootID was not known)."""
        started = self.record.did(StepName.START, gpu_node) or self.record.did(
            StepName.START_FREE, gpu_node
        )
        return self.boot_before if started else None


# Jobs that may start the GPU node.
STARTS_GPU_NODE: Final = frozenset({JobKind.RELEASE, JobKind.LEND})


def new_request_id() -> str:
    """A request id the agent accepts (and no one else will choose)."""
    return f"ha-{secrets.token_hex(12)}"


class RunnerHost(Protocol):
    """What the runner tells, and asks of, its host."""

    def step(self, step: str) -> None:
        """The operation is at ``step``."""

    def phase(self, phase: str) -> None:
        """The GPU node is at ``phase`` (PHASE_*) of the operation."""

    def drain_progress(self, progress: DrainProgress) -> None:
        """How far the drain is."""

    def show_node(self, view: NodeView) -> None:
        """The node as the runner just saw it."""

    def show_cordon(self, owner: str | None) -> None:
        """The cordon as the runner just left it."""

    def show_tower(self, status: TowerStatus) -> None:
        """The tower as the runner just read it."""

    @property
    def pending_job(self) -> PendingJob | None:
        """The tower job the stored operation asked for, if any."""

    async def save_job(self, job: PendingJob | None) -> None:
        """Store the tower job before it is asked for, and once it is known."""


def check_operator_cordon(owner: str | None, settings: Settings, node: str) -> None:
    """Refuse to hand off on top of someone else's cordon unless the user
    chose to (an administrator's drain, an upgrade controller's cordon)."""
    if owner == CORDON_OWNER_OTHER and not settings.handoff_when_cordoned:
        raise RunnerError(
            "cordoned_by_operator",
            f"the GPU node {node} is cordoned by someone else",
            node=node,
        )


def node_holds_cards_of(status: TowerStatus, vm: str) -> bool:
    """Whether the GPU node holds a card ``vm`` is defined with."""
    target = status.domains.get(vm)
    return target is not None and any(
        card.held_by == status.gpu_node and card.address in target.cards
        for card in status.cards
    )


def card_of(address: str) -> str:
    """The card a PCI function belongs to (``0000:03:00.1`` -> ``0000:03:00``)."""
    return address.rsplit(".", 1)[0]


def free_cards(status: TowerStatus) -> set[str]:
    """The GPU node's own cards (its persistent definition's) that no other
    running domain holds, nor a function of their IOMMU group (libvirt passes
    a group through whole; on a board without ACS two cards can share one):
    what it can run with now."""
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return set()
    elsewhere = [
        card
        for card in status.cards
        if card.held_by is not None and card.held_by != status.gpu_node
    ]
    groups = {card.iommu_group for card in elsewhere} - {None}
    taken = {card_of(card.address) for card in elsewhere} | {
        card_of(card.address) for card in status.cards if card.iommu_group in groups
    }
    return {card_of(address) for address in gpu.defined_cards} - taken


def cards_in_play(status: TowerStatus) -> bool:
    """Whether a running gaming VM holds one of the GPU node's cards (the GPU
    node cannot start then: libvirt refuses a PCI function in use)."""
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return False
    held = set(gpu.cards)
    return any(
        (domain := status.domains.get(vm)) is not None
        and domain.state == RUNNING
        and held & set(domain.cards)
        for vm in status.gaming
    )


def can_run(status: TowerStatus, settings: Settings) -> bool:
    """Whether the GPU node can run now: with every card of its definition,
    or, lending, with the free ones (at least one)."""
    if settings.lend_free:
        return bool(free_cards(status))
    return not cards_in_play(status)


def serves_free_cards(status: TowerStatus) -> bool:
    """Whether the GPU node runs with exactly the cards nobody plays with
    (lending at rest), or is off with none free."""
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return True
    free = free_cards(status)
    if gpu.state != RUNNING:
        return not free
    return {card_of(address) for address in gpu.cards} == free


def gpu_node_undisturbed(status: TowerStatus) -> bool:
    """Whether the GPU node runs and no tower job may stop it (a start by
    hand on the tower has libvirt's hook stop it for the player)."""
    gpu = status.domains.get(status.gpu_node)
    return (
        gpu is not None
        and gpu.state == RUNNING
        and status.job_for(status.gpu_node) is None
    )


def gpu_node_disturbed(status: TowerStatus) -> bool:
    """Whether the GPU node is off, or a tower job may stop it."""
    return not gpu_node_undisturbed(status)


def gpu_node_off(status: TowerStatus) -> bool:
    """Whether the GPU node is shut off (or gone)."""
    gpu = status.domains.get(status.gpu_node)
    return gpu is None or gpu.state == SHUT_OFF


async def lift_own_cordon_if_serving(
    tower: TowerClient, cluster: ClusterClient, k8s_node: str
) -> bool:
    """Lift GPU Handoff's own cordon if the GPU node runs and no tower job may
    still stop it; an operator's cordon is never touched. True if lifted."""
    if not gpu_node_undisturbed(await tower.status()):
        return False
    return await cluster.uncordon(k8s_node)


class OperationRunner:
    """Runs the steps of handoffs and returns for one tower."""

    # Set by the last return whose GPU node came back short of its GPUs.
    returned_unhealthy: UnhealthyReturn | None = None
    # What the tower jobs of the running operation did (their records) and
    # the pods its drain left on the cordoned node because they came back
    # tolerating its cordon; its host starts each operation with new ones.
    facts: JobFacts = JobFacts()

    def __init__(
        self,
        tower: TowerClient,
        cluster: ClusterClient,
        *,
        gpu_node: str,
        k8s_node: str,
        host: RunnerHost,
    ) -> None:
        """Nothing runs until an operation is called."""
        self.tower = tower
        self.cluster = cluster
        self.gpu_node = gpu_node
        self.k8s_node = k8s_node
        self._host = host
        self._records: dict[str, JobRecord] = {}
        self._shown: dict[str, int] = {}  # steps shown, by job id
        self._pushed = asyncio.Event()
        self._pushes = 0  # records pushed so far

    # --- pushed job progress ---------------------------------------------------

    def job_pushed(self, record: JobRecord) -> None:
        """A job record the session pushed (any job; the follower picks its own)."""
        self._records[record.job.id] = record
        self._pushes += 1
        self._pushed.set()

    # --- operations ----------------------------------------------------------

    async def handoff(
        self, vm: str, settings: Settings, *, hook_job: str | None = None
    ) -> None:
        """Give ``vm`` its cards: drain and stop the GPU node if it holds them,
        then start ``vm``. A failure leaves the rest to ``settle_failed_handoff``.
        A handoff for a start by hand (``hook_job``: the stop of the GPU node
        libvirt's hook asked for) reads that job's record too: whether the
        GPU node is off because of it is what it says, not a guess."""
        await self._hand_over(vm, settings)
        if hook_job is not None:
            await self._read_hook_job(hook_job)

    async def _hand_over(self, vm: str, settings: Settings) -> None:
        pending = self._host.pending_job
        if pending is not None:
            # Resume: the stored job, whatever the tower looks like now.
            if pending.kind is JobKind.HANDOFF:
                self._host.phase(PHASE_STOPPING)
            await self._job(pending.kind, pending.domain)
            return
        status = await self.tower.status()
        if status.domains[vm].state == RUNNING:
            return
        node_holds = node_holds_cards_of(status, vm)
        if node_holds:
            await self._drain(f"handoff to {vm}", settings)
            self._host.phase(PHASE_STOPPING)
        await self._job(JobKind.HANDOFF if node_holds else JobKind.START, vm)

    async def read_hook_jobs(self, job_ids: Iterable[str]) -> None:
        """Add what these jobs of libvirt's hook did to the operation's facts
        (the starts by hand it supersedes: their stops of the GPU node were
        asked for GPU Handoff, and count as its own)."""
        for job_id in sorted(set(job_ids)):
            await self._read_hook_job(job_id)

    async def _read_hook_job(self, job_id: str) -> None:
        """Add what the hook's job did to the operation's facts (followed to
        its end); a tower that cannot say leaves them as they are."""
        try:
            record = await self._follow(job_id)
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning("Could not read the hook's job %s: %s", job_id, err)
            return
        self.facts = self.facts.with_record(record, self.gpu_node)

    async def settle_failed_handoff(
        self, stopped_by_us: bool, settings: Settings, hook_job: str | None = None
    ) -> bool:
        """After a failed handoff: leave the GPU node serving or say it must be
        started again. True when the cards must go back to the cluster (a
        return follows).

        ``stopped_by_us``: the handoff's own job shut the GPU node down (its
        record says so: a shutdown step skipped because the GPU node was off
        already did nothing). A stop of the GPU node that libvirt's hook
        started for a gaming VM started by hand (``hook_job``; or, for an
        operation stored before hook jobs were, any hook job running now) is
        followed to its end and counts when it shut the GPU node down. A GPU
        node that still runs is uncordoned (our own cordon only). A GPU node
        shut down by someone else stays as it is, and so does one that
        cannot run now: every card a running gaming VM holds (lending: it
        runs with the free ones).
        """
        try:
            status = await self.tower.status()
            if hook_job is None:
                job = status.job_for(self.gpu_node)
                if job is not None and job.requested_by == REQUESTED_BY_HOOK:
                    hook_job = job.id
            if hook_job is not None:
                record = await self._follow(hook_job)
                # What it did counts as the operation's (core.returns_after).
                self.facts = self.facts.with_record(record, self.gpu_node)
                stopped_by_us = stopped_by_us or record.did(
                    StepName.SHUTDOWN, self.gpu_node
                )
                status = await self.tower.status()
            gpu = status.domains.get(self.gpu_node)
            if gpu is not None and gpu.state == RUNNING:
                await self.uncordon_if_serving()
                return False
            return (
                stopped_by_us
                and gpu is not None
                and gpu.state == SHUT_OFF
                and status.job_for(self.gpu_node) is None
                and can_run(status, settings)
            )
        except (TowerConnectionError, AgentCommandError, ClusterError) as err:
            # The tower cannot tell: when GPU Handoff may have stopped the GPU
            # node, the return decides (it reads the tower again, and fails
            # with a report if the tower is still away).
            _LOGGER.warning("Could not settle the failed handoff: %s", err)
            return stopped_by_us

    async def _drain(self, reason: str, settings: Settings) -> None:
        """Cordon the GPU node's node (marking the cordon as ours), then drain
        it as kubectl does."""
        self._host.phase(PHASE_DRAINING)
        self._host.step("draining")
        owner = await self.cluster.cordon(self.k8s_node, reason)
        self._host.show_cordon(owner)
        check_operator_cordon(owner, settings, self.k8s_node)
        progress = await self._first(
            self.cluster.drain(
                self.k8s_node,
                settings.drain_timeout,
                self._host.drain_progress,
                force=settings.evict_unmanaged,
                skip_after=settings.skip_wait,
            ),
            self._until_tower(gpu_node_off),
        )
        if progress is None:
            # The GPU node went off meanwhile (libvirt's hook stops it for a
            # start by hand; or its operator did): the pods left on it can
            # never finish terminating (a kubelet that is down deletes
            # nothing), so waiting for them would only hold the player up.
            _LOGGER.info(
                "%s: the GPU node shut off during the drain; pods still on it "
                "stop with it",
                self.k8s_node,
            )
            return
        if progress.came_back:
            self.facts = replace(self.facts, pods_came_back=progress.came_back)
            _LOGGER.info(
                "%s: not evicted again, they came back to the cordoned node "
                "tolerating its cordon and stop with it: %s",
                self.k8s_node,
                ", ".join(progress.came_back),
            )

    async def stop(
        self, vm: str, settings: Settings, *, gpu_stopped_by_us: bool = False
    ) -> bool:
        """Stop ``vm``; True when the cards went back to the cluster too
        (``gpu_stopped_by_us``: the GPU node is off because a tower job of
        GPU Handoff's shut it down; see core.stop_releases)."""
        pending = self._host.pending_job
        if pending is not None:
            # Resume the job the stored operation asked for.
            done = await self._job(pending.kind, pending.domain)
            if pending.kind is not JobKind.RELEASE:
                return await self._return_if_nobody_plays(
                    vm, settings, gpu_stopped_by_us
                )
            return await self._node_back(done)
        status = await self.tower.status()
        named = stop_names(status, vm)
        if not stop_releases(status, vm, settings, gpu_stopped_by_us=gpu_stopped_by_us):
            if named is not None:
                await self._job(JobKind.STOP, named)
            return await self._return_if_nobody_plays(vm, settings, gpu_stopped_by_us)
        # Nobody else plays: stop the VM and start the GPU node in one job.
        # The return begins now (the Handoff state goes to `starting` and
        # only forward from there, whatever the snapshot lags behind).
        self._host.phase(PHASE_RETURNING)
        return await self._node_back(await self._job(JobKind.RELEASE, named))

    async def _return_if_nobody_plays(
        self, vm: str, settings: Settings, gpu_stopped_by_us: bool
    ) -> bool:
        """After a stop that began while someone else played: the cards go
        back now if core.returns_after_stop says so. True when they went
        back."""
        if not settings.auto_return or settings.lend_free:
            return False
        status = await self.tower.status()
        if not returns_after_stop(
            status,
            vm,
            settings,
            facts=self.facts,
            gpu_stopped_by_us=gpu_stopped_by_us,
        ):
            return False
        self._host.phase(PHASE_RETURNING)
        return await self._node_back(await self._job(JobKind.RELEASE, None))

    async def return_cards(self, settings: Settings) -> bool:
        """Start the GPU node if it is off, wait until its node is Ready, and
        lift our own cordon. Lending: restart it with every card nobody plays
        with (none free: it stays off). True when the cluster has cards back."""
        self._host.phase(PHASE_RETURNING)
        pending = self._host.pending_job
        done: DoneJob | None = None
        if pending is None and settings.lend_free:
            lent, done = await self._lend(settings)
            if not lent:
                return False
        else:
            status = await self.tower.status()
            gpu = status.domains[status.gpu_node]
            if pending is not None or gpu.state != RUNNING:
                done = await self._job(JobKind.RELEASE, None)
        return await self._node_back(done)

    async def _lend(self, settings: Settings) -> tuple[bool, DoneJob | None]:
        """Have the GPU node run with every free card: as it is if it does
        already; else drained, stopped through its guest agent and started
        again with them (a live-only definition on the tower: its persistent
        one never changes). False when no card is free (it stays off); the
        lend job, when one ran."""
        status = await self.tower.status()
        gpu = status.domains[status.gpu_node]
        free = free_cards(status)
        if gpu.state == RUNNING:
            if {card_of(address) for address in gpu.cards} >= free:
                return True, None
            await self._drain("lending the cards nobody plays with", settings)
            self._host.phase(PHASE_RETURNING)
        elif not free:
            return False, None
        self._check_agent_lends()
        done = await self._job(JobKind.LEND, None)
        return bool(free), done

    def _check_agent_lends(self) -> None:
        """An agent older than lending (0.3.0) has no `lend`: say so before
        anything is asked of it (with the session down, its answer says it)."""
        session = self.tower.session
        if (
            session is not None
            and not session.closed
            and JobKind.LEND.value not in session.hello.verbs
        ):
            raise RunnerError(
                "agent_cannot_lend",
                f"the agent on the tower ({session.hello.version}) cannot lend "
                "cards yet: update it to the version this integration ships",
                version=session.hello.version,
            )

    async def finish_job(self) -> None:
        """Follow the stored job to its end (an operation being abandoned)."""
        pending = self._host.pending_job
        if pending is not None:
            await self._job(pending.kind, pending.domain)

    async def _node_back(self, done: DoneJob | None) -> bool:
        """Wait until the GPU node's Kubernetes node is Ready and advertises
        the GPUs the GPU node holds, then lift our own cordon (a drain's
        cordon survives the node's reboot); an operator's cordon stays.

        Ready is not enough: after a restart the kubelet advertises no GPU
        device (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``,
        ``nvidia.com/mig-*``) until the device plugin registers the cards
        (``cluster_client.gpus_short``). That wait is bounded (health.GPUS_BOUND); a node still short then is given
        back all the same (it runs other pods), and ``returned_unhealthy``
        says the cluster did not get its cards back.

        After a job that started the GPU node (``done``), only a Ready from a
        later boot counts: the node keeps the Ready its old kubelet posted
        until kube-controller-manager's node monitor grace period ends (the
        kubelet of a VM shut down posts nothing), and so do its GPUs.

        The cards are back only if the GPU node still runs when the wait is
        over, with no tower job acting on it: a start by hand meanwhile (the
        hook stops the GPU node for that player) has taken them again, and
        the node's Ready and GPUs are only what its kubelet last posted. Then
        our cordon stays (the handoff that follows needs it) and the return
        ends without them: False.
        """
        self.returned_unhealthy = None
        self._host.phase(PHASE_RETURNING)
        self._host.step("waiting_for_node")
        old_boot = done.booted(self.gpu_node) if done is not None else None
        try:
            view = await self.cluster.wait_ready(
                self.k8s_node, NODE_READY_TIMEOUT, not_boot=old_boot
            )
        except TimeoutError as err:
            raise RunnerError(
                "node_not_ready",
                f"{self.k8s_node} did not become Ready within {NODE_READY_TIMEOUT:.0f} s",
            ) from err
        self._host.show_node(view)
        try:
            expected = (await self.tower.status()).gpus_held_by(self.gpu_node)
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning(
                "Not waiting for the GPUs: the tower did not answer: %s", err
            )
            expected = 0
        if gpus_short(view, expected):
            self._host.step("waiting_for_gpus")
            try:
                found = await self._gpus_unless_stopped(expected, old_boot)
                if found is None:
                    return self._overtaken()
                view = found
            except TimeoutError:
                with contextlib.suppress(ClusterError):
                    view = await self.cluster.node_view(self.k8s_node)
                if gpus_short(view, expected):
                    self.returned_unhealthy = UnhealthyReturn(
                        reason=health.GPUS_MISSING,
                        expected=expected,
                        allocatable=view.gpu_allocatable,
                        capacity=view.gpu_capacity,
                    )
                    _LOGGER.warning(
                        "%s: %s", self.k8s_node, self.returned_unhealthy.message
                    )
            self._host.show_node(view)
        try:
            overtaken = not gpu_node_undisturbed(await self.tower.status())
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning("Could not read the tower before the uncordon: %s", err)
            overtaken = False
        if overtaken:
            return self._overtaken()
        self._host.step("uncordoning")
        if await self.cluster.uncordon(self.k8s_node):
            self._host.show_cordon(None)
        return True

    def _overtaken(self) -> bool:
        """The return ends without the cards: a tower job stops the GPU node
        again (a start by hand on the tower); our cordon stays for the
        handoff that follows."""
        _LOGGER.info(
            "The cards did not go back: the GPU node is stopping again "
            "(a start by hand on the tower); %s stays cordoned",
            self.k8s_node,
        )
        self.returned_unhealthy = None
        return False

    async def _gpus_unless_stopped(
        self, cards: int, old_boot: str | None
    ) -> NodeView | None:
        """The node once it advertises ``cards`` cards (TimeoutError past
        health.GPUS_BOUND), or None as soon as a tower job acts on the GPU
        node: its GPUs cannot come then, and the start by hand that stops it
        must not wait for the bound."""
        return await self._first(
            self.cluster.wait_gpus(
                self.k8s_node, cards, health.GPUS_BOUND, not_boot=old_boot
            ),
            self._until_tower(gpu_node_disturbed),
        )

    @staticmethod
    async def _first[T](work: Awaitable[T], until: Awaitable[None]) -> T | None:
        """``work``'s result, or None as soon as ``until`` ends first (``work``
        is cancelled then); an error of ``work`` is raised."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(until)
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for each in (task, stop):
                if not each.done():
                    each.cancel()
            await asyncio.gather(task, stop, return_exceptions=True)
        if task.done() and not task.cancelled():
            return task.result()
        return None

    async def _until_tower(self, seen: Callable[[TowerStatus], bool]) -> None:
        """Until the tower's status is ``seen``. It is read at once, after
        every push (a job that began and ended between two looks is still
        seen: the GPU node it stopped is off), every JOB_POLL seconds while no
        session pushes, and every JOB_SILENCE seconds while one does (a push
        may be lost with a session cut)."""
        loop = asyncio.get_running_loop()
        while True:
            pushes = self._pushes
            read_at = loop.time()
            try:
                status = await self.tower.status()
            except TowerConnectionError, AgentCommandError:
                status = None
            if status is not None and seen(status):
                return
            self._forget_ended(status)
            while self._pushes == pushes:
                bound = JOB_SILENCE if self._session_up() else JOB_POLL
                left = read_at + bound - loop.time()
                if left <= 0:
                    break
                self._pushed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, JOB_POLL)):
                        await self._pushed.wait()

    def _forget_ended(self, status: TowerStatus | None) -> None:
        """Drop the pushed records nobody follows any more: ended jobs, and
        active ones the tower no longer runs (their end was never pushed)."""
        running = {job.id for job in status.active_jobs} if status is not None else None
        for job_id, record in list(self._records.items()):
            if job_id in self._shown:
                continue  # a job being followed: its follower pops it
            if not record.job.state.active or (
                running is not None and job_id not in running
            ):
                self._records.pop(job_id, None)

    async def uncordon_if_serving(self) -> None:
        """Roll back our own cordon when the GPU node still runs (it was never
        stopped) and no tower job may still stop it."""
        try:
            if await lift_own_cordon_if_serving(
                self.tower, self.cluster, self.k8s_node
            ):
                self._host.show_cordon(None)
        except (TowerConnectionError, AgentCommandError, ClusterError) as err:
            _LOGGER.warning("Could not lift the cordon after a failed handoff: %s", err)

    # --- tower jobs ----------------------------------------------------------

    async def _job(self, kind: JobKind, domain: str | None) -> DoneJob:
        """Ask for a tower job of ``kind`` (or pick up the one the stored
        operation asked for, whatever its kind) and follow it to its end; its
        steps show as the operation's."""
        pending = self._host.pending_job
        if pending is None:
            pending = PendingJob(
                kind=kind,
                domain=domain,
                request_id=new_request_id(),
                boot_id=await self._boot_id() if kind in STARTS_GPU_NODE else None,
            )
            await self._host.save_job(pending)  # stored before it is sent
        job_id = pending.job_id
        if job_id is None:
            job_id = await self._submit(pending)
            await self._host.save_job(replace(pending, job_id=job_id))
        record = await self._follow(job_id)
        self.facts = self.facts.with_record(record, self.gpu_node)
        await self._host.save_job(None)
        if record.job.state is JobState.FAILED:
            raise JobFailedError(record)
        # What the job did, shown before the next step (a push may lag it).
        with contextlib.suppress(TowerConnectionError, AgentCommandError):
            self._host.show_tower(await self.tower.status())
        return DoneJob(record=record, boot_before=pending.boot_id)

    async def _boot_id(self) -> str | None:
        """The GPU node's bootID now (None when the cluster cannot say: then
        any Ready counts, as before bootIDs were read)."""
        try:
            return await self.cluster.boot_id(self.k8s_node)
        except ClusterError as err:
            _LOGGER.warning("Could not read %s's bootID: %s", self.k8s_node, err)
            return None

    async def _submit(self, pending: PendingJob) -> str:
        """The job id for ``pending``'s request id: asked for, or, after a reply
        that did not come, looked up. Tries until it knows (bounded by
        JOB_WAIT_MAX): while it does not, a job may run, so nothing here gives
        up early and nothing is rolled back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOB_WAIT_MAX
        delay = RETRY_START
        ask = True
        while True:
            try:
                if ask:
                    submitted = await self.tower.submit(
                        pending.kind, pending.domain, pending.request_id
                    )
                    return submitted.id
                found = await self.tower.find_request(pending.request_id)
                if found is not None:
                    return found.job.id
                ask = True  # never made: asking again under the same id is safe
                continue
            except TowerConnectionError as err:
                if loop.time() > deadline:
                    raise
                _LOGGER.info(
                    "No answer about job request %s (%s); looking it up",
                    pending.request_id,
                    err,
                )
                ask = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _follow(self, job_id: str) -> JobRecord:
        """Follow a job to its end: from the session's pushes while it is open,
        by reading it while it is not (and once after each reconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOB_WAIT_MAX
        read_under: object = None  # the session the last read was made under
        record: JobRecord | None = None
        while True:
            session = self.tower.session if self._session_up() else None
            if session is None or session is not read_under or record is None:
                # No session, a new one, or nothing known: read the job.
                try:
                    record = await self.tower.job(job_id)
                except TowerConnectionError:
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(JOB_POLL)
                    continue
                read_under = session
                # What was read is newer than anything pushed before it.
                self._records.pop(job_id, None)
            pushed = self._records.get(job_id) if session is not None else None
            if pushed is not None:
                record = pushed
            self._show(record)
            if not record.job.state.active:
                self._records.pop(job_id, None)
                self._shown.pop(job_id, None)
                return record
            if session is None:
                await asyncio.sleep(JOB_POLL)
                continue
            try:
                async with asyncio.timeout(JOB_SILENCE):
                    await self._next_push(job_id, record)
            except TimeoutError:
                record = None  # silent for long: read it again

    async def _next_push(self, job_id: str, seen: JobRecord) -> None:
        """Until a newer record of ``job_id`` is pushed, or the session ends."""
        while self._records.get(job_id) in (None, seen) and self._session_up():
            self._pushed.clear()
            await self._pushed.wait()

    def wake(self) -> None:
        """The session opened or ended: followers look again."""
        self._pushed.set()

    def _session_up(self) -> bool:
        session = self.tower.session
        return session is not None and not session.closed

    def _show(self, record: JobRecord) -> None:
        """Every step the job has begun since the last record shown, in
        order: a step that came and went between two pushes is still told."""
        shown = self._shown.get(record.job.id, 0)
        for step in record.steps[shown:]:
            if step.started is None:
                break
            name = AGENT_STEPS[step.name]
            role = "gpu_node" if step.domain == self.gpu_node else "vm"
            self._host.step(f"{name}_{role}")
            shown += 1
        self._shown[record.job.id] = shown
