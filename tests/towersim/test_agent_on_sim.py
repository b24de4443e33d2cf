"""The real tower agent against the simulated tower.

The agent runs as a program (as sshd's forced command would run it), reads
libvirt through the simulator's ``virsh`` and detaches its jobs through the
simulator's ``systemd-run``, named in its configuration.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from dataclasses import dataclass
import fcntl
import json
from pathlib import Path
import subprocess
import sys
from typing import Any

import pytest

from tests.support.agentbuild import AGENT
from tests.support.oldpython import oldest_python
from tests.support.simtower import write_agent_config
from tests.towersim import Tower, realistic_tower
from tests.towersim.helpers import sim

# How long a finished job's unit and lock may outlive its record.
LEAK_GRACE = 5.0
# An ssh forced command's environment: nothing of ours leaks in.
AGENT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Python:
    """The interpreter the tower runs the agent with (and its runners: the
    agent spawns them with its own)."""

    argv: tuple[str, ...]
    env: dict[str, str]


class Agent:
    def __init__(
        self, tower: Tower, directory: Path, python: Python, **timeouts: float
    ) -> None:
        self.tower = tower
        self.python = python
        self.state_dir = directory / "agent-state"
        self.config = write_agent_config(tower, directory, **timeouts)

    def argv(self, *args: str) -> list[str]:
        return [*self.python.argv, str(AGENT), "--config", str(self.config), *args]

    @property
    def env(self) -> dict[str, str]:
        return {**AGENT_ENV, **self.python.env}

    def run(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            check=False,
        )

    def call(self, *args: str) -> dict[str, Any]:
        proc = self.run(*args)
        reply: dict[str, Any] = json.loads(proc.stdout)
        assert reply["ok"], reply
        return reply

    def submit(self, verb: str, *args: str) -> str:
        job_id: str = self.call(verb, *args)["job"]["id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self.call("job", job_id)["job"]
        return job

    def peek(self, job_id: str) -> dict[str, Any]:
        """The job's record file, read directly (cheap enough to poll)."""
        try:
            data: dict[str, Any] = json.loads(
                (self.state_dir / "jobs" / f"{job_id}.json").read_text("utf-8")
            )
        except OSError, ValueError:
            return {}
        return data

    def step(self, job_id: str) -> str | None:
        job = self.peek(job_id)
        index = job.get("step")
        return job["steps"][index]["name"] if isinstance(index, int) else None

    def wait(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        """Wait for the job to end; its record as the ``job`` verb reports it."""
        self.tower.wait_until(
            lambda: self.peek(job_id).get("state") in ("succeeded", "failed"),
            timeout=timeout,
            what=f"job {job_id}",
        )
        return self.job(job_id)

    def held_locks(self) -> list[str]:
        """Lock files of the agent that some process still holds."""
        held = []
        for path in sorted(self.state_dir.rglob("*.lock")):
            with path.open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    held.append(path.name)
                else:
                    fcntl.flock(handle, fcntl.LOCK_UN)
        return held


@pytest.fixture(params=["newest", "oldest"])
def python(request: pytest.FixtureRequest) -> Python:
    """This Python, and the oldest the agent claims (3.9, Debian 11's): the
    tests below run the whole agent on both, its jobs and their runners
    included (a lint keeps the source to 3.9's syntax; only running it shows
    that nothing newer is called)."""
    if request.param == "newest":
        return Python((sys.executable,), {})
    old, env = oldest_python()
    return Python((old,), env)


@pytest.fixture
def agent_tower(tmp_path: Path) -> Iterator[Tower]:
    if not AGENT.exists():
        pytest.fail(f"the agent is missing: {AGENT}")
    tower = realistic_tower(tmp_path / "tower", time_scale=0.002)
    yield tower
    tower.close()


def _assert_clean(agent: Agent, tower: Tower) -> None:
    # A job's record says how it ended just before its runner exits: the
    # unit is collected and the lock let go a moment later (under load, a
    # moment the check can see). A leak is what is still there after that.
    with contextlib.suppress(TimeoutError):
        tower.wait_until(
            lambda: not tower.loaded_units() and not agent.held_locks(),
            timeout=LEAK_GRACE,
            what="units collected, locks let go",
        )
    assert tower.loaded_units() == [], "leaked units"
    assert agent.held_locks() == [], "locks still held"
    active = [
        j for j in agent.call("jobs")["jobs"] if j["state"] in ("queued", "running")
    ]
    assert active == [], "jobs still running"
    assert tower.destroy_attempts() == []


def test_handoff_and_release_cycles(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    """Twenty cycles on this Python, six (both VMs, both ways a card comes
    back) on the oldest."""
    tower = agent_tower
    agent = Agent(tower, tmp_path, python)
    cycles = 20 if python.argv == (sys.executable,) else 6
    for cycle in range(cycles):
        gaming = f"gaming-{cycle % 2 + 1}"
        job = agent.wait(agent.submit("handoff", gaming))
        assert job["state"] == "succeeded", job
        assert tower.domstate("gpu-node") == "shut off (shutdown)"
        assert tower.domstate(gaming) == "running (booted)"
        if cycle % 3 == 0:
            # the player powers the game VM off; the cards go back
            tower.guest_shutdown(gaming)
            tower.wait_until(
                lambda: not tower.is_running(gaming),  # noqa: B023 - used at once
                timeout=20,
                what="power-off",
            )
            job = agent.wait(agent.submit("release"))
        else:
            job = agent.wait(agent.submit("release", gaming))  # the switch turned off
        assert job["state"] == "succeeded", job
        assert tower.domstate("gpu-node") == "running (booted)"
        assert not tower.is_running(gaming)
    _assert_clean(agent, tower)
    stops = tower.calls("shutdown", "gpu-node")
    assert len(stops) == cycles
    assert all(
        c.commands == [["shutdown", "--mode", "agent", "--domain", "gpu-node"]]
        for c in stops
    )
    assert len(tower.unit_runs()) == 2 * cycles
    assert all(u.exit_code == 0 for u in tower.unit_runs())


def test_two_concurrent_handoffs(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    tower = agent_tower
    agent = Agent(tower, tmp_path, python)
    procs = [
        subprocess.Popen(
            agent.argv("handoff", g), stdout=subprocess.PIPE, text=True, env=agent.env
        )
        for g in ("gaming-1", "gaming-2")
    ]
    ids = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        ids.append(json.loads(out)["job"]["id"])
    jobs = [agent.wait(job_id) for job_id in ids]
    assert [j["state"] for j in jobs] == ["succeeded", "succeeded"], jobs
    assert tower.domstate("gaming-1") == "running (booted)"
    assert tower.domstate("gaming-2") == "running (booted)"
    assert tower.domstate("gpu-node") == "shut off (shutdown)"
    # one after the other, and only one of them stopped the GPU node
    first, second = sorted(jobs, key=lambda j: j["started"])
    assert first["finished"] <= second["started"]
    assert len(tower.calls("shutdown", "gpu-node")) == 1
    _assert_clean(agent, tower)


def test_hook_fires_while_a_handoff_runs(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    tower = agent_tower
    agent = Agent(tower, tmp_path, python)
    # a fresh GPU node whose guest agent is not up: the handoff waits for it
    assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 0
    tower.wait_until(lambda: not tower.is_running("gpu-node"), timeout=20, what="off")
    tower.set_agent_delay("gpu-node", None)
    assert sim(tower, "start", "gpu-node").rc == 0
    agent.call("status")  # the hook reads the GPU node's claims from its cache
    handoff = agent.submit("handoff", "gaming-1")
    tower.wait_until(
        lambda: agent.step(handoff) == "wait_agent",
        timeout=20,
        what="the handoff to wait for the guest agent",
    )
    # gaming-2 started by hand: libvirt runs the qemu hook with its XML
    xml = sim(tower, "dumpxml", "gaming-2").out
    hook = agent.run("hook", "gaming-2", "prepare", "begin", "-", stdin=xml)
    assert (hook.returncode, hook.stdout) == (0, "")
    assert agent.job(handoff)["state"] == "running"  # the hook did not wait for it
    requests = agent.call("status")["hook_requests"]
    assert [r["domain"] for r in requests] == ["gaming-2"]
    hook_job = requests[0]["job"]
    assert hook_job
    tower.set_agent_delay("gpu-node", 0.0)  # the guest agent comes up now
    assert agent.wait(handoff)["state"] == "succeeded"
    assert agent.wait(hook_job)["state"] == "succeeded"
    assert tower.domstate("gaming-1") == "running (booted)"
    assert tower.domstate("gpu-node") == "shut off (shutdown)"
    assert len(tower.calls("shutdown", "gpu-node")) == 2  # ours above, the handoff's
    _assert_clean(agent, tower)


def test_a_stop_whose_agent_socket_closes_first_succeeds(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    """libvirt answers the agent shutdown with "End of file from agent
    socket" as the guest powers off (QEMU's exit raced its SHUTDOWN event):
    the domain is off, so the step succeeded, and says what libvirt
    answered; nothing more is sent, nothing destroyed."""
    tower = agent_tower
    agent = Agent(tower, tmp_path, python)
    tower.agent_sockets_close_first("gpu-node")
    job = agent.wait(agent.submit("stop", "gpu-node"))
    assert job["state"] == "succeeded", job
    step = next(s for s in job["steps"] if s["name"] == "shutdown")
    assert step["result"] == "ok"
    assert step["detail"] == (
        "shut off; libvirt answered: agent: Failed to shutdown domain 'gpu-node' "
        "/ internal error: End of file from agent socket"
    )
    assert tower.domstate("gpu-node") == "shut off (shutdown)"
    assert len(tower.calls("shutdown", "gpu-node")) == 1
    _assert_clean(agent, tower)


def test_guest_agent_never_comes_up(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    tower = agent_tower
    agent = Agent(tower, tmp_path, python, agent=1.0)
    assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 0
    tower.wait_until(lambda: not tower.is_running("gpu-node"), timeout=20, what="off")
    tower.set_agent_delay("gpu-node", None)
    assert sim(tower, "start", "gpu-node").rc == 0
    before = len(tower.calls("shutdown", "gpu-node"))
    job = agent.wait(agent.submit("stop", "gpu-node"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "agent_timeout"
    assert tower.domstate("gpu-node") == "running (booted)"
    assert len(tower.calls("shutdown", "gpu-node")) == before  # no stop was sent
    _assert_clean(agent, tower)
    (unit,) = tower.unit_runs()
    assert (unit.state, unit.exit_code, unit.loaded) == ("failed", 1, False)


def test_a_session_says_hello_answers_and_pushes(
    agent_tower: Tower, tmp_path: Path, python: Python
) -> None:
    """The forced command's session: hello and a status, a request answered,
    a libvirt event pushed as it happens, and an exit 0 when the far end
    closes its side."""
    tower = agent_tower
    agent = Agent(tower, tmp_path, python)
    proc = subprocess.Popen(
        agent.argv("serve"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**agent.env, "SSH_ORIGINAL_COMMAND": "session"},
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:

        def expect(kind: str) -> dict[str, Any]:
            assert proc.stdout is not None
            for line in proc.stdout:
                message: dict[str, Any] = json.loads(line)
                if message["type"] == kind:
                    return message
            raise AssertionError(f"the session ended before a {kind}")

        hello = expect("hello")
        assert hello["ok"] is True
        assert "status" in hello["verbs"]
        assert expect("status")["status"]["gpu_node"] == "gpu-node"
        proc.stdin.write(json.dumps({"id": 7, "verb": "version", "args": []}) + "\n")
        proc.stdin.flush()
        reply = expect("reply")
        assert (reply["id"], reply["ok"]) == (7, True)
        tower.wait_until(
            lambda: any(c.subscribed for c in tower.calls("event")),
            timeout=30,
            what="the session's event stream",
        )
        assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 0
        event = expect("event")
        assert event["domain"] == "gpu-node"
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
