"""The operation runner: drain, tower job, node back; no Home Assistant imports.

It does the work of one operation with the tower and cluster clients and
tells its host (the controller, which keeps storage, events and repairs) what
happens through a small interface. Tower jobs are asked for under a request
id that the host stores before the request is sent; a reply lost on the way
is followed by a look-up of that id, so a job is never asked for twice and
nothing is rolled back while a job this side asked for may still run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import partial
import logging
from typing import Protocol

from .cluster_client import ClusterClient, ClusterError
from .cluster_events import NodeEvents
from .cluster_model import CORDON_OWNER_OTHER, CORDON_OWNER_US, DrainProgress
from .const import PHASE_DRAINING, PHASE_RETURNING, PHASE_STOPPING
from .core import (
    JobFacts,
    Settings,
    card_of,
    free_cards,
    gpu_node_off,
    gpu_node_undisturbed,
    hook_stopped_gpu_node,
    returns_after_stop,
    start_by_hand_over,
    stop_names,
    stop_releases,
    stopped_by_jobs,
)
from .drain import NodeDrain
from .health import UnhealthyReturn
from .jobs import DoneJob, JobHost, TowerJobs, first_of
from .node_return import NodeBackError, NodeReturn, ReturnHost
from .protocol import (
    AGENT_KEEPS,
    REQUESTED_BY_HOOK,
    RUNNING,
    SHUT_OFF,
    JobKind,
    JobRecord,
    TowerStatus,
    version_key,
)
from .tower_client import AgentCommandError, TowerClient, TowerConnectionError

_LOGGER = logging.getLogger(__name__)


class RunnerError(Exception):
    """An operation cannot go on; ``key`` names the translated message."""

    def __init__(self, key: str, message: str, **placeholders: str) -> None:
        super().__init__(message)
        self.key = key
        self.code = key
        self.placeholders = placeholders


class RunnerHost(JobHost, ReturnHost, Protocol):
    """What the runner tells, and asks of, its host."""

    def drain_progress(self, progress: DrainProgress) -> None:
        """How far the drain is."""


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


def check_agent_lends(tower: TowerClient, *, keeping: bool = False) -> None:
    """An agent older than lending (0.3.0) has no `lend`, and one older than
    holding cards (AGENT_KEEPS) lends every free card, those held for a
    gaming VM too: say so before anything is asked of it (with the session
    down, its answer says it)."""
    session = tower.session
    if session is None or session.closed:
        return
    version = session.hello.version
    cannot = JobKind.LEND.value not in session.hello.verbs
    if keeping and not cannot:
        theirs = version_key(version)
        cannot = theirs is not None and theirs < AGENT_KEEPS
    if cannot:
        raise RunnerError(
            "agent_cannot_lend",
            f"the agent on the tower ({version}) cannot lend cards "
            f"{'while others are held ' if keeping else ''}yet: update it to "
            "the version this integration ships",
            version=version,
        )


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
        events: NodeEvents | None = None,
    ) -> None:
        """Nothing runs until an operation is called; ``events`` tells the
        cluster what is done to its node and why (cluster_events)."""
        self.tower = tower
        self.cluster = cluster
        self.gpu_node = gpu_node
        self.k8s_node = k8s_node
        self._host = host
        self.events = events
        self.jobs = TowerJobs(tower, gpu_node=gpu_node, host=host)
        self.node_return = NodeReturn(
            tower,
            cluster,
            self.jobs,
            gpu_node=gpu_node,
            k8s_node=k8s_node,
            host=host,
            events=events,
        )

    @property
    def returned_unhealthy(self) -> UnhealthyReturn | None:
        """Set by the last return whose GPU node came back short of its GPUs."""
        return self.node_return.unhealthy

    # --- operations ----------------------------------------------------------

    async def handoff(
        self, vm: str, settings: Settings, *, hook_job: str | None = None
    ) -> None:
        """Give ``vm`` its cards: drain and stop the GPU node if it holds them,
        then start ``vm``. A failure leaves the rest to ``settle_failed_handoff``.
        A handoff for a start by hand (``hook_job``: the stop of the GPU node
        libvirt's hook asked for) reads that job's record too: whether the
        GPU node is off because of it is what it says, not a guess."""
        await self._hand_over(vm, settings, by_hand=hook_job is not None)
        if hook_job is not None:
            await self._read_hook_job(hook_job)

    async def _hand_over(self, vm: str, settings: Settings, *, by_hand: bool) -> None:
        pending = self._host.pending_job
        if pending is not None:
            # Resume: the stored job, whatever the tower looks like now.
            if pending.kind is JobKind.HANDOFF:
                self._host.phase(PHASE_STOPPING)
            await self._job(pending.kind, pending.domain)
            return
        status = await self.tower.status()
        domain = status.domains[vm]
        if domain.state == RUNNING or (by_hand and start_by_hand_over(domain)):
            return
        node_holds = node_holds_cards_of(status, vm)
        if node_holds:
            await self._drain(f"handoff to {vm}", settings)
            self._host.phase(PHASE_STOPPING)
            self._event(
                "ShuttingDown",
                "Shutdown",
                f"Shutting the GPU node's VM {self.gpu_node} down through its "
                f"guest agent: its cards go to the gaming VM {vm}",
            )
        await self._job(JobKind.HANDOFF if node_holds else JobKind.START, vm)

    async def prepare(self, vm: str, settings: Settings) -> None:
        """Free ``vm``'s cards without starting it: drain the GPU node and
        shut it down through its guest agent as a handoff does, if it holds
        them (the controller then holds them for ``vm``: core.Hold). A VM
        that runs already has them."""
        pending = self._host.pending_job
        if pending is not None:
            # Resume: the stored job, whatever the tower looks like now.
            self._host.phase(PHASE_STOPPING)
            await self._job(pending.kind, pending.domain)
            return
        status = await self.tower.status()
        if status.domains[vm].state == RUNNING or not node_holds_cards_of(status, vm):
            return
        await self._drain(f"cards held for {vm}", settings)
        self._host.phase(PHASE_STOPPING)
        self._event(
            "ShuttingDown",
            "Shutdown",
            f"Shutting the GPU node's VM {self.gpu_node} down through its guest "
            f"agent: its cards are held for the gaming VM {vm}, which starts soon",
        )
        await self._job(JobKind.STOP, self.gpu_node)

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
            record = await self.jobs.follow(job_id)
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning("Could not read the hook's job %s: %s", job_id, err)
            return
        self.facts = self.facts.with_hook_record(record, self.gpu_node)

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
        runs with the free ones). A tower or cluster that cannot answer
        raises (Operations._settle tries again).
        """
        status = await self.tower.status()
        if hook_job is None:
            job = status.job_for(self.gpu_node)
            if job is not None and job.requested_by == REQUESTED_BY_HOOK:
                hook_job = job.id
        if hook_job is not None:
            stopped_by_us = await self._hook_stopped(hook_job) or stopped_by_us
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

    async def _hook_stopped(self, hook_job: str) -> bool:
        """Follow libvirt's hook's stop of the GPU node to its end: True when
        it shut the GPU node down since GPU Handoff last started it (what it
        did then counts as the operation's: core.returns_after)."""
        record = await self.jobs.follow(hook_job)
        if not hook_stopped_gpu_node(
            record, self.gpu_node, since=self.facts.gpu_started_at
        ):
            return False
        self.facts = self.facts.with_record(record, self.gpu_node)
        return True

    async def _drain(self, reason: str, settings: Settings) -> None:
        """Cordon the GPU node's node (marking the cordon as ours), then drain
        it as kubectl does."""
        self._host.phase(PHASE_DRAINING)
        self._host.step("draining")
        owner = await self.cluster.cordon(self.k8s_node, reason)
        self._host.show_cordon(owner)
        check_operator_cordon(owner, settings, self.k8s_node)
        if owner == CORDON_OWNER_US:
            self._event("Cordoned", "Cordon", f"Cordoned by GPU Handoff: {reason}")
        progress = await first_of(
            NodeDrain(self.cluster, self.events).run(
                self.k8s_node,
                settings.drain_timeout,
                self._host.drain_progress,
                force=settings.evict_unmanaged,
                skip_after=settings.skip_wait,
            ),
            self.jobs.until_tower(gpu_node_off),
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
        self,
        vm: str,
        settings: Settings,
        *,
        gpu_stopped_by_us: bool = False,
        held: bool = False,
    ) -> bool:
        """Stop ``vm``; True when the cards went back to the cluster too
        (``gpu_stopped_by_us``: the GPU node is off because a tower job of
        GPU Handoff's shut it down; ``held``: cards are held for a gaming VM;
        see core.stop_releases)."""
        # (Resumed: what its own jobs did since counts.)
        gpu_stopped_by_us = stopped_by_jobs(gpu_stopped_by_us, self.facts)
        pending = self._host.pending_job
        if pending is not None:
            # Resume the job the stored operation asked for.
            done = await self._job(pending.kind, pending.domain)
            if pending.kind is not JobKind.RELEASE:
                return await self._return_if_nobody_plays(
                    vm, settings, gpu_stopped_by_us, held
                )
            return await self._node_back(done)
        status = await self.tower.status()
        gpu = status.domains.get(self.gpu_node)
        self.facts = self.facts.stop_began(gpu is not None and gpu.state == RUNNING)
        named = stop_names(status, vm)
        if not stop_releases(
            status, vm, settings, gpu_stopped_by_us=gpu_stopped_by_us, held=held
        ):
            if named is not None:
                await self._job(JobKind.STOP, named)
            return await self._return_if_nobody_plays(
                vm, settings, gpu_stopped_by_us, held
            )
        # Nobody else plays: stop the VM and start the GPU node in one job.
        # The return begins now (the Handoff state goes to `starting` and
        # only forward from there, whatever the snapshot lags behind).
        self._host.phase(PHASE_RETURNING)
        return await self._node_back(await self._job(JobKind.RELEASE, named))

    async def _return_if_nobody_plays(
        self, vm: str, settings: Settings, gpu_stopped_by_us: bool, held: bool
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
            held=held,
        ):
            return False
        self._host.phase(PHASE_RETURNING)
        return await self._node_back(await self._job(JobKind.RELEASE, None))

    async def return_cards(
        self, settings: Settings, *, if_running: bool, keep: str | None = None
    ) -> bool:
        """Start the GPU node if it is off, wait until its node is Ready, and
        lift our own cordon. Lending: restart it with every card nobody plays
        with (none free: it stays off), those held for ``keep`` (core.Hold)
        left out. ``if_running`` (core.Ask.LEVEL): a GPU node found off
        stays off. True when the cluster has cards back."""
        self._host.phase(PHASE_RETURNING)
        pending = self._host.pending_job
        done: DoneJob | None = None
        if pending is None and settings.lend_free:
            lent, done = await self._lend(settings, if_running=if_running, keep=keep)
            if not lent:
                return False
        elif pending is not None or not await self._gpu_node_runs():
            if pending is None and if_running:
                return False
            done = await self._job(JobKind.RELEASE, None)
        return await self._node_back(done)

    async def _gpu_node_runs(self) -> bool:
        status = await self.tower.status()
        return status.domains[status.gpu_node].state == RUNNING

    async def _lend(
        self, settings: Settings, *, if_running: bool, keep: str | None = None
    ) -> tuple[bool, DoneJob | None]:
        """Have the GPU node run with every free card: as it is if it does
        already; else drained, stopped through its guest agent and started
        again with them (a live-only definition on the tower: its persistent
        one never changes). False when no card is free (it stays off), or,
        ``if_running``, when it is off (also once drained); the lend job,
        when one ran. The cards of ``keep`` (held for it) are not free, and
        the job tells the tower so."""
        status = await self.tower.status()
        gpu = status.domains[status.gpu_node]
        free = free_cards(status, keep)
        if gpu.state == RUNNING:
            if {card_of(address) for address in gpu.cards} >= free:
                return True, None
            await self._drain("lending the cards nobody plays with", settings)
            self._host.phase(PHASE_RETURNING)
            if if_running and not await self._gpu_node_runs():
                return False, None
        elif if_running or not free:
            return False, None
        check_agent_lends(self.tower, keeping=keep is not None)
        if gpu.state == RUNNING:
            self._event(
                "ShuttingDown",
                "Shutdown",
                f"Shutting the GPU node's VM {self.gpu_node} down through its "
                "guest agent, to start it again with every card nobody plays with",
            )
        done = await self._job(JobKind.LEND, keep)
        return bool(free), done

    async def finish_job(self) -> None:
        """Follow the stored job to its end (an operation being abandoned)."""
        pending = self._host.pending_job
        if pending is not None:
            await self._job(pending.kind, pending.domain)

    async def _node_back(self, done: DoneJob | None) -> bool:
        """The node back and our cordon lifted (node_return): True when the
        cluster has the cards back."""
        try:
            return await self.node_return.wait(done)
        except NodeBackError as err:
            raise RunnerError("node_not_ready", str(err)) from err

    async def uncordon_if_serving(self) -> None:
        """Roll back our own cordon when the GPU node still runs (it was never
        stopped) and no tower job may still stop it."""
        try:
            if await lift_own_cordon_if_serving(
                self.tower, self.cluster, self.k8s_node
            ):
                self._host.show_cordon(None)
                self._event(
                    "Uncordoned",
                    "Uncordon",
                    "The handoff did not stop the GPU node; GPU Handoff lifted its "
                    "cordon",
                )
        except (TowerConnectionError, AgentCommandError, ClusterError) as err:
            _LOGGER.warning("Could not lift the cordon after a failed handoff: %s", err)

    def _event(self, reason: str, action: str, note: str) -> None:
        """A Normal event about the node, when events are told."""
        if self.events is not None:
            self.events.normal(reason, action, note)

    # --- tower jobs ----------------------------------------------------------

    async def _job(self, kind: JobKind, domain: str | None) -> DoneJob:
        """Run a tower job of ``kind`` (or the stored operation's) to its end;
        what it did joins the operation's facts."""
        return await self.jobs.run(
            kind,
            domain,
            boot_id=partial(read_boot_id, self.cluster, self.k8s_node),
            ended=self._job_ended,
        )

    def _job_ended(self, record: JobRecord) -> None:
        self.facts = self.facts.with_record(record, self.gpu_node)


async def read_boot_id(cluster: ClusterClient, k8s_node: str) -> str | None:
    """The GPU node's bootID now (None when the cluster cannot say: then any
    Ready counts, as before bootIDs were read)."""
    try:
        return await cluster.boot_id(k8s_node)
    except ClusterError as err:
        _LOGGER.warning("Could not read %s's bootID: %s", k8s_node, err)
        return None
