"""Fixtures of the tower agent's tests: in-process runs, a stand-in virsh."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from dataclasses import dataclass, field
import fcntl
import io
import json
import os
from pathlib import Path
import shutil
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    accounts as agent_accounts,
    cli as agent_cli,
    state as agent_state,
    wire,
)
from tests.tower import nodes

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"
REQUIRE_SYSTEM = os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM") == "1"


@pytest.fixture(autouse=True)
def auto_enable_custom_integrations() -> None:
    """The agent's tests need no Home Assistant instance."""
    return


@pytest.fixture(autouse=True)
def never_drop_privileges_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as root on a state directory of another user, the agent becomes that
    user for good: in a test's own process that would be the test runner.
    Such runs belong in a process of their own (tests/tower/test_trust.py)."""

    def refuse(uid: int, gid: int, env: dict[str, str]) -> None:
        pytest.fail(f"the agent would become uid {uid} inside the test process")

    monkeypatch.setattr(agent_accounts, "drop_privileges", refuse, raising=False)
    monkeypatch.setattr(agent_state, "drop_privileges", refuse, raising=False)


def require_tool(*names: str) -> None:
    """Skip when a system tool is missing, unless the environment requires it."""
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        message = f"missing system tools: {', '.join(missing)}"
        if REQUIRE_SYSTEM:
            pytest.fail(message + " (GPU_HANDOFF_REQUIRE_SYSTEM=1)")
        pytest.skip(message)


@dataclass
class Run:
    """What one in-process run of the agent printed."""

    rc: int
    lines: list[dict[str, Any]]
    stderr: str

    @property
    def reply(self) -> dict[str, Any]:
        assert len(self.lines) == 1, self.lines
        return self.lines[0]


def run_agent(
    argv: list[str], env: dict[str, str] | None = None, stdin: str = ""
) -> Run:
    """Call the agent's main in this process."""
    out, err = io.StringIO(), io.StringIO()
    base = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root")}
    rc = agent_cli.main(argv, {**base, **(env or {})}, io.StringIO(stdin), out, err)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    for line in lines:
        assert line["protocol"] == wire.PROTOCOL
    return Run(rc, lines, err.getvalue())


def write_config(file: Path, **data: Any) -> Path:
    """A configuration file."""
    file.write_text(json.dumps(data), encoding="utf-8")
    return file


@dataclass
class FakeTower:
    """The stand-in virsh (see fakevirsh.py) plus a configuration using it."""

    directory: Path
    config: Path = field(init=False)
    state_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.state_dir = self.directory / "state"
        self.virsh = self.directory / "bin" / "virsh"
        self.virsh.parent.mkdir()
        self.state_path = self.directory / "virsh-state.json"
        self.log_path = self.directory / "virsh-log.jsonl"
        self.log_path.touch()
        # -I -S: the stand-in is the standard library alone, and site's .pth
        # files would be most of its start (the job tests run it hundreds of
        # times).
        self.virsh.write_text(
            "#!/bin/sh\n"
            f"FAKEVIRSH_STATE={self.state_path} FAKEVIRSH_LOG={self.log_path} "
            f'exec {sys.executable} -I -S {HERE / "fakevirsh.py"} "$@"\n',
            encoding="utf-8",
        )
        self.virsh.chmod(0o755)
        domains = {}
        for name, devices in nodes.domains().items():
            domains[name] = {
                "state": "running" if name == "gpu-node" else "shut off",
                "reason": "booted" if name == "gpu-node" else "shutdown",
                "xml": nodes.domain_xml(
                    name, devices, running=True, test_driver_file=False
                ),
                "agent_after": 0,
                "shutdown_polls": 1,
            }
        self.save({"domains": domains})
        self.configure()

    def configure(self, **overrides: Any) -> None:
        data: dict[str, Any] = {
            "libvirt_uri": "test:///fake",
            "gpu_node": "gpu-node",
            "gaming": ["win-1", "win-2"],
            "state_dir": str(self.state_dir),
            "commands": {"virsh": str(self.virsh)},
            "timeouts": {"agent": 20, "shutdown": 20, "start": 20},
            "detach": "process",
            "poll_interval": 0.02,
            # no IOMMU groups (this machine's own are not the fake tower's)
            "sysfs": str(self.directory / "sys"),
        }
        data.update(overrides)
        self.config = write_config(self.directory / "config.json", **data)

    def load(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.state_path.read_text(encoding="utf-8"))
        return result

    def save(self, state: dict[str, Any]) -> None:
        """Replace the state whole: a running `event` reads it at any time."""
        tmp = self.state_path.with_suffix(".save")
        tmp.write_text(json.dumps(state), encoding="utf-8")
        tmp.replace(self.state_path)

    @contextlib.contextmanager
    def changing(self) -> Iterator[dict[str, Any]]:
        """The state to change in place: read and replaced under the lock
        the stand-in virsh takes for its own read-modify-write, so that a
        call running meanwhile (a session's refresh rewrites the state
        whole) neither loses the change nor is lost by it."""
        with self.state_path.with_suffix(".lock").open("a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.load()
            yield state
            self.save(state)

    def update(self, **values: Any) -> None:
        """Set top-level keys of the state (``unreachable``, ``event_fails``)."""
        with self.changing() as state:
            state.update(values)

    def set_domain(self, name: str, **values: Any) -> None:
        with self.changing() as state:
            state["domains"][name].update(values)

    def log(self) -> list[list[str]]:
        return [
            json.loads(line)
            for line in self.log_path.read_text(encoding="utf-8").splitlines()
        ]

    def commands(self) -> list[str]:
        """Every virsh subcommand run, batches split (the first word of each)."""
        out = []
        for argv in self.log():
            args = argv[2:]
            if len(args) == 1:
                out.extend(part.split()[0] for part in args[0].split(" ; ") if part)
            elif args:
                out.append(args[0])
        return out

    def run(
        self, *argv: str, stdin: str = "", env: dict[str, str] | None = None
    ) -> Run:
        return run_agent(["--config", str(self.config), *argv], env=env, stdin=stdin)

    def wait_job(self, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """Poll `job ID` until it is finished."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.run("job", job_id).reply["job"]
            if job["state"] in ("succeeded", "failed"):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job still {job['state']}: {job}")
            time.sleep(0.05)


@pytest.fixture
def fake_tower(tmp_path: Path) -> Iterator[FakeTower]:
    """A tower behind the stand-in virsh; fails the test if anything ran destroy."""
    tower = FakeTower(tmp_path)
    yield tower
    assert "destroy" not in tower.commands()


@pytest.fixture
def node_file(tmp_path: Path) -> Path:
    """A test-driver node file: gpu-node running, win-1/win-2 shut off."""
    return nodes.write_node_file(tmp_path / "node.xml")
