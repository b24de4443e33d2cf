"""A private root libvirtd with the QEMU driver, for real guests under TCG.

A root libvirtd always reads /etc/libvirt/qemu.conf and keeps its state in
/run/libvirt, /var/lib/libvirt, /var/cache/libvirt and /var/log/libvirt
(``-f`` moves only libvirtd.conf). So the daemon runs under ``unshare -m`` with
those five directories bind-mounted from a private temporary directory: nothing
it writes reaches the machine's own libvirt, and its unix socket lives outside
them, where ``virsh -c qemu+unix:///system?socket=...`` reaches it. QEMU's
capability cache (/var/cache/libvirt) is kept in the project's cache directory,
so only the first start pays for probing QEMU.

On exit every domain it still runs is destroyed (teardown only, after the
tests looked at them), the daemon is stopped, and any QEMU process it left is
killed by its own pid file.

With ``hook_agent`` the tower agent is the daemon's live qemu hook, as on a
tower: libvirtd runs every executable of ``SYSCONFDIR/libvirt/hooks/qemu.d``
(``LIBVIRT_HOOK_DIR`` in libvirt's src/util/virhook.c; Debian's daemon is
built with SYSCONFDIR=/etc) on every start and stop of any domain, and looks
for them once, when it starts (``virHookInitialize``, called from the
daemon's main in src/remote/remote_daemon.c; again only on SIGHUP). So the
script is written into the private directory that is bind-mounted over
/etc/libvirt before the daemon starts, where the agent's own install puts it
(``hooks/qemu.d/gpu-handoff``); nothing reaches the machine's /etc. The
script runs the agent's ``hook`` verb with the configuration a test names
(``set_hook_config``; with none it only logs), and logs every call with its
exit status (``hook_calls``). The domain XML on its stdin goes through
``cards.py filter`` first (the stand-in GPUs of real guests, see there).

libvirtd restarts under running domains as on a tower (``restart_daemon``,
or ``stop_daemon`` and ``start_daemon``): the namespace's init, a shell that
QEMU's processes are children of, stops and starts libvirtd on a signal and
stays, so they run on (INIT_LOOP).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, NamedTuple, Self

from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from tests.realvm.build_guest import Guest

BIND_TARGETS = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
}

QEMU_CONF = """\
# Written by tests/realvm/qemu_libvirtd.py for a private test daemon.
stdio_handler = "file"
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
namespaces = []
cgroup_controllers = []
security_driver = "none"
"""

LIBVIRTD_CONF = """\
# Written by tests/realvm/qemu_libvirtd.py for a private test daemon.
unix_sock_dir = "{sock_dir}"
unix_sock_group = "root"
unix_sock_ro_perms = "0700"
unix_sock_rw_perms = "0700"
unix_sock_admin_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
listen_tcp = 0
listen_tls = 0
log_outputs = "3:file:{log_dir}/libvirtd.log"
"""

START_TIMEOUT = 120.0

# The rest of the namespace's init (a shell, see QemuLibvirtd.start): it runs
# libvirtd and reaps every process of the namespace, QEMU's included (they
# daemonize, so they are the init's children). SIGUSR1 stops libvirtd alone
# (SIGTERM, as a restart of its service does, and waits until it is gone);
# SIGUSR2 starts it again, its pid file removed first. QEMU lives on
# meanwhile. SIGTERM ends it all, and so does libvirtd ending on its own.
# "$3" says "up" or "down" once a start or a stop is done.
INIT_LOOP = """\
conf=$1 pidfile=$2 state=$3
run() {
  rm -f "$pidfile"
  libvirtd -f "$conf" -p "$pidfile" &
  pid=$!
  mode=up
  echo up >"$state"
}
halt() {
  kill -TERM $pid 2>/dev/null
  while kill -0 $pid 2>/dev/null; do wait $pid; done
}
run
trap 'if [ $mode = up ]; then halt; mode=down; echo down >"$state"; fi' USR1
trap 'if [ $mode = down ]; then run; fi' USR2
trap 'halt; mode=quit' TERM INT
while [ $mode != quit ]; do
  if [ $mode = up ]; then
    kill -0 $pid 2>/dev/null || break
    wait $pid
  else
    sleep 0.1 &
    wait $!
  fi
