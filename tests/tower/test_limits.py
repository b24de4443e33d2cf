"""Limits on jobs, streams and writes (issue 11, findings 4 and 5), in this
process; tests/tower/test_trust.py floods them through sshd."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import fcntl
import os
from pathlib import Path
import time
from typing import IO

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    stream as agent_stream,
    wire,
)
from tests.tower.conftest import FakeTower, run_agent, write_config
from tests.tower.split import WIN1_XML

RID = "ha-limits-0001"


def runners_settle(tower: FakeTower) -> int:
    """How many runners this tower has once the count stops changing."""
    count = -1
    while True:
        time.sleep(0.3)
        now = len(live_runners(tower))
        if now == count:
            return count
        count = now


@contextlib.contextmanager
def tower_lock(tower: FakeTower) -> Iterator[None]:
    """Hold tower.lock: every job stays queued (its runner waits)."""
    tower.state_dir.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(tower.state_dir / "tower.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def live_runners(tower: FakeTower) -> list[int]:
    """This tower's runner processes (not zombies)."""
    agent_jobs.reap_runners()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"run-job" in argv and str(tower.config).encode() in argv and state != "Z":
            out.append(int(entry.name))
    return out


def test_the_same_work_while_queued_is_one_job(fake_tower: FakeTower) -> None:
    with tower_lock(fake_tower):
        first = fake_tower.run("stop", "gpu-node").reply
        assert first["existing"] is False
        job_id = first["job"]["id"]
        again = fake_tower.run("stop", "gpu-node", f"--request={RID}").reply
        assert (again["existing"], again["job"]["id"]) == (True, job_id)
        assert again["job"]["state"] == "queued"
        # The request id answered so is found later (Home Assistant reconnects).
        assert fake_tower.run("request", RID).reply["job"]["id"] == job_id
        assert fake_tower.run("stop", "gpu-node", f"--request={RID}").reply["job"][
            "id"
        ] == (job_id)
        other = fake_tower.run("stop", "win-1").reply
        assert other["existing"] is False
        assert runners_settle(fake_tower) == 2
    assert fake_tower.wait_job(job_id)["state"] == "succeeded"
    assert fake_tower.wait_job(other["job"]["id"])["state"] == "succeeded"
    # Once it ran, the same work is new work.
    later = fake_tower.run("stop", "gpu-node").reply
    assert later["existing"] is False
    fake_tower.wait_job(later["job"]["id"])
    assert fake_tower.run("request", RID).reply["job"]["id"] == job_id


def test_a_full_queue_is_refused(fake_tower: FakeTower) -> None:
    fake_tower.configure(max_queued_jobs=2)
    with tower_lock(fake_tower):
        for domain in ("win-1", "win-2"):
            assert fake_tower.run("stop", domain).reply["existing"] is False
        refused = fake_tower.run("start", "gpu-node")
        assert refused.rc == 1
        assert refused.reply["error"]["code"] == wire.ERR_QUEUE_FULL
        assert "max_queued_jobs = 2" in refused.reply["error"]["message"]
        assert len(list((fake_tower.state_dir / "jobs").glob("*.json"))) == 2
        assert runners_settle(fake_tower) == 2
        # The hook records the refusal (and still never waits).
        fake_tower.run("status")  # the claims cache it reads
        hook = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
        assert (hook.rc, hook.lines, hook.stderr) == (0, [], "")
        (request,) = fake_tower.run("status").reply["hook_requests"]
        assert request["job"] is None
        assert request["error"]["code"] == wire.ERR_QUEUE_FULL
    for job in fake_tower.run("jobs").reply["jobs"]:
        fake_tower.wait_job(job["id"])
    assert fake_tower.run("start", "gpu-node").reply["ok"] is True


def test_a_running_job_is_not_joined(fake_tower: FakeTower) -> None:
    """Only queued work is shared: a job that runs may be past what was asked."""
    fake_tower.set_domain("gpu-node", agent_after=10**6)
    fake_tower.configure(timeouts={"agent": 2, "shutdown": 2, "start": 2})
    first = fake_tower.run("stop", "gpu-node").reply["job"]["id"]
    deadline = time.monotonic() + 30
    while fake_tower.run("job", first).reply["job"]["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    second = fake_tower.run("stop", "gpu-node").reply
    assert second["existing"] is False
    assert second["job"]["id"] != first
    for job_id in (first, second["job"]["id"]):
        fake_tower.wait_job(job_id)


def test_streams_take_a_slot_each(fake_tower: FakeTower) -> None:
    fake_tower.configure(max_streams=2)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    with agent_stream.stream_slot(cfg), agent_stream.stream_slot(cfg):
        with pytest.raises(wire.AgentError) as refused, agent_stream.stream_slot(cfg):
            pass
        assert refused.value.code == wire.ERR_TOO_MANY_STREAMS
        run = fake_tower.run("session")
        assert run.reply["error"]["code"] == wire.ERR_TOO_MANY_STREAMS
    with agent_stream.stream_slot(cfg):  # freed with the stream
        pass


def test_a_write_waits_write_timeout_at_most() -> None:
    """A client that takes nothing: the stream ends, it does not hang."""

    def flood(stream: IO[str]) -> None:
        for _ in range(10_000):  # far more than a pipe holds
            agent_stream._emit(stream, {"pad": "x" * 4096}, timeout=0.3)

    read_fd, write_fd = os.pipe()
    try:
        with os.fdopen(os.dup(write_fd), "w") as stream:
            started = time.monotonic()
            with pytest.raises(agent_stream.StreamClosedError, match="took nothing"):
                flood(stream)
            assert 0.3 <= time.monotonic() - started < 10
            assert os.get_blocking(write_fd)  # left as it was found
    finally:
        os.close(read_fd)
        os.close(write_fd)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"max_queued_jobs": 0}, "max_queued_jobs: must be an integer in 1..100"),
        ({"max_queued_jobs": 101}, "max_queued_jobs: must be an integer in 1..100"),
        ({"max_queued_jobs": True}, "max_queued_jobs: must be an integer in 1..100"),
        ({"max_streams": 2.5}, "max_streams: must be an integer in 1..64"),
        ({"max_streams": 65}, "max_streams: must be an integer in 1..64"),
        ({"write_timeout": 0}, "write_timeout: must be a number in (0, 3600]"),
        ({"write_timeout": "5"}, "write_timeout: must be a number in (0, 3600]"),
    ],
)
def test_limits_are_validated(
    tmp_path: Path, data: dict[str, object], problem: str
) -> None:
    path = write_config(tmp_path / "c.json", gpu_node="g", gaming=["w"], **data)
    run = run_agent(["--config", str(path), "check-config"])
    assert run.reply["error"]["code"] == "config_invalid"
    assert problem in run.reply["error"]["message"]


def test_limit_defaults(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", gpu_node="g", gaming=["w"])
    config = run_agent(["--config", str(path), "check-config"]).reply["config"]
    assert (
        config["max_queued_jobs"],
        config["max_streams"],
        config["write_timeout"],
    ) == (8, 8, 30.0)
    path = write_config(
        tmp_path / "c.json",
        gpu_node="g",
        gaming=["w"],
        max_queued_jobs=3,
        max_streams=1,
        write_timeout=2.5,
    )
    config = run_agent(["--config", str(path), "check-config"]).reply["config"]
    assert (
        config["max_queued_jobs"],
        config["max_streams"],
        config["write_timeout"],
    ) == (3, 1, 2.5)
