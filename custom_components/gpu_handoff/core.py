"""The controller's typed state and its decisions: pure functions, no I/O.

No Home Assistant, no asyncio, no clients: what the controller owns (the
desired set, the requests waiting, the operation in flight) is typed here,
and every choice it makes from what the tower and the cluster report is a
function of those records and of the observation. The controller around it
holds the lock, storage, events and repairs; the runner does the work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
import datetime as dt
from enum import Enum, StrEnum, auto
from typing import Any, Final, NamedTuple

from .cluster_model import CORDON_OWNER_US, SKIP_WAIT_FOR_DELETE, NodeView
from .protocol import (
    RUNNING,
    SHUT_OFF,
    START_FAILED,
    DomainState,
    HookRequest,
    JobKind,
    JobRecord,
    StepName,
    TowerStatus,
)

# The version of the stored records (1: the dicts of 0.3.x, migrated).
STORE_VERSION: Final = 2


class Kind(StrEnum):
    """What an operation does."""

    HANDOFF = "handoff"
    STOP = "stop"
    RETURN = "return"
    # Drain and shut the GPU node down as a handoff does, then hold the
    # gaming VM's cards for it without starting it (Hold).
    PREPARE = "prepare"

    @property
    def hands_over(self) -> bool:
        """Whether it takes the cards from the GPU node for a gaming VM (a
        handoff, or a prepare: one that fails is settled the same way)."""
        return self in (Kind.HANDOFF, Kind.PREPARE)


class Origin(StrEnum):
    """Who asked for an operation."""

    USER = "user"  # a switch, an action, a voice command, an automation
    HOOK = "hook"  # libvirt's hook: a gaming VM started by hand on the tower
    GPU_HANDOFF = "gpu_handoff"  # a return GPU Handoff decided on itself


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The options an operation follows."""

    drain_timeout: float
    evict_unmanaged: bool
    handoff_when_cordoned: bool
    auto_return: bool
    skip_wait: float = SKIP_WAIT_FOR_DELETE
    # Keep lending the cards nobody plays with (the GPU node restarts with
    # them after a handoff, and again with more when a player stops).
    lend_free: bool = False


