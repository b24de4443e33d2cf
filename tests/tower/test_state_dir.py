"""The state directory's rules, in this process (the agent's own user owns it).

tests/tower/test_trust.py attacks them with the real privilege split; here
each rule on its own: ownership and modes checked, links and other strangers
refused, only the agent's own names written and removed, errors logged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import stat
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    state as agent_state,
    wire,
)
from tests.tower.conftest import FakeTower


def made(tower: FakeTower) -> Path:
    """The state directory, as the agent makes it."""
    assert tower.run("jobs").rc == 0
    tower.run("status")
    return tower.state_dir


def test_made_for_its_user_alone(fake_tower: FakeTower) -> None:
    state = made(fake_tower)
    job_id = fake_tower.run("stop", "win-1").reply["job"]["id"]
    fake_tower.wait_job(job_id)
    for path in [state, *state.rglob("*")]:
        st = path.lstat()
        assert st.st_uid == os.geteuid()
        expected = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        assert stat.S_IMODE(st.st_mode) == expected, path


@pytest.mark.parametrize("sub", ["", "jobs"])
def test_writable_by_others_is_refused(fake_tower: FakeTower, sub: str) -> None:
    state = made(fake_tower)
    (state / sub).mkdir(exist_ok=True)
    (state / sub).chmod(0o757)
    for verb in (["status"], ["jobs"], ["stop", "win-1"], ["session"]):
        run = fake_tower.run(*verb)
        assert run.reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE, verb
        assert f"{state / sub}".rstrip("/") in run.reply["error"]["message"]
        assert "chmod go-w" in run.reply["error"]["message"]


def test_a_link_or_a_stranger_where_the_agent_expects_its_own(
    fake_tower: FakeTower, tmp_path: Path
) -> None:
    state = made(fake_tower)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (state / "jobs").symlink_to(elsewhere)
    run = fake_tower.run("jobs")
    assert run.reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE
    assert "symbolic link" in run.reply["error"]["message"]
    (state / "jobs").unlink()
    (state / "jobs").write_text("a file", encoding="utf-8")
    assert fake_tower.run("jobs").reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE
    (state / "jobs").unlink()
    # A FIFO as a runner's log: refused, and nothing blocks on it.
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "win-1", "cli")
    os.mkfifo(state / "jobs" / f"{job['id']}.log")
    with pytest.raises(wire.AgentError) as refused:
        agent_jobs.spawn_runner(cfg, job)
    assert refused.value.code == wire.ERR_STATE_DIR_UNSAFE
    assert "not a regular file" in refused.value.message
    # The state directory itself not a directory.
    cfg.state_dir = str(state / "claims.json")
    with pytest.raises(wire.AgentError) as refused:
        agent_jobs.list_job_ids(cfg)
    assert refused.value.code == wire.ERR_STATE_DIR_UNSAFE


def test_a_runner_whose_tower_lock_is_a_link_fails_its_job(
    fake_tower: FakeTower, tmp_path: Path
) -> None:
    state = made(fake_tower)
    (state / "tower.lock").symlink_to(tmp_path / "elsewhere.lock")
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job_id = agent_jobs.create_job(cfg, "stop", "win-1", "cli")["id"]
    calls = len(fake_tower.log())
    assert fake_tower.run("run-job", job_id).rc == 1
    job = fake_tower.run("job", job_id).reply["job"]
    assert job["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE
    assert not (tmp_path / "elsewhere.lock").exists()
    assert len(fake_tower.log()) == calls  # nothing ran


def test_records_too_large_or_broken_are_no_records(fake_tower: FakeTower) -> None:
    state = made(fake_tower)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "win-1", "cli")
    path = state / "jobs" / f"{job['id']}.json"
    path.write_text(json.dumps({**job, "pad": "x" * agent_state.MAX_STATE_FILE}))
    assert fake_tower.run("job", job["id"]).reply["error"]["code"] == "unknown_job"
    job["args"] = {"domain": 7}
    path.write_text(json.dumps(job))
    assert fake_tower.run("run-job", job["id"]).rc == 1
    assert fake_tower.run("job", job["id"]).reply["job"]["error"]["code"] == (
        "bad_request"
    )
    with pytest.raises(wire.AgentError):
        agent_state.write_json_atomic("/etc/passwd", {}, cfg.state_dir)


def test_aliases_kept_young_and_sane(fake_tower: FakeTower) -> None:
    state = made(fake_tower)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job_id = agent_jobs.create_job(cfg, "stop", "win-1", "cli")["id"]
    now = time.time()
    aliases: dict[str, Any] = {
        "young-request": {"job": job_id, "time": now},
        "old-request": {
            "job": job_id,
            "time": now - agent_jobs.REQUEST_KEEP_SECONDS - 1,
        },
        "no-time-here": {"job": job_id, "time": "soon"},
        "not-an-entry": 5,
        "gone-request": {"job": "20990101-000000-000000-abcdef", "time": now},
    }
    (state / "aliases.json").write_text(json.dumps(aliases))
    assert agent_jobs.read_aliases(cfg) == {
        "young-request": job_id,
        "gone-request": "20990101-000000-000000-abcdef",
    }
    assert agent_jobs.find_request(cfg, "young-request") == job_id
    assert agent_jobs.find_request(cfg, "gone-request") is None
    assert agent_jobs.find_request(cfg, "old-request") is None
    agent_jobs.add_alias(cfg, "new-request", job_id)
    kept = json.loads((state / "aliases.json").read_text())
    assert set(kept) == {"young-request", "gone-request", "new-request"}


def test_root_becomes_the_owner_before_it_touches_the_directory(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which user root becomes (the becoming itself runs in processes of their
    own: tests/tower/test_trust.py)."""
    became: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        agent_state, "drop_privileges", lambda uid, gid, env: became.append((uid, gid))
    )
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    agent_state.act_as_state_owner(cfg)  # missing: nothing to become
    fake_tower.state_dir.mkdir(mode=0o700)
    agent_state.act_as_state_owner(cfg)  # root's own
    os.chown(fake_tower.state_dir, 4321, 8765)
    agent_state.act_as_state_owner(cfg)
    assert became == [(4321, 8765)]


def test_internal_errors_go_to_the_log_else_syslog(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = made(fake_tower)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    monkeypatch.setattr(agent_state, "AGENT_LOG_MAX", 10)
    first = agent_state.log_internal(cfg, "here", RuntimeError("one"))
    second = agent_state.log_internal(cfg, "there", RuntimeError("two"))
    assert f"internal error {first} in here" in (state / "agent.log.1").read_text()
    assert f"internal error {second} in there" in (state / "agent.log").read_text()
    assert stat.S_IMODE((state / "agent.log").stat().st_mode) == 0o600
    lines: list[str] = []

    class Syslog:
        LOG_PID = LOG_USER = LOG_ERR = 0

        @staticmethod
        def openlog(*args: object) -> None:
            pass

        @staticmethod
        def syslog(priority: int, line: str) -> None:
            lines.append(line)

    monkeypatch.setitem(sys.modules, "syslog", Syslog)
    third = agent_state.log_internal(None, "nowhere", RuntimeError("three"))
    assert f"internal error {third} in nowhere:" in lines[0]
    assert any("RuntimeError: three" in line for line in lines)
    monkeypatch.setattr(agent_state, "AGENT_LOG_MAX", 1 << 20)
    (state / "agent.log").unlink()
    (state / "agent.log").symlink_to(state / "elsewhere")
    agent_state.log_internal(cfg, "linked", RuntimeError("four"))
    assert not (state / "elsewhere").exists()
    assert any("RuntimeError: four" in line for line in lines)