done
"""

CARDS_FILTER = Path(__file__).resolve().with_name("cards.py")
# Where the agent's install puts its hook (its HOOK_PATH), below /etc/libvirt.
HOOK_PATH = ("hooks", "qemu.d", "gpu-handoff")
HOOK_SCRIPT = """#!/bin/sh
# qemu hook of a private test libvirtd (tests/realvm/qemu_libvirtd.py): the
# tower agent's `hook` verb for "prepare begin", as its hook script runs it,
# with the configuration named in {config_file}
# (with none, the domain XML is read and dropped); every call is logged with
# its exit status, and what the agent writes to stderr (libvirtd's log on a
# tower) is kept too.
started=$(date +%s.%N)
config=$(cat {config_file} 2>/dev/null)
if [ -n "$config" ] && [ "$2 $3" = "prepare begin" ]; then
  {python} {cards} filter |
    {python} {agent} --config "$config" hook "$@" 2>>{errors}
  rc=$?
elif [ -n "$config" ]; then
  # As the agent's own hook script (hook_script): every other step is the
  # shell's, the domain XML left unread (libvirt ignores the EPIPE).
  rc=0
else
  cat >/dev/null
  rc=0
fi
printf '%s %s %s\\n' "$started" "$rc" "$*" >>{log}
exit $rc
"""


class HookCall(NamedTuple):
    """One run of the qemu hook: libvirt's arguments and its exit status."""

    time: float
    rc: int
    domain: str
    op: str
    subop: str
    extra: str

    @property
    def event(self) -> str:
        return f"{self.op} {self.subop}"


class LibvirtdError(RuntimeError):
    """The private libvirtd could not be run."""


def missing_tools() -> list[str]:
    """The programs this daemon needs that are not installed."""
    return [
        tool
        for tool in ("libvirtd", "virsh", "qemu-system-x86_64", "unshare")
        if shutil.which(tool) is None
    ]


# qemu_agent.c, qemuAgentIO: QEMU's exit closed the agent's socket under the
# waiting guest-shutdown before libvirtd handled the guest's SHUTDOWN event.
AGENT_SOCKET_EOF = "error: internal error: End of file from agent socket\n"


def agent_shutdown_answers(name: str) -> tuple[tuple[int, str, str], ...]:
    """What ``virsh shutdown --mode agent`` answers (rc, stdout, stderr) when
    the guest powers off as asked: success, or "End of file from agent
    socket" when QEMU's exit closes the agent's channel before libvirtd has
    seen the guest's SHUTDOWN event (which of the two it handles first is a
    race in its event loop; a loaded machine loses it now and then). Both
    mean the guest went down; the tower agent takes both (its stop job)."""
    return (
        (0, f"Domain '{name}' is being shutdown\n\n", ""),
        (1, "\n", f"error: Failed to shutdown domain '{name}'\n{AGENT_SOCKET_EOF}"),
    )


