"""`session`: one long-lived connection, requests answered, the state pushed.

Most sessions run as their own process, as sshd's forced command runs them;
libvirt events come from the tower simulator (tests/towersim), which streams
them as real virsh does; the stand-in virsh (fakevirsh.py) counts calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import io
import json
import os
from pathlib import Path
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    cli as agent_cli,
    config as agent_config,
    screenshot as agent_screenshot,
    session as agent_session,
    status as agent_status,
    wire,
)
from tests.support.agentbuild import AGENT
from tests.support.simtower import write_agent_config
from tests.support.waiting import wait_until
from tests.tower.conftest import FakeTower
from tests.towersim import Tower, realistic_tower

RID = "ha-session-0001"
Message = dict[str, Any]


def alive(pid: int) -> bool:
    """Whether a process (not a zombie) with this id runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
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


class Client:
    """The far end of a session: sends lines, collects what comes back."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Message | None] = queue.Queue()
        self.lines: list[Message] = []

    def got(self, raw: str | bytes) -> None:
        message: Message = json.loads(raw)
        assert message["protocol"] == wire.PROTOCOL == 2
        self.queue.put(message)

    def send(self, request: Message | str | bytes) -> None:
        raise NotImplementedError

    def expect(
        self, match: Callable[[Message], object], timeout: float = 30.0
    ) -> Message:
        """The next message that matches; those before it stay in ``lines``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"nothing matched; got {self.lines}") from None
            if message is None:
                raise AssertionError(f"the session ended; got {self.lines}")
            self.lines.append(message)
            if match(message):
                return message

    def received(self) -> list[Message]:
        """Every message so far (those waiting are moved to ``lines``)."""
        while True:
            try:
                message = self.queue.get_nowait()
            except queue.Empty:
                return self.lines
            if message is None:  # the session ended: later waits still see it
                self.queue.put(None)
                return self.lines
            self.lines.append(message)

    def next(self, timeout: float = 30.0) -> Message:
        return self.expect(lambda m: True, timeout)

    def reply(self, ident: object, timeout: float = 30.0) -> Message:
        return self.expect(lambda m: m["type"] == "reply" and m["id"] == ident, timeout)

    def call(self, ident: object, verb: str, *args: str, **extra: object) -> Message:
        self.send({"id": ident, "verb": verb, "args": list(args), **extra})
        return self.reply(ident)

    def quiet(self, seconds: float, kind: str) -> None:
        """No message of this type for this long."""
        with pytest.raises(AssertionError, match="nothing matched"):
            self.expect(lambda m: m["type"] == kind, timeout=seconds)


class Process(Client):
    """A session as its own process; a thread reads its stdout."""

    def __init__(self, config: Path, *, serve: bool = False) -> None:
        super().__init__()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/root"}
        verb = "session"
        if serve:
            env["SSH_ORIGINAL_COMMAND"] = "session"
            verb = "serve"
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), "--config", str(config), verb],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.got(raw)
        self.queue.put(None)

    def send(self, request: Message | str | bytes) -> None:
        if isinstance(request, dict):
            request = json.dumps(request)
        data = request.encode() if isinstance(request, str) else request
        assert self.proc.stdin is not None
        self.proc.stdin.write(data if data.endswith(b"\n") else data + b"\n")
        self.proc.stdin.flush()

    def write(self, data: bytes) -> None:
        """Bytes as they are (no newline added)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close(self) -> int:
        """End of input: the exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=30)
        self.thread.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def sessions() -> Iterator[Callable[..., Process]]:
    """Start sessions; any still running at the end is killed."""
    started: list[Process] = []

    def start(config: Path, **kwargs: bool) -> Process:
        session = Process(config, **kwargs)
        started.append(session)
        return session

    yield start
    for session in started:
        session.kill()


