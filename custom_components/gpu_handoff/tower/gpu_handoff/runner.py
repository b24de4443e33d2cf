"""A job's runner: the steps of a stop, a start, a handoff, a release, a lend.

One runner process per job, in turn with the tower's lock. Every stop is a
graceful shutdown through the guest agent (or ACPI, if configured); a stop
that does not finish in time fails the job and leaves the domain running.
A start waits for the cards the VM needs to be free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import sys
import time
import xml.etree.ElementTree as ET

from .config import Config
from .jobs import job_path, job_work, jobs_dir, plan_job
from .observe import Snapshot, card_of, observe
from .state import (
    internal_error,
    log_internal,
    open_lock_at,
    read_json_at,
    state_dir_fd,
    write_json_at,
    write_json_atomic,
)
from .virsh import (
    Virsh,
    VirshResult,
    cmd_create,
    cmd_defined_xml,
    cmd_domstate,
    cmd_ping,
    cmd_shutdown,
    cmd_start,
    parse_domstate,
    pci_address,
)
from .wire import (
    _STREAM_ERRORS,
    ERR_AGENT_TIMEOUT,
    ERR_DEVICES_BUSY,
    ERR_DOMAIN_MISSING,
    ERR_RUNNER_DIED,
    ERR_SHUTDOWN_REFUSED,
    ERR_SHUTDOWN_TIMEOUT,
    ERR_START_FAILED,
    STOP_STEPS,
    AgentError,
    JsonObj,
    now_iso,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

# A job's virsh call that finds libvirt away (libvirtd restarting) is tried
# again for this long: a restart takes seconds, a handoff must not fail on it.
JOB_LIBVIRT_WAIT = 60.0


class JobRunner:
    """Executes one job's steps (inside the detached runner)."""

    def __init__(self, cfg: Config, job: JsonObj, virsh: Virsh) -> None:
        self.cfg = cfg
        self.job = job
        self.virsh = virsh
        self.path = job_path(cfg, job["id"])

    def save(self) -> None:
        write_json_atomic(self.path, self.job, self.cfg.state_dir)

    def begin(self, index: int) -> JsonObj:
        step: JsonObj = self.job["steps"][index]
        self.job["step"] = index
        step["started"] = now_iso()
        self.save()
        return step

    def end(self, step: JsonObj, result: str, detail: Optional[str]) -> None:
        step["finished"] = now_iso()
        step["result"] = result
        step["detail"] = detail
        self.save()

    def skip_rest(self, index: int, domain: str, detail: str) -> None:
        """Skip the rest of this stop (or start) of `domain`: a lend job's
        start of the GPU node still runs after its stop was skipped."""
        group = STOP_STEPS if self.job["steps"][index]["name"] in STOP_STEPS else None
        for step in self.job["steps"][index:]:
            if group is not None and step["name"] not in group:
                continue
            if step["domain"] == domain and step["result"] is None:
                step["started"] = step["started"] or now_iso()
                self.end(step, "skipped", detail)

    def state_of(self, domain: str) -> str:
        result = self.virsh.run(cmd_domstate(domain))
        if result.rc != 0:
            raise AgentError(ERR_DOMAIN_MISSING, result.error_text())
        return parse_domstate(result.out)[0]

    def agent_ready(self, domain: str) -> bool:
        result = self.virsh.run(cmd_ping(domain))
        return result.rc == 0 and '"return"' in result.out

    def run(self) -> None:
        for index, step in enumerate(self.job["steps"]):
            if step["result"] is None:
                handler: Callable[[int, JsonObj], None] = getattr(
                    self, "step_" + step["name"]
                )
                handler(index, step)

    def step_wait_agent(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_agent
        while True:
            state = self.state_of(domain)
            if state == "shut_off":
                self.skip_rest(index, domain, "already shut off")
                return
            if state == "in_shutdown":
                self.end(step, "ok", "already shutting down")
                return
            self.refuse_held(step, domain, state)
            if self.agent_ready(domain):
                self.end(step, "ok", "guest agent answered guest-ping")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"guest agent of {domain!r} did not answer within "
                    f"{self.cfg.timeout_agent:g} s; no stop was sent, the domain is left running"
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_AGENT_TIMEOUT, message)
            time.sleep(self.cfg.poll_interval)

    def refuse_held(self, step: JsonObj, domain: str, state: str) -> None:
        """Fail the step at once for a domain that is running but cannot shut
        down: libvirt refuses a guest agent command and every shutdown of a
        domain that is not RUNNING ("domain is not running",
        qemuDomainAgentAvailable, qemuDomainShutdownFlagsAgent/Monitor), so
        waiting would only reach a timeout without saying why."""
        why = HELD_STATES.get(state)
        if why is None:
            return
        message = (
            f"{domain!r} is {state.replace('_', ' ')}: {why}; "
            "it was left as it is (never forced off)"
        )
        self.end(step, "failed", message)
        raise AgentError(ERR_SHUTDOWN_REFUSED, message)

    def step_shutdown(self, index: int, step: JsonObj) -> None:
        """Ask each shutdown mode in turn until one is accepted.

        `shutdown --mode agent` waits until the guest is off, or fails after
        libvirt's 60 s (`Guest agent is not responding: Guest agent not
        available for now`) although the guest may still be going down; and
        a guest shutting itself down has let its guest agent go seconds
        before the power-off (`QEMU guest agent is not connected`). After
        such a refusal the domain is given the shutdown timeout to be shut
        off: then it is stopped; else the step fails. Never destroyed.
        """
        domain = step["domain"]
        self.begin(index)
        refusals: List[str] = []
        going_down = False
        for mode in self.cfg.shutdown_modes:
            result = self.virsh.run(cmd_shutdown(domain, mode))
            if result.rc == 0:
                self.end(step, "ok", f"shutdown --mode {mode} accepted")
                return
            going_down = going_down or may_be_going_down(result)
            if not going_down:
                state = self.state_of(domain)
                if state == "shut_off" and (refusals or not was_not_running(result)):
                    # An earlier mode's request (or this one) took it down
                    # while libvirt answered with an error: this step did.
                    error = "; ".join([*refusals, f"{mode}: {result.error_text()}"])
                    self.end(step, "ok", f"shut off; libvirt answered: {error}")
                    return
                if state == "shut_off":
                    self.skip_rest(index, domain, "already shut off")
                    return
                # the guest powered off itself meanwhile: libvirt ends it
                going_down = state == "in_shutdown"
                if not going_down:
                    self.refuse_held(step, domain, state)
            refusals.append(f"{mode}: {result.error_text()}")
        refused = "; ".join(refusals)
        if going_down and self.shut_off_within(domain, self.cfg.timeout_shutdown):
            self.end(step, "ok", f"shut off after the shutdown was refused ({refused})")
            return
        message = f"{domain!r} refused every shutdown mode: {refused}"
        if going_down:
            message += (
                f"; still running {self.cfg.timeout_shutdown:g} s later, "
                "left running (never forced off)"
            )
        self.end(step, "failed", message)
        raise AgentError(ERR_SHUTDOWN_REFUSED, message)

    def shut_off_within(self, domain: str, seconds: float) -> bool:
        """Whether the domain is shut off within `seconds` (polled)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.state_of(domain) == "shut_off":
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.cfg.poll_interval)

    def step_wait_shut_off(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_shutdown
        while True:
            if self.state_of(domain) == "shut_off":
                self.end(step, "ok", "shut off")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"{domain!r} did not shut off within {self.cfg.timeout_shutdown:g} s; "
                    "it is left running (never forced off)"
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_SHUTDOWN_TIMEOUT, message)
            time.sleep(self.cfg.poll_interval)

    def defined(self, step: JsonObj) -> Tuple[Snapshot, JsonObj]:
        """The tower now and the step's domain in it; the step fails with
        domain_missing when libvirt does not define it (any more)."""
        domain = step["domain"]
        snap = observe(self.cfg, self.virsh, ping=False)
        mine = snap.domains.get(domain)
        if mine is None or not mine["exists"]:
            message = f"domain {domain!r} is not defined in libvirt"
            self.end(step, "failed", message)
            raise AgentError(ERR_DOMAIN_MISSING, message)
        return snap, mine

    def step_wait_devices_free(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_start
        while True:
            snap, mine = self.defined(step)
            if Snapshot.holds(mine):
                self.skip_rest(index, domain, "already running")
                return
            # libvirt refuses a function another domain holds, or any
            # function of its IOMMU group (see busy_cards).
            wanted = {d["address"] for d in mine["hostdevs"]}
            groups = {snap.groups.get(address) for address in wanted} - {None}
            busy = sorted(
                f"{d['address']} held by {name}"
                for name, other in snap.all_domains().items()
                if name != domain and Snapshot.holds(other)
                for d in other["hostdevs"]
                if d["address"] in wanted or snap.groups.get(d["address"]) in groups
            )
            if not busy:
                self.end(step, "ok", "no running domain holds its PCI functions")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"PCI functions of {domain!r} still busy after "
                    f"{self.cfg.timeout_start:g} s: " + ", ".join(busy)
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_DEVICES_BUSY, message)
            step["detail"] = "waiting: " + ", ".join(busy)
            self.save()
            time.sleep(self.cfg.poll_interval)

    def start_retrying(
        self, domain: str, attempt: Callable[[], VirshResult]
    ) -> VirshResult:
        """A start, tried again while it fails on a VFIO device still busy.

        Just after a domain stopped, its QEMU process may not be gone yet and
        the VFIO group it held still open: the next start's QEMU fails to open
        it ("failed to open /dev/vfio/N: Device or resource busy") although
        libvirt released the device. A few seconds later the same start works;
        so such a failure of a domain that stayed shut off is tried again, a
        bounded number of times (START_BUSY_RETRIES)."""
        result = attempt()
        for delay in START_BUSY_RETRIES:
            if result.rc == 0 or not vfio_busy(result):
                return result
            if self.state_of(domain) != "shut_off":
                return result
            time.sleep(delay)
            result = attempt()
        return result

    def step_start(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        result = self.start_retrying(domain, lambda: self.virsh.run(cmd_start(domain)))
        if result.rc == 0:
            self.end(step, "ok", "started")
            return
        if self.state_of(domain) not in ("shut_off",):
            self.end(step, "ok", "already running")
            return
        message = f"start of {domain!r} failed: {result.error_text()}"
        self.end(step, "failed", message)
        raise AgentError(ERR_START_FAILED, message)

    def step_start_free(self, index: int, step: JsonObj) -> None:
        """Start the GPU node with every card of its persistent definition
        that no other running domain holds: with all of them through its own
        definition (`start`), with some through a live-only definition
        (`create`), with none not at all.

        The persistent definition is never written: a crash, a power cut or
        a kill at any instruction leaves it as it was, and the GPU node's next
        plain start has every card again.
        """
        domain = step["domain"]
        self.begin(index)
        snap, mine = self.defined(step)
        if Snapshot.holds(mine):
            self.end(step, "ok", "already running")
            return
        args = self.job.get("args")
        keep = args.get("domain") if isinstance(args, dict) else None
        busy = busy_cards(snap, domain, keep=keep)
        defined = self.virsh.run(cmd_defined_xml(domain))
        if defined.rc != 0:
            message = (
                f"cannot read the definition of {domain!r}: {defined.error_text()}"
            )
            self.end(step, "failed", message)
            raise AgentError(ERR_START_FAILED, message)
        try:
            live, kept, left = live_definition(defined.out, busy)
        except ET.ParseError as err:
            message = (
                f"the definition of {domain!r} is not XML libvirt would give: {err}"
            )
            self.end(step, "failed", message)
            raise AgentError(ERR_START_FAILED, message) from err
        if not kept and left:
            self.end(step, "skipped", "every card is in use: the GPU node stays off")
            return
        if not left:
            result = self.start_retrying(
                domain, lambda: self.virsh.run(cmd_start(domain))
            )
            detail = "started with every card"
        else:
            result = self.start_retrying(domain, lambda: self._create(live))
            detail = "started without " + ", ".join(left) + " (live definition only)"
        if result.rc == 0:
            self.end(step, "ok", detail)
            return
        if self.state_of(domain) != "shut_off":
            self.end(step, "ok", "already running")
            return
        message = f"start of {domain!r} failed: {result.error_text()}"
        self.end(step, "failed", message)
        raise AgentError(ERR_START_FAILED, message)

    def _create(self, xml_text: str) -> VirshResult:
        """`virsh create` from a private temporary file, removed afterwards."""
        import tempfile  # only a live definition change needs it

        tmpdir = tempfile.mkdtemp(prefix="gpu-handoff-live-")
        try:
            path = os.path.join(tmpdir, "live.xml")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(xml_text)
            return self.virsh.run(cmd_create(path))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


# A refused shutdown after which the guest may still be going down: the
# guest agent did not answer in time or is gone (VIR_ERR_AGENT_UNRESPONSIVE:
# qemuAgentSend's 60 s wait for the power-off, an agent that left with the
# guest's own shutdown), the agent job was held by another call
# (VIR_ERR_OPERATION_TIMEOUT), or virsh itself was given up on.
GOING_DOWN_ERRORS = (
    "error: Guest agent is not responding:",
    "error: Timed out during operation:",
)


# Running domains that cannot be shut down: libvirt needs VIR_DOMAIN_RUNNING
# for the guest agent and for every shutdown mode; why, for the user.
HELD_STATES = {
    "paused": "a paused domain answers neither its guest agent nor a shutdown "
    "until it is resumed (virsh resume)",
    "crashed": "the guest crashed (it panicked) and is kept for inspection; "
    "it cannot shut down",
    "pmsuspended": "the guest is suspended (sleeping); wake it first",
    "blocked": "the domain is blocked on a resource",
}

# After a stop the next start may find the VFIO group still open by the old
# QEMU for a moment: it is tried again after these pauses (seconds).
START_BUSY_RETRIES = (1.0, 2.0, 4.0)
VFIO_BUSY_RE = re.compile(r"vfio .*Device or resource busy")


def vfio_busy(result: VirshResult) -> bool:
    """Whether a failed start failed on a VFIO device still busy (QEMU's
    EBUSY opening /dev/vfio/N)."""
    return bool(VFIO_BUSY_RE.search(result.err))


def was_not_running(result: VirshResult) -> bool:
    """libvirt refused a shutdown because the domain was not running when it
    looked (virDomainObjCheckActive: VIR_ERR_OPERATION_INVALID, "domain is
    not running")."""
    return "domain is not running" in result.err


def may_be_going_down(result: VirshResult) -> bool:
    return result.timed_out or any(
        line.startswith(GOING_DOWN_ERRORS) for line in result.err.splitlines()
    )


def busy_cards(snap: Snapshot, domain: str, keep: Optional[str] = None) -> List[str]:
    """The cards `domain` cannot start with now: those a running domain other
    than `domain` holds a function of, and every card of an IOMMU group it
    holds a function of. Those of `keep` (a gaming VM Home Assistant holds
    cards for: it starts soon) count as held by it, running or not.

    libvirt passes a VFIO group through whole: before a start it checks every
    function of the group of each of the domain's functions, and refuses the
    start when another domain holds one ("PCI device ADDR is in use by driver
    QEMU, domain X", src/hypervisor/virhostdev.c,
    virHostdevPreparePCIDevicesImpl), even one the domain does not have. On a
    board without ACS two cards can share a group: the group, not the card,
    is then what can be lent.
    """
    blocked = {
        unit
        for name, other in snap.all_domains().items()
        if name != domain and (Snapshot.holds(other) or name == keep)
        for dev in other["hostdevs"]
        for unit in snap.units(dev["address"])
    }
    return sorted(
        {
            card_of(address)
            for address in snap.addresses()
            if blocked.intersection(snap.units(address))
        }
    )


# Namespaces libvirt domain XML uses, kept under their usual prefixes when a
# live definition is written back (ElementTree would call them ns0, ns1...).
LIBVIRT_NAMESPACES = {
    "qemu": "http://libvirt.org/schemas/domain/qemu/1.0",
    "lxc": "http://libvirt.org/schemas/domain/lxc/1.0",
    "bhyve": "http://libvirt.org/schemas/domain/bhyve/1.0",
    "xen": "http://libvirt.org/schemas/domain/xen/1.0",
    "vmware": "http://libvirt.org/schemas/domain/vmware/1.0",
    "test": "http://libvirt.org/schemas/domain/test/1.0",
}


def live_definition(xml_text: str, busy: List[str]) -> Tuple[str, List[str], List[str]]:
    """The persistent definition without the PCI hostdevs of `busy` cards:
    (XML, cards kept, cards left out)."""
    for prefix, uri in LIBVIRT_NAMESPACES.items():
        ET.register_namespace(prefix, uri)
    root = ET.fromstring(xml_text)  # noqa: S314 - XML from libvirt itself
    kept: List[str] = []
    left: List[str] = []
    devices = root.find("./devices")
    for dev in list(devices) if devices is not None else []:
        if dev.tag != "hostdev" or dev.get("type") != "pci":
            continue
        if dev.get("mode", "subsystem") != "subsystem":
            continue
        addr = dev.find("./source/address")
        if addr is None:
            continue
        card = card_of(pci_address(addr))
        target = left if card in busy else kept
        if card not in target:
            target.append(card)
        if card in busy and devices is not None:
            devices.remove(dev)
    return ET.tostring(root, encoding="unicode"), kept, left


# What stops a runner before its job is over, and why that comes: systemd
# stops its unit with SIGTERM (`systemctl stop`, the user's manager or the
# system shutting down), sent to every process of the unit (KillMode=
# control-group: a virsh the runner waits for gets it too); SIGHUP and SIGINT
# reach a runner started by hand from a terminal.
RUNNER_STOP_SIGNALS: Dict[int, str] = {
    signal.SIGTERM: "the system is shutting down or its unit was stopped",
    signal.SIGHUP: "its terminal or session went away",
    signal.SIGINT: "it was interrupted",
}


class RunnerStopped(BaseException):
    """A stop signal reached the runner. Not an Exception: no step's `except
    Exception` takes it for a failure of its own."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def message(self) -> str:
        return (
            f"the job's runner was stopped ({signal.Signals(self.signum).name}) "
            f"before the job finished: {RUNNER_STOP_SIGNALS[self.signum]}"
        )


class RunnerSignals:
    """The runner's stop signals while it runs (a context manager).

    The first one raises RunnerStopped where the runner is: in a sleep, in a
    wait for a lock or for virsh (subprocess.run kills and reaps its child on
    the way out). Once the runner holds (`hold`: it is writing its job's
    end) or has been stopped, a signal is only kept. Handlers are set in the
    main thread only (Python runs them nowhere else), never for a signal the
    runner was started with ignored, and the previous ones are back on exit.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.holding = False
        self._previous: Dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if not self.holding:
            self.holding = True
            raise RunnerStopped(signum)

    def hold(self) -> None:
        self.holding = True

    def __enter__(self) -> "RunnerSignals":
        for signum in RUNNER_STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            try:
                signal.signal(signum, self._handler)
            except ValueError:  # not the main thread
                break
            self._previous[signum] = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: object) -> None:
        self.holding = True
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def run_job(cfg: Config, job_id: str) -> int:
    """The detached runner: one job, serialised per tower by a flock.

    It waits for its job's lock (a `job`, `jobs` or `status` probe holds it for
    an instant; a rival runner until its job is over: then the job is no longer
    queued and this runner has nothing to do). It runs only queued work that
    the configuration allows, with steps made anew from the job's kind and
    domain: never the steps or domains a record lists.

    A stop signal (RUNNER_STOP_SIGNALS) ends it early: the job is recorded as
    failed (runner_died, naming the signal), its locks are released, and the
    signal is then delivered again with the handler the runner had before: by
    default it ends the process as it would have (for systemd, a clean stop).
    """
    with RunnerSignals() as signals:
        try:
            code = _run_job(cfg, job_id, signals)
        except RunnerStopped:
            code = 1  # before it held its job's lock: the job is not its to write
    if signals.received is not None:
        with contextlib.suppress(*_STREAM_ERRORS):
            sys.stderr.flush()
        os.kill(os.getpid(), signals.received)
        return 128 + signals.received  # a handler that did not end the process
    return code


