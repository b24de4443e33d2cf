"""The agent's jobs and session against the tower simulator's state model,
in this process (so coverage is measured): a paused or crashed domain fails
a stop at once, one ``in shutdown`` is waited for, a start that finds the VFIO
group still busy is tried again, and a session whose libvirt restarts says so
once and sees it back at once (tests/towersim/test_libvirt_states.py pins the
simulator's behaviour against libvirt's sources)."""

from __future__ import annotations

import io
import os
from pathlib import Path
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    runner as agent_runner,
    session as agent_session,
    virsh as agent_virsh,
    wire,
)
from tests.support.simtower import write_agent_config
from tests.towersim import Tower, realistic_tower

SCALE = 0.01


@pytest.fixture
def sim(tmp_path: Path) -> Tower:
    tower = realistic_tower(tmp_path / "sim", time_scale=SCALE)
    yield tower  # type: ignore[misc]
    tower.close()


@pytest.fixture
def cfg(sim: Tower, tmp_path: Path) -> agent_config.Config:
    path = write_agent_config(sim, tmp_path / "agent", agent=2.0, shutdown=5.0)
    return agent_config.load_config(str(path), dict(os.environ))


def runner(cfg: agent_config.Config, kind: str, target: str) -> agent_runner.JobRunner:
    job = agent_jobs.create_job(cfg, kind, target, "cli")
    return agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))


@pytest.mark.parametrize(
    ("hold", "state", "why"),
    [
        ("pause", "paused", "until it is resumed"),
        ("crash", "crashed", "kept for inspection"),
    ],
)
def test_a_held_domain_fails_the_stop_at_once(
    sim: Tower, cfg: agent_config.Config, hold: str, state: str, why: str
) -> None:
    if hold == "pause":
        sim.pause("gpu-node")
    else:
        sim.crash("gpu-node", preserve=True)
    job = runner(cfg, "stop", "gpu-node")
    began = time.monotonic()
    with pytest.raises(wire.AgentError) as err:
        job.run()
    assert time.monotonic() - began < cfg.timeout_agent  # no wait for the agent
    assert err.value.code == wire.ERR_SHUTDOWN_REFUSED
    assert f"'gpu-node' is {state}: " in err.value.message
    assert why in err.value.message
    step = job.job["steps"][0]
    assert (step["name"], step["result"]) == ("wait_agent", "failed")
    assert sim.calls("shutdown", "gpu-node") == []
    assert sim.is_running("gpu-node")


def test_a_domain_paused_between_ping_and_shutdown(
    sim: Tower, cfg: agent_config.Config
) -> None:
    """Its guest agent answered; then it was paused: the refused shutdown is
    followed by a look at its state, which says why."""
    job = runner(cfg, "stop", "gpu-node")
    job.step_wait_agent(0, job.job["steps"][0])
    sim.pause("gpu-node")
    with pytest.raises(wire.AgentError) as err:
        job.step_shutdown(1, job.job["steps"][1])
    assert "'gpu-node' is paused" in err.value.message
    assert [c.rc for c in sim.calls("shutdown", "gpu-node")] == [1]


def test_a_domain_in_shutdown_is_waited_for(
    sim: Tower, cfg: agent_config.Config
) -> None:
    """The GPU node powered itself off and libvirt is ending it: no ping, the
    refused shutdown ("domain is not running") counts, it is shut off."""
    sim.set_shutdown_duration("gpu-node", 100.0)  # in shutdown for its last 0.005 s
    sim.guest_shutdown("gpu-node")
    sim.wait_until(
        lambda: sim.domstate("gpu-node").startswith(("in shutdown", "shut off")),
        timeout=10,
        what="in shutdown",
    )
    job = runner(cfg, "stop", "gpu-node")
    job.run()
    assert not sim.is_running("gpu-node")
    assert [s["result"] for s in job.job["steps"]][-1] in ("ok", "skipped")


