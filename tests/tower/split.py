"""A tower with the real privilege split, for the agent's trust tests.

As installed: the configuration is root's (0644), the state directory belongs
to the SSH user (0700), Home Assistant's key logs in as that user through the
real sshd and is forced to run ``serve``, and the libvirt hook runs as root
(as libvirtd runs it), in a process of its own. virsh is the recording
stand-in (fakevirsh.py), which both users may run; its own files are
everyone's to write, and kept apart from the agent's.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from dataclasses import dataclass, field
import json
import os
from pathlib import Path
import pwd
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.account import give, python_as_user, shared_dir, split_account
from tests.support.agentbuild import AGENT
from tests.support.sshd import Sshd, ssh_environment, sshd_available
from tests.support.testdriver import agent_command
from tests.tower import nodes
from tests.tower.conftest import REQUIRE_SYSTEM, FakeTower

WIN1_XML = nodes.domain_xml(
    "win-1", nodes.WIN1_DEVICES, running=True, test_driver_file=False
)
# libvirtd runs its hooks with a bare environment.
HOOK_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def alive(pid: int) -> bool:
    """Whether a process (not a zombie) with this id runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


@dataclass
class SplitTower:
    base: Path
    account: pwd.struct_passwd
    fake: FakeTower = field(init=False)
    uids_path: Path = field(init=False)
    config: Path = field(init=False)
    state_dir: Path = field(init=False)
    sshd: Sshd | None = None

    def __post_init__(self) -> None:
        tools = self.base / "tower"
        tools.mkdir()
        self.fake = FakeTower(tools)
        tools.chmod(0o777)  # the stand-in virsh's own files, either user's
        self.uids_path = tools / "virsh-uids.jsonl"
        for path in (
            self.fake.state_path,
            self.fake.log_path,
            self.fake.state_path.with_suffix(".lock"),
            self.uids_path,
        ):
            path.touch()
            path.chmod(0o666)
        wrapper = self.fake.virsh.read_text(encoding="utf-8")
        self.fake.virsh.write_text(
            wrapper.replace("exec ", f"FAKEVIRSH_UIDS={self.uids_path} exec ", 1),
            encoding="utf-8",
        )
        self.state_dir = self.base / "state"
        self.state_dir.mkdir()
        give(self.state_dir, self.account, 0o700)
        self.fake.state_dir = self.state_dir
        etc = self.base / "etc"
        etc.mkdir()
        self.config = etc / "config.json"
        self.configure()

    def configure(self, **overrides: Any) -> None:
        """The agent's configuration (root's, 0644), as FakeTower's plus these."""
        data = json.loads(self.fake.config.read_text(encoding="utf-8"))
        data.update(state_dir=str(self.state_dir), **overrides)
        self.config.write_text(json.dumps(data), encoding="utf-8")
        self.config.chmod(0o644)

    # --- Home Assistant's side: the SSH user, through sshd

    def start_sshd(self) -> Sshd:
        if not sshd_available():
            if REQUIRE_SYSTEM:
                pytest.fail("sshd is required here (GPU_HANDOFF_REQUIRE_SYSTEM=1)")
            pytest.skip("needs OpenSSH's sshd")
        self.sshd = Sshd(
            self.base / "sshd", agent_command(self.config), user=self.account.pw_name
        ).start()
        return self.sshd

    def ssh_popen(self, command: str) -> subprocess.Popen[bytes]:
        assert self.sshd is not None
        return subprocess.Popen(
            self.sshd.client_argv(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ssh_environment(),
        )

    def ssh(self, command: str, stdin: str = "", timeout: float = 60) -> Any:
        """One forced-command call through sshd: its JSON reply."""
        assert self.sshd is not None
        done = subprocess.run(
            self.sshd.client_argv(command),
            input=stdin,
            capture_output=True,
            text=True,
            env=ssh_environment(),
            timeout=timeout,
            check=False,
        )
        assert done.stdout, (done.returncode, done.stderr)
        return json.loads(done.stdout)

    # --- libvirtd's side: root

    def hook(
        self, *args: str, stdin: str = WIN1_XML
    ) -> subprocess.CompletedProcess[str]:
        """The qemu hook as libvirtd runs it: root, a process of its own."""
        return subprocess.run(
            [sys.executable, str(AGENT), "--config", str(self.config), "hook", *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=HOOK_ENV,
            timeout=60,
            check=False,
        )

    # --- the SSH user acting on its own (a shell on the tower)

    def as_user(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return python_as_user(self.account, code, *args)

    # --- looking on, as root

    def virsh_uids(self) -> set[int]:
        """Who ran virsh so far."""
        lines = self.uids_path.read_text(encoding="utf-8").splitlines()
        return {json.loads(line)["uid"] for line in lines}

    def job_records(self) -> list[dict[str, Any]]:
        jobs = self.state_dir / "jobs"
        if not jobs.is_dir():
            return []
        out = []
        for path in sorted(jobs.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text(encoding="utf-8")))
        return out

    def processes(self) -> list[int]:
        """The agent's processes of this tower (sessions, runners) still running."""
        mine = str(self.config)
        return [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit()
            and mine in cmdline(int(entry.name))
            and alive(int(entry.name))
        ]

    def runners(self) -> list[int]:
        return [pid for pid in self.processes() if " run-job " in cmdline(pid)]

    def wait_idle(self, timeout: float = 60) -> None:
        """Until no runner of this tower runs (and every job is over)."""
        deadline = time.monotonic() + timeout
        while self.runners() or any(
            j.get("state") in ("queued", "running") for j in self.job_records()
        ):
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy: {self.job_records()}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.sshd is not None:
            self.sshd.stop()
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def split_tower() -> Iterator[SplitTower]:
    account = split_account()
    with shared_dir() as base:
        tower = SplitTower(base, account)
        try:
            yield tower
        finally:
            tower.close()
