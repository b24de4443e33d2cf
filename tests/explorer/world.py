"""The tower and the cluster as the explorer models them: small, immutable,
hashable, and as unkind as the faithful rigs where the decisions can tell.

- libvirt's hook runs on every start of a gaming VM, the product's own too
  (it records a start by hand only for the ones nobody asked GPU Handoff
  for, as agent 0.3.1 does); a start by hand has the hook submit a stop of
  the GPU node, asynchronous to the start, which fails (``shut off
  (failed)``) while the GPU node holds the VM's card. The agent's hook acts
  only when its record of the GPU node's cards (written at its last status)
  shares the VM's card: a record that lags a lend makes it act on a GPU
  node that does not hold the card, a fresh one lets the start go by
  unrecorded. Where the two differ, the model takes both (model.events);
- a GPU node shut down keeps its node Ready until a separate step (the node
  monitor's grace period) makes it NotReady; a started one is Ready only
  when its kubelet posts it, from a new boot (bootIDs);
- a tower job of GPU Handoff's runs on the tower whatever Home Assistant
  does (restarts, unloads): its effect is one step of the world, and its
  record says what each step did (a shutdown skipped because the domain was
  off did nothing);
- ``kubectl uncordon`` leaves GPU Handoff's mark behind (a stale mark).

Two gaming VMs with a card each; the GPU node is defined with both.
"""

from __future__ import annotations

from dataclasses import dataclass
import datetime as dt
from functools import lru_cache

from custom_components.gpu_handoff.cluster_model import CORDON_OWNER_US, NodeView
from custom_components.gpu_handoff.protocol import (
    RUNNING,
    SHUT_OFF,
    START_FAILED,
    Card,
    DomainState,
    HookRequest,
    HostDevice,
    Job,
    JobKind,
    JobState,
    TowerStatus,
)

GPU = "gpu-node"
VMS = ("gaming-1", "gaming-2")
CARDS = {"gaming-1": "0000:01:00", "gaming-2": "0000:02:00"}
OTHER = "other"
FAILED = "failed"  # shut off (failed): the start was refused
EPOCH = dt.datetime(2026, 12, 2, 5, tzinfo=dt.UTC)


def replace[T](record: T, /, **changes: object) -> T:
    """``dataclasses.replace`` for the explorer's frozen records (none has an
    ``__init__`` of its own or a ``__post_init__``), without its per-field
    checks: a search makes millions of copies, and the standard one was
    more than half of its time. A copy that changes nothing is the record
    itself, whose hash is then not computed again."""
    fields = record.__dict__
    same = True
    for name, value in changes.items():
        if name not in fields or name == _HASH:
            raise TypeError(f"{type(record).__name__} has no field {name!r}")
        same = same and fields[name] is value
    if same:
        return record  # immutable: the record itself is its copy
    copy = object.__new__(type(record))
    copy.__dict__.update(fields, **changes)
    copy.__dict__.pop(_HASH, None)
    return copy


_HASH = "_hash"


def cached_hash(record: object) -> int:
    """A frozen record's hash, computed once (``__hash__ = cached_hash`` in
    its class): the search hashes every state it reaches, and a state's
    world or controller is often the one it came from, unchanged."""
    values = record.__dict__
    try:
        return values[_HASH]  # type: ignore[no-any-return]
    except KeyError:
        names = type(record).__dataclass_fields__  # type: ignore[attr-defined]
        values[_HASH] = result = hash(tuple([values[name] for name in names]))
        return result


def at(moment: int) -> str:
    """The tower's clock at ``moment`` (a minute each), as the agent writes it."""
    return (EPOCH + dt.timedelta(minutes=moment)).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class TowerJob:
    """A tower job GPU Handoff asked for, and (once it ran) what it did."""

    kind: JobKind
    vm: str | None
    ran: bool = False
    failed: bool = False
    shut_down: frozenset[str] = frozenset()
    started_gpu: bool = False
    created: int = 0


