# ruff: noqa: PTH101, PTH118, PTH123
"""libvirt's qemu hook, run as libvirtd runs it, on every start and stop.

From libvirt's sources (``docs/hooks.rst``; ``src/util/virhook.c``
``virHookCall``/``virRunScript``; ``src/qemu/qemu_process.c``):

- a start (``qemuProcessStart``): ``qemuProcessInit`` allocates the domain's id
  and runs ``DOMAIN prepare begin -``; ``qemuProcessPrepareHost`` then takes
  the PCI functions (``... is in use by driver QEMU, domain X``) and checks the
  disks (``Cannot access storage file ...``); ``qemuProcessLaunch`` runs
  ``start begin -`` just before it spawns QEMU (which may die at once: a VFIO
  error); ``qemuProcessFinishStartup`` runs ``started begin -`` once the CPUs
  run. A non-zero exit of any of these fails the start;
- any failure after the id was allocated goes to ``qemuProcessStop`` with the
  reason ``failed``, which runs ``stopped end -`` and ``release end failed``
  (the extra argument is the shut-off reason since libvirt 10.5; ``-`` before):
  a refused ``prepare`` runs both stop hooks too, and the domain is then
  ``shut off (failed)``;
- a stop (``qemuProcessStop``): ``stopped end -``, then ``release end REASON``;
  their exit status is ignored;
- ``virHookCall`` runs ``hooks/qemu`` and then every executable
  ``hooks/qemu.d/*`` in ``strcmp`` order, each with the domain XML on stdin,
  ``DOMAIN OP SUBOP EXTRA`` as arguments and ``LC_ALL=C`` plus libvirtd's
  ``PATH`` as environment (``virCommandAddEnvPassCommon``); a failing script
  does not stop the others, and the error is the last one's:
  ``Hook script execution failed: internal error: Child process (ENV PATH
  ARGS) unexpected exit status N: STDERR`` (``virCommandWait``).

libvirtd holds the domain's lock while a hook runs: a virsh call about that
domain (and ``list``, which looks at every domain) waits until the start has
ended. The simulator does the same (``busy``), except for processes of the
hook itself, which libvirt would deadlock and the simulator lets through.

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

import fcntl
import os
import time

from . import domxml, lean, model

# The simulator is a process per virsh call: typing stays out of its imports
# (about 3 ms of each start); its names are for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    JsonObj = dict[str, Any]

HOOK_DIR = "/etc/libvirt/hooks"
DEFAULT_PATH = HOOK_DIR + "/qemu"
# libvirtd under systemd: LC_ALL=C from virCommandAddEnvPassCommon, and
# systemd's PATH for services (passed through by the same function)
HOOK_PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOOK_TIMEOUT = 30.0  # libvirt waits forever; the simulator kills the hook then
WAIT_LIMIT = 120.0  # longest a virsh call waits for another process's start
LOCK_FILE = "hooks.lock"
HOLDER_FILE = "hooks.holder"
LOG_FILE = "hooks.log"

# Start failures after the hook ran (``Tower.fail_next_start``), with
# libvirt's texts: qemuProcessPrepareHostStorage (virStorageSourceReportBrokenChain
# plus the errno, here as libvirt-qemu on Debian) and QEMU dying on a VFIO
# group another process holds (qemuProcessReportLogError's text since 9.x).
START_FAILURES = ("disk", "vfio")
QEMU_UID, QEMU_GID = 64055, 109


class StartFailedError(Exception):
    """A start failed; its error lines (without ``error: ``) are the args."""


def installed(data: JsonObj) -> list[tuple[str, JsonObj]]:
    """The installed hook scripts in libvirt's order: ``hooks/qemu``, then
    ``hooks/qemu.d/*`` sorted as strcmp sorts them."""
    hooks: dict[str, JsonObj] = data.get("hooks") or {}
    main = [(p, h) for p, h in hooks.items() if p == DEFAULT_PATH]
    rest = sorted(
        ((p, h) for p, h in hooks.items() if p != DEFAULT_PATH),
        key=lambda item: item[0].encode("utf-8"),
    )
    return main + rest


# --- running the hook -------------------------------------------------------------

# how deep this process holds the hook lock (re-entrant within a process)
_HELD = {"depth": 0}


# The session of the process that made this call: this process's own, or in
# a copy the fork server forked for a client (forkserver.py), the client's.
CALLER: dict[str, int | None] = {"session": None}


def _session() -> int:
    session = CALLER["session"]
    return os.getsid(0) if session is None else session


def inside_hook(state_dir: str) -> bool:
    """Whether this process belongs to a hook that runs now (its session)."""
    try:
        with open(os.path.join(state_dir, HOLDER_FILE), encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return False
    return text.isdigit() and int(text) == _session()


@lean.contextmanager
def hook_lock(state_dir: str) -> Iterator[None]:
    """One hook call at a time, in the order processes asked: so stop hooks run
    in the order of the stops, and a start's hooks after the stops before it.
    A process of the running hook itself does not wait (libvirt would deadlock)."""
    if _HELD["depth"]:
        _HELD["depth"] += 1
        try:
            yield
        finally:
            _HELD["depth"] -= 1
        return
    fd = os.open(os.path.join(state_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + WAIT_LIMIT
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if inside_hook(state_dir) or time.monotonic() > deadline:
                    locked = False
                    break
                time.sleep(0.005)
        _HELD["depth"] += 1
        try:
            yield
        finally:
            _HELD["depth"] -= 1
            if locked:
                _set_holder(state_dir, None)
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _set_holder(state_dir: str, session: int | None) -> None:
    path = os.path.join(state_dir, HOLDER_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("" if session is None else str(session))
    with lean.suppress(OSError):
        os.chmod(path, 0o666)  # noqa: S103 - the agent may run as another user


def _quote(word: str) -> str:
    """virCommandToString's quoting (virBufferEscapeShell) of one word."""
    if word and all(c.isalnum() or c in "@%_-+=:,./" for c in word):
        return word
    return "'" + word.replace("'", "'\\''") + "'"


@lean.contextmanager
def _sigpipe_ignored() -> Iterator[None]:
    """As in libvirtd, which ignores SIGPIPE: a hook that leaves the domain
    XML unread costs its writer an EPIPE, which virCommandProcessIO ignores
    ("child closed stdin early"), never the process. Here the writer is
    whichever simulated virsh runs the hook; ``virsh event`` takes SIGPIPE
    as virsh does (for its own output), and died of the hook's closed stdin.
    Signal handlers can only change in the main thread: elsewhere the
    process's own disposition stays (Python ignores SIGPIPE by default)."""
    import signal  # its one caller has imported subprocess, and these with it
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _run_script(
    state_dir: str, path: str, hook: JsonObj, args: list[str], xml: str
) -> str | None:
    """virRunScript: None if it exited 0, else libvirt's error text."""
    # only here: every simulated virsh call imports this module
    import signal
    import subprocess

    argv = [*hook["argv"], *args]
    env = {"LC_ALL": "C", "PATH": HOOK_PATH_ENV, **(hook.get("env") or {})}
    timeout = float(hook.get("timeout") or HOOK_TIMEOUT)
    started = time.time()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd="/",
            start_new_session=True,
        )
    except OSError as err:
        status = "exit status 1"
        err_text = f"libvirt:  error : cannot execute binary {path}: {err.strerror}\n"
    else:
        _set_holder(state_dir, proc.pid)
        try:
            with _sigpipe_ignored():
                _out, err_bytes = proc.communicate(xml.encode("utf-8"), timeout=timeout)
        except subprocess.TimeoutExpired:
            with lean.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _out, err_bytes = proc.communicate()
        err_text = err_bytes.decode("utf-8", "replace")
        rc = proc.returncode
        status = f"exit status {rc}" if rc >= 0 else f"fatal signal {-rc}"
        if rc == 0:
            status = ""
    with lean.suppress(OSError):
        model.append_command(
            state_dir,
            {
                "kind": "hook",
                "path": path,
                "args": args,
                "status": status or "exit status 0",
                "stderr": err_text,
                "t": started,
                "end": time.time(),
            },
            log_file=LOG_FILE,
        )
    if not status:
        return None
    shown = " ".join(
        [
            "LC_ALL=C",
            f"PATH={HOOK_PATH_ENV}",
            *(f"{k}={_quote(v)}" for k, v in (hook.get("env") or {}).items()),
            _quote(path),
            *(_quote(a) for a in args),
        ]
    )
    return (
        "Hook script execution failed: internal error: Child process "
        f"({shown}) unexpected {status}" + (f": {err_text}" if err_text else "")
    )


def call(
    state_dir: str,
    hooks: list[tuple[str, JsonObj]],
    domain: str,
    op: str,
    subop: str,
    extra: str,
    xml: str,
) -> str | None:
    """virHookCall: every script, in order, even after one failed; the error
    text of the last one that failed (None: all exited 0, or none installed)."""
    error = None
    if not hooks:
        return None
    with hook_lock(state_dir):
        for path, hook in hooks:
            failed = _run_script(state_dir, path, hook, [domain, op, subop, extra], xml)
            if failed is not None:
                error = failed
    return error


def _current_hooks(state_dir: str) -> list[tuple[str, JsonObj]]:
    with model.locked(state_dir, exclusive=False):
        return installed(model.load(state_dir))


# --- stops ------------------------------------------------------------------------


def pending_stops(data: JsonObj, world: model.World) -> list[model.Stop]:
    """Stops whose hooks no process has run yet (none without a hook)."""
    if not data.get("hooks"):
        return []
    done = set(data.get("stops_hooked") or [])
    return [s for s in world.stops if s.key not in done]


def dispatch_stops(state_dir: str) -> None:
    """Run ``stopped end -`` and ``release end REASON`` for every stop not yet
    hooked, in the order they happened, each exactly once.

    The simulator is lazy (a stop is a replay of the actions up to now), so
    the first simulator process that sees a stop runs its hooks."""
    with model.locked(state_dir, exclusive=False):
        data = model.load(state_dir)
        if not pending_stops(data, model.world(data)):
            return
    with hook_lock(state_dir):
        with model.locked(state_dir):
            data = model.load(state_dir)
            stops = pending_stops(data, model.world(data))
            if not stops:
                return
            done = list(data.get("stops_hooked") or [])
            data["stops_hooked"] = done + [s.key for s in stops]
            model.save(state_dir, data)
            hooks = installed(data)
        for stop in stops:
            run_stop_hooks(state_dir, hooks, stop.name, stop.xml(), stop.reason)


def run_stop_hooks(
    state_dir: str,
    hooks: list[tuple[str, JsonObj]],
    name: str,
    xml: str,
    reason: str,
) -> None:
    """qemuProcessStop's two hook calls (their failures change nothing)."""
    call(state_dir, hooks, name, "stopped", "end", "-", xml)
    call(state_dir, hooks, name, "release", "end", reason, xml)


def dispatch_reconnects(state_dir: str) -> None:
    """Once libvirtd is back from a restart: ``DOMAIN reconnect begin -`` for
    every domain that ran when it came back, each restart once.

    qemuProcessReconnect (src/qemu/qemu_process.c) runs the hook
    (VIR_HOOK_QEMU_OP_RECONNECT) for each running domain it takes back; a
    hook that fails makes it kill the domain (its error path: qemuProcessStop
    with VIR_DOMAIN_SHUTOFF_DAEMON, ``shut off (daemon)``), as docs/hooks.rst
    warns: "If the script fails, the existing QEMU process will be killed off".
    """
    with model.locked(state_dir, exclusive=False):
        data = model.load(state_dir)
        if not _reconnects_due(data):
            return
    # Under the hook lock, and marked done only once every hook ran: a call
    # that arrives meanwhile waits for them, as libvirtd makes a call wait
    # for the job qemuProcessReconnect holds on the domain.
    with hook_lock(state_dir):
        with model.locked(state_dir, exclusive=False):
            data = model.load(state_dir)
            due = _reconnects_due(data)
            if not due:
                return
            restarts = data["libvirtd_restarts"]
            back = {i: model.world(data, float(restarts[i]["until"])) for i in due}
            hooks = installed(data)
        killed: list[str] = []
        for i in due:
            for dom in back[i].listing():
                if not dom.running:
                    continue
                xml = domxml.dump_xml(dom.live_spec(), dom.id)
                if call(state_dir, hooks, dom.name, "reconnect", "begin", "-", xml):
                    killed.append(dom.name)
        with model.locked(state_dir):
            data = model.load(state_dir)
            data["reconnects_hooked"] = list(data.get("reconnects_hooked") or []) + due
            for name in killed:
                model.record(data, "daemon_stop", name, model.now(data))
            model.save(state_dir, data)


def _reconnects_due(data: JsonObj) -> list[int]:
    """Restarts that ended, whose reconnect hooks have not run."""
    t = model.now(data)
    done = set(data.get("reconnects_hooked") or [])
    return [
        i
        for i, restart in enumerate(data.get("libvirtd_restarts") or [])
        if float(restart["until"]) <= t and i not in done
    ]


# --- starts -----------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            stat = handle.read()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except _PROC_ERRORS:
        return False


# a tuple, so that no formatter turns it into 3.14-only syntax
_PROC_ERRORS = (OSError, IndexError)


def starting(data: JsonObj) -> dict[str, JsonObj]:
    """Starts under way in live processes, by domain name."""
    return {
        name: marker
        for name, marker in (data.get("starting") or {}).items()
        if _alive(int(marker["pid"]))
    }


def busy(state_dir: str, data: JsonObj, domain: str | None) -> bool:
    """Whether another process is starting ``domain`` (None: any domain), so
    that libvirt would make this call wait for the domain's lock."""
    others = {
        name: m for name, m in starting(data).items() if int(m["pid"]) != os.getpid()
    }
    if not others or inside_hook(state_dir):
        return False
    if domain is None:
        return True
    for name, marker in others.items():
        spec = data["domains"].get(name, {})
        if domain in (name, str(spec.get("uuid", "")), str(marker["id"])):
            return True
    return False


def claim(
    data: JsonObj,
    world: model.World,
    dom: model.Dom,
    t: float,
    op: str,
    *,
    hostdevs: list[JsonObj] | None = None,
    file: str | None = None,
) -> JsonObj:
    """Begin a start of ``dom`` (the caller saves ``data``): qemuProcessInit's
    id, taken now as libvirt takes it (a failed start uses one up too)."""
    markers = data.setdefault("starting", {})
    live = starting(data)
    domain_id = max([world.next_id, *(int(m["id"]) + 1 for m in live.values())])
    markers[dom.name] = {"pid": os.getpid(), "id": domain_id, "t": t, "hostdevs": None}
    spec = dom.spec if hostdevs is None else {**dom.spec, "hostdevs": hostdevs}
    return {
        "name": dom.name,
        "id": domain_id,
        "op": op,
        "spec": spec,
        "hostdevs": hostdevs,
        "file": file,
    }


def launch(state_dir: str, start: JsonObj, failed: str) -> None:
    """The rest of qemuProcessStart, after ``claim``: raises StartFailedError
    with virsh's error lines (``failed`` first) if the domain did not start."""
    name = str(start["name"])
    spec: JsonObj = start["spec"]
    hooks = _current_hooks(state_dir)
    progress: JsonObj = {"running": False}
    try:
        error = _start_steps(state_dir, start, hooks, progress)
    except BaseException:
        _end(state_dir, name, fail_id=None if progress["running"] else start["id"])
        raise
    if error is None:
        _end(state_dir, name, fail_id=None)
        return
    # qemuProcessStop(VIR_DOMAIN_SHUTOFF_FAILED): its XML has no id any more
    run_stop_hooks(state_dir, hooks, name, domxml.dump_xml(spec, None), "failed")
    _end(state_dir, name, fail_id=int(start["id"]))
    raise StartFailedError(failed, error)


def _start_steps(
    state_dir: str, start: JsonObj, hooks: list[tuple[str, JsonObj]], progress: JsonObj
) -> str | None:
    """prepare begin, the host's checks, start begin, QEMU, started begin: the
    error of the step that failed, None if the domain runs."""
    name = str(start["name"])
    spec: JsonObj = start["spec"]
    domain_id = int(start["id"])
    xml = domxml.dump_xml(spec, domain_id)
    error = call(state_dir, hooks, name, "prepare", "begin", "-", xml)
    if error is not None:
        return error
    refused, failure = _prepare_host(state_dir, name, spec)
    if refused is not None:
        return refused
    if failure is not None and failure["reason"] == "disk":
        return disk_error(name)
    error = call(state_dir, hooks, name, "start", "begin", "-", xml)
    if error is not None:
        return error
    if failure is not None:
        return vfio_error(name, spec, _now(state_dir))
    with model.locked(state_dir):
        data = model.load(state_dir)
        fields: JsonObj = {"id": domain_id}
        if start["op"] == "create":
            fields.update(hostdevs=start["hostdevs"], file=start["file"])
        model.record(data, start["op"], name, model.now(data), **fields)
        model.save(state_dir, data)
    progress["running"] = True
    return call(state_dir, hooks, name, "started", "begin", "-", xml)


def _now(state_dir: str) -> float:
    with model.locked(state_dir, exclusive=False):
        return model.now(model.load(state_dir))


def _prepare_host(
    state_dir: str, name: str, spec: JsonObj
) -> tuple[str | None, JsonObj | None]:
    """qemuProcessPrepareHost: take the PCI functions; libvirt's error if
    another domain holds one, or any function of its IOMMU group, and the
    start failure ``fail_next_start`` set.

    As ``virHostdevPreparePCIDevicesImpl`` (src/hypervisor/virhostdev.c),
    step 1, for each of the domain's functions in order: the function itself
    (``virHostdevIsPCINodeDeviceUsed``), then every function of its VFIO
    group (``virPCIDeviceAddressIOMMUGroupIterate``, src/util/virpci.c, which
    lists ``/sys/bus/pci/devices/ADDR/iommu_group/devices``): the first one
    another domain holds is refused with ITS address, one the starting domain's
    XML may not name."""
    addresses = [model.pci_name(h["address"]) for h in spec.get("hostdevs", [])]
    while True:
        with model.locked(state_dir):
            data = model.load(state_dir)
            world = model.world(data)
            if not pending_stops(data, world):
                break
        # a domain that stopped meanwhile releases its functions after its
        # stop hooks (qemuProcessStop): run them first
        dispatch_stops(state_dir)
    with model.locked(state_dir):
        data = model.load(state_dir)
        world = model.world(data)
        others = {n: m for n, m in starting(data).items() if n != name}
        for own in addresses:
            for address in [own, *model.group_mates(data, own)]:
                holder = world.holder(address, exclude=name) or next(
                    (
                        n
                        for n, m in others.items()
                        if address in (m.get("hostdevs") or [])
                    ),
                    None,
                )
                if holder is not None:
                    return (
                        f"Requested operation is not valid: PCI device {address} "
                        f"is in use by driver {model.DRIVER_NAME}, domain {holder}"
                    ), None
        failures = data.setdefault("start_failures", {})
        failure = failures.get(name)
        if failure is not None and not failure.get("every"):
            del failures[name]
        data["starting"][name]["hostdevs"] = addresses
        model.save(state_dir, data)
    return None, failure


def _end(state_dir: str, name: str, *, fail_id: int | None) -> None:
    """The start is over: a failed one shuts the domain off (``failed``)."""
    with model.locked(state_dir):
        data = model.load(state_dir)
        if fail_id is not None:
            model.record(data, "fail", name, model.now(data), id=fail_id)
        (data.get("starting") or {}).pop(name, None)
        model.save(state_dir, data)


def disk_error(name: str) -> str:
    path = f"/var/lib/libvirt/images/{name}.qcow2"
    return (
        f"Cannot access storage file '{path}' (as uid:{QEMU_UID}, gid:{QEMU_GID}): "
        "No such file or directory"
    )


def vfio_error(name: str, spec: JsonObj, t: float) -> str:
    hostdevs = spec.get("hostdevs") or []
    address = model.pci_name(hostdevs[0]["address"]) if hostdevs else "0000:03:00.0"
    group = 10 + int(address.split(":")[1], 16)
    device = (
        f'{{"driver":"vfio-pci","host":"{address}","id":"hostdev0",'
        '"bus":"pci.5","addr":"0x0"}'
    )
    whole = int(t)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    stamp += f".{int((t - whole) * 1e6):06d}Z"
    return (
        f"internal error: QEMU unexpectedly closed the monitor (vm='{name}'): "
        f"{stamp} qemu-system-x86_64: -device {device}: vfio {address}: "
        f"failed to open /dev/vfio/{group}: Device or resource busy"
    )


def read_log(state_dir: str) -> list[JsonObj]:
    path = os.path.join(state_dir, LOG_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            return [model.parse_record(line) for line in handle if line.strip()]
    except FileNotFoundError:
        return []