def record_stopped(jfd: int, name: str, stop: RunnerStopped) -> None:
    """A stopped runner's job, failed: the record as last written (whole:
    records are replaced atomically, so no step is half-recorded there; what
    the runner had not written yet is left out), a step under way left as
    begun. A job that had already ended is left as it is."""
    job = read_json_at(jfd, name)
    if not isinstance(job, dict) or job.get("state") not in ("queued", "running"):
        return
    job["state"] = "failed"
    job["finished"] = now_iso()
    job["error"] = {"code": ERR_RUNNER_DIED, "message": stop.message()}
    write_json_at(jfd, name, job)
    with contextlib.suppress(*_STREAM_ERRORS):
        sys.stderr.write(f"gpu-handoff: job {job.get('id')}: {stop.message()}\n")


def _failed_before_start(jfd: int, name: str, job: JsonObj, err: AgentError) -> int:
    """Record that a queued job failed before its first step (its work is
    not allowed, the tower's lock cannot be opened); the runner's exit code."""
    job["state"] = "failed"
    job["finished"] = now_iso()
    job["error"] = {"code": err.code, "message": err.message}
    write_json_at(jfd, name, job)
    return 1


def _run_job(cfg: Config, job_id: str, signals: RunnerSignals) -> int:
    name = job_id + ".json"
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        lock = open_lock_at(
            jfd, job_id + ".lock", os.path.join(jobs_dir(cfg), job_id + ".lock")
        )
        locked = False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            locked = True
            job = read_json_at(jfd, name)
            if not isinstance(job, dict) or job.get("state") != "queued":
                return 0  # another runner ran it, or no such job
            try:
                kind, target = job_work(cfg, job)
            except AgentError as err:
                return _failed_before_start(jfd, name, job, err)
            job["steps"] = plan_job(cfg, kind, target)
            job["step"] = None
            job["runner"] = {"pid": os.getpid()}
            write_json_at(jfd, name, job)
            try:
                with state_dir_fd(cfg.state_dir) as sfd:
                    tower = open_lock_at(
                        sfd, "tower.lock", os.path.join(cfg.state_dir, "tower.lock")
                    )
            except AgentError as err:
                return _failed_before_start(jfd, name, job, err)
            try:
                fcntl.flock(tower, fcntl.LOCK_EX)
                job["state"] = "running"
                job["started"] = now_iso()
                write_json_at(jfd, name, job)
                try:
                    try:
                        JobRunner(
                            cfg, job, Virsh(cfg, unreachable_wait=JOB_LIBVIRT_WAIT)
                        ).run()
                    finally:
                        signals.hold()  # the job's end is written whatever comes
                    job["state"] = "succeeded"
                except AgentError as err:
                    job["state"] = "failed"
                    job["error"] = {"code": err.code, "message": err.message}
                except Exception as err:  # noqa: BLE001 - logged, recorded in the job
                    job["state"] = "failed"
                    job["error"] = internal_error(
                        log_internal(cfg, f"job {job_id}", err)
                    )
                job["finished"] = now_iso()
                write_json_at(jfd, name, job)
            finally:
                os.close(tower)
        except RunnerStopped as stop:
            if not locked:
                raise
            record_stopped(jfd, name, stop)
            return 1
        finally:
            os.close(lock)
    return 0 if job["state"] == "succeeded" else 1