def test_in_shutdown_is_seen_by_the_shutdown_step(
    sim: Tower, cfg: agent_config.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal that is not one of the agent's, on a domain ``in shutdown``:
    it is going down, so the step waits for shut off."""
    job = runner(cfg, "stop", "gpu-node")
    states = iter(["in_shutdown", "shut_off"])
    monkeypatch.setattr(job, "state_of", lambda domain: next(states))
    refused = agent_virsh.VirshResult(
        1, "", "error: Requested operation is not valid: domain is not running\n"
    )
    monkeypatch.setattr(job.virsh, "run", lambda args, timeout=0: refused)
    job.step_shutdown(1, job.job["steps"][1])
    assert job.job["steps"][1]["result"] == "ok"
    assert "shut off after the shutdown was refused" in job.job["steps"][1]["detail"]


def gpu_node_off(sim: Tower) -> None:
    sim.guest_shutdown("gpu-node")
    sim.wait_until(lambda: not sim.is_running("gpu-node"), timeout=10, what="off")


def test_a_start_on_a_busy_vfio_group_is_tried_again(
    sim: Tower, cfg: agent_config.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_runner, "START_BUSY_RETRIES", (0.05, 0.05))
    gpu_node_off(sim)
    sim.fail_next_start("gaming-2", "vfio")
    job = runner(cfg, "start", "gaming-2")
    job.step_start(1, job.job["steps"][1])
    assert [c.rc for c in sim.calls("start", "gaming-2")] == [1, 0]
    assert sim.is_running("gaming-2")


def test_a_start_busy_every_time_fails_after_the_retries(
    sim: Tower, cfg: agent_config.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_runner, "START_BUSY_RETRIES", (0.05, 0.05))
    gpu_node_off(sim)
    sim.fail_next_start("gaming-2", "vfio", every=True)
    job = runner(cfg, "start", "gaming-2")
    with pytest.raises(wire.AgentError) as err:
        job.step_start(1, job.job["steps"][1])
    assert err.value.code == wire.ERR_START_FAILED
    assert "Device or resource busy" in err.value.message
    assert len(sim.calls("start", "gaming-2")) == 3


def test_a_start_failing_otherwise_is_not_tried_again(
    sim: Tower, cfg: agent_config.Config
) -> None:
    gpu_node_off(sim)
    sim.fail_next_start("gaming-2", "disk")
    job = runner(cfg, "start", "gaming-2")
    with pytest.raises(wire.AgentError):
        job.step_start(1, job.job["steps"][1])
    assert len(sim.calls("start", "gaming-2")) == 1


# --- the session while libvirtd restarts -------------------------------------------


class Pushes(io.StringIO):
    """A session's stdout: every message it wrote."""

    def messages(self) -> list[dict[str, Any]]:
        import json

        return [json.loads(line) for line in self.getvalue().splitlines() if line]


def test_session_says_once_and_sees_libvirt_back_at_once(
    sim: Tower, cfg: agent_config.Config
) -> None:
    out = Pushes()
    session = agent_session.Session(cfg, io.StringIO(), out, "test")
    session.jobs.scan()
    assert session.start_events() is None
    session.recompute(force=True, drain=False)
    deadline = time.monotonic() + 10

    def step_until(what: Any) -> None:
        while not what():
            assert time.monotonic() < deadline, out.messages()
            session.step()

    def status_after_the_errors() -> bool:
        types = [m["type"] for m in out.messages()]
        errors = [i for i, kind in enumerate(types) if kind == "error"]
        return bool(errors) and "status" in types[errors[-1] + 1 :]

    time.sleep(0.3)  # the event stream connects
    back = time.monotonic() + 1.0  # when libvirtd answers again
    sim.restart_libvirtd(100.0)  # 1 s here
    step_until(lambda: any(m["type"] == "error" for m in out.messages()))
    # A status comes after the errors, within moments of libvirtd's return
    # (whether the session's next look falls before or after a given
    # instant is the machine's load, not the product: not asserted).
    step_until(status_after_the_errors)
    assert time.monotonic() - back < 2.0
    errors = [m for m in out.messages() if m["type"] == "error"]
    assert [(e["source"], e["error"]["code"]) for e in errors] == [
        ("events", wire.ERR_LIBVIRT_UNREACHABLE),
        ("status", wire.ERR_LIBVIRT_UNREACHABLE),
    ]
    # "Disconnected from ... due to end of file" when the stream had
    # connected before the restart, else "failed to connect"
    assert errors[0]["error"]["message"].startswith(("Disconnected", "failed"))
    # and the event stream is back (its reconnection is the session's next
    # step after libvirtd answers: within the deadline, whatever the load)
    step_until(lambda: session.events is not None)
    # and once it has stayed up, the outage is over (a later loss is news)
    step_until(lambda: session.events_failure is None)
    assert session.events is not None
    session.stop_events()


def test_a_job_waits_for_libvirt_to_come_back(
    sim: Tower, cfg: agent_config.Config
) -> None:
    """libvirtd restarts (no socket activation: its socket is gone) as a stop
    job begins: the job's calls are tried again until it answers, and the
    stop succeeds; a call that may not wait fails at once."""
    sim.restart_libvirtd(100.0)  # 1 s here
    with pytest.raises(wire.AgentError) as err:
        agent_virsh.Virsh(cfg).run(agent_virsh.cmd_domstate("gpu-node"))
    assert err.value.code == wire.ERR_LIBVIRT_UNREACHABLE
    job = agent_jobs.create_job(cfg, "stop", "gpu-node", "cli")
    agent_runner.JobRunner(
        cfg, job, agent_virsh.Virsh(cfg, unreachable_wait=10.0)
    ).run()
    assert [s["result"] for s in job["steps"]] == ["ok", "ok", "ok"]
    assert not sim.is_running("gpu-node")


def test_the_runner_waits_for_libvirt(
    sim: Tower, cfg: agent_config.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_job gives its runner's virsh the wait (JOB_LIBVIRT_WAIT)."""
    monkeypatch.setattr(agent_runner, "JOB_LIBVIRT_WAIT", 10.0)
    job = agent_jobs.create_job(cfg, "stop", "gpu-node", "cli")
    sim.restart_libvirtd(100.0)  # 1 s here
    assert agent_runner.run_job(cfg, job["id"]) == 0
    assert agent_jobs.load_job(cfg, job["id"])["state"] == "succeeded"
