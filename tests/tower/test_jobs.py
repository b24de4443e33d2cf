"""Jobs: graceful stops, starts that wait for PCI functions, serialisation.

These run against the stand-in virsh (fakevirsh.py; see its docstring for why).
Steps run in this process (``run-job``) so coverage is measured; the tests named
``*_detached`` start real detached runners.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
import sys
import time

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    runner as agent_runner,
    stream as agent_stream,
    virsh as agent_virsh,
    wire,
)
from tests.tower.conftest import FakeTower


def queue(tower: FakeTower, kind: str, target: str | None) -> str:
    """Create a job without starting a runner; its id."""
    cfg = agent_config.load_config(str(tower.config), dict(os.environ))
    return str(agent_jobs.create_job(cfg, kind, target, "cli")["id"])


def run_job(tower: FakeTower, job_id: str) -> dict[str, object]:
    run = tower.run("run-job", job_id)
    assert run.lines == []
    job = tower.run("job", job_id).reply["job"]
    assert (run.rc == 0) == (job["state"] == "succeeded")
    return dict(job)


def test_stop_waits_for_agent_then_shuts_down(fake_tower: FakeTower) -> None:
    fake_tower.set_domain("gpu-node", agent_after=3)
    job_id = queue(fake_tower, "stop", "gpu-node")
    job = run_job(fake_tower, job_id)
    assert job["state"] == "succeeded", job
    steps = job["steps"]
    assert [(s["name"], s["result"]) for s in steps] == [  # type: ignore[attr-defined]
        ("wait_agent", "ok"),
        ("shutdown", "ok"),
        ("wait_shut_off", "ok"),
    ]
    commands = fake_tower.commands()
    # No stop before the agent answered: three failed pings, one good, then shutdown.
    assert commands.count("qemu-agent-command") == 4
    assert commands.index("shutdown") > max(
        i for i, c in enumerate(commands) if c == "qemu-agent-command"
    )
    assert [
        "-c",
        "test:///fake",
        "shutdown",
        "--mode",
        "agent",
        "--domain",
        "gpu-node",
    ] in fake_tower.log()
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "shut off"
    assert job["requested_by"] == "cli"
    assert job["error"] is None


def test_a_shutdown_that_took_the_domain_down_with_an_error_is_ours(
    fake_tower: FakeTower,
) -> None:
    """libvirt answers the agent shutdown with an error, yet the guest went
    down (its QEMU exited while libvirt still waited): the step did it, and
    says so with libvirt's words; it is not a domain found off (a real-QEMU
    run under load recorded such a stop of the GPU node as skipped, so
    Home Assistant took the GPU node as shut down by someone else)."""
    fake_tower.set_domain("gpu-node", agent_shutdown="ended_with_error")
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    assert job["state"] == "succeeded", job
    steps = {s["name"]: s for s in job["steps"]}  # type: ignore[attr-defined]
    assert steps["shutdown"]["result"] == "ok"
    assert "End of file from qemu monitor" in steps["shutdown"]["detail"]
    assert steps["wait_shut_off"]["result"] == "ok"
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "shut off"


def test_stop_already_off_is_success(fake_tower: FakeTower) -> None:
    job = run_job(fake_tower, queue(fake_tower, "stop", "win-1"))
    assert job["state"] == "succeeded"
    assert {s["result"] for s in job["steps"]} == {"skipped"}  # type: ignore[attr-defined]
    assert "shutdown" not in fake_tower.commands()


def test_agent_timeout_sends_no_stop(fake_tower: FakeTower) -> None:
    # A short shutdown timeout too: a stop sent anyway (the mutant
    # stop_before_guest_agent) fails here in a second, not in minutes.
    fake_tower.configure(timeouts={"agent": 0.2, "shutdown": 1.0})
    fake_tower.set_domain("gpu-node", agent_after=10**6)
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "agent_timeout"  # type: ignore[index]
    assert "left running" in job["error"]["message"]  # type: ignore[index]
    assert "shutdown" not in fake_tower.commands()
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "running"


def test_shutdown_timeout_leaves_vm_running(fake_tower: FakeTower) -> None:
    fake_tower.configure(timeouts={"shutdown": 0.2})
    fake_tower.set_domain("gpu-node", shutdown_polls=-1)
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "shutdown_timeout"  # type: ignore[index]
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "running"
    steps = {s["name"]: s for s in job["steps"]}  # type: ignore[attr-defined]
    assert steps["wait_shut_off"]["result"] == "failed"


def test_modes_in_order_until_one_is_accepted(fake_tower: FakeTower) -> None:
    """agent refused (the agent vanished after the ping): acpi is tried next."""
    fake_tower.configure(shutdown_modes=["agent", "acpi"])
    fake_tower.set_domain("gpu-node", acpi=True)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "gpu-node", "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    runner.step_wait_agent(0, job["steps"][0])
    fake_tower.set_domain("gpu-node", agent_after=5)
    runner.run()
    assert job["steps"][1]["detail"] == "shutdown --mode acpi accepted"
    modes = [a[4] for a in fake_tower.log() if a[2:3] == ["shutdown"]]
    assert modes == ["agent", "acpi"]


def test_every_mode_refused(fake_tower: FakeTower) -> None:
    """The agent is gone and the domain stays running for the whole shutdown
    timeout: refused, left running (never destroyed)."""
    fake_tower.configure(timeouts={"shutdown": 0.2})
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "gpu-node", "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    runner.step_wait_agent(0, job["steps"][0])
    fake_tower.set_domain("gpu-node", agent_after=5)
    with pytest.raises(wire.AgentError) as err:
        runner.run()
    assert err.value.code == "shutdown_refused"
    assert "QEMU guest agent is not connected" in err.value.message
    assert "still running 0.2 s later" in err.value.message
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "running"


def test_a_refusal_that_is_not_an_agent_one_fails_at_once(
    fake_tower: FakeTower,
) -> None:
    """ACPI refused for another reason (here: the stand-in's "domain is not
    running" of a domain that then reads running): no waiting."""
    fake_tower.configure(shutdown_modes=["acpi"], timeouts={"shutdown": 30})
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "gpu-node", "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    result = agent_virsh.VirshResult(
        1, "", "error: Failed to shutdown domain 'x'\nerror: nope\n"
    )
    assert not agent_runner.may_be_going_down(result)
    runner.virsh.run = lambda args, timeout=agent_virsh.VIRSH_TIMEOUT: (  # type: ignore[method-assign]
        result
        if args[0] == "shutdown"
        else agent_virsh.Virsh.run(runner.virsh, args, timeout)
    )
    began = time.monotonic()
    with pytest.raises(wire.AgentError) as err:
        runner.step_shutdown(1, job["steps"][1])
    assert time.monotonic() - began < 5
    assert err.value.code == "shutdown_refused"
    assert "later" not in err.value.message