@dataclass(frozen=True, kw_only=True)
class PendingJob:
    """A tower job this side asked for (or is about to): stored first."""

    kind: JobKind
    domain: str | None
    request_id: str
    job_id: str | None = None
    # The GPU node's bootID when a job that may start it was asked for: the
    # node is back only when a later boot posts Ready.
    boot_id: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        """For storage."""
        return {
            "kind": self.kind.value,
            "domain": self.domain,
            "request_id": self.request_id,
            "job_id": self.job_id,
            "boot_id": self.boot_id,
        }

    @classmethod
    def from_dict(cls, data: object) -> PendingJob | None:
        """From storage (None for anything unreadable)."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                kind=JobKind(data["kind"]),
                domain=data.get("domain"),
                request_id=str(data["request_id"]),
                job_id=data.get("job_id"),
                boot_id=data.get("boot_id"),
            )
        except KeyError, ValueError:
            return None


@dataclass(frozen=True, kw_only=True)
class Request:
    """An accepted request for one VM (or, a return, for the GPU node)."""

    vm: str
    kind: Kind
    origin: Origin = Origin.USER
    # The stop of the GPU node libvirt's hook asked for with a start by hand
    # (None: none, or not known: a store written before hook jobs were kept).
    hook_job: str | None = None
    # A return GPU Handoff decided on because it saw the GPU node run (see
    # Ask.LEVEL): found off when it acts, it starts nothing.
    if_running: bool = False
    # A prepare: how long the cards are held for the VM once they are free
    # (seconds).
    hold: float = 0.0

    @property
    def by_hook(self) -> bool:
        """Whether libvirt's hook asked for it (a start by hand)."""
        return self.origin is Origin.HOOK

    def as_dict(self) -> dict[str, str | bool | float | None]:
        """For storage."""
        return {
            "vm": self.vm,
            "kind": self.kind.value,
            "origin": self.origin.value,
            "hook_job": self.hook_job,
            **({"if_running": True} if self.if_running else {}),
            **({"hold": self.hold} if self.hold else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Request:
        """From storage."""
        return cls(
            vm=str(data["vm"]),
            kind=Kind(data["kind"]),
            origin=Origin(data.get("origin") or Origin.USER),
            hook_job=data.get("hook_job"),
            if_running=bool(data.get("if_running", False)),
            hold=float(data.get("hold", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class JobFacts:
    """What the tower jobs an operation followed to their end did, from their
    records (never inferred from a later status); stored with the plan, so a
    restart between a job's end and the operation's does not forget it."""

    # When the first of them was created (the tower's clock).
    first_created: str | None = None
    # The last thing they did to the GPU node was to shut it down (a step
    # skipped because it was off already did nothing; a later start undoes
    # it: a GPU node off after that was shut down by someone else).
    stopped_gpu_node: bool = False
    # A job started the GPU node.
    started_gpu_node: bool = False
    # The domains a job's shutdown step shut down.
    shut_down: frozenset[str] = frozenset()
    # Pods that came back to the cordoned node during the drain.
    pods_came_back: tuple[str, ...] = ()
    # When a job of GPU Handoff's last started the GPU node (the tower's
    # clock): carried from the owned records into each operation. A stop of
    # the GPU node libvirt's hook made before it is over: the GPU node ran
    # again since.
    gpu_started_at: str | None = None
    # A stop: the GPU node ran when it began (read before its first job; a
    # GPU node off after it and not by its jobs was shut down by someone
    # else while the stop ran).
    gpu_was_running: bool = False

    def stop_began(self, gpu_running: bool) -> JobFacts:
        """These facts, with whether the GPU node runs as the stop (re)begins:
        read before its first job, and kept once a job of it was created. A
        stop begun again after a restart must not take a later shutdown of
        the GPU node by someone else for how the stop found it (it would
        return the cards to the GPU node the operator shut down)."""
        if self.first_created is not None:
            return self
        return replace(self, gpu_was_running=gpu_running)

    def with_record(self, record: JobRecord, gpu_node: str) -> JobFacts:
        """These facts and what ``record`` says its job did, step by step."""
        facts = replace(self, first_created=self.first_created or record.job.created)
        for step in record.steps:
            if not record.did(step.name, step.domain):
                continue
            if step.name is StepName.SHUTDOWN:
                facts = replace(
                    facts,
                    shut_down=facts.shut_down | {step.domain},
                    stopped_gpu_node=facts.stopped_gpu_node or step.domain == gpu_node,
                )
            elif step.domain == gpu_node and step.name in STARTS:
                facts = replace(
                    facts,
                    stopped_gpu_node=False,
                    started_gpu_node=True,
                    gpu_started_at=step.finished or facts.gpu_started_at,
                )
        return facts

    def with_hook_record(self, record: JobRecord, gpu_node: str) -> JobFacts:
        """These facts and what a job of libvirt's hook did, when it counts
        as GPU Handoff's (the start by hand it stopped the GPU node for is
        one GPU Handoff hands over or supersedes): a stop of the GPU node
        counts only if it came after GPU Handoff last started it."""
        if not hook_stopped_gpu_node(record, gpu_node, since=self.gpu_started_at):
            return self
        return self.with_record(record, gpu_node)

    def since(self, started_at: str | None) -> JobFacts:
        """These facts, knowing GPU Handoff last started the GPU node at
        ``started_at`` (the owned record), unless they know a later start."""
        if started_at is None or _later(self.gpu_started_at, started_at):
            return self
        return replace(self, gpu_started_at=started_at)

    def as_dict(self) -> dict[str, Any]:
        """For storage."""
        return {
            "first_created": self.first_created,
            "stopped_gpu_node": self.stopped_gpu_node,
            "started_gpu_node": self.started_gpu_node,
            "shut_down": sorted(self.shut_down),
            "pods_came_back": list(self.pods_came_back),
            "gpu_started_at": self.gpu_started_at,
            "gpu_was_running": self.gpu_was_running,
        }

    @classmethod
    def from_dict(cls, data: object) -> JobFacts:
        """From storage (none: nothing known)."""
        if not isinstance(data, Mapping):
            return cls()
        return cls(
            first_created=data.get("first_created"),
            stopped_gpu_node=bool(data.get("stopped_gpu_node")),
            started_gpu_node=bool(data.get("started_gpu_node")),
            shut_down=frozenset(data.get("shut_down", ())),
            pods_came_back=tuple(data.get("pods_came_back", ())),
            gpu_started_at=data.get("gpu_started_at"),
            gpu_was_running=bool(data.get("gpu_was_running")),
        )


# The steps that start a domain.
STARTS: Final = frozenset({StepName.START, StepName.START_FREE})


@dataclass(frozen=True, kw_only=True)
class Settle:
    """A failed handoff, to be left safe: whether its own tower job shut the
    GPU node down (the job records say), and the hook's stop to follow."""

    stopped_by_us: bool
    hook_job: str | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The operation in flight, stored before each step so a restart resumes
    it: the request, the tower job it asked for, and (a handoff that failed)
    what is left to settle."""

    request: Request
    job: PendingJob | None = None
    settle: Settle | None = None
    facts: JobFacts = JobFacts()

    @property
    def vm(self) -> str:
        """The VM it is for."""
        return self.request.vm

    @property
    def kind(self) -> Kind:
        """What it does."""
        return self.request.kind

    def as_dict(self) -> dict[str, Any]:
        """For storage."""
        return {
            **self.request.as_dict(),
            "job": self.job.as_dict() if self.job is not None else None,
            "settle": (
                {
                    "stopped_by_us": self.settle.stopped_by_us,
                    "hook_job": self.settle.hook_job,
                }
                if self.settle is not None
                else None
            ),
            "facts": self.facts.as_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """From storage."""
        settle = data.get("settle")
        return cls(
            request=Request.from_dict(data),
            job=PendingJob.from_dict(data.get("job")),
            settle=(
                Settle(
                    stopped_by_us=bool(settle.get("stopped_by_us")),
                    hook_job=settle.get("hook_job"),
                )
                if isinstance(settle, Mapping)
                else None
            ),
            facts=JobFacts.from_dict(data.get("facts")),
        )


@dataclass(frozen=True, kw_only=True)
class Hold:
    """Cards held for a gaming VM that does not run yet (a prepare): the GPU
    node is off (or, lending, runs without them), and they wait for the VM
    until ``until`` (ISO 8601, UTC). Turning the VM on then only starts it."""

    vm: str
    until: str

    def expired(self, now: dt.datetime | None) -> bool:
        """Whether the hold's time is over at ``now`` (unknown: not; an
        unreadable end: over)."""
        if now is None:
            return False
        until = _parse_time(self.until)
        return until is None or now >= until

    def as_dict(self) -> dict[str, str]:
        """For storage."""
        return {"vm": self.vm, "until": self.until}

    @classmethod
    def from_dict(cls, data: object) -> Hold | None:
        """From storage (None for anything unreadable)."""
        if not isinstance(data, Mapping):
            return None
        vm, until = data.get("vm"), data.get("until")
        if not isinstance(vm, str) or not isinstance(until, str):
            return None
        return cls(vm=vm, until=until)


def hold_after(hold: Hold | None, request: Request) -> Hold | None:
    """The hold once an operation for ``request`` begins: a handoff (to the
    held VM, which it starts, or to another, whose player the cards now
    follow), a prepare (it holds anew when it is done), a stop of the held
    VM and a return the user asked for end it; a stop of another VM and a
    return GPU Handoff decided on (a lend after a prepare) keep it."""
    if hold is None:
        return None
    if request.kind.hands_over:
        return None
    if request.kind is Kind.STOP:
        return None if request.vm == hold.vm else hold
    return hold if request.origin is Origin.GPU_HANDOFF else None


@dataclass(frozen=True, kw_only=True)
class Owned:
    """What the controller owns and stores: the gaming VMs that should play,
    the operation in flight, the requests waiting behind it in the order
    they came, and whether the GPU node is off because a tower job of GPU
    Handoff's shut it down (lending restarts only such a GPU node)."""

    desired: frozenset[str] = frozenset()
    plan: Plan | None = None
    queue: tuple[Request, ...] = ()
    gpu_stopped_by_us: bool = False
    # The starts by hand the tower recorded that GPU Handoff dealt with
    # (their keys); None: not known (a store written by 0.3.x: every start
    # by hand the tower shows at the next start counts as dealt with).
    seen_hook_requests: frozenset[str] | None = None
    # When a tower job of GPU Handoff's last started the GPU node (the
    # tower's clock; JobFacts.gpu_started_at).
    gpu_started_at: str | None = None
    # Cards held for a gaming VM after a prepare.
    hold: Hold | None = None

    def as_dict(self) -> dict[str, Any]:
        """For storage (version STORE_VERSION)."""
        return {
            "desired": sorted(self.desired),
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "queue": [request.as_dict() for request in self.queue],
            "gpu_stopped_by_us": self.gpu_stopped_by_us,
            "seen_hook_requests": (
                sorted(self.seen_hook_requests)
                if self.seen_hook_requests is not None
                else None
            ),
            "gpu_started_at": self.gpu_started_at,
            "hold": self.hold.as_dict() if self.hold is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Owned:
        """From storage (version STORE_VERSION)."""
        plan = data.get("plan")
        seen = data.get("seen_hook_requests")
        return cls(
            desired=frozenset(data.get("desired", ())),
            plan=Plan.from_dict(plan) if isinstance(plan, Mapping) else None,
            queue=tuple(Request.from_dict(item) for item in data.get("queue", ())),
            gpu_stopped_by_us=bool(data.get("gpu_stopped_by_us", False)),
            seen_hook_requests=frozenset(seen) if seen is not None else None,
            gpu_started_at=data.get("gpu_started_at"),
            hold=Hold.from_dict(data.get("hold")),
        )


def migrate_store(version: int, data: Mapping[str, Any]) -> dict[str, Any]:
    """Stored records of an earlier version, as STORE_VERSION stores them.

    Version 1 (0.3.x) kept the operation as ``pending`` (a dict with vm,
    kind, job, and for a start by hand ``origin: hook`` and ``hook_job``;
    ``settle`` once a handoff had failed) and the waiting requests as
    ``queued`` (vm, kind, and the same two for a start by hand).
    """
    if version >= STORE_VERSION:
        return dict(data)
    pending = data.get("pending")
    return {
        "desired": list(data.get("desired", [])),
        "plan": dict(pending) if isinstance(pending, Mapping) else None,
        "queue": [dict(item) for item in data.get("queued", [])],
        "gpu_stopped_by_us": bool(data.get("gpu_stopped_by_us", False)),
        "seen_hook_requests": None,
    }


# --- decisions ------------------------------------------------------------------


class StartByHand(StrEnum):
    """What a gaming VM started by hand, as libvirt's hook recorded it, asks
    of GPU Handoff (see start_by_hand_asks)."""

    HAND_OFF = "hand_off"
    FOLLOW = "follow"
    ENDED = "ended"


def start_by_hand_asks(
    vm: DomainState | None, gpu_node: DomainState | None, *, hook_job_running: bool
) -> StartByHand:
    """Decide from the first status that shows the hook's record.

    The hook writes the record at "prepare begin" and submits a stop of the
    GPU node (which does nothing to one that is off); libvirt keeps the
    domain locked until that start has failed or its QEMU runs
    (qemuProcessStart), so the status shows the start's outcome, or what
    came after it:

    - the start failed (``shut off (failed)``: the GPU node held the cards):
      HAND_OFF, properly (drain, follow the hook's stop, start the VM), so
      the player's retry works;
    - the VM runs while the hook's stop takes a running GPU node down:
      HAND_OFF too (the node is drained, the stop followed; the VM's start
      step finds it running);
    - the VM runs, the GPU node off: it got its cards, nothing is to be
      handed over; its session is GPU Handoff's to follow (the cards return
      when it ends): FOLLOW. A handoff job here would start the VM again
      should it stop before the job's start step;
    - the VM is off for any other reason, or gone: it ran and ended since:
      ENDED, nothing to do.
    """
    if vm is None or not vm.exists:
        return StartByHand.ENDED
    if vm.state == SHUT_OFF:
        return StartByHand.HAND_OFF if vm.reason == START_FAILED else StartByHand.ENDED
    gpu_node_up = gpu_node is not None and gpu_node.state not in (SHUT_OFF, None)
    if hook_job_running and gpu_node_up:
        return StartByHand.HAND_OFF
    return StartByHand.FOLLOW


def start_by_hand_over(vm: DomainState | None) -> bool:
    """Whether a start by hand's VM is off for a reason other than a refused
    start (its player quit, or it crashed): a handoff for that start, run
    only now, starts nothing (the player's session is over, and the cards go
    back as at any session's end)."""
    return start_by_hand_asks(vm, None, hook_job_running=False) is StartByHand.ENDED


def known_desired(
    desired: frozenset[str], domains: Mapping[str, DomainState], configured: set[str]
) -> frozenset[str]:
    """The desired set without VMs no longer defined on the tower, or no
    longer configured and off (they would block the automatic return
    forever). A VM removed from GPU Handoff while it plays keeps its session
    until it is off, its cards held meanwhile also while it is neither
    running nor off (paused, or ``in shutdown`` between the guest's
    power-off and QEMU's exit): then its cards go back."""
    return frozenset(
        vm
        for vm in desired
        if (state := domains.get(vm)) is not None
        and state.exists
        and (vm in configured or state.state != SHUT_OFF)
    )


@dataclass(frozen=True, kw_only=True)
class Observed:
    """The tower and the cluster as the last update (or push) showed them."""

    tower: TowerStatus
    node: NodeView | None
    configured: frozenset[str]
    settings: Settings
    # When it was observed (Home Assistant's clock): a hold's end is judged
    # against it (None: no hold ends by time).
    now: dt.datetime | None = None


class HookStop(StrEnum):
    """Whether the hook's stop of the GPU node for a start by hand whose
    session ended before GPU Handoff looked still stands (see _ended_start)."""

    KEEP = "keep"  # not known yet, or nothing to tell: looked at again
    READ = "read"  # its job's record is needed
    STANDS = "stands"  # it shut the GPU node down, which is still off
    OVER = "over"  # it did nothing, or the GPU node runs again since


class HookJobRead(NamedTuple):
    """A job of libvirt's hook whose record was read once it ended, and when
    it shut the GPU node down (the tower's clock, "" if that cannot be
    read; None: it did not; hook_gpu_stop)."""

    job: str
    gpu_stopped_at: str | None


@dataclass(frozen=True, kw_only=True)
class Memory:
    """What the controller remembers between updates: the starts by hand
    it has dealt with (stored with the owned records, so one recorded while
    Home Assistant was down is dealt with after it starts), and the pods
    that refused the last lend (not stored), what the hook's ended jobs
    did, and the free cards the last return began with."""

    seen_hook_requests: frozenset[str] = frozenset()
    lend_refused: tuple[str, ...] = ()
    # The hook's jobs whose records were read once they ended (not stored:
    # read again after a restart), each with when it shut the GPU node down
    # (judged at each use against GPU Handoff's last start of the GPU node,
    # which may come after the read).
    hook_jobs_read: frozenset[HookJobRead] = frozenset()

    def hook_stop(self, job: str, *, since: str | None) -> HookStop:
        """What the record read of the hook's ended job ``job`` says: READ
        if it was not read; STANDS if the job shut the GPU node down after
        GPU Handoff last started it (``since``: a start may come after the
        read, and ends that stop), OVER if not."""
        for read in self.hook_jobs_read:
            if read.job == job:
                stood = read.gpu_stopped_at is not None and stopped_after(
                    read.gpu_stopped_at, since
                )
                return HookStop.STANDS if stood else HookStop.OVER
        return HookStop.READ

    # The free cards when the last return began (not stored): lending, the
    # GPU node is lent again when they change, not after every update while
    # a lend that failed is not fixed (see _lend_falls_short).
    lent_for: frozenset[str] | None = None


@dataclass(frozen=True, kw_only=True)
class Reconciled:
    """What an update asks of an idle controller."""

    desired: frozenset[str]
    memory: Memory
    # The operation to run now (a handoff for a start by hand, or a return).
    run: Request | None = None
    # GPU Handoff's mark on a node nobody cordons is to be removed.
    forget_stale_mark: bool = False
    # The desired set changed (to be stored).
    changed: bool = False
    # Gaming VMs whose start by hand GPU Handoff now follows (they play).
    followed: tuple[str, ...] = field(default=())
    # Gaming VMs started by hand whose session ended before GPU Handoff
    # looked, the hook's stop of the GPU node for them standing.
    ended: frozenset[str] = frozenset()
    # The hook's ended jobs whose records the decision needs (read them, then
    # reconcile again).
    read_hook_jobs: tuple[str, ...] = ()
    # Whether the GPU node is off because of GPU Handoff (Owned), now that a
    # followed start by hand's hook stop counts.
    gpu_stopped_by_us: bool = False
    # The cards held for a gaming VM after this update, and why a hold
    # ended with it (None: none did).
    hold: Hold | None = None
    hold_ended: HoldEnd | None = None


class HoldEnd(StrEnum):
    """Why a hold ended without an operation (see hold_ends)."""

    PLAYS = "plays"  # its VM runs: the player started it on the tower
    EXPIRED = "expired"  # nobody started it in time: the cards go back
    GONE = "gone"  # its VM was removed from GPU Handoff or from the tower


def hold_ends(observed: Observed, hold: Hold | None) -> HoldEnd | None:
    """Whether the hold ends with this update, and why: its VM runs (the
    player started it by hand; its session is followed as any start by
    hand's), is no longer GPU Handoff's, or its time is over. The last two
    end it as a session's end does: the cards go back."""
    if hold is None:
        return None
    domain = observed.tower.domains.get(hold.vm)
    if domain is None or not domain.exists or hold.vm not in observed.configured:
        return HoldEnd.GONE
    if domain.state == RUNNING:
        return HoldEnd.PLAYS
    if hold.expired(observed.now):
        return HoldEnd.EXPIRED
    return None


def _hook_request_asks(
    observed: Observed, desired: frozenset[str], request: HookRequest
) -> StartByHand | None:
    """What one start by hand asks (None: nothing, ever: not ours to act on;
    nor of a VM GPU Handoff gave its cards to that plays: its session is
    followed already. One of a VM it wants to play that does not run is a
    player's start that failed: it is handed over)."""
    status = observed.tower
    vm = request.domain
    if vm not in status.gaming or vm not in observed.configured:
        return None
    domain = status.domains.get(vm)
    if vm in desired and domain is not None and domain.state == RUNNING:
        return None
    return start_by_hand_asks(
        status.domains.get(vm),
        status.domains.get(status.gpu_node),
        hook_job_running=any(job.id == request.job for job in status.active_jobs),
    )


@dataclass(kw_only=True)
class _Scan:
    """What one reconcile made of the starts by hand looked at so far."""

    desired: set[str]
    seen: set[str]
    stopped: bool
    # When GPU Handoff last started the GPU node: a stop of the hook's
    # before that is over.
    gpu_started_at: str | None
    followed: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    to_read: list[str] = field(default_factory=list)

    def reconciled(
        self, owned: Owned, memory: Memory, run: Request | None = None
    ) -> Reconciled:
        """What the update asks for (``run``: a handoff to start now)."""
        return Reconciled(
            desired=frozenset(self.desired),
            memory=replace(memory, seen_hook_requests=frozenset(self.seen)),
            run=run,
            changed=(
                run is not None
                or bool(self.followed)
                or self.seen != memory.seen_hook_requests
                or self.stopped != owned.gpu_stopped_by_us
            ),
            followed=tuple(self.followed),
            ended=frozenset(self.ended) if run is None else frozenset(),
            read_hook_jobs=tuple(self.to_read) if run is None else (),
            gpu_stopped_by_us=self.stopped,
        )


def _starts_by_hand(observed: Observed, owned: Owned, memory: Memory) -> Reconciled:
    """The starts by hand the tower recorded and nothing dealt with yet."""
    scan = _Scan(
        desired=set(owned.desired),
        seen=set(memory.seen_hook_requests),
        stopped=owned.gpu_stopped_by_us,
        gpu_started_at=owned.gpu_started_at,
    )
    for request in observed.tower.hook_requests:
        if request.key in scan.seen:
            continue
        asks = _hook_request_asks(observed, frozenset(scan.desired), request)
        if asks is StartByHand.ENDED:
            stand = _ended_start(
                observed,
                request,
                memory,
                stopped_by_us=owned.gpu_stopped_by_us,
                since=scan.gpu_started_at,
            )
            _scan_ended(scan, request, stand)
        elif (run := _scan_started(observed, memory, scan, request, asks)) is not None:
            return scan.reconciled(owned, memory, run)
    return scan.reconciled(owned, memory)


def _scan_ended(scan: _Scan, request: HookRequest, stand: HookStop) -> None:
    """A start by hand whose session ended before GPU Handoff looked."""
    if stand is HookStop.READ and request.job is not None:
        scan.to_read.append(request.job)
    elif stand is HookStop.STANDS:
        # (It counts as GPU Handoff's, as a followed start's does: a
        # handoff decided after it lends after it.)
        scan.ended.add(request.domain)
        scan.stopped = True
    if stand in (HookStop.STANDS, HookStop.OVER):
        scan.seen.add(request.key)
    # Otherwise kept unseen: a request for the VM supersedes it
    # (superseded_hook_requests).


def _scan_started(
    observed: Observed,
    memory: Memory,
    scan: _Scan,
    request: HookRequest,
    asks: StartByHand | None,
) -> Request | None:
    """A start by hand that plays, or failed: the handoff to start for it
    now, if any (else it is followed, or left as it is)."""
    follows = asks is StartByHand.FOLLOW or (
        asks is None and _plays_as_ours(observed, frozenset(scan.desired), request)
    )
    # Lending, a followed start by hand with the GPU node off is handed over
    # (its hook's record says whether the free cards go back).
    lends = follows and _lends_on_follow(observed)
    follow = (
        _followed_start(observed, request, memory, since=scan.gpu_started_at)
        if follows and not lends
        else None
    )
    if follow is HookStop.READ and request.job is not None:
        scan.to_read.append(request.job)
        return None  # followed once its record is read
    scan.stopped = scan.stopped or follow is HookStop.STANDS
    if follow is not HookStop.KEEP:
        # (Its hook's stop still to run: looked at again once it ran.)
        scan.seen.add(request.key)
    if asks is None and not lends:
        return None
    scan.desired.add(request.domain)
    if asks is StartByHand.FOLLOW and not lends:
        scan.followed.append(request.domain)
        return None
    return Request(
        vm=request.domain, kind=Kind.HANDOFF, origin=Origin.HOOK, hook_job=request.job
    )


def _plays_as_ours(
    observed: Observed, desired: frozenset[str], request: HookRequest
) -> bool:
    """Whether the VM of a start by hand plays in a session GPU Handoff
    follows already (it ended and began again before GPU Handoff looked)."""
    status = observed.tower
    domain = status.domains.get(request.domain)
    return (
        request.domain in desired
        and request.domain in observed.configured
        and domain is not None
        and domain.state == RUNNING
    )


def _followed_start(
    observed: Observed, request: HookRequest, memory: Memory, *, since: str | None
) -> HookStop:
    """A start by hand that plays with its cards: its session is followed.
    Once its hook's stop of the GPU node ran (until then it is looked at
    again: the stop may take down a GPU node that runs now), the GPU node
    off, the job's record says whether the GPU node is off because of it
    (then it counts as GPU Handoff's: the session's end, or a stop asked for
    meanwhile, brings the cards back) or was off already (someone else shut
    it down: it stays off)."""
    status = observed.tower
    gpu = status.domains.get(status.gpu_node)
    job = request.job
    if job is None or gpu is None:
        return HookStop.OVER
    if any(j.id == job for j in status.active_jobs):
        return HookStop.KEEP
    if gpu.state != SHUT_OFF:
        return HookStop.OVER
    return memory.hook_stop(job, since=since)


def _ended_start(
    observed: Observed,
    request: HookRequest,
    memory: Memory,
    *,
    stopped_by_us: bool,
    since: str | None,
) -> HookStop:
    """A player's start by hand whose session ended before GPU Handoff
    looked (the start was refused and the hook stopped the GPU node, the
    retry played, the player quit): a session's end, on which the cards go
    back (or, lending, the free ones are lent) if the GPU node is off
    because of GPU Handoff (``stopped_by_us``) or of the hook's job (its
    record says it shut the GPU node down) and has stayed off; once it runs
    again, that stop is over (an operator's later shutdown stays), and so
    it is once a job of GPU Handoff's started the GPU node after it
    (hook_stopped_gpu_node). What happens between two looks is otherwise
    unseen: a GPU node started and shut down by hand in between is taken
    for one that stayed off."""
    status = observed.tower
    gpu = status.domains.get(status.gpu_node)
    job = request.job
    if job is None or gpu is None or any(j.id == job for j in status.active_jobs):
        return HookStop.KEEP
    if gpu.state == RUNNING:
        return HookStop.OVER
    if gpu.state != SHUT_OFF:
        return HookStop.KEEP
    if stopped_by_us:
        return HookStop.STANDS
    return memory.hook_stop(job, since=since)


def card_of(address: str) -> str:
    """The card a PCI function belongs to (``0000:03:00.1`` -> ``0000:03:00``)."""
    return address.rsplit(".", 1)[0]


def free_cards(status: TowerStatus, held: str | None = None) -> set[str]:
    """The GPU node's own cards (its persistent definition's) that no other
    running domain holds, nor a function of their IOMMU group (libvirt passes
    a group through whole; on a board without ACS two cards can share one):
    what it can run with now. Those of ``held`` (a gaming VM the cards are
    held for: Hold) count as held by it."""
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return set()
    kept = status.domains.get(held) if held is not None else None
    kept_cards = set(kept.defined_cards) if kept is not None else set()
    elsewhere = [
        card
        for card in status.cards
        if (card.held_by is not None and card.held_by != status.gpu_node)
        or card.address in kept_cards
    ]
    groups = {card.iommu_group for card in elsewhere} - {None}
    taken = {card_of(card.address) for card in elsewhere} | {
        card_of(card.address) for card in status.cards if card.iommu_group in groups
    }
    return {card_of(address) for address in gpu.defined_cards} - taken


def serves_free_cards(status: TowerStatus, held: str | None = None) -> bool:
    """Whether the GPU node runs with exactly the cards nobody plays with
    (lending at rest; ``held``: free_cards), or is off with none free."""
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return True
    free = free_cards(status, held)
    if gpu.state != RUNNING:
        return not free
    return {card_of(address) for address in gpu.cards} == free


def _lends_on_follow(observed: Observed) -> bool:
    """Lending, a start by hand followed with the GPU node off is handed
    over all the same: the VM plays already, but the hook's job record says
    whether it shut the GPU node down for it (then the GPU node comes back
    with the free cards) or found it off (someone else shut it down: it
    stays off)."""
    status, settings = observed.tower, observed.settings
    gpu = status.domains.get(status.gpu_node)
    return (
        settings.lend_free
        and settings.auto_return
        and gpu is not None
        and gpu.state == SHUT_OFF
    )


class Ask(Enum):
    """Why the cards go back to the cluster (see reconcile)."""

    # A session's end: they go back, the GPU node started if it is off.
    EDGE = auto()
    # What GPU Handoff saw of the GPU node (it runs with our cordon left, or
    # without the free cards, or a refused lend's pods are gone): the act
    # looks again, as the tower may have moved since (a poll reads the tower
    # before the cluster; a push may be late), and a GPU node found off then
    # stays off unless GPU Handoff holds it off.
    LEVEL = auto()


def _return_asked(
    observed: Observed,
    desired: frozenset[str],
    ended: bool,
    memory: Memory,
    *,
    held: bool = False,
) -> Ask | None:
    """Whether the cards go back to the cluster now, and why: the session
    GPU Handoff knew of ended (automatic return), a player quit while another
    plays (lending: their cards are free), a refused lend's pods are gone, or
    our own cordon is left on a GPU node that serves again (an operation
    interrupted between the node's return and the uncordon, a failed handoff
    whose rollback could not reach the tower). Never because the GPU node is
    seen off: someone may have shut it down on purpose. While cards are
    held for a gaming VM (``held``) a session's end returns nothing unless
    lending: the GPU node cannot run without the held card; the hold's own
    end returns them."""
    status, node, settings = observed.tower, observed.node, observed.settings
    gpu = status.domains.get(status.gpu_node)
    if gpu is None:
        return None
    playing = any(
        (domain := status.domains.get(vm)) is not None and domain.state == RUNNING
        for vm in status.gaming
    )
    session_ended = ended and not playing and not desired and not held
    if settings.auto_return and (session_ended or (ended and settings.lend_free)):
        return Ask.EDGE
    lend_again = (
        settings.lend_free
        and settings.auto_return
        # (A refused lend drained a GPU node that ran: one shut down since
        # stays off.)
        and bool(memory.lend_refused)
        and gpu.state == RUNNING
        and node is not None
        and not set(memory.lend_refused) & set(node.unmanaged)
    )
    leftover = (
        gpu.state == RUNNING
        and node is not None
        and node.ready is True
        and node.cordon_owner == CORDON_OWNER_US
        and status.job_for(status.gpu_node) is None
    )
    return Ask.LEVEL if leftover or lend_again else None


def reconcile(observed: Observed, owned: Owned, memory: Memory) -> Reconciled:
    """What an update asks of a controller with nothing running or waiting:
    a start by hand to hand the cards over for (or to follow), a session
    that ended (the player shut the game down from inside; a VM removed from
    GPU Handoff while it played ends its session all the same), the cards to
    go back, a stale cordon mark to remove."""
    found = _starts_by_hand(observed, owned, memory)
    if (hold_ended := hold_ends(observed, owned.hold)) is not None:
        found = replace(found, hold_ended=hold_ended, changed=True)
    else:
        found = replace(found, hold=owned.hold)
    if unannounced := _playing_unannounced(observed, found):
        # (With a handoff to run too: a session followed only once that
        # ended would end unseen meanwhile, its freed card never lent.)
        found = replace(
            found,
            desired=found.desired | unannounced,
            followed=(*found.followed, *sorted(unannounced)),
            changed=True,
        )
    if found.run is not None:
        return found
    status = observed.tower
    ended = found.ended | {
        vm
        for vm in found.desired
        if (domain := status.domains.get(vm)) is not None and domain.state == SHUT_OFF
    }
    remaining = known_desired(
        found.desired - ended, status.domains, set(observed.configured)
    )
    changed = found.changed or remaining != found.desired
    # A hold that ended unused ends as a session does: the cards go back.
    unused = found.hold_ended in (HoldEnd.EXPIRED, HoldEnd.GONE)
    ask = _return_asked(
        observed,
        remaining,
        bool(ended) or unused,
        found.memory,
        held=found.hold is not None,
    )
    if ask is None and _lend_falls_short(observed, found):
        ask = Ask.LEVEL
    if ask is not None:
        return replace(
            found,
            desired=remaining,
            changed=changed,
            run=Request(
                vm=status.gpu_node,
                kind=Kind.RETURN,
                origin=Origin.GPU_HANDOFF,
                if_running=ask is Ask.LEVEL and not found.gpu_stopped_by_us,
            ),
        )
    node = observed.node
    return replace(
        found,
        desired=remaining,
        changed=changed,
        forget_stale_mark=node is not None and node.stale_mark,
    )


def _lend_falls_short(observed: Observed, found: Reconciled) -> bool:
    """Lending at rest, the level the edges above may miss: the GPU node GPU
    Handoff holds (it runs, or GPU Handoff's jobs or a start by hand it
    followed shut it down) does not run with exactly the free cards, and
    they changed since the last return began (a player who started a VM on
    the tower and quit it while an operation ran, unseen by every look).
    Not while a tower job acts on the GPU node or a start by hand is still
    to be looked at; not again for the same free cards after a lend that
    failed or was refused (those are reported, and retried as they say)."""
    status, settings = observed.tower, observed.settings
    gpu = status.domains.get(status.gpu_node)
    recorded = {request.key for request in status.hook_requests}
    held = found.hold.vm if found.hold is not None else None
    return (
        settings.lend_free
        and settings.auto_return
        and gpu is not None
        and (
            gpu.state == RUNNING or (gpu.state == SHUT_OFF and found.gpu_stopped_by_us)
        )
        and status.job_for(status.gpu_node) is None
        and recorded <= found.memory.seen_hook_requests
        and not serves_free_cards(status, held)
        and frozenset(free_cards(status, held)) != found.memory.lent_for
    )


def _playing_unannounced(observed: Observed, found: Reconciled) -> frozenset[str]:
    """Gaming VMs that play with their cards though no start by hand was
    recorded for them and GPU Handoff did not start them: lending, a VM
    started on the tower while the agent's record of the GPU node's cards
    (written at its last status) lacked its card, so libvirt's hook let it
    start without a word. Their sessions are followed (their end lends the
    freed card), as a start by hand's would be. Not one whose start by
    hand is still being looked at."""
    status = observed.tower
    pending = {
        request.domain
        for request in status.hook_requests
        if request.key not in found.memory.seen_hook_requests
    }
    return frozenset(
        vm
        for vm in status.gaming
        if vm in observed.configured
        and vm not in found.desired
        and vm not in pending
        and (domain := status.domains.get(vm)) is not None
        and domain.state == RUNNING
    )


def lends_after(
    request: Request,
    *,
    succeeded: bool,
    facts: JobFacts,
    owned: Owned,
    waiting: bool,
    observed: Observed,
) -> bool:
    """Whether the free cards go back to the cluster after a handoff or a
    stop (lending): not while another request waits, whose own end does it
    (two requests close together cost one GPU node restart). Only when the
    GPU node runs (a stop's freed card, or one a handoff left free, joins
    it) or GPU Handoff holds it off: its job stopped it, or libvirt's hook
    for a start by hand (their records say so); after a stop that ended a
    session (its job shut the VM down), also when the GPU node was off
    already as the stop began (a session's end brings the cards back, as it
    does without lending); after a failed handoff, only when the GPU node
    GPU Handoff stopped is still off. A GPU node someone else shut down
    stays off otherwise: a stop does not start a GPU node its operator shut
    down while the stop ran, and a hook's stop that found the GPU node off
    (the operator shut it down first) did nothing."""
    settings = observed.settings
    if not (
        request.kind in (Kind.HANDOFF, Kind.STOP, Kind.PREPARE)
        and settings.lend_free
        and settings.auto_return
        and not waiting
    ):
        return False
    status = observed.tower
    gpu = status.domains.get(status.gpu_node)
    if ends_session(request, facts):
        # A session's end: the cards go back to a GPU node that was off when
        # the stop began, as they do without lending (returns_after_stop).
        return True
    if request.kind.hands_over and not succeeded:
        # A failed handoff (or prepare): a GPU node GPU Handoff stopped (a request before
        # it, which left its lend to this one's end; or a start by hand it
        # supersedes, whose hook's stop counts as its own) is still off. What
        # its own job stopped is settled too (settle_failed_handoff); either
        # asks for the same return.
        return owned.gpu_stopped_by_us and gpu is not None and gpu.state == SHUT_OFF
    return (
        owned.gpu_stopped_by_us
        or facts.stopped_gpu_node
        or (gpu is not None and gpu.state == RUNNING)
    )


def _playing(status: TowerStatus, besides: str | None = None) -> bool:
    return any(
        (domain := status.domains.get(vm)) is not None and domain.state == RUNNING
        for vm in status.gaming
        if vm != besides
    )


def stop_releases(
    status: TowerStatus,
    vm: str,
    settings: Settings,
    *,
    gpu_stopped_by_us: bool,
    held: bool = False,
) -> bool:
    """Whether a stop of ``vm`` is one tower job that also starts the GPU
    node (a release): nobody else plays, the cards go back automatically and
    are not lent (lending: the return that follows restarts the GPU node
    with every free card), and the GPU node is GPU Handoff's to start: it
    runs, or a tower job of GPU Handoff's (or libvirt's hook, for a start by
    hand GPU Handoff followed) shut it down. Otherwise the stop is a plain
    one, and the cards go back after it only if its job ended a session
    (returns_after_stop): ``vm`` running when the stop begins is not enough,
    for its player may quit before the job runs, and a job that shut nothing
    down would start a GPU node someone else shut down. Not while cards are
    held for another gaming VM (``held``): the GPU node would take them."""
    if (
        held
        or _playing(status, besides=vm)
        or not settings.auto_return
        or settings.lend_free
    ):
        return False
    gpu = status.domains.get(status.gpu_node)
    return (gpu is not None and gpu.state == RUNNING) or gpu_stopped_by_us


def stop_names(status: TowerStatus, vm: str) -> str | None:
    """The VM a stop's tower job names: ``vm``, unless it is shut off when
    the stop begins. A job that named it anyway would shut down a start by
    hand made after the request (a player's retry) and then, releasing,
    start the GPU node under the hook's stop for it: nothing is to be
    stopped."""
    domain = status.domains.get(vm)
    return None if domain is not None and domain.state == SHUT_OFF else vm


def returns_after_stop(
    status: TowerStatus,
    vm: str,
    settings: Settings,
    *,
    facts: JobFacts,
    gpu_stopped_by_us: bool,
    held: bool = False,
) -> bool:
    """After a stop that did not release (it began while someone else
    played, or the GPU node was not GPU Handoff's to start): whether the
    cards go back now: nobody plays any more (they quit meanwhile, or the
    view the stop began with lagged), the GPU node is off, the cards go back
    automatically and are not lent (lending: the controller's return does
    it), the stop ended a session (its job shut ``vm`` down) or GPU Handoff
    shut the GPU node down, and the stop's own jobs did not start the GPU
    node already (a stop resumed after a restart whose release ran: the GPU
    node off again was shut down by someone else since). Not while cards
    are held for a gaming VM (``held``)."""
    if held or not settings.auto_return or settings.lend_free or _playing(status):
        return False
    gpu = status.domains.get(status.gpu_node)
    return (
        gpu is not None
        and gpu.state == SHUT_OFF
        and not facts.started_gpu_node
        and (vm in facts.shut_down or gpu_stopped_by_us)
    )


def returns_after(
    request: Request,
    *,
    succeeded: bool,
    facts: JobFacts,
    owned: Owned,
    waiting: bool,
    observed: Observed,
) -> bool:
    """Whether the cards go back after a stop (not lending: lends_after
    decides then) or a failed handoff, once nobody plays and the GPU node
    GPU Handoff stopped is off: their own jobs return them when they can
    (stop_releases, returns_after_stop, settle_failed_handoff); this is for
    a GPU node libvirt's hook stopped for a start by hand they supersede
    (the player's start failed, and the request is the last word). Not
    while cards are held for a gaming VM: the hold's end returns them."""
    settings, status = observed.settings, observed.tower
    stop = request.kind is Kind.STOP and succeeded and not settings.lend_free
    failed_handoff = request.kind.hands_over and not succeeded
    if (
        not (stop or failed_handoff)
        or owned.hold is not None
        or waiting
        or not settings.auto_return
        or _playing(status)
    ):
        return False
    gpu = status.domains.get(status.gpu_node)
    return (
        gpu is not None
        and gpu.state == SHUT_OFF
        and (owned.gpu_stopped_by_us or facts.stopped_gpu_node)
    )


def gpu_stopped_by_us(
    owned: Owned, facts: JobFacts, tower: TowerStatus, request: Request
) -> bool:
    """After ``request``'s operation: whether the GPU node, off, is GPU
    Handoff's to start: one of our tower jobs shut it down (its job
    records), or the operation was a stop that ended a session while it was
    off and did not start it (``ends_session``: the session's end asks for
    the cards back, so an operator's earlier shutdown is over, and the
    return it owes is not lost when a later request of the same burst makes
    it; a stop that started it paid that return, and a shutdown since is
    someone else's). Cleared once the GPU node runs again."""
    gpu = tower.domains.get(tower.gpu_node)
    if gpu is not None and gpu.state == RUNNING:
        return False
    owed = ends_session(request, facts) and not facts.started_gpu_node
    return stopped_by_jobs(owned.gpu_stopped_by_us, facts) or owed


def ends_session(request: Request, facts: JobFacts) -> bool:
    """Whether ``request`` was a stop whose job shut its VM down while the
    GPU node was off as it began: a session's end, after which the cards go
    back to the GPU node whoever shut it down."""
    return (
        request.kind is Kind.STOP
        and request.vm in facts.shut_down
        and not facts.gpu_was_running
    )


def stopped_by_jobs(stopped_before: bool, facts: JobFacts) -> bool:
    """Whether the GPU node, if off, is off because of GPU Handoff: as the
    owned record says (``stopped_before``), unless the operation's own jobs
    (``facts``, so far) say otherwise. One that started it since leaves it
    off only by someone else's hand (libvirt's hook for a start by hand,
    the operator), unless a later job of its own stopped it: so a stop
    resumed after a restart whose release ran does not release again."""
    if facts.started_gpu_node:
        return facts.stopped_gpu_node
    return stopped_before or facts.stopped_gpu_node


def _recorded_after(request: HookRequest, moment: dt.datetime | None) -> bool:
    """Whether the tower recorded the start by hand after ``moment`` (its
    own clock; an unreadable time counts as before)."""
    recorded = _parse_time(request.time)
    return moment is not None and recorded is not None and recorded > moment


def _parse_time(value: str | None) -> dt.datetime | None:
    """An ISO 8601 time (None when unreadable)."""
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


def _later(value: str | None, than: str) -> bool:
    """Whether the time ``value`` is after ``than`` (unreadable: not)."""
    later, earlier = _parse_time(value), _parse_time(than)
    return later is not None and earlier is not None and later > earlier


def hook_gpu_stop(record: JobRecord, gpu_node: str) -> str | None:
    """When a job of libvirt's hook shut the GPU node down (its step's end,
    else the job's, on the tower's clock; "" if neither is known), or None
    if it did not."""
    if not record.did(StepName.SHUTDOWN, gpu_node):
        return None
    finished = next(
        (
            step.finished
            for step in record.steps
            if step.name is StepName.SHUTDOWN and step.domain == gpu_node
        ),
        None,
    )
    return finished or record.job.finished or ""


def stopped_after(stopped_at: str, since: str | None) -> bool:
    """Whether a stop of the GPU node at ``stopped_at`` came after GPU
    Handoff last started it (``since``). A stop before that is over: the
    GPU node ran again since, and being off now is someone else's doing
    (the operator's). The agent runs one job at a time, so the tower's clock
    orders them; a time that cannot be read counts as after."""
    if since is None or _parse_time(since) is None:
        return True
    return _parse_time(stopped_at) is None or _later(stopped_at, since)


def hook_stopped_gpu_node(
    record: JobRecord, gpu_node: str, *, since: str | None
) -> bool:
    """Whether a job of libvirt's hook shut the GPU node down after GPU
    Handoff last started it (``since``, the tower's clock; stopped_after)."""
    stopped_at = hook_gpu_stop(record, gpu_node)
    return stopped_at is not None and stopped_after(stopped_at, since)


def superseded_hook_requests(
    requests: Iterable[HookRequest],
    request: Request,
    facts: JobFacts,
    *,
    succeeded: bool = True,
    running: frozenset[str] = frozenset(),
) -> set[str]:
    """The starts by hand a finished handoff or stop of ``request.vm``
    supersedes: those recorded before it ends (the user turned it off since;
    or it was the start this handoff made, which libvirtd runs the qemu hook
    for too, and an agent older than 0.3.1 recorded as a start by hand).

    But a start by hand the tower recorded after a stop made its first job
    came after that stop: it is the newer request, and stays one. And while
    the VM runs, a stop (which left it off, or found it off) or a handoff
    that failed (neither it nor its job started it) supersedes none: a
    player started it on the tower since, and its session is to be followed.
    One whose VM does not run after a failed handoff is superseded all the
    same: it may be the failed start of the handoff's own job (an agent
    older than 0.3.1).
    """
    if request.vm in running and (request.kind is Kind.STOP or not succeeded):
        return set()
    stop = request.kind is Kind.STOP
    after = _parse_time(facts.first_created) if stop else None
    return {
        hook.key
        for hook in requests
        if hook.domain == request.vm and not _recorded_after(hook, after)
    }


def settle_hook_job(
    request: Request, hook_requests: Iterable[HookRequest], seen: frozenset[str]
) -> str | None:
    """The hook's stop of the GPU node a failed handoff settles after: the
    one its start by hand asked for, or (a request of the user's) the one
    of the newest start by hand of its VM not dealt with yet (a player
    started it on the tower meanwhile: the hook stopped the GPU node for
    it, and the failed handoff supersedes it; what that stop did counts as
    GPU Handoff's)."""
    if request.hook_job is not None:
        return request.hook_job
    jobs = [
        hook.job
        for hook in hook_requests
        if hook.domain == request.vm and hook.key not in seen and hook.job is not None
    ]
    return jobs[-1] if jobs else None


def job_stopped_gpu_node(
    facts: JobFacts, *, job_failed: bool, job_pending: bool
) -> bool:
    """Whether a failed handoff's own tower job shut the GPU node down: the
    records of the jobs followed to their end say (a shutdown step skipped
    because the GPU node was off already did nothing); a job not followed to
    its end may have (the return that follows reads the tower again)."""
    if facts.stopped_gpu_node or job_failed:
        return facts.stopped_gpu_node
    return job_pending


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
