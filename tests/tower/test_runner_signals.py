"""A runner stopped by a signal reports it: the job failed, runner_died.

systemd stops a job's unit (``systemctl --user stop``, the user's manager or
the whole system going down) with SIGTERM to every process of the unit: the
runner and the virsh it may be waiting for. The runner then records its job
as failed (runner_died, "stopped (SIGTERM)"), releases its locks and ends as
the signal ends a process; before, Python's default ended it on the spot and
the job was reported later only as "gone". SIGHUP and SIGINT (a runner
started by hand in a terminal) do the same.

Each test starts a real runner (``run-job`` in a process of its own, over the
stand-in virsh of fakevirsh.py), holds it where a runner waits (between two
polls, inside a virsh call, for the tower's lock, for its job's lock) and
signals it.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import fcntl
import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    runner as agent_runner,
    wire,
)
from tests.support.testdriver import AGENT
from tests.support.waiting import wait_until
from tests.tower.conftest import FakeTower

TIMEOUT = 30.0


def queue(tower: FakeTower, kind: str, target: str | None) -> str:
    """Create a job without starting a runner; its id."""
    cfg = agent_config.load_config(str(tower.config), dict(os.environ))
    return str(agent_jobs.create_job(cfg, kind, target, "cli")["id"])


def record(tower: FakeTower, job_id: str) -> dict[str, Any]:
    """The job's record as stored (no liveness check)."""
    path = tower.state_dir / "jobs" / f"{job_id}.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


# Runs the runner with its stop signals as systemd starts a service: by
# default. (The test runner may have inherited SIGINT ignored, as a
# background job of a shell does; and a runner keeps an ignored signal
# ignored.) Its handlers end with the exec; SIG_DFL stays.
DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
    "    signal.signal(sig, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


