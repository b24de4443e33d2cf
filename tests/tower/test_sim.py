"""Jobs end to end against the tower simulator (tests/towersim): detached
runners through its systemd-run, graceful stops through its guest agent."""

from __future__ import annotations

from collections.abc import Iterator
import json
from pathlib import Path
import time
from typing import Any

import pytest

from tests.tower.conftest import Run, run_agent, write_config
from tests.towersim import Tower, realistic_tower

# Simulated durations x 0.01: guest agent up 0.3 s after boot, shutdown 0.1 s.
FAST = 0.01


class SimAgent:
    """The agent configured for one simulated tower."""

    def __init__(self, tower: Tower, directory: Path) -> None:
        self.tower = tower
        self.config = write_config(
            directory / "config.json",
            libvirt_uri=tower.uri,
            gpu_node="gpu-node",
            gaming=["gaming-1", "gaming-2"],
            state_dir=str(directory / "agent-state"),
            commands={"virsh": str(tower.virsh), "systemd_run": str(tower.systemd_run)},
            detach="systemd",
            timeouts={"agent": 30, "shutdown": 30, "start": 30},
            poll_interval=0.02,
        )

    def run(self, *argv: str) -> Run:
        return run_agent(["--config", str(self.config), *argv])

    def submit(self, *argv: str) -> str:
        run = self.run(*argv)
        assert run.rc == 0, run.lines
        return str(run.reply["job"]["id"])

    def wait(self, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job: dict[str, Any] = self.run("job", job_id).reply["job"]
            if job["state"] in ("succeeded", "failed"):
                return job
            assert time.monotonic() < deadline, job
            time.sleep(0.05)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimAgent]:
    tower = realistic_tower(tmp_path / "tower", time_scale=FAST)
    yield SimAgent(tower, tmp_path)
    tower.close()
    assert tower.destroy_attempts() == []


def test_status_through_simulator(sim: SimAgent) -> None:
    reply = sim.run("status").reply
    assert reply["virsh_calls"] == 1
    gpu = reply["domains"][0]
    assert (gpu["state"], gpu["agent_ready"]) == ("running", True)
    held = {c["address"]: c["held_by"] for c in reply["cards"]}
    assert set(held.values()) == {"gpu-node"}
    assert len(held) == 6


def test_handoff_then_release(sim: SimAgent) -> None:
    job = sim.wait(sim.submit("handoff", "gaming-1"))
    assert job["state"] == "succeeded", job
    assert not sim.tower.is_running("gpu-node")
    assert sim.tower.is_running("gaming-1")
    assert sim.tower.holder("0000:03:00.0") == "gaming-1"
    # The player's VM boots; its agent needs a moment: release waits for it.
    job = sim.wait(sim.submit("release", "gaming-1"))
    assert job["state"] == "succeeded", job
    assert sim.tower.is_running("gpu-node")
    assert not sim.tower.is_running("gaming-1")
    modes = [c.commands for c in sim.tower.calls("shutdown")]
    assert all(cmd[0][:3] == ["shutdown", "--mode", "agent"] for cmd in modes if cmd)
    units = sim.tower.units()
    assert len(units) == 2
    assert all(u.collect and u.name.startswith("gpu-handoff-job-") for u in units)
    # Collected once their runner exits (it exits right after the last write).
    sim.tower.wait_until(
        lambda: sim.tower.loaded_units() == [], timeout=30, what="units collected"
    )
    assert [u.exit_code for u in sim.tower.unit_runs()] == [0, 0]


def test_stop_right_after_start_waits_for_agent(sim: SimAgent) -> None:
    """A stop sent before the agent is up would fail at once: it waits."""
    job = sim.wait(sim.submit("handoff", "gaming-2"))
    assert job["state"] == "succeeded"
    before = len(sim.tower.commands())
    job = sim.wait(sim.submit("stop", "gaming-2"))
    assert job["state"] == "succeeded", job
    later = sim.tower.commands()[before:]
    shutdowns = [c for c in later if c.has("shutdown")]
    assert len(shutdowns) == 1
    assert shutdowns[0].rc == 0  # accepted the first time: no early refusal


def test_agent_never_up_fails_without_stop(sim: SimAgent) -> None:
    assert sim.wait(sim.submit("handoff", "gaming-1"))["state"] == "succeeded"
    assert sim.wait(sim.submit("release", "gaming-1"))["state"] == "succeeded"
    sim.tower.set_agent_delay("gaming-1", None)
    assert sim.wait(sim.submit("handoff", "gaming-1"))["state"] == "succeeded"
    # gaming-1 booted with a guest agent that never comes up.
    data = json.loads(sim.config.read_text(encoding="utf-8"))
    data["timeouts"]["agent"] = 0.5
    sim.config.write_text(json.dumps(data), encoding="utf-8")
    before = len(sim.tower.calls("shutdown", "gaming-1"))
    job = sim.wait(sim.submit("stop", "gaming-1"))
    assert job["state"] == "failed"
    assert job["error"]["code"] == "agent_timeout"
    assert sim.tower.is_running("gaming-1")
    assert len(sim.tower.calls("shutdown", "gaming-1")) == before


def test_two_handoffs_at_once(sim: SimAgent) -> None:
    first = sim.submit("handoff", "gaming-1")
    second = sim.submit("handoff", "gaming-1")
    jobs = [sim.wait(first), sim.wait(second)]
    assert [j["state"] for j in jobs] == ["succeeded", "succeeded"]
    assert len(sim.tower.calls("shutdown", "gpu-node")) == 1
    assert len(sim.tower.calls("start", "gaming-1")) == 1
