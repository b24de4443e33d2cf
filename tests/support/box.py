"""A tower in a box: the test root booted under its own systemd, as PID 1.

The box is the root file system the tests run in (the provisioned Debian root;
or another root file system, ``lower``: the Debian 11 tower's) under an
overlay whose upper layer is the box's directory, so nothing is written to
the root itself. It runs in private mount, PID, cgroup and UTS
namespaces (and a network namespace of its own when asked), in a sub-tree of
the machine's cgroup2 hierarchy bind-mounted at its ``/sys/fs/cgroup``, with
its own ``/proc`` (``/proc/sys`` read-only: kernel variables are the
machine's), a read-only ``/sys``, a small ``/dev`` and tmpfs ``/run`` and
``/tmp``.
``/usr/lib/systemd/systemd`` then boots as on a machine with
``container=gpu-handoff-box``: journald, dbus, logind, the real sshd as
``ssh.service``, the real ``libvirtd.service`` (socket-activated, QEMU
driver), ``systemd-tmpfiles``, ``systemd-run`` and ``systemctl`` are the
root's own programs doing what they do on a tower.

Units a tower does not need (timers, gettys, ``var-lib-machines.mount``...)
are masked so the box boots in about a second. ``poweroff()`` shuts it down
through systemd; ``boot()`` again starts it on the same upper layer (what was
written before survives, as on a disk; ``/run`` and ``/tmp`` do not).
``close()`` powers off, removes the cgroup sub-tree and the directory, and
checks that no process, mount or cgroup of the box is left.

Two directories cross the wall at the same path on both sides: the
repository (read-only, at ``/src``) and the box's ``shared`` directory (read
and write), so a test can hand the box programs and read what they leave.

    with Box(tmp_path / "box") as box:
        box.run(["systemctl", "is-active", "ssh.service"])
"""

from __future__ import annotations

from collections.abc import Iterable
import contextlib
import os
from pathlib import Path
import secrets
import shutil
import signal
import stat
import subprocess
import time
from typing import Self

from tests.support.sshd import _free_port
from tests.support.waiting import wait_until

SYSTEMD = "/usr/lib/systemd/systemd"
CGROUP2 = Path("/sys/fs/cgroup/unified")
CONTAINER = "gpu-handoff-box"
REPOSITORY = "/src"
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# What a tower in a box does not need; each masked unit is one fewer to start
# (or, for var-lib-machines.mount, one that fails in a container).
MASKED = (
    "var-lib-machines.mount",
    "systemd-machined.service",
    "systemd-machined.socket",
    "getty.target",
    "console-getty.service",
    "systemd-logind-varlink.socket",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "man-db.timer",
    "logrotate.timer",
    "systemd-tmpfiles-clean.timer",
    "systemd-timesyncd.service",
    "systemd-networkd.service",
    "systemd-resolved.service",
    "libvirt-guests.service",
    # Kernel variables are the machine's, not the box's (/proc/sys is
    # read-only in the box, as in any container).
    "systemd-sysctl.service",
)

# Device nodes the box gets from the machine (those that exist here). No
# /dev/kvm: QEMU in the box runs TCG, as the real-QEMU tests do (the
# machine's /dev/kvm is root's alone, and libvirt, finding a KVM its QEMU
# user cannot open, probes QEMU's capabilities again on every lookup).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty", "fuse", "net/tun")

# Boots are recorded here for the suite's summary (see tests/conftest.py).
BOOT_SECONDS: list[float] = []

# The launcher: moves itself into the box's cgroup, then starts the
# namespaces; PID 1 of the new PID namespace mounts the box and becomes
# systemd. Positional arguments: cgroup, merged root, upper, work, shared
# directory, network flag, mount propagation ("private", or "unchanged" where
# the mounts are private already: inside a chroot, where "/" is no mount
# point, unshare cannot make them so), the lower layer (the root booted).
_LAUNCHER = r"""
set -eu
echo $$ > "$1/cgroup.procs"
net=""
[ "$6" = private ] && net=--net
exec unshare --mount --pid --fork --propagation "$7" --cgroup --uts $net \
  --kill-child /bin/sh -c '
set -eu
root=$2 shared=$5
mount -t overlay overlay -o "lowerdir=$8,upperdir=$3,workdir=$4" "$root"
mount -t proc proc "$root/proc"
mount --bind "$root/proc/sys" "$root/proc/sys"
mount -o remount,bind,ro "$root/proc/sys"
if [ -e "$root/proc/sysrq-trigger" ]; then
  mount --bind "$root/proc/sysrq-trigger" "$root/proc/sysrq-trigger"
  mount -o remount,bind,ro "$root/proc/sysrq-trigger"
fi
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"
mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup"
mount -t tmpfs -o mode=0755,nosuid tmpfs "$root/dev"
for dev in @DEVICES@; do
  [ -c "/dev/$dev" ] || continue
  case $dev in */*) mkdir -p "$root/dev/${dev%/*}" ;; esac
  touch "$root/dev/$dev"
  mount --bind "/dev/$dev" "$root/dev/$dev"
done
touch "$root/dev/console"
mount --bind /dev/null "$root/dev/console"
mkdir -m 0755 "$root/dev/pts" "$root/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$root/run"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/tmp"
mkdir -p "$root/src"
mount --bind -o ro /src "$root/src"
mkdir -p "$root$shared"
mount --bind "$shared" "$root$shared"
exec chroot "$root" /usr/bin/env -i container=gpu-handoff-box TERM=dumb \
  LANG=C.UTF-8 /usr/lib/systemd/systemd
' box "$@"
""".replace("@DEVICES@", " ".join(DEVICES))