class QemuLibvirtd:
    """``with QemuLibvirtd() as d:`` runs the daemon; ``d.uri`` reaches it."""

    def __init__(
        self, *, cache_dir: Path | None = None, hook_agent: Path | None = None
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="gh-qemu-libvirtd-"))
        self.dirs = {key: self.tmp / key for key in BIND_TARGETS}
        if cache_dir is not None:
            self.dirs["cache"] = cache_dir
        self.sock_dir = self.tmp / "sock"
        self.data_dir = self.tmp / "data"  # serial logs and other guest files
        self.hook_agent = hook_agent
        self.hook_dir = self.tmp / "hook"  # the hook's log and config pointer
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid_ns: str | None = None

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.socket}"

    @property
    def socket(self) -> Path:
        return self.sock_dir / "libvirt-sock"

    @property
    def daemon_state(self) -> Path:
        """Written by the namespace's init: "up" or "down" (INIT_LOOP)."""
        return self.tmp / "libvirtd.state"

    @property
    def log_file(self) -> Path:
        return self.dirs["log"] / "libvirtd.log"

    @property
    def hook_log(self) -> Path:
        return self.hook_dir / "calls.log"

    @property
    def hook_errors_log(self) -> Path:
        return self.hook_dir / "stderr.log"

    def hook_errors(self) -> str:
        """What the agent's hook wrote to stderr so far."""
        path = self.hook_errors_log
        return path.read_text(errors="replace") if path.exists() else ""

    def set_hook_config(self, config: Path | None) -> None:
        """The agent configuration the live hook runs with from now on
        (None: the hook runs no agent)."""
        pointer = self.hook_dir / "config"
        if config is None:
            pointer.unlink(missing_ok=True)
            return
        staged = self.hook_dir / "config.new"
        staged.write_text(str(config), encoding="utf-8")
        staged.replace(pointer)

    def hook_calls(self) -> list[HookCall]:
        """Every run of the qemu hook so far, in order."""
        if not self.hook_log.exists():
            return []
        calls = []
        for line in self.hook_log.read_text(errors="replace").splitlines():
            stamp, rc, domain, op, subop, extra = line.split(" ", 5)
            calls.append(HookCall(float(stamp), int(rc), domain, op, subop, extra))
        return calls

    def wait_hook(
        self, domain: str, event: str, *, since: int = 0, timeout: float = 30
    ) -> list[HookCall]:
        """The hook's calls from index ``since`` on, once one of them is
        ``event`` (e.g. "release end") of ``domain``."""

        def seen() -> list[HookCall] | None:
            calls = self.hook_calls()[since:]
            if any((c.domain, c.event) == (domain, event) for c in calls):
                return calls
            return None

        return wait_until(seen, timeout=timeout, what=f"the hook's {event} of {domain}")

    def _install_hook(self, agent: Path) -> None:
        self.hook_dir.mkdir(parents=True, exist_ok=True)
        script = self.dirs["etc"].joinpath(*HOOK_PATH)
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(
            HOOK_SCRIPT.format(
                config_file=shlex.quote(str(self.hook_dir / "config")),
                python=shlex.quote(sys.executable),
                cards=shlex.quote(str(CARDS_FILTER)),
                agent=shlex.quote(str(agent)),
                log=shlex.quote(str(self.hook_log)),
                errors=shlex.quote(str(self.hook_errors_log)),
            ),
            encoding="utf-8",
        )
        script.chmod(0o755)

    def domain_log(self, name: str) -> Path:
        """QEMU's own log of a domain (command line, 'shutting down, reason=')."""
        return self.dirs["log"] / "qemu" / f"{name}.log"

    def virsh(
        self, *args: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["virsh", "-c", self.uri, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def shutdown_by_agent(self, name: str) -> subprocess.CompletedProcess[str]:
        """``virsh shutdown --mode agent name``, which must be one of libvirt's
        answers for a guest powering off (agent_shutdown_answers)."""
        done = self.virsh("shutdown", "--mode", "agent", name)
        answer = (done.returncode, done.stdout, done.stderr)
        assert answer in agent_shutdown_answers(name), answer
        return done

    def stop_guest(self, name: str, *, timeout: float = 60) -> None:
        """Teardown: a running guest goes down through its guest agent, asked
        until its agent is up to take it (the daemon's own teardown destroys
        what is left: a guest still up after ``timeout`` is not an error)."""

        def asked() -> bool:
            if self.virsh("domstate", name).stdout.strip() != "running":
                return True
            done = self.virsh("shutdown", "--mode", "agent", name)
            answer = (done.returncode, done.stdout, done.stderr)
            return answer in agent_shutdown_answers(name)

        with contextlib.suppress(TimeoutError):
            wait_until(asked, timeout=timeout, interval=0.5, what=f"{name} to go down")
            wait_until(
                # (a transient domain is gone: domstate answers nothing)
                lambda: self.virsh("domstate", name).stdout.strip() in ("shut off", ""),
                timeout=timeout,
                interval=0.2,
                what=f"{name} to shut off",
            )

    def start(self) -> None:
        missing = missing_tools()
        if missing:
            raise LibvirtdError(f"missing: {', '.join(missing)}")
        for d in (*self.dirs.values(), self.sock_dir, self.data_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.dirs["etc"] / "qemu.conf").write_text(QEMU_CONF)
        if self.hook_agent is not None:
            # Before the daemon starts: it looks for hooks only then.
            self._install_hook(self.hook_agent)
        conf = self.dirs["etc"] / "libvirtd.conf"
        conf.write_text(
            LIBVIRTD_CONF.format(sock_dir=self.sock_dir, log_dir=self.dirs["log"])
        )
        mounts = []
        for key, target in BIND_TARGETS.items():
            mounts.append(f"mkdir -p {target}")
            mounts.append(f'mount --bind "{self.dirs[key]}" {target}')
        # The daemon gets its own mount and PID namespaces. A shell is the
        # namespace's init: QEMU daemonizes, and its processes must be reaped
        # by an init that waits for any child (the test runner may be PID 1 of
        # its own namespace and reaps nobody; libvirtd waits for a killed QEMU
        # to vanish). When the shell ends, the kernel kills whatever is left;
        # so the shell outlives a restart of libvirtd (INIT_LOOP).
        # In a chroot "/" is no mount point and cannot be made private; there
        # the enclosing namespace is private already.
        script = "\n".join(
            [
                "set -e",
                "mount --make-rprivate / 2>/dev/null || true",
                "mount -t proc proc /proc",
                *mounts,
                "set +e",
                INIT_LOOP,
            ]
        )
        stderr = (self.tmp / "libvirtd.stderr").open("wb")
        with stderr:
            self.proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--propagation",
                    "unchanged",
                    "sh",
                    "-c",
                    script,
                    "gh-libvirtd",
                    str(conf),
                    str(self.tmp / "libvirtd.pid"),
                    str(self.daemon_state),
                ],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
            )
        self._wait_answering()
        init = self._init_pid()
        if init is not None:
            self.pid_ns = str(Path(f"/proc/{init}/ns/pid").readlink())

    def _wait_answering(self) -> None:
        """Return once the daemon answers on its socket."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise LibvirtdError(
                    f"libvirtd exited with {self.proc.returncode}: {self.stderr_text()}"
                )
            if self.socket.exists():
                probe = self.virsh("uri", timeout=START_TIMEOUT)
                if probe.returncode == 0:
                    return
            if time.monotonic() > deadline:
                raise LibvirtdError(f"libvirtd did not answer: {self.stderr_text()}")
            time.sleep(0.05)

    def _signal_init(self, sig: signal.Signals) -> None:
        init = self._init_pid()
        if self.proc is None or self.proc.poll() is not None or init is None:
            raise LibvirtdError("the daemon's namespace is not running")
        os.kill(init, sig)

    def daemon_is_up(self) -> bool:
        """Whether libvirtd runs (False between stop_daemon and start_daemon)."""
        path = self.daemon_state
        return path.exists() and path.read_text().strip() == "up"

    def stop_daemon(self, timeout: float = 60) -> None:
        """Stop libvirtd alone (SIGTERM, as a restart of its service does)
        and return once it is gone; the domains' QEMU processes run on."""
        if not self.daemon_is_up():
            raise LibvirtdError("libvirtd is stopped already")
        self._signal_init(signal.SIGUSR1)
        wait_until(
            lambda: not self.daemon_is_up(), timeout=timeout, what="libvirtd to stop"
        )

    def start_daemon(self) -> None:
        """Start libvirtd again after stop_daemon; return once it answers (it
        reconnects to the running domains, running the qemu hook's
        ``reconnect begin`` for each, in threads of its own: maybe later)."""
        if self.daemon_is_up():
            raise LibvirtdError("libvirtd runs already")
        self._signal_init(signal.SIGUSR2)
        wait_until(self.daemon_is_up, timeout=30, what="libvirtd to be started")
        self._wait_answering()

    def restart_daemon(self, down: float = 0.0) -> None:
        """Stop libvirtd, wait ``down`` seconds, start it again; return once it
        answers. Domains keep running."""
        self.stop_daemon()
        time.sleep(down)
        self.start_daemon()

    def stderr_text(self) -> str:
        path = self.tmp / "libvirtd.stderr"
        return path.read_text(errors="replace") if path.exists() else ""

    def qemu_pids(self) -> list[int]:
        """Pids (as seen here) of the QEMU processes in this daemon's PID
        namespace."""
        if self.pid_ns is None:
            return []
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if str((proc / "ns" / "pid").readlink()) != self.pid_ns:
                    continue
                if b"qemu-system" in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
        return pids

    def _init_pid(self) -> int | None:
        """The namespace's init (the shell), a child of unshare."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            task = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            children = task.read_text().split()
            if children:
                return int(children[0])
        return None

    def stop(self) -> list[int]:
        """Stop everything; returns the QEMU pids that were still alive after
        the daemon ended (and had to be killed)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                for name in self.virsh("list", "--name", timeout=30).stdout.split():
                    # Teardown only: the tests have looked at the domain already.
                    self.virsh("destroy", name, timeout=30)
            init = self._init_pid()
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        leftovers = self.qemu_pids()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc = None
        return leftovers

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def domain_xml(
    name: str,
    *,
    kernel: Path,
    initrd: Path,
    cmdline: str,
    serial_log: Path,
    memory_mib: int = 192,
    metadata: str = "",
    devices: str = "",
) -> str:
    """A TCG guest: direct kernel boot, no disk, serial to a file, and the QEMU
    guest agent's virtio channel (``metadata``: a whole ``<metadata>`` element;
    ``devices``: more device elements, each line indented by four spaces)."""
    return f"""<domain type='qemu'>
  <name>{name}</name>
{metadata}  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>{cmdline}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{shutil.which("qemu-system-x86_64")}</emulator>
{devices}    <serial type='file'>
      <source path='{serial_log}'/>
      <target port='0'/>
    </serial>
    <channel type='unix'>
      <target type='virtio' name='org.qemu.guest_agent.0'/>
    </channel>
    <video><model type='none'/></video>
    <memballoon model='none'/>
  </devices>
</domain>
"""


