"""`serve`: the forced command behind Home Assistant's SSH key."""

from __future__ import annotations

import pytest

from tests.tower.conftest import FakeTower


def serve(tower: FakeTower, command: str | None) -> tuple[int, dict[str, object]]:
    env = {} if command is None else {"SSH_ORIGINAL_COMMAND": command}
    run = tower.run("serve", env=env)
    return run.rc, run.reply


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (None, "bad_request"),
        ("", "bad_request"),
        ("   ", "bad_request"),
        ("status; id", "not_allowed"),
        ("status && id", "bad_request"),
        ("status | id", "bad_request"),
        ("$(id)", "not_allowed"),
        ("stop ../x", "unknown_domain"),
        ("stop nope", "unknown_domain"),
        ("stop", "bad_request"),
        ("stop gpu-node win-1", "bad_request"),
        ("screenshot /etc/passwd", "unknown_domain"),
        ("handoff gpu-node", "unknown_domain"),
        ("release gpu-node", "unknown_domain"),
        ("job ../../etc/passwd", "bad_request"),
        ("job 20990101-000000-000000-abcdef", "unknown_job"),
        ("status " + "x" * 600, "bad_request"),
        ("status 'unterminated", "bad_request"),
        ("status\nid", "bad_request"),
        ("run-job x", "not_allowed"),
        ("install --user root --gpu-node a --gaming b", "not_allowed"),
        ("hook win-1 prepare begin -", "not_allowed"),
        ("check-config", "not_allowed"),
        ("serve", "not_allowed"),
        ("--config /tmp/x status", "not_allowed"),
    ],
)
def test_rejected_without_side_effect(
    fake_tower: FakeTower, command: str | None, code: str
) -> None:
    rc, reply = serve(fake_tower, command)
    assert rc != 0
    assert reply["ok"] is False
    assert reply["error"]["code"] == code  # type: ignore[index]
    assert fake_tower.log() == []
    assert not (fake_tower.state_dir / "jobs").exists()


def test_allowed_verbs(fake_tower: FakeTower) -> None:
    rc, reply = serve(fake_tower, "version")
    assert rc == 0
    assert reply["version"]
    rc, reply = serve(fake_tower, "status")
    assert rc == 0
    assert reply["gpu_node"] == "gpu-node"
    rc, reply = serve(fake_tower, "stop 'win-1'")
    assert rc == 0
    job_id = reply["job"]["id"]  # type: ignore[index]
    fake_tower.wait_job(job_id)
    rc, reply = serve(fake_tower, f"job {job_id}")
    assert reply["job"]["requested_by"] == "ssh"  # type: ignore[index]
    rc, reply = serve(fake_tower, "jobs")
    assert rc == 0
    assert reply["jobs"][0]["id"] == job_id  # type: ignore[index]


def test_cli_checks_domains_too(fake_tower: FakeTower) -> None:
    run = fake_tower.run("stop", "nope")
    assert run.reply["error"]["code"] == "unknown_domain"
    run = fake_tower.run("handoff", "gpu-node")
    assert run.reply["error"]["code"] == "unknown_domain"
    assert fake_tower.log() == []