@pytest.mark.parametrize(
    ("how", "text"),
    [
        ("timed_out", "Guest agent not available for now"),
        ("agent_left", "QEMU guest agent is not connected"),
    ],
)
def test_a_refused_agent_shutdown_of_a_guest_going_down_is_a_stop(
    fake_tower: FakeTower, how: str, text: str
) -> None:
    """libvirt's agent shutdown gave up after 60 s while the guest goes down
    (qemuAgentShutdown), or the guest shut itself down and its agent left
    first: the domain is shut off within the shutdown timeout, so it is
    stopped (the step counts as the job's: its detail says why)."""
    fake_tower.set_domain("gpu-node", agent_shutdown=how, shutdown_polls=3)
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    assert job["state"] == "succeeded", job
    steps = {s["name"]: s for s in job["steps"]}  # type: ignore[attr-defined]
    assert steps["shutdown"]["result"] == "ok"
    assert steps["shutdown"]["detail"].startswith(
        "shut off after the shutdown was refused (agent: "
    )
    assert text in steps["shutdown"]["detail"]
    assert steps["wait_shut_off"]["result"] == "ok"
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "shut off"


def test_a_guest_still_going_down_at_the_timeout_fails_the_step(
    fake_tower: FakeTower,
) -> None:
    fake_tower.configure(timeouts={"shutdown": 0.2})
    fake_tower.set_domain("gpu-node", agent_shutdown="timed_out", shutdown_polls=-1)
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "shutdown_refused"  # type: ignore[index]
    assert "left running (never forced off)" in job["error"]["message"]  # type: ignore[index]
    assert fake_tower.load()["domains"]["gpu-node"]["state"] == "running"