@contextlib.contextmanager
def runner(tower: FakeTower, job_id: str) -> Iterator[subprocess.Popen[str]]:
    """A real runner of the job, in a session (and process group) of its own,
    as systemd-run or the process mode starts it; killed if a test leaves it."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DEFAULT_SIGNALS,
            str(AGENT),
            "--config",
            str(tower.config),
            "run-job",
            job_id,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(word) for word in path.read_text().split()]
    return []


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def running_step(tower: FakeTower, job_id: str, step: str) -> bool:
    job = record(tower, job_id)
    index = job["step"]
    return (
        job["state"] == "running"
        and isinstance(index, int)
        and job["steps"][index]["name"] == step
    )


def lock_is_free(path: Path) -> bool:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
    return True


def check_stopped(
    tower: FakeTower, job_id: str, proc: subprocess.Popen[str], sig: signal.Signals
) -> dict[str, Any]:
    """The runner ended by the signal (once its job's end was written); the
    job failed with runner_died naming the signal, as stored and as the
    `job` verb reports it; its locks free."""
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -sig, (proc.returncode, stderr)
    job = record(tower, job_id)
    reason = agent_runner.RUNNER_STOP_SIGNALS[sig]
    message = (
        f"the job's runner was stopped ({sig.name}) before the job finished: {reason}"
    )
    assert job["state"] == "failed", job
    assert job["error"] == {"code": wire.ERR_RUNNER_DIED, "message": message}
    assert job["finished"]
    assert f"job {job_id}: {message}" in stderr
    reported = tower.run("job", job_id).reply["job"]
    assert (reported["state"], reported["error"]) == ("failed", job["error"])
    assert lock_is_free(tower.state_dir / "jobs" / f"{job_id}.lock")
    assert lock_is_free(tower.state_dir / "tower.lock")
    return job


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda sig: sig.name
)
def test_stopped_between_polls(fake_tower: FakeTower, sig: signal.Signals) -> None:
    """Waiting for the GPU node's guest agent (it never answers): the step
    under way stays as begun, the steps after it untouched."""
    fake_tower.set_domain("gpu-node", agent_after=10**6)
    fake_tower.configure(timeouts={"agent": 600, "shutdown": 20, "start": 20})
    job_id = queue(fake_tower, "stop", "gpu-node")
    with runner(fake_tower, job_id) as proc:
        wait_until(
            lambda: (
                running_step(fake_tower, job_id, "wait_agent")
                and fake_tower.commands().count("qemu-agent-command") >= 2
            ),
            timeout=TIMEOUT,
            what="the runner polling the guest agent",
        )
        proc.send_signal(sig)
        job = check_stopped(fake_tower, job_id, proc, sig)
    first, *rest = job["steps"]
    assert first["name"] == "wait_agent"
    assert first["started"]
    assert (first["result"], first["finished"]) == (None, None)
    assert all(step["started"] is None and step["result"] is None for step in rest)
    assert "shutdown" not in fake_tower.commands()


@pytest.mark.parametrize("whole_group", [False, True], ids=["runner", "group"])
def test_stopped_inside_a_virsh_call(fake_tower: FakeTower, whole_group: bool) -> None:
    """A ping that hangs: the runner waits for its virsh child when SIGTERM
    comes, to it alone (its virsh is then killed and reaped by the runner) or
    to the whole group, as systemd's KillMode=control-group sends it."""
    fake_tower.set_domain("gpu-node", ping_sleep=3600)
    fake_tower.configure(timeouts={"agent": 600, "shutdown": 20, "start": 20})
    job_id = queue(fake_tower, "stop", "gpu-node")
    with runner(fake_tower, job_id) as proc:
        virsh = wait_until(
            lambda: (
                running_step(fake_tower, job_id, "wait_agent")
                and "qemu-agent-command" in fake_tower.commands()
                and children(proc.pid)
            ),
            timeout=TIMEOUT,
            what="the runner waiting for virsh",
        )
        assert len(virsh) == 1
        if whole_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        check_stopped(fake_tower, job_id, proc, signal.SIGTERM)
        assert not alive(virsh[0])


def test_stopped_waiting_for_the_tower(fake_tower: FakeTower) -> None:
    """Queued behind another job (the tower's lock held): failed too, no
    step begun, nothing asked of libvirt."""
    job_id = queue(fake_tower, "stop", "gpu-node")
    with (fake_tower.state_dir / "tower.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with runner(fake_tower, job_id) as proc:
            wait_until(
                lambda: (
                    (record(fake_tower, job_id).get("runner") or {}).get("pid")
                    == proc.pid
                ),
                timeout=TIMEOUT,
                what="the runner waiting for the tower's lock",
            )
            assert record(fake_tower, job_id)["state"] == "queued"
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=TIMEOUT)
            held.close()  # the tower's lock free again, for the check
            job = check_stopped(fake_tower, job_id, proc, signal.SIGTERM)
    assert all(step["started"] is None for step in job["steps"])
    assert fake_tower.log() == []


def test_stopped_before_it_holds_its_job(fake_tower: FakeTower) -> None:
    """Waiting for its job's lock (held here, as a rival runner would): the
    job is not the runner's to write; it ends by the signal, the job stays
    queued for whoever holds the lock."""
    job_id = queue(fake_tower, "stop", "gpu-node")
    lock = fake_tower.state_dir / "jobs" / f"{job_id}.lock"
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with runner(fake_tower, job_id) as proc:
            wait_until(
                lambda: any(
                    fd.resolve() == lock.resolve()
                    for fd in Path(f"/proc/{proc.pid}/fd").iterdir()
                ),
                timeout=TIMEOUT,
                what="the runner waiting for its job's lock",
            )
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == -signal.SIGTERM, stderr
            job = record(fake_tower, job_id)
            assert (job["state"], job["error"], job["runner"]) == ("queued", None, None)
    assert fake_tower.log() == []


def signal_self(sig: signal.Signals) -> None:
    """Send ``sig`` to this process and give its handler time to run (Python
    runs it between two bytecodes, here at once)."""
    os.kill(os.getpid(), sig)
    time.sleep(0.01)


def test_the_signals_in_this_process() -> None:
    """RunnerSignals itself: the first signal raises RunnerStopped, any later
    one is only kept; held, a signal raises nothing; the handlers before it
    are back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in agent_runner.RUNNER_STOP_SIGNALS}
    with agent_runner.RunnerSignals() as signals:
        with pytest.raises(agent_runner.RunnerStopped) as stopped:
            signal_self(signal.SIGHUP)
        assert stopped.value.signum == signal.SIGHUP
        signal_self(signal.SIGTERM)  # kept, not raised
        assert signals.received == signal.SIGHUP
    assert {
        sig: signal.getsignal(sig) for sig in agent_runner.RUNNER_STOP_SIGNALS
    } == before
    with agent_runner.RunnerSignals() as signals:
        signals.hold()
        signal_self(signal.SIGTERM)
        assert signals.received == signal.SIGTERM
    assert {
        sig: signal.getsignal(sig) for sig in agent_runner.RUNNER_STOP_SIGNALS
    } == before


def test_a_runner_in_this_process_keeps_the_handlers(fake_tower: FakeTower) -> None:
    """run_job called in a process that has handlers of its own (the test
    runner's) gives them back; a job's run is as before."""
    before = {sig: signal.getsignal(sig) for sig in agent_runner.RUNNER_STOP_SIGNALS}
    job_id = queue(fake_tower, "stop", "gpu-node")
    assert fake_tower.run("run-job", job_id).rc == 0
    assert record(fake_tower, job_id)["state"] == "succeeded"
    assert {
        sig: signal.getsignal(sig) for sig in agent_runner.RUNNER_STOP_SIGNALS
    } == before
