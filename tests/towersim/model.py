# ruff: noqa: PTH101, PTH105, PTH110, PTH116, PTH118, PTH123
"""The tower simulator's state: recorded actions plus a clock, replayed lazily.

Everything lives in one directory: ``state`` (domain specs, the action log,
systemd units), ``commands.log`` (every simulated command line, for
assertions) and ``lock`` (an ``fcntl`` lock that serialises every process
that reads or changes the state). The state is kept in ``marshal``'s format
and the log as one Python literal per line, not as JSON: every simulated
call reads the state, and the ``json`` module's import (``re`` with it)
cost a third of each start (``python -m tests.towersim.model DIR`` prints
both as JSON). Nothing is computed in the background: the
state of a domain at time T is the replay of the actions recorded before T.

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import time

from . import lean

STATE_FILE = "state"
LOCK_FILE = "lock"
COMMANDS_FILE = "commands.log"
# marshal's format 2, which every Python 3 reads, and which, unlike 3 and
# later, writes an object the state holds twice as two (as JSON did): one
# loaded state never shares a dict between two places.
MARSHAL_VERSION = 2
AGENT_CHANNEL = "org.qemu.guest_agent.0"
DRIVER_NAME = "QEMU"
# libvirt's waits, in simulated seconds (scaled by the tower's time_scale;
# ``Tower.create`` and ``Tower.set_libvirt_waits`` change them):
# qemuAgentShutdown waits this long for the guest to power off
# (VIR_DOMAIN_QEMU_AGENT_COMMAND_SHUTDOWN, src/qemu/qemu_agent.h) ...
AGENT_SHUTDOWN_TIMEOUT = 60.0
# ... and virDomainObjBeginJobInternal this long for a domain's job
# (VIR_JOB_WAIT_TIME, src/conf/virdomainjob.c; QEMU_JOB_WAIT_TIME before 8.x)
JOB_WAIT_TIME = 30.0
# the API that holds the agent job of a blocked ``virsh shutdown``
SHUTDOWN_API = "remoteDispatchDomainShutdownFlags"
# How long a domain is ``in shutdown`` (simulated seconds, scaled): QEMU's
# SHUTDOWN event (the guest powered off) makes qemuProcessHandleShutdown set
# VIR_DOMAIN_SHUTDOWN / VIR_DOMAIN_SHUTDOWN_UNKNOWN; libvirt then ends the
# QEMU process that ``-no-shutdown`` kept (qemuProcessShutdownOrReboot) and
# the domain is shut off: a short moment on a real tower.
IN_SHUTDOWN = 0.5

# The simulator is a process per virsh call: typing stays out of its imports
# (about 3 ms of each start); its names are for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    JsonObj = dict[str, Any]


# --- storage -------------------------------------------------------------------


@lean.contextmanager
def locked(state_dir: str, *, exclusive: bool = True) -> Iterator[None]:
    """Hold the simulator's lock (exclusive for changes, shared for reads)."""
    fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def load(state_dir: str) -> JsonObj:
    with open(os.path.join(state_dir, STATE_FILE), "rb") as handle:
        data: JsonObj = marshal.load(handle)  # noqa: S302 - written by save()
    return data