def _propagation() -> str:
    from tests.support.fresh_tower import private_mounts_argv

    argv = private_mounts_argv()
    if argv is None:
        raise BoxError("the box needs a private mount namespace (unshare -m)")
    return "unchanged" if "unchanged" in argv else "private"


class BoxError(RuntimeError):
    """The box did not boot, or did not go away cleanly (the message says which)."""


def box_unavailable() -> str | None:
    """Why no box can boot here, or None when one can."""
    if os.geteuid() != 0:
        return "the box needs the tests to run as root"
    if os.environ.get("GPU_HANDOFF_ENV") != "root":
        return (
            "the box boots the provisioned Debian root: run the tests through "
            "scripts/test on a machine that builds one"
        )
    if not Path(SYSTEMD).exists():
        return f"the box needs systemd ({SYSTEMD})"
    missing = [
        tool for tool in ("unshare", "nsenter", "chroot") if not shutil.which(tool)
    ]
    if missing:
        return f"the box needs {', '.join(missing)}"
    if "overlay" not in Path("/proc/filesystems").read_text(encoding="utf-8").split():
        return "the box needs overlayfs"
    if not (CGROUP2 / "cgroup.procs").exists():
        return (
            f"the box needs a cgroup2 hierarchy at {CGROUP2} (this kernel mounts "
            "none beside its v1 controllers)"
        )
    if not Path(REPOSITORY).is_dir():
        return f"the box needs the repository at {REPOSITORY}"
    return None


def require_box() -> None:
    """Skip the test without a box; fail when the system must have one
    (``GPU_HANDOFF_REQUIRE_SYSTEM``), as the real-QEMU tests do."""
    import pytest  # only the tests that want a box need it

    reason = box_unavailable()
    if reason is None:
        return
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM)")
    pytest.skip(reason)


