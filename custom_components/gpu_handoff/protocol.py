"""Every message the tower agent sends, typed; no Home Assistant imports.

One module parses what the agent says, wherever it is said: one-shot replies,
the session's replies and its pushed messages. Parsing checks the type of
every field it reads and fails with ``ProtocolError`` when a field is missing
or has the wrong type. With ``strict=True`` it also fails on fields it does
not know: the contract tests drive the real agent through every message kind
with strict parsing, so the agent and the integration cannot disagree on a
field unnoticed (a job's ``args`` once arrived as a mapping while this side
read a list).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
import json
from typing import Any, Final

from .tower.gpu_handoff import wire
from .tower.gpu_handoff.wire import Word

PROTOCOL: Final = wire.PROTOCOL
RUNNING: Final = "running"
SHUT_OFF: Final = "shut_off"
# virsh's "in shutdown" (VIR_DOMAIN_SHUTDOWN): the guest has powered off and
# libvirt is ending its QEMU process, which still holds its devices.
IN_SHUTDOWN: Final = "in_shutdown"
# libvirt's reason for a domain shut off by a start that failed
# (VIR_DOMAIN_SHUTOFF_FAILED, "shut off (failed)" in virsh domstate --reason).
START_FAILED: Final = "failed"
# Who asked for a job: libvirt's hook (a gaming VM started by hand).
REQUESTED_BY_HOOK: Final = "hook"
# The first agent whose lend job leaves out the cards held for a gaming VM
# (`lend GAMING`): older ones lend every free card.
AGENT_KEEPS: Final = (0, 3, 7)


def version_key(version: str) -> tuple[int, ...] | None:
    """``"0.3.0"`` -> ``(0, 3, 0)``; None for a version that is not dotted
    numbers (compared with nothing)."""
    parts = version.split(".")
    if not all(part.isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


# What a job does, where it is, its steps: the agent's own words (wire).
JobKind = wire.JobKind
JobState = wire.JobState
StepName = wire.StepName


class ProtocolError(ValueError):
    """A message does not have the shape this side expects."""


# --- reading fields ---------------------------------------------------------------


class _Reader:
    """Typed access to one JSON object, remembering which keys were read."""

    def __init__(self, data: Any, what: str, strict: bool) -> None:
        if not isinstance(data, Mapping):
            raise ProtocolError(
                f"{what}: expected an object, got {type(data).__name__}"
            )
        self.data = data
        self.what = what
        self.strict = strict
        self.read: set[str] = set()

    def _get(self, key: str, optional: bool) -> Any:
        self.read.add(key)
        if key not in self.data:
            if optional:
                return None
            raise ProtocolError(f"{self.what}: no {key!r}")
        return self.data[key]

    def _typed(self, key: str, kinds: tuple[type, ...], optional: bool) -> Any:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        # bool is an int in Python: never accept one for the other.
        if not isinstance(value, kinds) or (
            isinstance(value, bool) and bool not in kinds
        ):
            raise ProtocolError(
                f"{self.what}: {key!r} is {type(value).__name__}, expected "
                + " or ".join(kind.__name__ for kind in kinds)
            )
        return value

    def text(self, key: str) -> str:
        return str(self._typed(key, (str,), optional=False))

    def opt_text(self, key: str) -> str | None:
        value = self._typed(key, (str,), optional=True)
        return None if value is None else str(value)

    def flag(self, key: str) -> bool:
        return bool(self._typed(key, (bool,), optional=False))

    def opt_flag(self, key: str) -> bool | None:
        value = self._typed(key, (bool,), optional=True)
        return None if value is None else bool(value)

    def number(self, key: str) -> int:
        return int(self._typed(key, (int,), optional=False))

    def opt_number(self, key: str) -> int | None:
        value = self._typed(key, (int,), optional=True)
        return None if value is None else int(value)

    def opt_real(self, key: str) -> float | None:
        value = self._typed(key, (int, float), optional=True)
        return None if value is None else float(value)

    def texts(self, key: str) -> tuple[str, ...]:
        items = self._typed(key, (list,), optional=False)
        if not all(isinstance(item, str) for item in items):
            raise ProtocolError(f"{self.what}: {key!r} must hold strings")
        return tuple(items)

    def objects[T](
        self, key: str, parse: Callable[[Any, str, bool], T]
    ) -> tuple[T, ...]:
        items = self._typed(key, (list,), optional=False)
        return tuple(
            parse(item, f"{self.what}.{key}[{index}]", self.strict)
            for index, item in enumerate(items)
        )

    def object(self, key: str) -> _Reader:
        return _Reader(
            self._get(key, optional=False), f"{self.what}.{key}", self.strict
        )

    def opt_objects[T](
        self, key: str, parse: Callable[[Any, str, bool], T]
    ) -> tuple[T, ...] | None:
        if self._get(key, optional=True) is None:
            return None
        return self.objects(key, parse)

    def opt_object(self, key: str) -> _Reader | None:
        value = self._get(key, optional=True)
        if value is None:
            return None
        return _Reader(value, f"{self.what}.{key}", self.strict)

    def enum[E: Word](self, key: str, kind: type[E]) -> E:
        value = self.text(key)
        try:
            return kind(value)
        except ValueError as err:
            raise ProtocolError(f"{self.what}: {key!r} is {value!r}") from err

    def opt_enum[E: Word](self, key: str, kind: type[E]) -> E | None:
        value = self.opt_text(key)
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError as err:
            raise ProtocolError(f"{self.what}: {key!r} is {value!r}") from err

    def raw(self, key: str) -> Any:
        """A field as sent, for a parser of its own."""
        return self._get(key, optional=False)

    def ignore(self, *keys: str) -> None:
        """Fields this side knows and has no use for."""
        self.read.update(keys)

    def done(self) -> None:
        """In strict mode, every field the agent sent must have been read."""
        unknown = set(self.data) - self.read
        if self.strict and unknown:
            raise ProtocolError(f"{self.what}: unknown fields {sorted(unknown)}")


# --- the status ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HostDevice:
    """One PCI function in a domain's definition."""

    address: str
    managed: bool
    rom_bar: str | None


