"""A status check never makes a fresh runner quit (issue 11, finding 8).

`load_job` probed a young queued job's runner by taking jobs/ID.lock without
blocking, and `run_job` took that same lock without blocking and left when it
was busy ("another runner has it"). A `job ID`, `jobs` or `status` landing
between the runner's open() and its flock() stranded the job: queued, then
failed 60 s later as runner_died. Home Assistant asks `job ID` right after it
submits, and `status` probes active jobs: 49 of 200 jobs followed in a tight
loop never ran. Here: the real agent module, the stand-in virsh, real detached
runners, 60 jobs each followed in a tight loop of probes. At the rate the bug
had (49 of 200, a quarter), 60 jobs all running despite it has a chance of
0.755 ** 60, about 5e-8: the bug cannot pass unseen, in a third of the time.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import threading

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    wire,
)
from tests.tower.conftest import FakeTower

JOBS = 60
# Quick jobs that need their runner: win-1 and win-2 are off (a stop skips
# after one domstate), gpu-node is running (a start skips after one status).
WORKS = [("stop", "win-1"), ("stop", "win-2"), ("start", "gpu-node")]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_probes_never_strand_a_starting_runner(fake_tower: FakeTower) -> None:
    """`job ID`, `jobs` and `status` one-shot probes in a tight loop, and a
    session's `job` probe (the agent's load_job, the config loaded once) in a
    tighter one beside them."""
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    batch: dict[str, int] = {}
    stop = threading.Event()

    def session_probes() -> None:
        while not stop.is_set():
            for job_id in list(batch):
                with contextlib.suppress(wire.AgentError):
                    agent_jobs.load_job(cfg, job_id)

    prober = threading.Thread(target=session_probes, daemon=True)
    prober.start()
    lost: list[str] = []
    done = 0
    probes = 0
    try:
        while done < JOBS:
            for kind, domain in WORKS[: JOBS - done]:
                submitted = fake_tower.run(kind, domain).reply
                assert submitted["existing"] is False, submitted
                job = submitted["job"]
                batch[job["id"]] = job["runner"]["pid"]
            while batch:
                for job_id, pid in list(batch.items()):
                    probes += 1
                    if probes % 25 == 0:
                        assert fake_tower.run("status").rc == 0
                    elif probes % 5 == 0:
                        fake_tower.run("jobs")
                    state = fake_tower.run("job", job_id).reply["job"]["state"]
                    if state in ("succeeded", "failed"):
                        assert state == "succeeded", fake_tower.run("job", job_id)
                        del batch[job_id]
                        done += 1
                    elif not alive(pid):
                        # The runner is gone: its job must be over.
                        job = fake_tower.run("job", job_id).reply["job"]
                        if job["state"] not in ("succeeded", "failed"):
                            lost.append(job_id)
                            del batch[job_id]
                            done += 1
    finally:
        stop.set()
        prober.join(timeout=30)
    assert lost == [], f"{len(lost)} of {JOBS} jobs never ran ({probes} probes)"
