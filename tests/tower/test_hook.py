"""The libvirt qemu hook: records the request, fires a detached stop, returns."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
import shlex
import subprocess

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    hook as agent_hook,
    install as agent_install,
)
from tests.tower import nodes
from tests.tower.conftest import FakeTower
from tests.tower.test_jobs import queue, write_systemd_run

WIN1_XML = nodes.domain_xml(
    "win-1", nodes.WIN1_DEVICES, running=True, test_driver_file=False
)


def hook_tower(tower: FakeTower) -> Path:
    """Configure a systemd-run stand-in that only records (runs nothing)."""
    tool = write_systemd_run(tower.directory, run_it=False)
    tower.configure(
        detach="systemd", commands={"virsh": str(tower.virsh), "systemd_run": str(tool)}
    )
    return tower.directory / "systemd-run.jsonl"


def test_prepare_begin_fires_stop_without_libvirt(fake_tower: FakeTower) -> None:
    calls = hook_tower(fake_tower)
    assert fake_tower.run("status").rc == 0  # writes the claims cache
    before = len(fake_tower.log())
    run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
    assert run.rc == 0
    assert run.lines == []
    assert run.stderr == ""
    assert len(fake_tower.log()) == before  # virsh never called from the hook
    requests = fake_tower.run("status").reply["hook_requests"]
    assert len(requests) == 1
    request = requests[0]
    assert request["domain"] == "win-1"
    assert request["addresses"] == ["0000:01:00.0", "0000:01:00.1"]
    job = fake_tower.run("job", request["job"]).reply["job"]
    assert job["kind"] == "stop"
    assert job["args"] == {"domain": "gpu-node"}
    assert job["requested_by"] == "hook"
    assert len(calls.read_text(encoding="utf-8").splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (["win-1", "start", "begin", "-"], WIN1_XML),
        (["win-1", "prepare", "end", "-"], WIN1_XML),
        (["gpu-node", "prepare", "begin", "-"], WIN1_XML),
        (["other", "prepare", "begin", "-"], WIN1_XML),
        (["win-1", "prepare", "begin", "-"], "<not xml"),
        (["win-1", "prepare", "begin", "-"], "<domain><name>win-1</name></domain>"),
        (["win-1"], ""),
    ],
)
def test_everything_else_is_silent(
    fake_tower: FakeTower, args: list[str], stdin: str
) -> None:
    hook_tower(fake_tower)
    fake_tower.run("status")
    run = fake_tower.run("hook", *args, stdin=stdin)
    assert (run.rc, run.lines, run.stderr) == (0, [], "")
    assert not (fake_tower.state_dir / "requests").exists()
    assert not (fake_tower.state_dir / "jobs").exists()


def test_no_claims_cache_no_action(fake_tower: FakeTower) -> None:
    hook_tower(fake_tower)
    run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
    assert run.rc == 0
    assert not (fake_tower.state_dir / "requests").exists()


def test_broken_config_still_exits_zero(tmp_path: Path) -> None:
    from tests.tower.conftest import run_agent

    run = run_agent(
        [
            "--config",
            str(tmp_path / "none.json"),
            "hook",
            "win-1",
            "prepare",
            "begin",
            "-",
        ]
    )
    assert run.rc == 0
    assert run.lines == []
    assert "cannot read" in run.stderr


def test_spawn_failure_is_recorded(fake_tower: FakeTower) -> None:
    fake_tower.run("status")
    fake_tower.configure(
        detach="systemd",
        commands={"virsh": str(fake_tower.virsh), "systemd_run": "/nonexistent"},
    )
    run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
    assert run.rc == 0
    request = fake_tower.run("status").reply["hook_requests"][0]
    assert request["job"] is None
    assert request["error"]["code"] == "spawn_failed"


def test_old_requests_pruned(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setattr(agent_hook, "MAX_HOOK_REQUESTS", 2)
    hook_tower(fake_tower)
    fake_tower.run("status")
    for _ in range(3):
        fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
    names = sorted(p.name for p in (fake_tower.state_dir / "requests").iterdir())
    assert len(names) == 2
    data = [
        json.loads((fake_tower.state_dir / "requests" / n).read_text()) for n in names
    ]
    assert all(d["domain"] == "win-1" for d in data)


def _job_at_step(tower: FakeTower, kind: str, target: str, step_name: str) -> Path:
    """A job of ours that has begun ``step_name`` of ``target`` (its runner
    writes that before it calls virsh); the path of its lock file."""
    job_id = queue(tower, kind, target)
    path = tower.state_dir / "jobs" / f"{job_id}.json"
    job = json.loads(path.read_text(encoding="utf-8"))
    index = next(
        i
        for i, step in enumerate(job["steps"])
        if step["name"] == step_name and step["domain"] == target
    )
    for step in job["steps"][:index]:
        step.update(started="t", finished="t", result="ok")
    job["steps"][index]["started"] = "t"
    job.update(state="running", step=index, started="t")
    path.write_text(json.dumps(job), encoding="utf-8")
    return path.with_suffix(".lock")


def test_the_agents_own_start_is_no_request(fake_tower: FakeTower) -> None:
    """libvirtd runs the qemu hook on every start, the agent's own `virsh
    start` inside a handoff job too (libvirt's hooks documentation; qemu
    driver: qemuProcessStartHook). That start is the job's: no request, no
    stop of the GPU node. Once the job's runner is gone, a start is a start
    by hand again."""
    calls = hook_tower(fake_tower)
    fake_tower.run("status")
    lock = _job_at_step(fake_tower, "handoff", "win-1", "start")
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # the runner lives
        run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
        assert (run.rc, run.lines, run.stderr) == (0, [], "")
        assert fake_tower.run("status").reply["hook_requests"] == []
        assert not calls.exists()
    # The runner died: its record says failed, and a start now is by hand.
    run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
    assert run.rc == 0
    assert [r["domain"] for r in fake_tower.run("status").reply["hook_requests"]] == [
        "win-1"
    ]


@pytest.mark.parametrize(
    ("kind", "target", "step"),
    [
        ("start", "win-2", "start"),  # another domain's start
        ("handoff", "win-1", "wait_devices_free"),  # not starting it yet
    ],
)
def test_a_start_by_hand_beside_a_job_is_a_request(
    fake_tower: FakeTower, kind: str, target: str, step: str
) -> None:
    hook_tower(fake_tower)
    fake_tower.run("status")
    lock = _job_at_step(fake_tower, kind, target, step)
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        run = fake_tower.run("hook", "win-1", "prepare", "begin", "-", stdin=WIN1_XML)
        assert run.rc == 0
        requests = fake_tower.run("status").reply["hook_requests"]
    assert [r["domain"] for r in requests] == ["win-1"]


# Every (operation, sub-operation) libvirt runs the qemu hook with (libvirt's
# docs/hooks.rst, "Calling convention", and src/util/virhook.h).
LIBVIRT_QEMU_HOOK_CALLS = [
    ("prepare", "begin"),
    ("start", "begin"),
    ("started", "begin"),
    ("stopped", "end"),
    ("release", "end"),
    ("migrate", "begin"),
    ("restore", "begin"),
    ("reconnect", "begin"),
    ("attach", "begin"),
]


@pytest.mark.parametrize(("operation", "subop"), LIBVIRT_QEMU_HOOK_CALLS)
def test_the_hook_script_starts_the_agent_only_for_prepare_begin(
    tmp_path: Path, operation: str, subop: str
) -> None:
    """The script install writes, run as libvirtd runs it (the domain XML on
    stdin, LC_ALL=C and no PATH of ours): the four other steps of a start and
    stop, and the rest, are answered by the shell alone, in silence, with 0
    (libvirt fails a start whose hook fails); prepare begin runs the agent
    with libvirt's arguments as they are."""
    calls = tmp_path / "calls"
    program = tmp_path / "gpu handoff's program"
    program.write_text(
        f'#!/bin/sh\nprintf "%s|" "$@" >> {shlex.quote(str(calls))}\ncat > /dev/null\n',
        encoding="utf-8",
    )
    program.chmod(0o755)
    script = tmp_path / "qemu-hook"
    script.write_text(agent_install.hook_script(str(program), "/etc/gh/config.json"))
    script.chmod(0o755)
    run = subprocess.run(
        [str(script), "win-1", operation, subop, "-"],
        input=WIN1_XML,
        capture_output=True,
        text=True,
        env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"},
        check=False,
        timeout=10,
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    called = calls.read_text(encoding="utf-8") if calls.exists() else None
    if (operation, subop) == ("prepare", "begin"):
        assert called == "--config|/etc/gh/config.json|hook|win-1|prepare|begin|-|"
    else:
        assert called is None