def opened(session: Client) -> Message:
    """Check the greeting (hello, then at once the status); the status body."""
    hello = session.next()
    assert hello == {
        "protocol": 2,
        "type": "hello",
        "ok": True,
        "version": wire.VERSION,
        "verbs": sorted(wire.SESSION_VERBS),
        "host_name": socket.gethostname(),
    }
    status = session.next()
    assert status["type"] == "status"
    assert set(status) == {"protocol", "type", "status"}
    body: Message = status["status"]
    return body


def virsh_calls(tower: FakeTower) -> int:
    """Calls of the stand-in virsh, but for the session's `virsh event`."""
    return sum(1 for argv in tower.log() if argv[2:3] != ["event"])


def domain(body: Message, name: str) -> Message:
    found: Message = next(d for d in body["domains"] if d["name"] == name)
    return found


# --- against the stand-in virsh --------------------------------------------------------


def test_opens_with_hello_then_status(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    session = sessions(fake_tower.config)
    body = opened(session)
    one_shot = fake_tower.run("status").reply
    assert body == {k: v for k, v in one_shot.items() if k not in ("protocol", "ok")}
    assert session.close() == 0


def test_status_request_from_kept_state(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    fake_tower.configure(session_refresh=60)
    session = sessions(fake_tower.config)
    body = opened(session)
    calls = virsh_calls(fake_tower)
    assert calls == 1
    time.sleep(0.3)
    reply = session.call(1, "status")
    assert virsh_calls(fake_tower) == calls  # no virsh call: answered from state
    assert reply.pop("ok") is True
    assert reply.pop("type") == "reply"
    assert reply.pop("id") == 1
    assert reply.pop("protocol") == 2
    age = reply.pop("age")
    assert isinstance(age, float)
    assert 0.3 <= age < 30
    assert reply == body
    # Other verbs answer as their one-shot forms do.
    version = session.call("v", "version")
    assert version["version"] == wire.VERSION
    assert "session" in version["verbs"]
    shot = session.call(2, "screenshot", "gpu-node")
    assert (shot["ok"], shot["mime"]) == (True, "image/png")
    assert session.call(3, "jobs")["jobs"] == []
    assert session.close() == 0


def test_bad_lines_answered_and_session_goes_on(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    fake_tower.configure(session_refresh=60)
    session = sessions(fake_tower.config)
    opened(session)
    bad_lines: list[tuple[str | bytes, object, str]] = [
        ("not json", None, "bad_request"),
        (b"\xff\xfe{", None, "bad_request"),
        ("[1, 2]", None, "bad_request"),
        ('{"verb": "status"}', None, "bad_request"),
        ('{"id": true, "verb": "status"}', None, "bad_request"),
        ('{"id": 1.5, "verb": "status"}', None, "bad_request"),
        (json.dumps({"id": "x" * 65, "verb": "status"}), None, "bad_request"),
        (
            json.dumps({"id": "x", "verb": "status", "pad": "y" * 5000}),
            None,
            "bad_request",
        ),
        ('{"id": 7, "verb": "watch"}', 7, "not_allowed"),
        ('{"id": 8, "verb": "session"}', 8, "not_allowed"),
        ('{"id": 9, "verb": "run-job", "args": ["x"]}', 9, "not_allowed"),
        ('{"id": 10, "verb": 5}', 10, "bad_request"),
        ('{"id": 11, "verb": "stop", "args": ["nope"]}', 11, "unknown_domain"),
        ('{"id": 12, "verb": "stop", "args": "win-1"}', 12, "bad_request"),
        ('{"id": 13, "verb": "stop", "args": [1]}', 13, "bad_request"),
        ('{"id": 14, "verb": "stop", "args": []}', 14, "bad_request"),
        ('{"id": 15, "verb": "handoff", "args": ["gpu-node"]}', 15, "unknown_domain"),
        ('{"id": 16, "verb": "job", "args": ["../x"]}', 16, "bad_request"),
        ('{"id": 17, "verb": "job", "args": ["nope"]}', 17, "unknown_job"),
        ('{"id": 18, "verb": "request", "args": ["short"]}', 18, "bad_request"),
        (
            '{"id": 19, "verb": "request", "args": ["nobody-asked"]}',
            19,
            "unknown_request",
        ),
        ('{"id": 20, "verb": "status", "request_id": "abcdefgh"}', 20, "bad_request"),
        (
            '{"id": 21, "verb": "stop", "args": ["win-1"], "request_id": "bad id!"}',
            21,
            "bad_request",
        ),
        ('{"id": 22, "verb": "version", "extra": 1}', 22, "bad_request"),
        ('{"id": "s", "verb": "stop", "args": ["win-1\\n"]}', "s", "unknown_domain"),
    ]
    for line, ident, code in bad_lines:
        session.send(line)
        reply = session.expect(lambda m: m["type"] == "reply")
        assert reply["id"] == ident, line
        assert reply["ok"] is False, line
        assert reply["error"]["code"] == code, (line, reply)
        assert set(reply) == {"protocol", "type", "id", "ok", "error"}
    # A line longer than 4096 bytes, in pieces: one error, then on as before.
    session.write(b"x" * 3000)
    time.sleep(0.2)
    session.write(b"y" * 3000)
    time.sleep(0.2)
    session.write(b'"}\n{"id": 30, "verb": "version"}\n')
    too_long = session.reply(None)
    assert too_long["error"]["code"] == "bad_request"
    assert "4096" in too_long["error"]["message"]
    assert session.reply(30)["ok"] is True
    session.send("")  # empty lines are skipped
    assert session.call(31, "version")["ok"] is True
    assert not (fake_tower.state_dir / "jobs").exists()
    assert session.close() == 0


def test_eof_ends_session_and_its_event_child(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    session = sessions(fake_tower.config, serve=True)  # as sshd's forced command
    opened(session)
    kids = [
        pid
        for pid in children(session.proc.pid)
        if b"event" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(kids) == 1
    assert session.close() == 0
    assert not alive(kids[0])


def test_sigterm_ends_session_and_its_event_child(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    session = sessions(fake_tower.config)
    opened(session)
    kids = children(session.proc.pid)
    assert kids
    session.proc.send_signal(signal.SIGTERM)
    assert session.proc.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in kids)


def test_broken_stdout_ends_session(fake_tower: FakeTower) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(AGENT), "--config", str(fake_tower.config), "session"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", ""), "HOME": "/root"},
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["type"] == "hello"
    kids = children(proc.pid)
    proc.stdout.close()
    proc.stdin.write(b'{"id": 1, "verb": "version"}\n')
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0
    proc.stdin.close()
    assert kids
    assert not any(alive(pid) for pid in kids)


def test_job_pushed_and_one_job_per_request_id(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    fake_tower.configure(session_refresh=60)
    fake_tower.set_domain("gpu-node", agent_after=20)  # the job takes a while
    session = sessions(fake_tower.config)
    opened(session)
    reply = session.call(1, "stop", "gpu-node", request_id=RID)
    assert reply["ok"] is True
    assert reply["existing"] is False
    job_id = reply["job"]["id"]
    assert reply["job"]["request_id"] == RID
    # The same request id from a one-shot process (Home Assistant reconnected).
    again = fake_tower.run(
        "serve", env={"SSH_ORIGINAL_COMMAND": f"stop gpu-node --request={RID}"}
    ).reply
    assert (again["existing"], again["job"]["id"]) == (True, job_id)
    # ... and in the session again.
    reply = session.call(2, "stop", "gpu-node", request_id=RID)
    assert (reply["existing"], reply["job"]["id"]) == (True, job_id)
    # The status follows the job: active while it runs, then gone.
    active = session.expect(
        lambda m: m["type"] == "status" and m["status"]["active_jobs"]
    )
    summary = active["status"]["active_jobs"][0]
    assert (summary["id"], summary["request_id"]) == (job_id, RID)
    done = session.expect(
        lambda m: m["type"] == "job" and m["job"]["state"] == "succeeded"
    )
    after = session.expect(
        lambda m: m["type"] == "status" and m["status"]["active_jobs"] == []
    )
    # Jobs are read before libvirt: once the job is gone, so is the domain.
    assert domain(after["status"], "gpu-node")["state"] == "shut_off"
    jobs = [m for m in session.lines if m["type"] == "job"]
    assert {m["job"]["id"] for m in jobs} == {job_id}
    assert all(m["job"]["request_id"] == RID for m in jobs)
    assert jobs[0]["job"]["state"] == "queued"
    assert [(s["name"], s["result"]) for s in done["steps"]] == [
        ("wait_agent", "ok"),
        ("shutdown", "ok"),
        ("wait_shut_off", "ok"),
    ]
    assert len(list((fake_tower.state_dir / "jobs").glob("*.json"))) == 1
    found = session.call(3, "request", RID)
    assert found["job"]["id"] == job_id
    assert found["job"]["requested_by"] == "cli"
    assert session.call(4, "job", job_id)["job"] == found["job"]
    assert fake_tower.commands().count("shutdown") == 1
    assert session.close() == 0


def test_refresh_timer_catches_what_no_event_tells(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    fake_tower.configure(session_refresh=0.2)
    session = sessions(fake_tower.config)
    body = opened(session)
    assert domain(body, "gpu-node")["agent_ready"] is True
    calls = virsh_calls(fake_tower)
    # Recomputed, but unchanged: nothing pushed.
    session.quiet(1.0, "status")
    assert virsh_calls(fake_tower) > calls
    fake_tower.set_domain("gpu-node", agent_after=10**6)  # the guest agent hangs
    pushed = session.expect(lambda m: m["type"] == "status")
    assert domain(pushed["status"], "gpu-node")["agent_ready"] is False
    assert session.close() == 0


def test_hook_request_pushes_status(
    fake_tower: FakeTower, sessions: Callable[..., Process]
) -> None:
    fake_tower.configure(session_refresh=60)
    session = sessions(fake_tower.config)
    assert opened(session)["hook_requests"] == []
    request = {
        "domain": "win-1",
        "operation": "prepare begin",
        "addresses": ["0000:01:00.0"],
        "time": "2099-01-01T00:00:00.000Z",
        "job": None,
    }
    requests = fake_tower.state_dir / "requests"
    requests.mkdir()
    (requests / "20990101-000000-000000-abcdef-win-1.json").write_text(
        json.dumps(request), encoding="utf-8"
    )
    pushed = session.expect(lambda m: m["type"] == "status")
    assert pushed["status"]["hook_requests"] == [request]
    assert session.close() == 0


# --- in this process: failures, and stdin that is not a pipe ------------------------------


class Collector(Client):
    """A session's stdout in this process; its stdin is a pipe we hold."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        read_fd, self.stdin_w = os.pipe()
        self.stdin = os.fdopen(read_fd, "r")

    def write(self, text: str) -> int:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self.got(line)
        return len(text)

    def flush(self) -> None:
        pass

    def send(self, request: Message | str | bytes) -> None:
        data = json.dumps(request) if isinstance(request, dict) else request
        raw = data.encode() if isinstance(data, str) else data
        os.write(self.stdin_w, raw + b"\n")


def test_event_child_dies_and_comes_back(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libvirt's event stream cannot connect: the error is pushed once for
    the outage while the child is tried again; once a child stays up the
    outage is over, and the next loss is pushed again."""
    monkeypatch.setattr(agent_session, "EVENT_RESTART_SECONDS", 0.2)
    fake_tower.configure(session_refresh=60)
    fake_tower.update(event_fails=True)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    client = Collector()
    session = agent_session.Session(cfg, client.stdin, client, "cli")  # type: ignore[arg-type]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(session.run()))
    thread.start()

    def errors() -> list[Message]:
        return [m for m in client.received() if m["type"] == "error"]

    try:
        opened(client)
        error = client.expect(lambda m: m["type"] == "error")
        assert error["source"] == "events"
        assert error["error"]["code"] == "libvirt_unreachable"
        assert "failed to connect to the hypervisor" in error["error"]["message"]
        # The session goes on: requests answered, the child tried again and
        # again (each dies as it starts), the outage's error not pushed again.
        assert client.call(1, "status")["ok"] is True
        tried = fake_tower.commands().count("event")
        wait_until(
            lambda: fake_tower.commands().count("event") >= tried + 3,
            timeout=30,
            what="event child tried again",
        )
        assert errors() == [error]
        fake_tower.update(event_fails=False)
        # A child started as the state changed may still have read the
        # failing one and die at once: the session's child that stays up
        # for half a second is the one that came back.
        first_seen: dict[int, float] = {}

        def steady() -> Any:
            child = session.events
            if child is None or child.proc.poll() is not None:
                return None
            since = first_seen.setdefault(child.proc.pid, time.monotonic())
            return child if time.monotonic() - since >= 0.5 else None

        child = wait_until(steady, timeout=30, what="event child running steadily")
        assert child.proc.poll() is None
        assert session.events is child
        # Up for EVENT_STEADY_SECONDS: the outage is over.
        wait_until(
            lambda: session.events_failure is None,
            timeout=30,
            what="the outage seen over",
        )
        assert session.events is child
        assert errors() == [error]
        # libvirtd goes away again: news, pushed though the code is the same.
        fake_tower.update(event_fails=True)
        again = client.expect(lambda m: m["type"] == "error")
        assert again["source"] == "events"
        assert again["error"]["code"] == "libvirt_unreachable"
        assert again["error"]["message"].startswith("Disconnected from")
        assert child.proc.wait(timeout=30) == 1
    finally:
        os.close(client.stdin_w)
        thread.join(timeout=30)
        client.stdin.close()
    assert codes == [0]
    left: object = session.events  # ended with the session
    assert left is None
    assert child.proc.poll() is not None


def test_status_failure_reported_then_recovered(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_tower.configure(session_refresh=0.2)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    client = Collector()
    session = agent_session.Session(cfg, client.stdin, client, "cli")  # type: ignore[arg-type]
    thread = threading.Thread(target=session.run)
    thread.start()
    try:
        opened(client)
        fake_tower.update(unreachable=True)
        error = client.expect(lambda m: m["type"] == "error")
        assert error["source"] == "status"
        assert error["error"]["code"] == "libvirt_unreachable"
        reply = client.call(1, "status")
        assert reply["error"]["code"] == "libvirt_unreachable"
        fake_tower.update(unreachable=False)
        # Back: the status is pushed again although it did not change.
        client.expect(lambda m: m["type"] == "status")
    finally:
        os.close(client.stdin_w)
        thread.join(timeout=30)
        client.stdin.close()


def test_requests_from_a_file_and_internal_errors(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stdin that cannot be selected is read to its end; a crash is answered."""

    def boom(cfg: agent_config.Config, name: str) -> wire.JsonObj:
        raise RuntimeError("kaput")

    # (requests imports the screenshot's verb when a screenshot is asked for)
    monkeypatch.setattr(agent_screenshot, "verb_screenshot", boom)
    lines = [
        {"id": 1, "verb": "screenshot", "args": ["win-1"]},
        {"id": 2, "verb": "status"},
    ]
    run = fake_tower.run(
        "session", stdin="".join(json.dumps(line) + "\n" for line in lines)[:-1]
    )
    assert run.rc == 0
    assert [m["type"] for m in run.lines] == ["hello", "status", "reply", "reply"]
    error = run.lines[2]["error"]
    assert error["code"] == "internal"
    assert "kaput" not in error["message"]
    log = (fake_tower.state_dir / "agent.log").read_text(encoding="utf-8")
    assert f"internal error {error['message'].split()[2].rstrip(';')}" in log
    assert "RuntimeError: kaput" in log
    assert run.lines[3]["ok"] is True
    assert run.lines[3]["age"] >= 0


def test_virsh_missing_is_a_plain_error(fake_tower: FakeTower, tmp_path: Path) -> None:
    fake_tower.configure(commands={"virsh": str(tmp_path / "none")})
    run = fake_tower.run("session", stdin="")
    assert run.rc == 1
    assert run.reply["error"]["code"] == "virsh_missing"


def test_status_body_is_the_one_shot_status(fake_tower: FakeTower) -> None:
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    body = agent_status.status_body(cfg)
    reply = agent_status.verb_status(cfg)
    assert reply == {"protocol": 2, "ok": True, **body}
    stdout = io.StringIO()
    assert (
        agent_cli.main(["--config", str(fake_tower.config), "status"], stdout=stdout)
        == 0
    )


# --- against the tower simulator: real libvirt events --------------------------------------


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[tuple[Tower, Path]]:
    tower = realistic_tower(tmp_path / "tower", time_scale=0.01)
    config = write_agent_config(tower, tmp_path / "agent")
    data = json.loads(config.read_text(encoding="utf-8"))
    data["session_refresh"] = 60  # only events and jobs make it recompute
    config.write_text(json.dumps(data), encoding="utf-8")
    yield tower, config
    tower.close()
    assert tower.destroy_attempts() == []


def listening(tower: Tower) -> None:
    """Wait until the session's `virsh event` sees every event from now on."""
    wait_until(
        lambda: any(c.subscribed for c in tower.calls("event")),
        timeout=30,
        what="virsh event subscribed",
    )


def test_event_pushes_event_then_status(
    sim: tuple[Tower, Path], sessions: Callable[..., Process]
) -> None:
    tower, config = sim
    session = sessions(config)
    body = opened(session)
    assert domain(body, "gpu-node")["state"] == "running"
    listening(tower)
    tower.set_shutdown_duration("gpu-node", 50)  # 0.5 s here
    tower.guest_shutdown("gpu-node")  # the guest powers off by itself
    stopped = session.expect(
        lambda m: m["type"] == "event" and m.get("action") == "stopped"
    )
    assert stopped["domain"] == "gpu-node"
    assert stopped["event"] == "lifecycle"
    assert stopped["time"]
    pushed = session.expect(
        lambda m: (
            m["type"] == "status"
            and domain(m["status"], "gpu-node")["state"] == "shut_off"
        )
    )
    assert session.lines.index(pushed) > session.lines.index(stopped)
    held = {c["address"]: c["held_by"] for c in pushed["status"]["cards"]}
    assert set(held.values()) == {None}
    assert session.close() == 0


def test_handoff_in_a_session(
    sim: tuple[Tower, Path], sessions: Callable[..., Process]
) -> None:
    tower, config = sim
    session = sessions(config)
    opened(session)
    listening(tower)
    reply = session.call(1, "handoff", "gaming-1", request_id=RID)
    assert reply["existing"] is False
    job_id = reply["job"]["id"]
    assert reply["job"]["runner"]["mode"] == "systemd"
    session.expect(lambda m: m["type"] == "job" and m["job"]["state"] == "succeeded")
    final = session.expect(
        lambda m: (
            m["type"] == "status"
            and domain(m["status"], "gaming-1")["state"] == "running"
            and m["status"]["active_jobs"] == []
        )
    )
    assert domain(final["status"], "gpu-node")["state"] == "shut_off"
    assert tower.holder("0000:03:00.0") == "gaming-1"
    events = {
        (m["domain"], m.get("action")) for m in session.lines if m["type"] == "event"
    }
    assert {("gpu-node", "stopped"), ("gaming-1", "started")} <= events
    jobs = [m for m in session.lines if m["type"] == "job"]
    assert {(m["job"]["id"], m["job"]["request_id"]) for m in jobs} == {(job_id, RID)}
    # Home Assistant reconnects and asks again: the same job, nothing new.
    again = session.call(2, "handoff", "gaming-1", request_id=RID)
    assert (again["existing"], again["job"]["id"]) == (True, job_id)
    assert again["job"]["state"] == "succeeded"
    assert len(tower.units()) == 1
    assert session.close() == 0