def _hostdev(data: Any, what: str, strict: bool) -> HostDevice:
    r = _Reader(data, what, strict)
    out = HostDevice(
        address=r.text("address"),
        managed=r.flag("managed"),
        rom_bar=r.opt_text("rom_bar"),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class DomainState:
    """One managed libvirt domain."""

    name: str
    title: str
    role: str
    exists: bool
    state: str | None
    reason: str | None
    agent_channel: bool
    agent_ready: bool | None
    hostdevs: tuple[HostDevice, ...]
    # The GPU node's persistent definition, where it differs from what it runs
    # with (cards lent to players through a live-only definition); None for
    # the gaming VMs and from older agents.
    defined_hostdevs: tuple[HostDevice, ...] | None = None

    @property
    def cards(self) -> tuple[str, ...]:
        """The PCI addresses it runs with (or is defined with, while off)."""
        return tuple(device.address for device in self.hostdevs)

    @property
    def defined_cards(self) -> tuple[str, ...]:
        """The PCI addresses of its persistent definition: all its own cards."""
        devices = (
            self.hostdevs if self.defined_hostdevs is None else self.defined_hostdevs
        )
        return tuple(device.address for device in devices)


def _domain(data: Any, what: str, strict: bool) -> DomainState:
    r = _Reader(data, what, strict)
    name = r.text("name")
    out = DomainState(
        name=name,
        title=r.opt_text("title") or name,
        role=r.text("role"),
        exists=r.flag("exists"),
        state=r.opt_text("state"),
        reason=r.opt_text("reason"),
        agent_channel=r.flag("agent_channel"),
        agent_ready=r.opt_flag("agent_ready"),
        hostdevs=r.objects("hostdevs", _hostdev),
        defined_hostdevs=r.opt_objects("defined_hostdevs", _hostdev),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class Card:
    """One PCI function: who holds it now, who claims it, and its IOMMU group
    (None: the tower has none for it; the card is then the unit)."""

    address: str
    held_by: str | None
    claimed_by: tuple[str, ...]
    iommu_group: int | None = None


def _card(data: Any, what: str, strict: bool) -> Card:
    r = _Reader(data, what, strict)
    out = Card(
        address=r.text("address"),
        held_by=r.opt_text("held_by"),
        claimed_by=r.texts("claimed_by"),
        iommu_group=r.opt_number("iommu_group"),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class Finding:
    """A configuration problem the agent found."""

    code: str
    domain: str | None
    detail: str


def _finding(data: Any, what: str, strict: bool) -> Finding:
    r = _Reader(data, what, strict)
    out = Finding(
        code=r.text("code"), domain=r.opt_text("domain"), detail=r.text("detail")
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class AgentError:
    """An error as the agent reports it: a code and a message."""

    code: str
    message: str


def _required_error(r: _Reader) -> AgentError:
    out = AgentError(code=r.text("code"), message=r.text("message"))
    r.done()
    return out


def _error(r: _Reader | None) -> AgentError | None:
    return None if r is None else _required_error(r)


@dataclass(frozen=True, kw_only=True)
class HookRequest:
    """A gaming VM started by hand, as the libvirt hook recorded it."""

    domain: str
    operation: str
    addresses: tuple[str, ...]
    time: str
    job: str | None
    error: AgentError | None

    @property
    def key(self) -> str:
        """What tells two requests apart."""
        return f"{self.time}|{self.domain}"


def _hook_request(data: Any, what: str, strict: bool) -> HookRequest:
    r = _Reader(data, what, strict)
    out = HookRequest(
        domain=r.text("domain"),
        operation=r.text("operation"),
        addresses=r.texts("addresses"),
        time=r.text("time"),
        job=r.opt_text("job"),
        error=_error(r.opt_object("error")),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class Job:
    """A tower job as listed (``status``' active jobs, ``jobs``, pushes)."""

    id: str
    kind: JobKind
    domain: str | None
    state: JobState
    step: StepName | None
    request_id: str | None
    requested_by: str
    created: str
    finished: str | None
    error: AgentError | None

    @property
    def domains(self) -> tuple[str, ...]:
        """The domains it acts on by name (a release with no gaming VM names
        none; a lend's gaming VM is the one whose cards it leaves alone)."""
        if self.domain is None or self.kind is JobKind.LEND:
            return ()
        return (self.domain,)


def _job_args(r: _Reader) -> str | None:
    args = r.object("args")
    domain = args.opt_text("domain")
    args.done()
    return domain


def _job(data: Any, what: str, strict: bool) -> Job:
    r = _Reader(data, what, strict)
    out = Job(
        id=r.text("id"),
        kind=r.enum("kind", JobKind),
        domain=_job_args(r),
        state=r.enum("state", JobState),
        step=r.opt_enum("step", StepName),
        request_id=r.opt_text("request_id"),
        requested_by=r.text("requested_by"),
        created=r.text("created"),
        finished=r.opt_text("finished"),
        error=_error(r.opt_object("error")),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class TowerStatus:
    """The tower as the agent sees it (``status``, and the session's pushes)."""

    uri: str
    gpu_node: str
    gaming: tuple[str, ...]
    domains: dict[str, DomainState]
    cards: tuple[Card, ...]
    findings: tuple[Finding, ...]
    hook_requests: tuple[HookRequest, ...]
    active_jobs: tuple[Job, ...]
    virsh_calls: int
    # Seconds since the session computed it (None: computed for this reply).
    age: float | None = None

    def cards_held_by(self, domain: str) -> tuple[Card, ...]:
        """The PCI functions ``domain`` holds now."""
        return tuple(card for card in self.cards if card.held_by == domain)

    def gpus_held_by(self, domain: str) -> int:
        """Cards (PCI devices, each with its functions) ``domain`` holds now."""
        return len(
            {card.address.rsplit(".", 1)[0] for card in self.cards_held_by(domain)}
        )

    def blocked_by(self, card: Card) -> str | None:
        """Who keeps a PCI function nobody holds from being passed through:
        a running domain that holds a function of its IOMMU group (libvirt
        passes a group through whole), or of its card. None if it is free
        (or held: see ``held_by``)."""
        if card.held_by is not None:
            return None
        device = card.address.rsplit(".", 1)[0]
        for other in self.cards:
            if other.held_by is None:
                continue
            if other.address.rsplit(".", 1)[0] == device or (
                card.iommu_group is not None and other.iommu_group == card.iommu_group
            ):
                return other.held_by
        return None

    def job_for(self, domain: str) -> Job | None:
        """The active job acting on ``domain``: a stop or start of it, or for
        the GPU node a handoff, a release or a lend (which name no GPU node
        but stop or start it)."""
        for job in self.active_jobs:
            if domain in job.domains or (
                domain == self.gpu_node
                and job.kind in (JobKind.HANDOFF, JobKind.RELEASE, JobKind.LEND)
            ):
                return job
        return None


def _status_fields(r: _Reader) -> TowerStatus:
    domains = r.objects("domains", _domain)
    return TowerStatus(
        uri=r.text("uri"),
        gpu_node=r.text("gpu_node"),
        gaming=r.texts("gaming"),
        domains={domain.name: domain for domain in domains},
        cards=r.objects("cards", _card),
        findings=r.objects("findings", _finding),
        hook_requests=r.objects("hook_requests", _hook_request),
        active_jobs=r.objects("active_jobs", _job),
        virsh_calls=r.number("virsh_calls"),
        age=r.opt_real("age"),
    )


def parse_status(data: Any, *, strict: bool = False) -> TowerStatus:
    """A ``status`` reply (or a pushed status body)."""
    r = _Reader(data, "status", strict)
    r.ignore("protocol", "ok", "type", "id")
    out = _status_fields(r)
    r.done()
    return out


# --- jobs -------------------------------------------------------------------------------


# The details of a step that succeeded with nothing to do (the agent's
# step_start and step_start_free: the domain was running already).
NOTHING_DONE: Final = frozenset({"already running"})


@dataclass(frozen=True, kw_only=True)
class JobStep:
    """One step of a job record."""

    name: StepName
    domain: str
    started: str | None
    finished: str | None
    result: str | None
    detail: str | None


def _step(data: Any, what: str, strict: bool) -> JobStep:
    r = _Reader(data, what, strict)
    out = JobStep(
        name=r.enum("name", StepName),
        domain=r.text("domain"),
        started=r.opt_text("started"),
        finished=r.opt_text("finished"),
        result=r.opt_text("result"),
        detail=r.opt_text("detail"),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """A job with its steps (``job``, ``request``, and pushed job progress)."""

    job: Job
    steps: tuple[JobStep, ...]
    step_index: int | None = None

    def did(self, step: StepName, domain: str) -> bool:
        """Whether the job ran ``step`` on ``domain`` to success: a step it
        skipped (the domain was shut off or running already) did nothing."""
        return any(
            s.name is step
            and s.domain == domain
            and s.result == "ok"
            and s.detail not in NOTHING_DONE
            for s in self.steps
        )

    @property
    def current(self) -> JobStep | None:
        """The step it is at, if it is at one."""
        if self.step_index is not None and self.step_index < len(self.steps):
            return self.steps[self.step_index]
        if self.job.step is not None:
            for step in self.steps:
                if step.name == self.job.step and step.result is None:
                    return step
        return None


def _job_record(data: Any, what: str, strict: bool) -> JobRecord:
    """The full record the ``job`` verb answers (step as an index)."""
    r = _Reader(data, what, strict)
    index = r.opt_number("step")
    steps = r.objects("steps", _step)
    current = steps[index] if index is not None and index < len(steps) else None
    job = Job(
        id=r.text("id"),
        kind=r.enum("kind", JobKind),
        domain=_job_args(r),
        state=r.enum("state", JobState),
        step=current.name if current is not None else None,
        request_id=r.opt_text("request_id"),
        requested_by=r.text("requested_by"),
        created=r.text("created"),
        finished=r.opt_text("finished"),
        error=_error(r.opt_object("error")),
    )
    r.ignore("created_epoch", "started", "runner")
    r.done()
    return JobRecord(job=job, steps=steps, step_index=index)


def parse_job_reply(data: Any, *, strict: bool = False) -> JobRecord:
    """A ``job ID`` or ``request RID`` reply."""
    r = _Reader(data, "job reply", strict)
    r.ignore("protocol", "ok", "type", "id")
    out = _job_record(r.raw("job"), "job reply.job", strict)
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class Submitted:
    """The answer to a job request: the job, and whether it already existed
    (the same request id was submitted before)."""

    id: str
    kind: JobKind
    state: JobState
    existing: bool


def parse_submitted(data: Any, *, strict: bool = False) -> Submitted:
    """A ``stop``/``start``/``handoff``/``release`` reply."""
    r = _Reader(data, "submit reply", strict)
    r.ignore("protocol", "ok", "type", "id")
    job = r.object("job")
    out = Submitted(
        id=job.text("id"),
        kind=job.enum("kind", JobKind),
        state=job.enum("state", JobState),
        existing=r.flag("existing"),
    )
    job.ignore("runner", "request_id")
    job.done()
    r.done()
    return out


def parse_jobs(data: Any, *, strict: bool = False) -> tuple[Job, ...]:
    """A ``jobs`` reply, newest first."""
    r = _Reader(data, "jobs reply", strict)
    r.ignore("protocol", "ok", "type", "id")
    out = r.objects("jobs", _job)
    r.done()
    return out


# --- version, screenshot ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Version:
    """What ``version`` (and a session's hello) says."""

    protocol: int
    version: str
    verbs: tuple[str, ...]
    # The tower's name (the agent's "name" setting, else its host name);
    # None from an agent older than this field.
    host_name: str | None = None


def parse_version(data: Any, *, strict: bool = False) -> Version:
    """A ``version`` reply or a session's ``hello``."""
    r = _Reader(data, "version", strict)
    r.ignore("ok", "type", "id", "python")
    out = Version(
        protocol=r.number("protocol"),
        version=r.text("version"),
        verbs=r.texts("verbs"),
        host_name=r.opt_text("host_name"),
    )
    r.done()
    return out


@dataclass(frozen=True, kw_only=True)
class Screenshot:
    """A VM's screen as the agent captured it (base64 in ``data``)."""

    domain: str
    mime: str
    size: int
    data: str = field(repr=False)


def parse_screenshot(data: Any, *, strict: bool = False) -> Screenshot:
    """A ``screenshot`` reply."""
    r = _Reader(data, "screenshot", strict)
    r.ignore("protocol", "ok", "type", "id")
    out = Screenshot(
        domain=r.text("domain"),
        mime=r.text("mime"),
        size=r.number("size"),
        data=r.text("data"),
    )
    r.done()
    return out


# --- the session's pushed messages --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LibvirtEvent:
    """A libvirt event for a managed domain (``virsh event --timestamp``)."""

    time: str
    domain: str
    event: str
    action: str | None = None
    detail: str | None = None
    state: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class StatusPush:
    """The tower's state changed; here it is."""

    status: TowerStatus


@dataclass(frozen=True, kw_only=True)
class JobPush:
    """A job record changed."""

    record: JobRecord


@dataclass(frozen=True, kw_only=True)
class ErrorPush:
    """The agent lost something it watches: libvirt's event stream
    (``source`` "events") or the tower's state ("status")."""

    error: AgentError
    source: str | None = None


@dataclass(frozen=True, kw_only=True)
class Hello:
    """The first line of a session."""

    version: Version


type Push = LibvirtEvent | StatusPush | JobPush | ErrorPush | Hello


def _pushed_job(data: Any, strict: bool) -> JobRecord:
    r = _Reader(data, "job push", strict)
    r.ignore("protocol", "type")
    job = _job(r.raw("job"), "job push.job", strict)
    steps = r.objects("steps", _step)
    r.done()
    return JobRecord(job=job, steps=steps)


def parse_push(data: Any, *, strict: bool = False) -> Push:
    """One message the agent pushed on a session (or on ``watch``)."""
    r = _Reader(data, "message", strict)
    kind = r.text("type")
    if kind == "hello":
        return Hello(version=parse_version(data, strict=strict))
    if kind == "status":
        r.ignore("protocol")
        status = parse_status(r.raw("status"), strict=strict)
        r.done()
        return StatusPush(status=status)
    if kind == "job":
        return JobPush(record=_pushed_job(data, strict))
    if kind == "error":
        r.ignore("protocol", "ok")
        error = _required_error(r.object("error"))
        source = r.opt_text("source")
        r.done()
        return ErrorPush(error=error, source=source)
    if kind == "event":
        r.ignore("protocol")
        out = LibvirtEvent(
            time=r.text("time"),
            domain=r.text("domain"),
            event=r.text("event"),
            action=r.opt_text("action"),
            detail=r.opt_text("detail"),
            state=r.opt_text("state"),
            reason=r.opt_text("reason"),
        )
        r.done()
        return out
    raise ProtocolError(f"message: unknown type {kind!r}")


# --- lines --------------------------------------------------------------------------------


def decode_line(line: str) -> dict[str, Any]:
    """One line of the agent's output as a JSON object."""
    try:
        message = json.loads(line)
    except ValueError as err:
        raise ProtocolError(f"not JSON: {line[:200]!r}") from err
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {line[:200]!r}")
    return message


def error_of(message: Mapping[str, Any]) -> AgentError | None:
    """The error a reply or message carries, if it is one."""
    if message.get("ok") is False or message.get("type") == "error":
        raw = message.get("error")
        if isinstance(raw, Mapping):
            return AgentError(
                code=str(raw.get("code", "unknown")),
                message=str(raw.get("message", "")),
            )
        return AgentError(code="unknown", message="")
    return None