def test_virsh_given_up_on_may_be_going_down() -> None:
    timed_out = agent_virsh.VirshResult(
        124, "", "error: virsh timed out", timed_out=True
    )
    assert agent_runner.may_be_going_down(timed_out)
    lock = agent_virsh.VirshResult(
        1,
        "",
        "error: Failed to shutdown domain 'g'\nerror: Timed out during operation: "
        "cannot acquire state change lock (held by agent=remoteDispatchDomainShutdownFlags)\n",
    )
    assert agent_runner.may_be_going_down(lock)


def test_start_waits_until_devices_are_free(fake_tower: FakeTower) -> None:
    fake_tower.configure(timeouts={"start": 0.3})
    job = run_job(fake_tower, queue(fake_tower, "start", "win-1"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "devices_busy"  # type: ignore[index]
    assert "0000:01:00.0 held by gpu-node" in job["error"]["message"]  # type: ignore[index]
    assert "start" not in fake_tower.commands()


def test_start_already_running_and_missing(fake_tower: FakeTower) -> None:
    job = run_job(fake_tower, queue(fake_tower, "start", "gpu-node"))
    assert job["state"] == "succeeded"
    assert job["steps"][0]["detail"] == "already running"  # type: ignore[index]
    with fake_tower.changing() as state:
        del state["domains"]["win-2"]
    job = run_job(fake_tower, queue(fake_tower, "start", "win-2"))
    assert job["error"]["code"] == "domain_missing"  # type: ignore[index]
    job = run_job(fake_tower, queue(fake_tower, "stop", "win-2"))
    assert job["error"]["code"] == "domain_missing"  # type: ignore[index]


def test_start_refused_by_libvirt(fake_tower: FakeTower) -> None:
    """A start that libvirt refuses although the agent saw the devices free."""
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "start", "win-1", "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    with pytest.raises(wire.AgentError) as err:
        runner.step_start(1, job["steps"][1])
    assert err.value.code == "start_failed"
    assert "PCI device 0000:01:00.0 is in use" in err.value.message
    fake_tower.set_domain("win-1", state="running")
    runner.step_start(1, job["steps"][1])
    assert job["steps"][1]["detail"] == "already running"


def test_handoff_and_release(fake_tower: FakeTower) -> None:
    job = run_job(fake_tower, queue(fake_tower, "handoff", "win-1"))
    assert job["state"] == "succeeded", job
    domains = fake_tower.load()["domains"]
    assert domains["gpu-node"]["state"] == "shut off"
    assert domains["win-1"]["state"] == "running"
    job = run_job(fake_tower, queue(fake_tower, "release", "win-1"))
    assert job["state"] == "succeeded", job
    domains = fake_tower.load()["domains"]
    assert domains["win-1"]["state"] == "shut off"
    assert domains["gpu-node"]["state"] == "running"
    job = run_job(fake_tower, queue(fake_tower, "release", None))
    assert [s["name"] for s in job["steps"]] == ["wait_devices_free", "start"]  # type: ignore[attr-defined]
    assert job["state"] == "succeeded"


def test_runner_exception_is_recorded(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: agent_runner.JobRunner) -> None:
        raise RuntimeError("kaput")

    monkeypatch.setattr(agent_runner.JobRunner, "run", boom)
    job = run_job(fake_tower, queue(fake_tower, "stop", "gpu-node"))
    # The client learns a code and an incident id; the tower's log the rest.
    assert job["error"]["code"] == "internal"  # type: ignore[index]
    assert "kaput" not in job["error"]["message"]  # type: ignore[index]
    incident = job["error"]["message"].split()[2].rstrip(";")  # type: ignore[index]
    log = (fake_tower.state_dir / "agent.log").read_text(encoding="utf-8")
    assert f"internal error {incident} in job {job['id']}" in log
    assert "RuntimeError: kaput" in log


def test_run_job_twice_and_other_runner(fake_tower: FakeTower) -> None:
    import fcntl
    import threading

    job_id = queue(fake_tower, "stop", "win-1")
    run_job(fake_tower, job_id)
    calls = len(fake_tower.log())
    assert fake_tower.run("run-job", job_id).rc == 0  # not queued: nothing to do
    assert len(fake_tower.log()) == calls
    # Someone holds the job's lock (a probe, for an instant; a rival runner,
    # for its whole job): the runner waits for it, and never gives up its job.
    job_id = queue(fake_tower, "stop", "win-1")
    lock = fake_tower.state_dir / "jobs" / f"{job_id}.lock"
    codes: list[int] = []
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        runner = threading.Thread(
            target=lambda: codes.append(fake_tower.run("run-job", job_id).rc)
        )
        runner.start()
        time.sleep(0.5)
        assert runner.is_alive()
        assert (
            json.loads((fake_tower.state_dir / "jobs" / f"{job_id}.json").read_text())[
                "state"
            ]
            == "queued"
        )
    runner.join(timeout=60)
    assert codes == [0]
    assert fake_tower.run("job", job_id).reply["job"]["state"] == "succeeded"


def test_dead_runner_is_reported_failed(fake_tower: FakeTower) -> None:
    job_id = queue(fake_tower, "stop", "gpu-node")
    path = fake_tower.state_dir / "jobs" / f"{job_id}.json"
    job = json.loads(path.read_text(encoding="utf-8"))
    # Queued and young, no runner yet: still queued.
    assert fake_tower.run("job", job_id).reply["job"]["state"] == "queued"
    job["state"] = "running"
    path.write_text(json.dumps(job), encoding="utf-8")
    reply = fake_tower.run("job", job_id).reply["job"]
    assert reply["state"] == "failed"
    assert reply["error"]["code"] == "runner_died"
    # Stored, not only reported.
    assert json.loads(path.read_text(encoding="utf-8"))["state"] == "failed"
    job_id = queue(fake_tower, "stop", "gpu-node")
    path = fake_tower.state_dir / "jobs" / f"{job_id}.json"
    job = json.loads(path.read_text(encoding="utf-8"))
    job["created_epoch"] -= agent_jobs.QUEUED_GRACE_SECONDS + 1
    path.write_text(json.dumps(job), encoding="utf-8")
    assert fake_tower.run("job", job_id).reply["job"]["error"]["code"] == "runner_died"


def test_job_and_jobs_verbs(fake_tower: FakeTower) -> None:
    assert fake_tower.run("job", "nope").reply["error"]["code"] == "unknown_job"
    assert fake_tower.run("job", "../x").reply["error"]["code"] == "bad_request"
    first = queue(fake_tower, "stop", "win-1")
    second = queue(fake_tower, "start", "win-2")
    (fake_tower.state_dir / "jobs" / "zzz-broken.json").write_text(
        "{", encoding="utf-8"
    )
    jobs = fake_tower.run("jobs").reply["jobs"]
    assert [j["id"] for j in jobs] == [second, first]
    assert jobs[0]["kind"] == "start"
    assert jobs[0]["args"] == {"domain": "win-2"}
    assert jobs[0]["step"] is None


def test_prune_keeps_last_jobs(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_jobs, "MAX_JOBS", 3)
    monkeypatch.setattr(agent_stream, "MAX_JOBS", 3)
    ids = [queue(fake_tower, "stop", "win-1") for _ in range(3)]
    for job_id in ids:
        run_job(fake_tower, job_id)
    running = queue(fake_tower, "stop", "win-1")
    newest = [queue(fake_tower, "stop", "win-1") for _ in range(3)]
    left = sorted(p.stem for p in (fake_tower.state_dir / "jobs").glob("*.json"))
    # Finished old jobs pruned; queued ones are kept.
    assert left == sorted([running, *newest])
    assert not any((fake_tower.state_dir / "jobs").glob(f"{ids[0]}.*"))


def test_stop_detached(fake_tower: FakeTower) -> None:
    fake_tower.set_domain("gpu-node", agent_after=2)
    run = fake_tower.run("stop", "gpu-node")
    assert run.rc == 0
    job = run.reply["job"]
    assert wire.JOB_ID_RE.match(job["id"])
    assert job["state"] == "queued"
    assert job["runner"]["mode"] == "process"
    finished = fake_tower.wait_job(job["id"])
    assert finished["state"] == "succeeded", finished
    assert finished["runner"]["pid"] != os.getpid()


def test_two_handoffs_at_once_detached(fake_tower: FakeTower) -> None:
    """Serialised by the tower lock: the second finds the GPU node already off
    (or, asked while the first was still queued, is the first)."""
    first = fake_tower.run("handoff", "win-1").reply
    second = fake_tower.run("handoff", "win-1").reply
    ids = [first["job"]["id"], second["job"]["id"]]
    assert first["existing"] is False
    assert second["existing"] is (ids[0] == ids[1])
    jobs = [fake_tower.wait_job(job_id) for job_id in dict.fromkeys(ids)]
    assert {j["state"] for j in jobs} == {"succeeded"}
    assert fake_tower.commands().count("shutdown") == 1
    assert fake_tower.commands().count("start") == 1
    if len(jobs) == 2:
        later = max(jobs, key=lambda j: j["started"])
        assert {s["result"] for s in later["steps"]} == {"skipped"}
        spans = sorted((j["started"], j["finished"]) for j in jobs)
        assert spans[0][1] <= spans[1][0]


def write_systemd_run(directory: Path, run_it: bool) -> Path:
    """A stand-in systemd-run: records argv; refuses a loaded unit name."""
    tool = directory / "systemd-run"
    log = directory / "systemd-run.jsonl"
    tool.write_text(
        f"#!{sys.executable}\n"
        "import json, subprocess, sys\n"
        f"log = {str(log)!r}\n"
        "args = sys.argv[1:]\n"
        "seen = [json.loads(l) for l in open(log)] if __import__('os').path.exists(log) else []\n"
        "unit = [a for a in args if a.startswith('--unit=')][0]\n"
        "if any(unit in s for s in seen) and '--collect' not in args:\n"
        "    sys.stderr.write('Failed to start transient service unit: Unit ' + unit[7:] + '.service was already loaded or has a fragment file.\\n'); sys.exit(1)\n"
        "open(log, 'a').write(json.dumps(args) + '\\n')\n"
        f"if {run_it!r}:\n"
        "    subprocess.Popen(args[args.index('--') + 1:], start_new_session=True,\n"
        "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n",
        encoding="utf-8",
    )
    tool.chmod(0o755)
    return tool


def test_systemd_run_unique_units(fake_tower: FakeTower) -> None:
    tool = write_systemd_run(fake_tower.directory, run_it=True)
    fake_tower.configure(
        detach="systemd",
        commands={"virsh": str(fake_tower.virsh), "systemd_run": str(tool)},
    )
    ids = []
    for _ in range(2):
        run = fake_tower.run("stop", "win-1")
        assert run.rc == 0, run.lines
        assert run.reply["job"]["runner"]["mode"] == "systemd"
        ids.append(run.reply["job"]["id"])
        assert fake_tower.wait_job(ids[-1])["state"] == "succeeded"
    calls = [
        json.loads(line)
        for line in (fake_tower.directory / "systemd-run.jsonl")
        .read_text()
        .splitlines()
    ]
    units = [next(a for a in c if a.startswith("--unit=")) for c in calls]
    assert units == [f"--unit=gpu-handoff-job-{i}" for i in ids]
    for call in calls:
        assert "--collect" in call
        assert ("--user" in call) == (os.geteuid() != 0)
        assert call[call.index("--") + 1 :][-4:-2] == [
            "run-job",
            call[call.index("--") + 1 :][-3],
        ]


def test_systemd_run_failure(fake_tower: FakeTower, tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "systemd-run"
    tool.write_text(
        "#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n", encoding="utf-8"
    )
    tool.chmod(0o755)
    fake_tower.configure(
        detach="systemd",
        commands={"virsh": str(fake_tower.virsh), "systemd_run": str(tool)},
    )
    run = fake_tower.run("stop", "win-1")
    assert run.reply["error"]["code"] == "spawn_failed"
    assert "Failed to connect to bus" in run.reply["error"]["message"]
    job = fake_tower.run("jobs").reply["jobs"][0]
    assert job["state"] == "failed"
    # auto falls back to a plain detached process.
    fake_tower.configure(
        detach="auto",
        commands={"virsh": str(fake_tower.virsh), "systemd_run": str(tool)},
    )
    original = agent_jobs.SYSTEMD_RUNTIME_DIR
    agent_jobs.SYSTEMD_RUNTIME_DIR = str(tmp_path)
    try:
        run = fake_tower.run("stop", "win-1")
    finally:
        agent_jobs.SYSTEMD_RUNTIME_DIR = original
    assert run.reply["job"]["runner"]["mode"] == "process"
    fake_tower.wait_job(run.reply["job"]["id"])
    fake_tower.configure(
        detach="systemd",
        commands={
            "virsh": str(fake_tower.virsh),
            "systemd_run": str(tmp_path / "none"),
        },
    )
    assert fake_tower.run("stop", "win-1").reply["error"]["code"] == "spawn_failed"


def test_spawn_oserror(fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(fake_tower.directory / "no-python"))
    run = fake_tower.run("start", "win-1")
    assert run.reply["error"]["code"] == "spawn_failed"


def test_wait_devices_polls_until_free(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While waiting, the step says who holds what; it goes on once freed."""
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "start", "win-1", "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    sleeps = []
    real_sleep = time.sleep

    def fake_sleep(seconds: float) -> None:
        if seconds != cfg.poll_interval:  # subprocess's own waits
            real_sleep(seconds)
            return
        sleeps.append(seconds)
        assert (
            job["steps"][0]["detail"]
            == "waiting: 0000:01:00.0 held by gpu-node, 0000:01:00.1 held by gpu-node"
        )
        fake_tower.set_domain("gpu-node", state="shut off", reason="shutdown")

    monkeypatch.setattr(time, "sleep", fake_sleep)
    runner.run()
    assert len(sleeps) == 1
    assert job["steps"][0]["result"] == "ok"
    assert fake_tower.load()["domains"]["win-1"]["state"] == "running"


def _flock_waiters(path: Path) -> int:
    """How many processes wait, blocked in flock, for the lock on ``path``
    (the kernel's /proc/locks marks a waiter's line ``->``)."""
    st = path.stat()
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with Path("/proc/locks").open(encoding="ascii") as locks:
        return sum(1 for line in locks if " -> FLOCK " in line and ident in line)


def test_jobs_wait_for_tower_lock(fake_tower: FakeTower) -> None:
    """A runner queued behind the tower lock stays `queued` and alive."""
    import fcntl

    lock = fake_tower.state_dir / "tower.lock"
    fake_tower.state_dir.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        job_id = fake_tower.run("stop", "win-1").reply["job"]["id"]
        # The runner blocks in flock on the tower lock: the kernel lists it
        # as a waiter on the file (a runner that did not wait never is).
        # Until then the job stays queued (a runner past the lock runs it).
        cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
        deadline = time.monotonic() + 30
        while not _flock_waiters(lock):
            assert agent_jobs.load_job(cfg, job_id)["state"] == "queued"
            assert time.monotonic() < deadline, "no runner waits on the tower lock"
            time.sleep(0.02)
        assert fake_tower.run("job", job_id).reply["job"]["state"] == "queued"
        assert fake_tower.run("status").reply["active_jobs"][0]["id"] == job_id
    assert fake_tower.wait_job(job_id)["state"] == "succeeded"


def test_jobs_made_in_the_same_microsecond_get_units_of_their_own(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's unit is named after its id. Ids made at the same instant
    differ by their random part, and should that repeat too, the id is made
    again: no record, and so no unit name, is ever used twice (real
    systemd refuses a name in use: tests/box/test_detached_jobs.py)."""
    instant = dt.datetime(2026, 12, 1, 21, 0, 0, 123456, dt.UTC)

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:
            return instant

    draws = iter(["aaaaaa", "aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(dt, "datetime", Frozen)
    real = agent_jobs._random_hex
    monkeypatch.setattr(
        agent_jobs, "_random_hex", lambda n: next(draws) if n == 3 else real(n)
    )
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    first = agent_jobs.create_job(cfg, "stop", "win-1", "test")
    second = agent_jobs.create_job(cfg, "stop", "win-2", "test")
    assert first["id"] == "20261201-210000-123456-aaaaaa"
    assert second["id"] == "20261201-210000-123456-bbbbbb"
    assert agent_jobs.load_job(cfg, first["id"])["args"] == {"domain": "win-1"}