PROBE_DOMAIN = "gh-event-probe"
PROBE_XML = """<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>64</memory>
  <os><type arch='x86_64'>hvm</type></os>
</domain>
"""


class EventLog:
    """``virsh event --loop --all --timestamp`` running into a file (its
    stderr too, or with ``split_stderr`` into ``stderr_path``)."""

    def __init__(
        self, daemon: QemuLibvirtd, name: str = "events", *, split_stderr: bool = False
    ) -> None:
        self.path = daemon.data_dir / f"{name}.txt"
        self.stderr_path = daemon.data_dir / f"{name}.stderr.txt"
        with self.path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    "virsh",
                    "-c",
                    daemon.uri,
                    "event",
                    "--loop",
                    "--all",
                    "--timestamp",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err if split_stderr else subprocess.STDOUT,
            )
        self._wait_subscribed(daemon)

    def _wait_subscribed(self, daemon: QemuLibvirtd) -> None:
        """Return once the listener receives events: virsh prints nothing when
        it has subscribed, so define a probe domain until its event shows (a
        busy machine otherwise loses the first real domain's events)."""
        probe = PROBE_XML.format(name=PROBE_DOMAIN)
        xml = daemon.data_dir / f"{PROBE_DOMAIN}.xml"
        xml.write_text(probe, encoding="utf-8")

        def seen() -> bool:
            daemon.virsh("define", str(xml))
            daemon.virsh("undefine", PROBE_DOMAIN)
            return PROBE_DOMAIN in self.path.read_text(errors="replace")

        wait_until(seen, timeout=60, interval=0.2, what="the event listener")

    def lines(self) -> list[str]:
        text = self.path.read_text(errors="replace")
        # Only whole lines (the last one may still be being written), and not
        # the probe's.
        return [line for line in text.split("\n")[:-1] if PROBE_DOMAIN not in line]

    def wait_for(self, needle: str, *, timeout: float) -> str:
        return wait_until(
            lambda: next((line for line in self.lines() if needle in line), None),
            timeout=timeout,
            what=f"event {needle!r}",
        )

    def stop(self) -> list[str]:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.lines()


def define_guest(
    daemon: QemuLibvirtd,
    guest: Guest,
    name: str,
    *,
    knobs: str = "",
    metadata: str = "",
    devices: str = "",
) -> Path:
    """Define a domain booting ``guest`` with /init knobs on the kernel command
    line (see build_guest); returns its serial log."""
    serial = daemon.data_dir / f"{name}.serial"
    xml = daemon.data_dir / f"{name}.xml"
    xml.write_text(
        domain_xml(
            name,
            kernel=guest.kernel,
            initrd=guest.initrd,
            cmdline=f"{guest.cmdline} {knobs}".strip(),
            serial_log=serial,
            metadata=metadata,
            devices=devices,
        )
    )
    result = daemon.virsh("define", str(xml))
    if result.returncode != 0:
        raise LibvirtdError(f"define {name}: {result.stderr}")
    return serial
