"""Request ids: one job per request id, however often and from wherever it comes."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    state as agent_state,
    stream as agent_stream,
    wire,
)
from tests.support.agentbuild import AGENT
from tests.tower.conftest import FakeTower

RID = "ha-0123456789abcdef"


def job_files(tower: FakeTower) -> list[Path]:
    return sorted((tower.state_dir / "jobs").glob("*.json"))


def serve(tower: FakeTower, command: str) -> dict[str, Any]:
    return tower.run("serve", env={"SSH_ORIGINAL_COMMAND": command}).reply


def test_same_request_id_is_one_job(fake_tower: FakeTower) -> None:
    first = fake_tower.run("stop", "win-1", f"--request={RID}")
    assert first.rc == 0, first.lines
    assert first.reply["existing"] is False
    job = first.reply["job"]
    assert job["request_id"] == RID
    assert job["runner"]["mode"] == "process"
    # Again, the option first this time: the same job, nothing new.
    again = fake_tower.run("stop", f"--request={RID}", "win-1")
    assert again.rc == 0
    assert again.reply["existing"] is True
    assert again.reply["job"]["id"] == job["id"]
    assert set(again.reply["job"]) == set(job)
    # Through serve (Home Assistant's SSH key), after the job finished.
    fake_tower.wait_job(job["id"])
    reply = serve(fake_tower, f"stop win-1 --request={RID}")
    assert reply["existing"] is True
    assert reply["job"] == {
        "id": job["id"],
        "kind": "stop",
        "state": "succeeded",
        "request_id": RID,
        "runner": reply["job"]["runner"],
    }
    assert len(job_files(fake_tower)) == 1
    record = json.loads(job_files(fake_tower)[0].read_text(encoding="utf-8"))
    assert record["request_id"] == RID
    # A submit without a request id is always new.
    plain = fake_tower.run("stop", "win-1")
    assert plain.reply["existing"] is False
    assert plain.reply["job"]["request_id"] is None
    fake_tower.wait_job(plain.reply["job"]["id"])
    summaries = fake_tower.run("jobs").reply["jobs"]
    assert [s["request_id"] for s in summaries] == [None, RID]


def test_request_verb(fake_tower: FakeTower) -> None:
    job_id = fake_tower.run("start", "gpu-node", f"--request={RID}").reply["job"]["id"]
    fake_tower.wait_job(job_id)
    found = fake_tower.run("request", RID)
    assert found.rc == 0
    assert found.reply["job"] == fake_tower.run("job", job_id).reply["job"]
    assert found.reply["job"]["steps"]  # the full record, as `job` answers
    reply = serve(fake_tower, f"request {RID}")
    assert reply["job"]["id"] == job_id
    missing = fake_tower.run("request", "nobody-asked-this")
    assert missing.rc == 1
    assert missing.reply["error"]["code"] == wire.ERR_UNKNOWN_REQUEST
    assert fake_tower.run("request", "x").reply["error"]["code"] == "bad_request"


@pytest.mark.parametrize(
    "command",
    [
        "stop win-1 --request=short",  # 8..64 characters
        "stop win-1 --request=-abcdefgh",  # starts with a letter or digit
        "stop win-1 --request=abc.defgh",
        "stop win-1 --request=" + "a" * 65,
        "stop win-1 --request=",
        f"stop win-1 --request={RID} --request={RID}",
        f"handoff --request={RID}",  # the domain is still required
        f"status --request={RID}",  # only the job verbs take one
        f"job --request={RID}",
        "request short",
        "request",
        f"request {RID} {RID}",
        "session now",
    ],
)
def test_invalid_request_ids(fake_tower: FakeTower, command: str) -> None:
    reply = serve(fake_tower, command)
    assert reply["ok"] is False
    assert reply["error"]["code"] == "bad_request"
    assert fake_tower.log() == []
    assert not (fake_tower.state_dir / "jobs").exists()


def test_cli_rejects_bad_request_id(fake_tower: FakeTower) -> None:
    run = fake_tower.run("release", "--request=no", "win-1")
    assert run.reply["error"]["code"] == "bad_request"
    assert fake_tower.log() == []


# Each process waits for the go file, so that all ten submit at the same moment.
RACER = """
import os, runpy, sys, time
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.001)
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_concurrent_submits_make_one_job(fake_tower: FakeTower) -> None:
    """Ten processes with the same request id at once: one job, nine answers."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/root"),
    }
    go = fake_tower.directory / "go"
    argv = [
        sys.executable,
        "-c",
        RACER,
        str(go),
        str(AGENT),
        "--config",
        str(fake_tower.config),
        "handoff",
        "win-1",
        f"--request={RID}",
    ]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, env=env) for _ in range(10)]
    time.sleep(0.5)  # all of them started and waiting
    go.touch()
    replies = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        replies.append(json.loads(out))
    assert len(job_files(fake_tower)) == 1
    assert len({r["job"]["id"] for r in replies}) == 1
    assert sorted(r["existing"] for r in replies) == [False] + [True] * 9
    job = fake_tower.wait_job(replies[0]["job"]["id"])
    assert job["state"] == "succeeded", job
    assert fake_tower.commands().count("start") == 1


def test_prune_keeps_young_request_records(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_jobs, "MAX_JOBS", 2)
    monkeypatch.setattr(agent_stream, "MAX_JOBS", 2)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))

    def finished(request_id: str | None, age: float = 0.0) -> str:
        job = agent_jobs.create_job(cfg, "stop", "win-1", "ssh", request_id)
        job.update(state="succeeded", created_epoch=time.time() - age)
        agent_state.write_json_atomic(
            agent_jobs.job_path(cfg, job["id"]), job, cfg.state_dir
        )
        return str(job["id"])

    old_request = finished("old-request-1", age=agent_jobs.REQUEST_KEEP_SECONDS + 60)
    young_request = finished("young-request-1")
    plain = finished(None)
    newest = [finished(None), finished(None)]
    left = sorted(p.stem for p in job_files(fake_tower))
    # The two newest, plus the young record Home Assistant may still ask for.
    assert left == sorted([young_request, *newest])
    assert old_request not in left
    assert plain not in left
    assert fake_tower.run("request", "young-request-1").reply["job"]["id"] == (
        young_request
    )
    reply = fake_tower.run("request", "old-request-1").reply
    assert reply["error"]["code"] == "unknown_request"


def test_records_without_request_id(fake_tower: FakeTower) -> None:
    """Records written by protocol 1 have no request_id: summarised as None."""
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "win-1", "ssh")
    del job["request_id"]
    agent_state.write_json_atomic(
        agent_jobs.job_path(cfg, job["id"]), job, cfg.state_dir
    )
    assert fake_tower.run("jobs").reply["jobs"][0]["request_id"] is None
    reply = fake_tower.run("request", "abcdefgh").reply
    assert reply["error"]["code"] == "unknown_request"