class Box:
    """One box (see the module's docstring); a context manager that boots it.

    ``network="private"`` gives the box a network namespace of its own
    (only a loopback, which systemd brings up); the default shares the
    machine's, so a service in the box listening on 127.0.0.1 is reachable
    from the tests. ``ssh.service`` listens on 127.0.0.1 at ``ssh_port`` (a
    free port by default, so it never meets the machine's own sshd).
    ``masked``: the units masked before the first boot. ``lower``: the root
    file system booted (its overlay's lower layer; by default the test
    root itself), one with systemd at /usr/lib/systemd/systemd.
    """

    def __init__(
        self,
        directory: Path,
        *,
        network: str = "shared",
        masked: Iterable[str] = MASKED,
        hostname: str = "tower",
        ssh_port: int = 0,
        lower: Path = Path("/"),
    ) -> None:
        if network not in ("shared", "private"):
            raise ValueError(f"network must be 'shared' or 'private', not {network!r}")
        self.directory = directory
        self.network = network
        self.masked = tuple(masked)
        self.hostname = hostname
        self.ssh_port = ssh_port
        self.lower = lower
        self.cgroup = CGROUP2 / f"gpu-handoff-box-{secrets.token_hex(4)}"
        self.launcher: subprocess.Popen[bytes] | None = None
        self.pid1: int | None = None
        self.boot_seconds: float | None = None
        self.boots = 0

    # -- paths

    @property
    def upper(self) -> Path:
        return self.directory / "upper"

    @property
    def shared(self) -> Path:
        """A directory at the same path inside and outside (read and write)."""
        return self.directory / "shared"

    @property
    def root(self) -> Path:
        """The running box's root, as seen from outside (through PID 1)."""
        if self.pid1 is None:
            raise BoxError("the box is not running")
        return Path(f"/proc/{self.pid1}/root")

    # -- writing into the box

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write ``path`` in the box: into the running box, or, while it is
        down, into the upper layer (its directories take the lower layer's
        owner and mode, as the overlay would show them)."""
        if not path.startswith("/"):
            raise ValueError(f"an absolute path in the box, not {path!r}")
        if self.pid1 is not None:
            target = self.root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
        else:
            self._prepare()
            target = self.upper / path.lstrip("/")
            self._upper_dirs(Path(path).parent)
        target.write_text(text, encoding="utf-8")
        target.chmod(mode)

    def _upper_dirs(self, path: Path) -> None:
        for depth in range(1, len(path.parts)):
            part = Path(*path.parts[: depth + 1])
            upper = self.upper / str(part).lstrip("/")
            if upper.is_dir():
                continue
            upper.mkdir()
            below = self.lower / str(part).lstrip("/")
            if below.is_dir():
                info = below.stat()
                os.chown(upper, info.st_uid, info.st_gid)
                upper.chmod(stat.S_IMODE(info.st_mode))

    def mask(self, units: Iterable[str]) -> None:
        """Mask ``units`` (as ``systemctl mask`` does: a link to /dev/null)."""
        self._prepare()
        for unit in units:
            link = self.upper / "etc/systemd/system" / unit
            self._upper_dirs(Path("/etc/systemd/system"))
            if not link.is_symlink():
                link.symlink_to("/dev/null")

    # -- running commands inside

    def argv(self, user: str = "root") -> list[str]:
        """The argv prefix that runs a command inside the box as ``user``."""
        if self.pid1 is None:
            raise BoxError("the box is not running")
        argv = ["nsenter", "-t", str(self.pid1), "-m", "-p", "-u", "-C", "-r", "-w"]
        if self.network == "private":
            argv.append("-n")
        argv.append("--")
        if user != "root":
            argv += ["/usr/sbin/runuser", "-u", user, "--"]
        return argv

    def run(
        self,
        argv: list[str],
        user: str = "root",
        *,
        stdin: str | None = None,
        timeout: float = 60,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the box (root's PATH; never through a shell)."""
        done = subprocess.run(
            [*self.argv(user), *argv],
            input=stdin if stdin is not None else "",
            env={"PATH": ROOT_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise BoxError(
                f"{' '.join(argv)} exited with {done.returncode} in the box: "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done

    def systemctl(
        self, *args: str, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", *args], check=check)

    def journal(self, unit: str | None = None) -> str:
        """What the box's journal holds (of one unit), for failure messages."""
        argv = ["journalctl", "--no-pager", "-o", "short-monotonic"]
        if unit:
            argv += ["-u", unit]
        return self.run(argv).stdout

    # -- boot and power off

    def __enter__(self) -> Self:
        return self.boot()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def boot(self, timeout: float = 60.0) -> Self:
        """Boot the box and wait until systemd says it is up: ``running``, or
        BoxError naming the failed units (``degraded``) with their journal."""
        if self.launcher is not None:
            raise BoxError("the box is running already")
        began = time.monotonic()
        if self.boots == 0:
            self._first_boot()
        (self.directory / "root").mkdir(exist_ok=True)
        self.cgroup.mkdir(exist_ok=True)
        log = (self.directory / "launcher.log").open("ab")
        try:
            self.launcher = subprocess.Popen(
                [
                    "/bin/sh",
                    "-c",
                    _LAUNCHER,
                    "box-launcher",
                    str(self.cgroup),
                    str(self.directory / "root"),
                    str(self.upper),
                    str(self.directory / "work"),
                    str(self.shared),
                    self.network,
                    _propagation(),
                    str(self.lower),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd="/",
                env={"PATH": ROOT_PATH, "LANG": "C.UTF-8"},
            )
        finally:
            log.close()
        self.boots += 1
        try:
            self.pid1 = wait_until(
                self._find_pid1, timeout=timeout, what="the box's PID 1", interval=0.01
            )
            state = self._wait_booted(began + timeout - time.monotonic())
        except BaseException:
            self._force_down()
            raise
        if state != "running":
            failed = self.systemctl("--failed", "--plain", "--no-legend").stdout
            journal = self.journal()[-4000:]
            self._force_down()
            raise BoxError(
                f"the box booted {state}; failed units:\n{failed}\njournal:\n{journal}"
            )
        self.boot_seconds = time.monotonic() - began
        BOOT_SECONDS.append(self.boot_seconds)
        return self

    def _prepare(self) -> None:
        """The box's directory laid out, once: it must be new."""
        if self.upper.is_dir():
            return
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"a box's directory must be new: {self.directory}")
        path = str(self.directory.resolve())
        if any(char in path for char in ",:\\") or any(c.isspace() for c in path):
            raise ValueError(f"a box's directory must be a plain path: {path}")
        for sub in ("upper", "work", "shared", "root"):
            (self.directory / sub).mkdir(parents=True)
        self.shared.chmod(0o755)

    def _first_boot(self) -> None:
        self._prepare()
        self.mask(self.masked)
        self.write("/etc/hostname", self.hostname + "\n")
        self.ssh_port = self.ssh_port or _free_port()
        self.write(
            "/etc/ssh/sshd_config.d/10-box.conf",
            f"Port {self.ssh_port}\nListenAddress 127.0.0.1\n",
        )
        # No machine id: systemd makes one on the first boot and keeps it
        # (the upper layer holds it), as on a freshly installed machine.
        self.write("/etc/machine-id", "")

    def _find_pid1(self) -> int | None:
        launcher = self.launcher
        if launcher is None or launcher.poll() is not None:
            raise BoxError(f"the box's launcher ended: {self.launcher_log()}")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                status = Path(entry.path, "status").read_text(encoding="utf-8")
                fields = dict(
                    line.split(":", 1) for line in status.splitlines() if ":" in line
                )
                # PID 1 inside once it is systemd, not the mounting shell.
                if (
                    int(fields["PPid"]) == launcher.pid
                    and Path(entry.path, "comm").read_text().strip() == "systemd"
                ):
                    return int(entry.name)
        return None

    def _wait_booted(self, timeout: float) -> str:
        deadline = time.monotonic() + max(timeout, 1.0)
        while True:
            # --wait blocks until start-up finishes; it fails while systemd's
            # bus is not up yet, so try again until the deadline.
            left = deadline - time.monotonic()
            try:
                done = self.run(
                    ["systemctl", "is-system-running", "--wait"], timeout=max(left, 0.1)
                )
            except subprocess.TimeoutExpired:
                raise BoxError(
                    f"the box did not finish booting within {timeout:.0f} s:\n"
                    f"{self.systemctl('list-jobs').stdout}"
                ) from None
            state = done.stdout.strip()
            if state in ("running", "degraded", "maintenance", "stopping"):
                return state
            if time.monotonic() > deadline:
                raise BoxError(f"the box says {state!r}: {done.stderr.strip()}")
            time.sleep(0.02)

    def launcher_log(self) -> str:
        path = self.directory / "launcher.log"
        return path.read_text("utf-8", "replace") if path.exists() else ""

    def poweroff(self, timeout: float = 30.0) -> None:
        """Shut the box down through systemd (units stopped in order, as on a
        machine), then wait for its PID 1 to end."""
        launcher = self.launcher
        if launcher is None:
            return
        if launcher.poll() is None:
            self.run(["systemctl", "poweroff", "--no-block"])
        try:
            launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._force_down()
            raise BoxError(f"the box did not power off within {timeout:g} s") from None
        self.launcher = None
        self.pid1 = None

    def reboot(self, timeout: float = 60.0) -> Self:
        """Power off and boot again on the same disk (the upper layer)."""
        self.poweroff()
        return self.boot(timeout)

    def _force_down(self) -> None:
        """Kill the launcher: --kill-child takes PID 1, and with it the whole
        PID namespace."""
        launcher, self.launcher, self.pid1 = self.launcher, None, None
        if launcher is None:
            return
        with contextlib.suppress(ProcessLookupError):
            launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)

    def close(self) -> None:
        """Power off, remove the cgroup sub-tree and the directory; BoxError
        if anything of the box is left. Safe to call more than once."""
        try:
            # Forced down on failure; the check below says what is left.
            with contextlib.suppress(BoxError):
                self.poweroff()
            self._remove_cgroup()
            left = self.leftovers()
        finally:
            if self.directory.exists():
                shutil.rmtree(self.directory, ignore_errors=True)
        if left:
            raise BoxError("the box left " + "; ".join(left))

    def _remove_cgroup(self) -> None:
        def remove() -> bool:
            if not self.cgroup.exists():
                return True
            for directory, _, _ in sorted(
                os.walk(self.cgroup), key=lambda walked: -len(walked[0])
            ):
                with contextlib.suppress(OSError):
                    Path(directory).rmdir()
            return not self.cgroup.exists()

        with contextlib.suppress(TimeoutError):
            wait_until(remove, timeout=10, what="the box's cgroup to empty")

    def leftovers(self) -> list[str]:
        """What of the box still exists: processes in its cgroup, the cgroup
        itself, mounts of its directory in this mount namespace."""
        left: list[str] = []
        if self.cgroup.exists():
            procs = [
                line
                for path in self.cgroup.rglob("cgroup.procs")
                for line in path.read_text(encoding="utf-8").split()
            ]
            left.append(f"its cgroup {self.cgroup} ({len(procs)} processes in it)")
        mounts = Path("/proc/self/mountinfo").read_text(encoding="utf-8")
        directory = str(self.directory)
        if any(directory in line for line in mounts.splitlines()):
            left.append(f"mounts under {directory}")
        return left