def save(state_dir: str, data: JsonObj) -> None:
    # mkstemp's name and flags, without tempfile's import cost at every call
    tmp = os.path.join(state_dir, f".state-{os.getpid()}-{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        marshal.dump(data, handle, MARSHAL_VERSION)
    os.chmod(tmp, 0o666)  # noqa: S103 - the agent may run as another user
    os.replace(tmp, os.path.join(state_dir, STATE_FILE))


def state_mtime(state_dir: str) -> tuple[int, int, int]:
    """What tells a reader the state changed without reading it. Not the
    mtime alone: the kernel stamps a new file from its coarse clock (a tick,
    a few ms), so saves within one tick share it; and ``save`` replaces the
    file, whose inode number ext4 may hand out again at the next save but
    one. The size too makes two states alike in all three unlikely (an event
    stream that missed a change would wait for the next one, which a quiet
    world may never make)."""
    st = os.stat(os.path.join(state_dir, STATE_FILE))
    return st.st_mtime_ns, st.st_ino, st.st_size


def now(data: JsonObj) -> float:
    """The simulated clock: wall time plus what tests advanced it by."""
    return time.time() + float(data.get("clock_offset", 0.0))


def append_command(
    state_dir: str, record: JsonObj, log_file: str = COMMANDS_FILE
) -> None:
    line = repr(record) + "\n"  # one line: repr escapes every newline
    path = os.path.join(state_dir, log_file)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_commands(state_dir: str) -> list[JsonObj]:
    path = os.path.join(state_dir, COMMANDS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [parse_record(line) for line in handle.read().splitlines() if line]


def parse_record(line: str) -> JsonObj:
    """One line of a log ``append_command`` wrote (a Python literal)."""
    import ast  # only the tests read the logs

    record: JsonObj = ast.literal_eval(line)
    return record


def new_state(time_scale: float) -> JsonObj:
    return {
        "version": 1,
        "time_scale": time_scale,
        "clock_offset": 0.0,
        "domains": {},
        "actions": [],
        "units": {},
        "unit_counter": 0,
    }


def libvirt_wait(data: JsonObj, field: str) -> float:
    """``agent_shutdown_timeout`` or ``job_wait``, in real seconds."""
    default = (
        AGENT_SHUTDOWN_TIMEOUT if field == "agent_shutdown_timeout" else JOB_WAIT_TIME
    )
    value = data.get(field)
    seconds = default if value is None else float(value)
    return seconds * float(data.get("time_scale", 1.0))


# What virsh says when libvirtd does not answer (the socket gone while the
# daemon is stopped): virshConnect's error, then the remote driver's
# (src/rpc/virnetsocket.c, virNetSocketNewConnectUNIX).
CONNECT_FAILED = (
    "failed to connect to the hypervisor",
    (
        "Failed to connect socket to '/var/run/libvirt/libvirt-sock': "
        "No such file or directory"
    ),
)


def libvirtd_down(data: JsonObj, t: float) -> JsonObj | None:
    """The restart of libvirtd under way at ``t``, if any."""
    for restart in data.get("libvirtd_restarts") or []:
        if float(restart["t"]) <= t < float(restart["until"]):
            return dict(restart)
    return None


def libvirtd_restart_after(data: JsonObj, since: float) -> float | None:
    """When libvirtd first went down at or after ``since`` (None: not yet
    recorded): a connection made at ``since`` ends then."""
    times = [
        float(r["t"])
        for r in data.get("libvirtd_restarts") or []
        if float(r["t"]) >= since
    ]
    return min(times) if times else None


def record(data: JsonObj, op: str, name: str, t: float, **fields: Any) -> None:
    action: JsonObj = {"op": op, "name": name, "t": t}
    action.update(fields)
    data["actions"].append(action)


# --- replay --------------------------------------------------------------------


def pci_name(address: str) -> str:
    """``0000:01:00.0`` from any spelling of a PCI address."""
    dom, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.{int(function, 16):x}"


# --- IOMMU groups ------------------------------------------------------------------
#
# The kernel puts every PCI function in one IOMMU (VFIO) group; a group is
# passed through whole: libvirt refuses a start while another domain holds
# any function of the group of one of its own (see hooks._prepare_host). On a
# board with ACS each card (bus:slot) has its own group, which is the default
# here; ``Tower.set_iommu_group`` puts functions of several cards in one, as
# on a board without ACS.


def default_iommu_group(address: str) -> int:
    """The group number of a function whose card has a group of its own:
    10 + bus for slot 0 (as /dev/vfio/N of ``vfio_error``), unique per card."""
    dom, bus, rest = pci_name(address).split(":")
    slot = int(rest.split(".")[0], 16)
    return 10 + int(bus, 16) + 256 * (slot + 32 * int(dom, 16))


def iommu_group(data: JsonObj, address: str) -> int:
    """The IOMMU group of a PCI function."""
    name = pci_name(address)
    groups: dict[str, int] = data.get("iommu_groups") or {}
    return int(groups[name]) if name in groups else default_iommu_group(name)


def pci_functions(data: JsonObj) -> list[str]:
    """Every PCI function the tower has: those its domains are defined with
    and those put in a group by hand."""
    found = {
        pci_name(h["address"])
        for spec in data["domains"].values()
        for h in spec.get("hostdevs") or []
    }
    found.update(pci_name(a) for a in data.get("iommu_groups") or {})
    return sorted(found)


def iommu_groups(data: JsonObj) -> dict[int, list[str]]:
    """Every IOMMU group: its number and its functions, sorted."""
    groups: dict[int, list[str]] = {}
    for address in pci_functions(data):
        groups.setdefault(iommu_group(data, address), []).append(address)
    return groups


def group_mates(data: JsonObj, address: str) -> list[str]:
    """The functions of ``address``'s IOMMU group (itself included), sorted,
    as ``/sys/bus/pci/devices/ADDR/iommu_group/devices`` lists them."""
    return iommu_groups(data).get(iommu_group(data, address), [pci_name(address)])


class Event:
    """One event line of ``virsh event --all``, without its timestamp."""

    __slots__ = ("domain", "t", "text")

    def __init__(self, t: float, domain: str, text: str) -> None:
        self.t = t
        self.domain = domain
        self.text = text

    @property
    def key(self) -> str:
        return f"{self.t!r}|{self.domain}|{self.text}"

    def line(self, *, timestamp: bool = True) -> str:
        if not timestamp:
            return self.text
        return f"{format_timestamp(self.t)}: {self.text}"


def format_timestamp(t: float) -> str:
    """libvirt's event timestamp: ``2026-11-29 23:10:01.281+0000`` (UTC)."""
    whole = int(t)
    millis = round((t - whole) * 1000)
    if millis == 1000:
        whole, millis = whole + 1, 0
    return (
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(whole)) + f".{millis:03d}+0000"
    )


def lifecycle(domain: str, what: str) -> str:
    return f"event 'lifecycle' for domain '{domain}': {what}"


def agent_lifecycle(domain: str, state: str, reason: str) -> list[str]:
    channel = (
        f"event 'channel-lifecycle' for domain '{domain}': channel name: "
        f"'{AGENT_CHANNEL}' state: '{state}' reason: '{reason}'"
    )
    return [
        f"event 'agent-lifecycle' for domain '{domain}': state: '{state}' reason: '{reason}'",
        channel,
    ]


class Stop:
    """A running domain that powered off (not a failed start): its qemu hook's
    ``stopped end -`` and ``release end REASON`` are due."""

    __slots__ = ("domain_id", "name", "reason", "spec", "t")

    def __init__(
        self, t: float, name: str, domain_id: int | None, reason: str, spec: JsonObj
    ) -> None:
        self.t = t
        self.name = name
        self.domain_id = domain_id
        self.reason = reason
        self.spec = spec

    @property
    def key(self) -> str:
        return f"{self.name}#{self.domain_id}"

    def xml(self) -> str:
        """The live definition, as qemuProcessStop formats it (no id any more)."""
        from . import domxml

        return domxml.dump_xml(self.spec, None)


class Dom:
    """A domain's runtime state during a replay."""

    def __init__(self, spec: JsonObj, scale: float) -> None:
        self.spec = dict(spec)
        self.scale = scale
        self.running = False
        self.reason = "unknown"
        self.id: int | None = None
        self.boot_t: float | None = None
        self.agent_at: float | None = None
        self.agent_connected = False
        self.off_at: float | None = None
        # a ``shutdown --mode agent`` in libvirtd holds the domain's agent job
        # until the guest is off, its agent gone, or this instant
        self.agent_job_until: float | None = None
        # the hostdevs of a live-only definition (``virsh create`` of a defined
        # domain), while it runs from one; None: it runs from (or is) its
        # persistent definition
        self.live_hostdevs: list[JsonObj] | None = None
        # a running domain that is not RUNNING: ``paused`` (user) after
        # ``suspend``, ``crashed`` (panicked) after a guest panic with
        # <on_crash>preserve</on_crash>; None: running
        self.held: str | None = None
        # when the shutdown that sets ``off_at`` began, and whether QEMU's
        # SHUTDOWN event (``Shutdown Finished``) was sent
        self.down_from: float | None = None
        self.finished = False
        # what was left of a shutdown when the domain was paused
        self.paused_left: float | None = None

    def shutdown_finished_at(self) -> float | None:
        """When the guest powers off and the domain is ``in shutdown``."""
        if self.off_at is None:
            return None
        window = self.seconds("in_shutdown_duration")
        start = self.off_at - (IN_SHUTDOWN * self.scale if window is None else window)
        return start if self.down_from is None else max(self.down_from, start)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def has_channel(self) -> bool:
        return bool(self.spec.get("agent_channel", True))

    def seconds(self, field: str) -> float | None:
        value = self.spec.get(field)
        return None if value is None else float(value) * self.scale

    def in_shutdown(self, t: float) -> bool:
        """Whether the guest has powered off and libvirt is ending its QEMU
        process (``in shutdown``) at ``t``."""
        finished = self.shutdown_finished_at()
        return self.running and finished is not None and finished <= t

    def state_at(self, t: float) -> tuple[str, str]:
        """virsh's words for the state and its reason at ``t``
        (tools/virsh-domain-monitor.c, virshDomainStateToString and
        virshDomainStateReasonToString)."""
        if not self.running:
            return "shut off", self.reason
        if self.held == "paused":
            return "paused", "user"
        if self.held == "crashed":
            return "crashed", "panicked"
        if self.in_shutdown(t):
            # qemuProcessHandleShutdown: VIR_DOMAIN_SHUTDOWN_UNKNOWN (the
            # real rig shows "in shutdown (unknown)")
            return "in shutdown", "unknown"
        return "running", self.reason

    def active_state(self, t: float) -> bool:
        """Whether the domain is RUNNING (not paused, crashed or in
        shutdown): what qemuDomainAgentAvailable and the ACPI shutdown
        require ("domain is not running" otherwise)."""
        return self.state_at(t)[0] == "running"

    def state_text(self, *, reason: bool, t: float) -> str:
        state, why = self.state_at(t)
        return f"{state} ({why})" if reason else state

    def agent_job_held(self, t: float) -> bool:
        """Whether a blocked ``shutdown --mode agent`` holds the agent job at ``t``."""
        return (
            self.running
            and self.agent_job_until is not None
            and self.agent_job_until > t
        )

    def hostdevs(self) -> list[JsonObj]:
        """The PCI functions of the definition it runs with (or would start with)."""
        if self.live_hostdevs is not None:
            return self.live_hostdevs
        return list(self.spec.get("hostdevs", []))

    def live_spec(self) -> JsonObj:
        """What ``dumpxml`` shows: the live definition while it runs from one."""
        if self.live_hostdevs is None:
            return self.spec
        return {**self.spec, "hostdevs": self.live_hostdevs}

    def addresses(self) -> list[str]:
        return [pci_name(h["address"]) for h in self.hostdevs()]


class World:
    """The replayed tower at one instant."""

    def __init__(self, data: JsonObj, at: float) -> None:
        self.t = at
        self.scale = float(data.get("time_scale", 1.0))
        self.doms: dict[str, Dom] = {}
        self.order: list[str] = []
        self.events: list[Event] = []
        self.stops: list[Stop] = []
        self.next_id = int(data.get("first_id", 1))
        self.pending: list[float] = []
        for action in data["actions"]:
            if float(action["t"]) > at:
                break
            self._advance(float(action["t"]))
            self._apply(action)
        self._advance(at)
        self.pending = sorted(
            t
            for d in self.doms.values()
            if d.running
            for t in (d.agent_at if not d.agent_connected else None, d.off_at)
            if t is not None
        )

    # running domains first by id, then the others by name (as virsh list)
    def listing(self) -> list[Dom]:
        running = sorted(
            (d for d in self.doms.values() if d.running), key=lambda d: d.id or 0
        )
        others = sorted(
            (d for d in self.doms.values() if not d.running),
            key=lambda d: d.name.lower(),
        )
        return running + others

    def holder(self, address: str, *, exclude: str = "") -> str | None:
        wanted = pci_name(address)
        for d in self.listing():
            if d.running and d.name != exclude and wanted in d.addresses():
                return d.name
        return None

    def _emit(self, t: float, domain: str, *texts: str) -> None:
        for text in texts:
            self.events.append(Event(t, domain, text))

    def _advance(self, until: float) -> None:
        while True:
            due: list[tuple[float, int, Dom]] = []
            for d in self.doms.values():
                if not d.running:
                    continue
                if (
                    d.agent_at is not None
                    and not d.agent_connected
                    and d.agent_at <= until
                    and (d.off_at is None or d.agent_at < d.off_at)
                ):
                    due.append((d.agent_at, 0, d))
                if d.off_at is not None:
                    finished = d.shutdown_finished_at()
                    if not d.finished and finished is not None and finished <= until:
                        due.append((finished, 1, d))
                    if d.off_at <= until:
                        due.append((d.off_at, 2, d))
            if not due:
                return
            t, kind, d = min(due, key=lambda item: (item[0], item[1], item[2].name))
            if kind == 0:
                d.agent_connected = True
                self._emit(
                    t, d.name, *agent_lifecycle(d.name, "connected", "channel event")
                )
            elif kind == 1:
                # the guest powers off: QEMU's SHUTDOWN event, QEMU not
                # ended yet. Its guest agent is gone, which ends a ``shutdown
                # --mode agent`` waiting for it (qemuAgentNotifyEvent): the
                # call returns while the domain is ``in shutdown``, as the
                # real rig shows. The real guests' event lines show no agent
                # disconnect here on a quick power-off (recorded/virsh.json)
                # and one only sometimes on a slow one: none is sent.
                d.finished = True
                d.agent_connected = False
                d.agent_at = None
                d.agent_job_until = None
                self._emit(
                    t,
                    d.name,
                    lifecycle(d.name, "Shutdown Finished after guest request"),
                )
            else:
                if not d.finished:
                    self._emit(
                        t,
                        d.name,
                        lifecycle(d.name, "Shutdown Finished after guest request"),
                    )
                self._emit(t, d.name, lifecycle(d.name, "Stopped Shutdown"))
                self.stops.append(Stop(t, d.name, d.id, "shutdown", d.live_spec()))
                self._power_off(d, "shutdown")

    @staticmethod
    def _power_off(d: Dom, reason: str) -> None:
        d.running = False
        d.reason = reason
        d.id = None
        d.boot_t = None
        d.agent_at = None
        d.agent_connected = False
        d.off_at = None
        d.agent_job_until = None
        d.held = None
        d.down_from = None
        d.finished = False
        d.paused_left = None
        # libvirt drops a live-only definition when the domain stops
        d.live_hostdevs = None

    def _apply(self, action: JsonObj) -> None:
        op = action["op"]
        t = float(action["t"])
        name = action["name"]
        if op == "define":
            spec = action["spec"]
            if name not in self.doms:
                self.order.append(name)
                self.doms[name] = Dom(spec, self.scale)
                self._emit(t, name, lifecycle(name, "Defined Added"))
                if action.get("running"):
                    self._boot(self.doms[name], t, connected=True, events=False)
            else:
                self.doms[name].spec = dict(spec)
                self._emit(t, name, lifecycle(name, "Defined Updated"))
            return
        d = self.doms[name]
        if op == "start":
            self._boot(d, t, connected=False, events=True, domain_id=action.get("id"))
        elif op == "create":
            # a defined domain started from a live-only definition: the same
            # boot (and events) as a start, with the file's hostdevs
            self._boot(d, t, connected=False, events=True, domain_id=action.get("id"))
            d.live_hostdevs = [dict(h) for h in action["hostdevs"]]
        elif op == "fail":
            # a start that failed (qemuProcessStop with VIR_DOMAIN_SHUTOFF_FAILED,
            # its hooks run by the start itself); its id is used up
            self.next_id = max(self.next_id, int(action["id"]) + 1)
            if d.running:
                self._emit(t, name, lifecycle(name, "Stopped Failed"))
            self._power_off(d, "failed")
        elif op == "shutdown":
            # accepted with effect: the guest powers off after its duration
            if d.running and d.held is None:
                end = t + (d.seconds("shutdown_duration") or 0.0)
                if d.off_at is None:
                    d.down_from = t
                d.off_at = end if d.off_at is None else min(d.off_at, end)
                if action.get("mode") == "agent" and action.get("job_until"):
                    # qemuDomainShutdownFlagsAgent: the agent job is held
                    # while qemuAgentShutdown waits for the power-off
                    d.agent_job_until = float(action["job_until"])
                if action.get("mode") == "guest" or d.spec.get("agent_leaves_first"):
                    # the guest stops its agent on the way down: that also
                    # ends an agent shutdown's wait (qemuAgentNotifyCloseLocked)
                    self._agent_leaves(d, t)
        elif op == "pause" and d.running and d.held is None:
            # qemuDomainSuspend: the vCPUs stop, a guest shutdown under way
            # with them (it goes on after the resume)
            d.held = "paused"
            if d.off_at is not None:
                d.paused_left = d.off_at - t
                d.off_at = None
                d.down_from = None
            self._emit(t, name, lifecycle(name, "Suspended Paused"))
        elif op == "resume" and d.running and d.held == "paused":
            d.held = None
            left, d.paused_left = d.paused_left, None
            if left is not None:
                d.off_at = t + float(left)
                d.down_from = t
            self._emit(t, name, lifecycle(name, "Resumed Unpaused"))
        elif op == "crash" and d.running:
            # a guest panic (pvpanic): qemuProcessHandleGuestPanic; with
            # <on_crash>preserve</on_crash> the domain stays ``crashed
            # (panicked)``, holding its devices; with destroy (the default)
            # it is stopped: ``shut off (crashed)``
            self._emit(t, name, lifecycle(name, "Crashed Panicked"))
            if action.get("preserve"):
                d.held = "crashed"
                d.off_at = None
                d.down_from = None
            else:
                self._emit(t, name, lifecycle(name, "Stopped Crashed"))
                self.stops.append(Stop(t, name, d.id, "crashed", d.live_spec()))
                self._power_off(d, "crashed")
        elif op == "daemon_stop" and d.running:
            # qemuProcessReconnect could not take the domain back (its
            # ``reconnect`` hook failed): libvirtd kills it
            # (VIR_DOMAIN_SHUTOFF_DAEMON)
            self._emit(t, name, lifecycle(name, "Stopped Daemon"))
            self.stops.append(Stop(t, name, d.id, "daemon", d.live_spec()))
            self._power_off(d, "daemon")
        elif op == "set":
            field, value = action["field"], action["value"]
            d.spec[field] = value
            if (
                field == "agent_delay"
                and d.running
                and not d.agent_connected
                and d.off_at is None
            ):
                delay = d.seconds("agent_delay")
                d.agent_at = (
                    None
                    if delay is None or not d.has_channel or d.boot_t is None
                    else max(t, d.boot_t + delay)
                )

    def _agent_leaves(self, d: Dom, t: float) -> None:
        """The guest began to shut itself down: its guest agent (stopped by
        the guest's shutdown) closes the channel at once, seconds before the
        power-off, and does not come back; QEMU reports the port closed
        (VSERPORT_CHANGE) and libvirt closes its agent (processSerialChangedEvent,
        qemuAgentClose), which also ends a ``shutdown --mode agent`` waiting
        in qemuAgentSend (qemuAgentNotifyCloseLocked) and frees its agent job."""
        if d.agent_connected:
            self._emit(
                t, d.name, *agent_lifecycle(d.name, "disconnected", "channel event")
            )
        d.agent_connected = False
        d.agent_at = None
        d.agent_job_until = None

    def _boot(
        self,
        d: Dom,
        t: float,
        *,
        connected: bool,
        events: bool,
        domain_id: int | None = None,
    ) -> None:
        d.running = True
        d.reason = "booted"
        d.id = self.next_id if domain_id is None else int(domain_id)
        self.next_id = max(self.next_id, d.id) + 1
        d.boot_t = t
        d.off_at = None
        d.down_from = None
        d.finished = False
        d.held = None
        delay = d.seconds("agent_delay")
        d.agent_connected = connected and delay is not None and d.has_channel
        d.agent_at = t + delay if (delay is not None and d.has_channel) else None
        if connected and d.agent_at is not None:
            d.agent_at = t
        if events:
            if d.has_channel:
                self._emit(
                    t,
                    d.name,
                    *agent_lifecycle(d.name, "disconnected", "domain started"),
                )
            self._emit(
                t,
                d.name,
                lifecycle(d.name, "Resumed Unpaused"),
                lifecycle(d.name, "Started Booted"),
            )


def world(data: JsonObj, at: float | None = None) -> World:
    return World(data, now(data) if at is None else at)


if __name__ == "__main__":  # pragma: no cover - a debugging aid
    import json
    import sys

    # python -m tests.towersim.model STATE_DIR: the state and the command
    # log of a simulated tower, as JSON.
    directory = sys.argv[1]
    print(json.dumps(load(directory), indent=1, sort_keys=True))
    for command in read_commands(directory):
        print(json.dumps(command, sort_keys=True))