@dataclass(frozen=True)
class World:
    """The tower and the GPU node's Kubernetes node."""

    __hash__ = cached_hash

    gpu: str = RUNNING
    lent: frozenset[str] = frozenset(CARDS.values())  # the cards it runs with
    vms: tuple[str, str] = (SHUT_OFF, SHUT_OFF)
    hooks: tuple[tuple[str, int], ...] = ()  # starts by hand: (vm, time)
    # The hook's stops of the GPU node waiting to run (their times, in
    # order), and those that shut it down (a stop that found it off did
    # nothing): job "hook-<time>".
    hook_pending: tuple[int, ...] = ()
    hook_stopped: frozenset[int] = frozenset()
    job: TowerJob | None = None
    boot: int = 1
    ready_boot: int | None = 1  # the boot whose kubelet posted Ready, if Ready
    cordon: str | None = None  # CORDON_OWNER_US, OTHER, or none
    stale_mark: bool = False
    bare_pod: bool = False  # a pod nothing recreates
    start_fails: bool = False  # the next start of a gaming VM fails (vfio)
    ignores_shutdown: bool = False  # the GPU node ignores the next shutdown
    clock: int = 1
    # Invariant bookkeeping: the operator shut the GPU node down and nothing
    # asked for the cards back since.
    operator_off: bool = False
    # A request for the cards back (return_cards, a session GPU Handoff
    # knows of ending) GPU Handoff has not acted on yet: an operator's
    # shutdown after it is not held against GPU Handoff (as in the soak).
    edge: bool = False
    # The last to shut the GPU node down was the operator (left as they left
    # it: not a half state).
    off_by_operator: bool = False

    def state(self, vm: str) -> str:
        return self.gpu if vm == GPU else self.vms[VMS.index(vm)]

    def with_vm(self, vm: str, state: str) -> World:
        states = list(self.vms)
        states[VMS.index(vm)] = state
        return replace(self, vms=(states[0], states[1]))

    def running(self, vm: str) -> bool:
        return self.state(vm) == RUNNING

    def playing(self) -> set[str]:
        return {vm for vm in VMS if self.running(vm)}

    def free(self) -> frozenset[str]:
        """The cards no running gaming VM holds."""
        return frozenset(CARDS[vm] for vm in VMS if not self.running(vm))

    def gpu_holds(self, vm: str) -> bool:
        return self.gpu == RUNNING and CARDS[vm] in self.lent

    @property
    def ready(self) -> bool:
        return self.ready_boot is not None

    def job_runs_next(self) -> bool:
        """GPU Handoff's job runs before the hook's stop (the agent runs one
        job at a time, in the order they were asked for)."""
        job = self.job
        return (
            job is not None
            and not job.ran
            and (not self.hook_pending or job.created < self.hook_pending[0])
        )

    def hook_runs_next(self) -> bool:
        return bool(self.hook_pending) and not (
            self.job is not None
            and not self.job.ran
            and self.job.created < self.hook_pending[0]
        )

    @property
    def hook_stop(self) -> bool:
        """A stop of the GPU node the hook asked for is under way."""
        return bool(self.hook_pending)

    def hook_job_done(self, job_id: str) -> bool:
        return hook_time(job_id) not in self.hook_pending

    def hook_job_stopped(self, job_id: str) -> bool:
        return hook_time(job_id) in self.hook_stopped

    def job_on_gpu(self) -> bool:
        """A tower job may still stop (or start) the GPU node."""
        if self.hook_stop:
            return True
        job = self.job
        return (
            job is not None
            and not job.ran
            and job.kind in (JobKind.HANDOFF, JobKind.RELEASE, JobKind.LEND)
        )

    # --- as the product reads it ------------------------------------------------

    def tower_status(self) -> TowerStatus:
        """The agent's status of this world (the same object for an equal
        world: each step asks for it several times)."""
        return _tower_status(self)

    def _status(self) -> TowerStatus:
        domains = {GPU: _domain(GPU, self.gpu, None, self._gpu_cards())}
        for vm in VMS:
            state = self.state(vm)
            domains[vm] = _domain(
                vm,
                SHUT_OFF if state == FAILED else state,
                START_FAILED if state == FAILED else None,
                (CARDS[vm],),
            )
        jobs: list[Job] = []
        jobs.extend(
            _job(f"hook-{time}", JobKind.STOP, GPU, "hook")
            for time in self.hook_pending
        )
        if self.job is not None and not self.job.ran:
            jobs.append(_job("ours", self.job.kind, self.job.vm, "ssh"))
        return TowerStatus(
            uri="test:///explorer",
            gpu_node=GPU,
            gaming=VMS,
            domains=domains,
            cards=tuple(
                Card(address=f"{card}.0", held_by=self._holder(card), claimed_by=())
                for card in CARDS.values()
            ),
            findings=(),
            hook_requests=tuple(
                HookRequest(
                    domain=vm,
                    operation="prepare",
                    addresses=(f"{CARDS[vm]}.0",),
                    time=at(time),
                    job=f"hook-{time}",
                    error=None,
                )
                for vm, time in self.hooks
            ),
            active_jobs=tuple(jobs),
            virsh_calls=0,
        )

    def _gpu_cards(self) -> tuple[str, ...]:
        return tuple(sorted(self.lent if self.gpu == RUNNING else CARDS.values()))

    def _holder(self, card: str) -> str | None:
        for vm in VMS:
            if self.running(vm) and CARDS[vm] == card:
                return vm
        return GPU if self.gpu == RUNNING and card in self.lent else None

    def node_view(self) -> NodeView:
        return NodeView(
            name=GPU,
            ready=self.ready,
            unschedulable=self.cordon is not None,
            cordon_owner=self.cordon,
            lease_age=1.0,
            gpu_capacity=len(self.lent) if self.ready else 0,
            gpu_allocatable=len(self.lent) if self.ready else 0,
            gpu_requested=0,
            pods=1 if self.bare_pod else 0,
            evictable_pods=0,
            stale_mark=self.stale_mark,
            boot_id=str(self.boot),
            unmanaged=("default/debug",) if self.bare_pod else (),
        )

    def our_cordon(self) -> bool:
        return self.cordon == CORDON_OWNER_US


@lru_cache(maxsize=4096)
def _tower_status(world: World) -> TowerStatus:
    return world._status()


def hook_time(job_id: str) -> int:
    return int(job_id.removeprefix("hook-"))


def _domain(
    name: str, state: str, reason: str | None, cards: tuple[str, ...]
) -> DomainState:
    devices = tuple(
        HostDevice(address=f"{card}.0", managed=True, rom_bar=None) for card in cards
    )
    return DomainState(
        name=name,
        title=name,
        role="gpu_node" if name == GPU else "gaming",
        exists=True,
        state=state,
        reason=reason,
        agent_channel=True,
        agent_ready=None,
        hostdevs=devices,
        defined_hostdevs=(
            tuple(
                HostDevice(address=f"{card}.0", managed=True, rom_bar=None)
                for card in sorted(CARDS.values())
            )
            if name == GPU
            else None
        ),
    )


def _job(job_id: str, kind: JobKind, domain: str | None, by: str) -> Job:
    return Job(
        id=job_id,
        kind=kind,
        domain=domain,
        state=JobState.RUNNING,
        step=None,
        request_id=None,
        requested_by=by,
        created=at(0),
        finished=None,
        error=None,
    )
