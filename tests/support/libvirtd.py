"""A private, real ``libvirtd`` for tests, and libvirt's test driver on top.

``Libvirtd`` is generic: configuration text in, its own socket directory, the
process run in its own session and stopped cleanly (nothing left running). It
serves any driver the daemon has; ``LibvirtTestDriver`` adds what the test
driver needs: its state lives only while one connection stays open, so a
``virsh event --loop --all --timestamp`` keeper stays connected for the
daemon's whole life (its lines are the event log), and domains are defined
from XML.

    with LibvirtTestDriver(tmp_path / "libvirtd") as lv:
        lv.define(xml)
        lv.virsh("start", "gpu-node")
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import os
from pathlib import Path
import shutil
import signal
import subprocess
from typing import Self

import pytest

from tests.support.waiting import wait_until

LIBVIRTD = "libvirtd"
VIRSH = "virsh"


def libvirtd_available() -> bool:
    """Whether virsh and libvirtd are installed."""
    return shutil.which(VIRSH) is not None and shutil.which(LIBVIRTD) is not None


def require_libvirtd() -> None:
    """Skip the test without libvirt; fail when the system must have it."""
    if libvirtd_available():
        return
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail("virsh and libvirtd are required here (GPU_HANDOFF_REQUIRE_SYSTEM)")
    pytest.skip("needs libvirt's virsh and libvirtd")


class LibvirtdError(RuntimeError):
    """libvirtd did not come up (the message holds its log)."""


class Libvirtd:
    """One private libvirtd: ``libvirtd -f CONF`` with its own unix sockets."""

    def __init__(
        self,
        directory: Path,
        config: str = "",
        *,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        self.directory = directory
        self.sock_dir = directory / "sock"
        self.conf = directory / "libvirtd.conf"
        self.log = directory / "libvirtd.log"
        self.pid_file = directory / "libvirtd.pid"
        self.config = config
        self.argv = argv or [LIBVIRTD]
        self.env = env
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.sock_dir / "libvirt-sock"

    def uri(self, driver: str = "qemu:///system") -> str:
        """``driver``'s URI through this daemon's socket (``test:///default``...)."""
        scheme, rest = driver.split("://", 1)
        sep = "&" if "?" in rest else "?"
        return f"{scheme}+unix://{rest}{sep}socket={self.socket}"

    def config_text(self) -> str:
        return (
            f'unix_sock_dir = "{self.sock_dir}"\n'
            'unix_sock_rw_perms = "0777"\n'
            'unix_sock_ro_perms = "0777"\n'
            'auth_unix_rw = "none"\n'
            'auth_unix_ro = "none"\n'
            f'log_outputs = "3:file:{self.log}"\n' + self.config
        )

    def start(self) -> Self:
        self.sock_dir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self.config_text(), encoding="utf-8")
        stderr = (self.directory / "libvirtd.stderr").open("wb")
        with stderr:
            self.process = subprocess.Popen(
                # its own PID file: with the default, /run/libvirtd.pid, only
                # one daemon could run at a time
                [*self.argv, "-f", str(self.conf), "-p", str(self.pid_file)],
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
                env=self.env,
            )
        try:
            wait_until(
                lambda: self.socket.exists() or self.process.poll() is not None,  # type: ignore[union-attr]
                timeout=self.start_timeout,
                what="libvirtd's socket",
            )
        except BaseException:
            self.stop()
            raise
        if self.process is None or self.process.poll() is not None:
            text = self.stderr_text()
            self.stop()
            raise LibvirtdError(f"libvirtd exited: {text}")
        return self

    def stderr_text(self) -> str:
        path = self.directory / "libvirtd.stderr"
        return path.read_text("utf-8", "replace") if path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the daemon's session, SIGKILL after ``timeout``; reaped."""
        proc, self.process = self.process, None
        if proc is None:
            return
        _stop_session(proc, timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_session(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # anything else left in the session (the daemon's helpers)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class LibvirtTestDriver(Libvirtd):
    """libvirt's test driver inside a private libvirtd, with state across calls.

    ``clean=True`` removes the driver's built-in ``test`` domain, so the daemon
    holds only what the test defines.
    """

    PROBE = "libvirtd-runner-probe"

    def __init__(self, directory: Path, *, clean: bool = True) -> None:
        # The test driver is part of libvirt itself. The daemon loads no
        # hypervisor driver (libvirt looks for them in LIBVIRT_DRIVER_DIR, here
        # an empty directory): the QEMU driver's state is the machine's
        # (/run/libvirt/qemu/driver.pid), so two daemons that load it cannot
        # run at once, and pytest's workers start several.
        no_drivers = directory / "no-drivers"
        no_drivers.mkdir(parents=True, exist_ok=True)
        super().__init__(
            directory, env={**os.environ, "LIBVIRT_DRIVER_DIR": str(no_drivers)}
        )
        self.clean = clean
        self.keeper: subprocess.Popen[bytes] | None = None
        self.events_file = directory / "events.log"

    @property
    def test_uri(self) -> str:
        return self.uri("test:///default")

    def virsh(
        self, *args: str, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [VIRSH, "-c", self.test_uri, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def start(self) -> Self:
        super().start()
        try:
            with self.events_file.open("wb") as out:
                self.keeper = subprocess.Popen(
                    [
                        VIRSH,
                        "-c",
                        self.test_uri,
                        "event",
                        "--loop",
                        "--all",
                        "--timestamp",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            # The keeper holds the state once it sees what another client does.
            probe = f"<domain type='test'><name>{self.PROBE}</name><memory>1024</memory><os><type>hvm</type></os></domain>"

            def keeper_sees_probe() -> bool:
                if self.keeper.poll() is not None:  # type: ignore[union-attr]
                    raise LibvirtdError(  # noqa: TRY301 - cleaned up below
                        f"event keeper exited: {self.event_lines()}"
                    )
                if any(self.PROBE in line for line in self.event_lines()):
                    return True
                # Not seen: a keeper that connected after the last define
                # missed its event; define it again for one it can see.
                if self.PROBE in self.virsh("list", "--all", "--name").stdout:
                    self.virsh("undefine", self.PROBE)
                self.define(probe)
                return False

            wait_until(
                keeper_sees_probe,
                timeout=30,
                what="the event keeper to connect",
                interval=0.2,
            )
            self.virsh("undefine", self.PROBE, check=True)
            last = self.PROBE
            if self.clean:
                self.virsh("destroy", "test")
                self.virsh("undefine", "test", check=True)
                last = "test"
            self.await_last_event(
                f"event 'lifecycle' for domain '{last}': Undefined Removed"
            )
            self.mark = len(self.event_lines())
        except BaseException:
            self.stop()
            raise
        return self

    def event_lines(self) -> list[str]:
        """What the keeper printed (``virsh event --loop --all --timestamp``)."""
        if not self.events_file.exists():
            return []
        return self.events_file.read_text("utf-8", "replace").splitlines()

    def await_last_event(self, event: str, *, timeout: float = 30) -> None:
        """Wait until the keeper's last line is ``event`` (after its
        timestamp). The keeper may print an event after the call that caused
        it has returned, so a test that reads the lines right after its last
        call would miss the call's own."""

        def printed() -> bool:
            lines = self.event_lines()
            return bool(lines) and lines[-1].endswith(": " + event)

        wait_until(printed, timeout=timeout, what=f"the keeper's line {event!r}")

    def new_event_lines(self) -> list[str]:
        """Event lines since the daemon was ready (setup events left out)."""
        return self.event_lines()[self.mark :]

    def define(self, xml: str) -> None:
        path = self.directory / "define.xml"
        path.write_text(xml, encoding="utf-8")
        self.virsh("define", str(path), check=True)
        path.unlink()

    def stop(self, timeout: float = 15.0) -> None:
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            _stop_session(keeper, timeout)
        super().stop(timeout)


@pytest.fixture
def libvirt_test_driver(tmp_path: Path) -> Iterator[LibvirtTestDriver]:
    """A private libvirtd serving a clean test driver (skips without libvirt)."""
    require_libvirtd()
    directory = tmp_path / "libvirtd"
    directory.mkdir()
    with LibvirtTestDriver(directory) as daemon:
        yield daemon
