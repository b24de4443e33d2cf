"""The contract between the agent and Home Assistant: every message kind the
real agent produces, parsed by Home Assistant's one protocol module, strictly.

Strict parsing fails on a missing field, a field of the wrong type, and a
field it does not know; so the agent and the integration cannot disagree on
any field without this failing (a job's ``args`` once arrived as a mapping
while Home Assistant read a list). No reply here is written by hand: each is
what the real agent printed, on the tower simulator (stateful: jobs run,
guests start and stop, libvirt events flow) and on libvirt's test driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import json
import os
from pathlib import Path
import select
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.protocol import (
    PROTOCOL,
    ErrorPush,
    Hello,
    JobKind,
    JobPush,
    JobState,
    LibvirtEvent,
    StatusPush,
    error_of,
    parse_job_reply,
    parse_jobs,
    parse_push,
    parse_screenshot,
    parse_status,
    parse_submitted,
    parse_version,
)
from tests.support.simtower import write_agent_config
from tests.support.testdriver import AGENT, write_tower
from tests.towersim import Tower, realistic_tower

BOUND = 30.0
RID = "ha-contract-0001"


def _one_shot(config: Path, *argv: str) -> dict[str, Any]:
    """The reply the agent prints for one verb (as over SSH: one JSON line)."""
    result = subprocess.run(
        [sys.executable, str(AGENT), "--config", str(config), *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=BOUND,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout + result.stderr
    message = json.loads(lines[0])
    assert message["protocol"] == PROTOCOL
    return dict(message)


class _Session:
    """The agent's ``session`` verb, spoken to over pipes."""

    def __init__(self, config: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(AGENT), "--config", str(config), "session"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.seen: list[dict[str, Any]] = []
        self._next = 0
        # Read from the pipe itself: a line the file object had buffered
        # would never make select() say the pipe is ready.
        self._pending = b""

    def send(self, verb: str, *args: str, request_id: str | None = None) -> int:
        assert self.process.stdin is not None
        self._next += 1
        request: dict[str, Any] = {"id": self._next, "verb": verb, "args": list(args)}
        if request_id is not None:
            request["request_id"] = request_id
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._next

    def until(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read messages until one is ``wanted``; every one is kept."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            if b"\n" not in self._pending:
                ready, _, _ = select.select([fd], [], [], 0.5)
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
                assert chunk, "the session ended"
                self._pending += chunk
                continue
            line, self._pending = self._pending.split(b"\n", 1)
            message = json.loads(line)
            assert message["protocol"] == PROTOCOL
            self.seen.append(message)
            if wanted(message):
                return dict(message)
        raise AssertionError(f"not seen within {BOUND} s; saw {self.seen[-5:]}")

    def reply(self, number: int) -> dict[str, Any]:
        return self.until(lambda m: m.get("type") == "reply" and m.get("id") == number)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Tower]:
    """The simulated tower, 100x faster than real guests."""
    tower = realistic_tower(tmp_path / "sim", time_scale=0.01)
    yield tower
    assert tower.destroy_attempts() == []
    tower.close()


@pytest.fixture
def sim_config(sim: Tower, tmp_path: Path) -> Path:
    """The agent's configuration for the simulated tower."""
    return write_agent_config(sim, tmp_path / "agent")


def test_one_shot_replies_parse_strictly(sim: Tower, sim_config: Path) -> None:
    """version, status, a job request (fresh and repeated), job, request,
    jobs, screenshot and an error, as the agent prints them."""
    version = parse_version(_one_shot(sim_config, "version"), strict=True)
    assert version.protocol == PROTOCOL
    # The command line's version reads no configuration: the host name.
    assert version.host_name == socket.gethostname()
    status = parse_status(_one_shot(sim_config, "status"), strict=True)
    assert status.domains["gpu-node"].state == "running"
    assert {card.held_by for card in status.cards} == {"gpu-node"}

    fresh = parse_submitted(
        _one_shot(sim_config, "stop", "gaming-1", f"--request={RID}"), strict=True
    )
    again = parse_submitted(
        _one_shot(sim_config, "stop", "gaming-1", f"--request={RID}"), strict=True
    )
    assert (fresh.existing, again.existing) == (False, True)
    assert fresh.id == again.id
    assert fresh.kind is JobKind.STOP
    record = parse_job_reply(_one_shot(sim_config, "job", fresh.id), strict=True)
    assert record.job.request_id == RID
    assert record.job.domains == ("gaming-1",)
    assert [step.domain for step in record.steps] == ["gaming-1"] * len(record.steps)
    found = parse_job_reply(_one_shot(sim_config, "request", RID), strict=True)
    assert found.job.id == fresh.id
    jobs = parse_jobs(_one_shot(sim_config, "jobs"), strict=True)
    assert [job.id for job in jobs] == [fresh.id]

    shot = parse_screenshot(
        _one_shot(sim_config, "screenshot", "gpu-node"), strict=True
    )
    assert shot.size > 0
    assert shot.domain == "gpu-node"

    refused = _one_shot(sim_config, "request", "ha-nobody-asked")
    error = error_of(refused)
    assert error is not None
    assert error.code == "unknown_request"


def test_session_messages_parse_strictly(sim: Tower, sim_config: Path) -> None:
    """A handoff driven over a session: hello, status pushes and replies, the
    job's request reply and its pushed progress, libvirt events; and a job
    whose pushed arguments name no domain (a release). The tower's configured
    name comes with the hello and every version reply."""
    data = json.loads(sim_config.read_text(encoding="utf-8"))
    sim_config.write_text(json.dumps(data | {"name": "Contract tower"}), "utf-8")
    session = _Session(sim_config)
    try:
        hello = parse_push(session.until(lambda m: m["type"] == "hello"), strict=True)
        assert isinstance(hello, Hello)
        assert hello.version.host_name == "Contract tower"
        pushed = parse_push(session.until(lambda m: m["type"] == "status"), strict=True)
        assert isinstance(pushed, StatusPush)
        status = parse_status(session.reply(session.send("status")), strict=True)
        assert status.age is not None

        # A release while the GPU node runs: its arguments name no domain.
        number = session.send("release", request_id="ha-contract-0003")
        release = parse_submitted(session.reply(number), strict=True)
        session.until(
            lambda m: (
                m["type"] == "job"
                and m["job"]["id"] == release.id
                and m["job"]["state"] == "succeeded"
            )
        )

        number = session.send("handoff", "gaming-1", request_id="ha-contract-0002")
        submitted = parse_submitted(session.reply(number), strict=True)
        assert submitted.kind is JobKind.HANDOFF

        def job_done(message: dict[str, Any]) -> bool:
            return (
                message["type"] == "job"
                and message["job"]["id"] == submitted.id
                and message["job"]["state"] not in ("queued", "running")
            )

        session.until(job_done)
        session.until(
            lambda m: (
                m["type"] == "status"
                and any(
                    d["name"] == "gaming-1" and d["state"] == "running"
                    for d in m["status"]["domains"]
                )
            )
        )
        for verb, args in (("version", ()), ("jobs", ()), ("job", (submitted.id,))):
            reply = session.reply(session.send(verb, *args))
            assert error_of(reply) is None
        version = parse_version(session.reply(session.send("version")), strict=True)
        assert version.host_name == "Contract tower"
        parse_jobs(session.reply(session.send("jobs")), strict=True)
        parse_job_reply(session.reply(session.send("job", submitted.id)), strict=True)
        parse_job_reply(
            session.reply(session.send("request", "ha-contract-0002")), strict=True
        )
        wrong = session.reply(session.send("stop", "nope", request_id="ha-contract-9"))
        assert error_of(wrong) is not None
    finally:
        session.close()

    kinds: dict[str, int] = {}
    for message in session.seen:
        kinds[message["type"]] = kinds.get(message["type"], 0) + 1
        if message["type"] == "reply":
            continue
        push = parse_push(message, strict=True)
        if isinstance(push, JobPush):
            assert push.record.job.kind in (JobKind.HANDOFF, JobKind.RELEASE)
            if push.record.job.kind is JobKind.RELEASE:
                assert push.record.job.domains == ()
        if isinstance(push, LibvirtEvent):
            assert push.domain in ("gpu-node", "gaming-1", "gaming-2")
    assert {"hello", "status", "reply", "job", "event"} <= set(kinds)
    finals = [
        parse_push(m, strict=True)
        for m in session.seen
        if m["type"] == "job" and m["job"]["id"] == submitted.id
    ]
    assert isinstance(finals[-1], JobPush)
    assert finals[-1].record.job.state is JobState.SUCCEEDED


@pytest.mark.skipif(not shutil.which("virsh"), reason="needs libvirt's virsh")
def test_test_driver_status_and_error_pushes(tmp_path: Path) -> None:
    """On libvirt's test driver: a status, and a session whose libvirt cannot
    be reached pushes errors (events and status) that parse strictly."""
    config = write_tower(tmp_path / "tower")
    parse_status(_one_shot(config, "status"), strict=True)
    session = _Session(config)
    try:
        assert isinstance(
            parse_push(session.until(lambda m: m["type"] == "hello"), strict=True),
            Hello,
        )
        parse_push(session.until(lambda m: m["type"] == "status"), strict=True)
    finally:
        session.close()

    data = json.loads(config.read_text(encoding="utf-8"))
    data["libvirt_uri"] = f"test://{tmp_path}/missing.xml"
    config.write_text(json.dumps(data), encoding="utf-8")
    session = _Session(config)
    try:
        session.until(lambda m: m["type"] == "hello")
        message = session.until(lambda m: m["type"] == "error")
        push = parse_push(message, strict=True)
        assert isinstance(push, ErrorPush)
        assert push.source in ("events", "status")
    finally:
        session.close()
