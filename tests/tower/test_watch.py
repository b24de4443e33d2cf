"""`watch`: libvirt events (real libvirtd, test driver) and job progress."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
from typing import Any

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    stream as agent_stream,
)
from tests.support.libvirtd import LibvirtTestDriver
from tests.tower import nodes
from tests.tower.conftest import FakeTower, require_tool, write_config


class Client:
    """The watching client: reacts to lines, and disconnects when done."""

    def __init__(
        self, lv: LibvirtTestDriver, cfg: agent_config.Config, stdin_w: int
    ) -> None:
        self.lv = lv
        self.cfg = cfg
        self.stdin_w = stdin_w
        self.lines: list[dict[str, Any]] = []
        self.buffer = ""
        self.job_ids: list[str] = []
        self.closed = False

    def write(self, text: str) -> int:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self.react(json.loads(line))
        return len(text)

    def flush(self) -> None:
        pass

    def react(self, obj: dict[str, Any]) -> None:
        self.lines.append(obj)
        if self.closed:
            return
        if obj.get("type") == "watching":
            for name, devices in (
                ("gpu-node", nodes.GPU_NODE_DEVICES),
                ("unmanaged", ""),
            ):
                xml = nodes.domain_xml(
                    name, devices, running=True, test_driver_file=False
                )
                self.lv.define(xml)
            self.new_job()
        elif obj.get("type") == "job" and not self.started():
            # virsh event may not have been listening yet: toggle again. Each
            # new job brings the next job line, so this repeats until seen.
            assert len(self.lines) < 500, "no Started event ever arrived"
            for name in ("unmanaged", "gpu-node"):
                self.toggle(name)
            self.new_job()
        elif self.started() and any(line.get("type") == "job" for line in self.lines):
            self.closed = True
            os.close(self.stdin_w)  # the client disconnects

    def new_job(self) -> None:
        job_id = agent_jobs.create_job(self.cfg, "stop", "gpu-node", "cli")["id"]
        self.job_ids.append(job_id)

    def toggle(self, name: str) -> None:
        for verb in ("shutdown", "start"):
            self.lv.virsh(verb, name)

    def started(self) -> bool:
        return any(
            line.get("type") == "event" and line.get("action") == "started"
            for line in self.lines
        )


def test_watch_streams_events_and_jobs(tmp_path: Path) -> None:
    require_tool("virsh", "libvirtd")
    (tmp_path / "libvirtd").mkdir()
    with LibvirtTestDriver(tmp_path / "libvirtd") as lv:
        config = write_config(
            tmp_path / "c.json",
            libvirt_uri=lv.test_uri,
            gpu_node="gpu-node",
            gaming=["win-1"],
            state_dir=str(tmp_path / "state"),
            poll_interval=0.05,
        )
        cfg = agent_config.load_config(str(config), dict(os.environ))
        read_fd, write_fd = os.pipe()
        client = Client(lv, cfg, write_fd)
        with os.fdopen(read_fd, "r") as stdin:
            rc = agent_stream.verb_watch(cfg, stdin, client)  # type: ignore[arg-type]
    assert rc == 0
    assert client.lines[0]["ok"] is True
    events = [line for line in client.lines if line["type"] == "event"]
    assert {e["domain"] for e in events} == {"gpu-node"}  # unmanaged filtered out
    assert ("started", "Booted") in [(e["action"], e["detail"]) for e in events]
    assert all(e["event"] == "lifecycle" and e["time"] for e in events)
    jobs = [line for line in client.lines if line["type"] == "job"]
    assert jobs[0]["job"]["id"] == client.job_ids[0]
    assert jobs[0]["job"]["state"] == "queued"
    assert jobs[0]["steps"][0]["name"] == "wait_agent"


class BrokenStdout:
    """A client whose connection breaks after the first line."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        if self.lines:
            raise BrokenPipeError
        self.lines += 1
        return len(text)

    def flush(self) -> None:
        pass


def test_watch_ends_on_broken_pipe(fake_tower: FakeTower) -> None:
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    agent_jobs.create_job(cfg, "stop", "win-1", "cli")  # seen at start: not re-emitted
    stdout = BrokenStdout()
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "r") as stdin:
        orig = agent_stream.list_job_ids
        calls = []

        def list_ids(c: agent_config.Config) -> list[str]:
            calls.append(1)
            if len(calls) == 2:  # after the greeting: a new job appears
                agent_jobs.create_job(cfg, "stop", "win-2", "cli")
            return orig(c)

        agent_stream.list_job_ids = list_ids  # type: ignore[assignment]
        try:
            rc = agent_stream.verb_watch(cfg, stdin, stdout)  # type: ignore[arg-type]
        finally:
            agent_stream.list_job_ids = orig  # type: ignore[assignment]
            os.close(write_fd)
    assert rc == 0
    assert stdout.lines == 1
    # The event child (the stand-in sleeps forever) was killed: none of this
    # process's children is one (another test worker may run its own).
    children = subprocess.run(
        ["pgrep", "-P", str(os.getpid()), "-f", "fakevirsh.py -c test:///fake event"],
        capture_output=True,
        check=False,
    )
    assert children.stdout == b""


def test_watch_libvirt_unreachable(tmp_path: Path) -> None:
    require_tool("virsh")
    config = write_config(
        tmp_path / "c.json",
        libvirt_uri=f"test+unix:///default?socket={tmp_path}/none",
        gpu_node="gpu-node",
        gaming=["win-1"],
        state_dir=str(tmp_path / "state"),
    )
    cfg = agent_config.load_config(str(config), dict(os.environ))
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    rc = agent_stream.verb_watch(cfg, None, Out())  # type: ignore[arg-type]
    assert rc == 1
    last = json.loads(lines[-1])
    assert last["type"] == "error"
    assert last["error"]["code"] == "libvirt_unreachable"
