"""`status` against real virsh and libvirt's test driver (test:///node.xml)."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import fcntl
import io
import json
import os
from pathlib import Path

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    observe as agent_observe,
    session as agent_session,
    state as agent_state,
    status as agent_status,
    virsh as agent_virsh,
    wire,
)
from tests.tower import nodes
from tests.tower.conftest import FakeTower, require_tool, run_agent, write_config


def status(tmp_path: Path, node: Path) -> dict[str, object]:
    require_tool("virsh")
    config = write_config(
        tmp_path / "c.json",
        libvirt_uri=f"test://{node}",
        gpu_node="gpu-node",
        gaming=["win-1", "win-2", "win-3"],
        state_dir=str(tmp_path / "state"),
        sysfs=str(tmp_path / "sys"),  # no IOMMU groups
    )
    run = run_agent(["--config", str(config), "status"])
    assert run.rc == 0, run.lines
    return run.reply


def test_status_domains_cards_findings(tmp_path: Path) -> None:
    node = nodes.write_node_file(tmp_path / "node.xml", other=True)
    reply = status(tmp_path, node)
    domains = {d["name"]: d for d in reply["domains"]}  # type: ignore[attr-defined]
    gpu = domains["gpu-node"]
    assert gpu["role"] == "gpu_node"
    assert (gpu["state"], gpu["reason"]) == ("running", "unknown")
    assert gpu["agent_channel"] is True
    assert gpu["agent_ready"] is False  # the test driver has no guest agent
    assert [h["address"] for h in gpu["hostdevs"]] == [
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:02:00.1",
    ]
    assert domains["win-1"]["state"] == "shut_off"
    assert domains["win-1"]["agent_ready"] is None
    assert domains["win-3"]["exists"] is False
    cards = {c["address"]: c for c in reply["cards"]}  # type: ignore[attr-defined]
    assert cards["0000:01:00.0"] == {
        "address": "0000:01:00.0",
        "held_by": "gpu-node",
        "claimed_by": ["gpu-node", "win-1"],
        "iommu_group": None,
    }
    assert cards["0000:02:00.0"]["claimed_by"] == ["gpu-node", "other-vm", "win-2"]
    findings = {(f["code"], f["domain"]) for f in reply["findings"]}  # type: ignore[attr-defined]
    assert findings == {
        ("rom_bar_not_off", "gpu-node"),
        ("no_agent_channel", "win-2"),
        ("claimed_by_unmanaged", "other-vm"),
        ("domain_missing", "win-3"),
    }
    # Two virsh processes: managed domains (+ pings), then the unmanaged one.
    assert reply["virsh_calls"] == 2
    cache = json.loads((tmp_path / "state" / "claims.json").read_text(encoding="utf-8"))
    assert cache["gpu_node"] == "gpu-node"
    assert "0000:02:00.1" in cache["addresses"]


def test_status_gaming_holds_card(tmp_path: Path) -> None:
    node = nodes.write_node_file(tmp_path / "node.xml", running=("win-1",))
    reply = status(tmp_path, node)
    cards = {c["address"]: c for c in reply["cards"]}  # type: ignore[attr-defined]
    assert cards["0000:01:00.0"]["held_by"] == "win-1"
    assert cards["0000:02:00.0"]["held_by"] is None
    assert reply["virsh_calls"] == 1


def test_status_libvirt_unreachable(tmp_path: Path) -> None:
    require_tool("virsh")
    config = write_config(
        tmp_path / "c.json",
        libvirt_uri=f"test+unix:///default?socket={tmp_path}/none",
        gpu_node="gpu-node",
        gaming=["win-1"],
        state_dir=str(tmp_path / "state"),
    )
    run = run_agent(["--config", str(config), "status"])
    assert run.rc == 1
    assert run.reply["error"]["code"] == "libvirt_unreachable"


def test_status_unreachable_fake(fake_tower: FakeTower) -> None:
    state = fake_tower.load()
    state["unreachable"] = True
    fake_tower.save(state)
    assert fake_tower.run("status").reply["error"]["code"] == "libvirt_unreachable"


def test_status_agent_ready_and_jobs(fake_tower: FakeTower) -> None:
    run = fake_tower.run("status")
    gpu = run.reply["domains"][0]
    assert gpu["agent_ready"] is True
    assert run.reply["active_jobs"] == []
    assert run.reply["hook_requests"] == []


def test_screenshot_real(tmp_path: Path, node_file: Path) -> None:
    require_tool("virsh")
    config = write_config(
        tmp_path / "c.json",
        libvirt_uri=f"test://{node_file}",
        gpu_node="gpu-node",
        gaming=["win-1"],
        state_dir=str(tmp_path / "state"),
    )
    run = run_agent(["--config", str(config), "screenshot", "gpu-node"])
    assert run.rc == 0
    assert run.reply["mime"] == "image/png"
    import base64

    assert base64.b64decode(run.reply["data"]).startswith(b"\x89PNG")


def test_screenshot_limits_and_cleanup(
    fake_tower: FakeTower, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    fake_tower.configure(screenshot_max_bytes=3)
    run = fake_tower.run("screenshot", "win-1")
    assert run.reply["error"]["code"] == "too_large"
    assert list(tmp.iterdir()) == []
    fake_tower.configure(screenshot_max_bytes=4)
    run = fake_tower.run("screenshot", "win-1")
    assert run.reply["size"] == 4
    assert list(tmp.iterdir()) == []
    state = fake_tower.load()
    del state["domains"]["win-2"]
    fake_tower.save(state)
    run = fake_tower.run("screenshot", "win-2")
    assert run.reply["error"]["code"] == "screenshot_failed"
    assert list(tmp.iterdir()) == []


# --- the status never waits on a guest agent that a stop holds ------------------


@contextlib.contextmanager
def _running_shutdown_job(tower: FakeTower, domain: str) -> Iterator[None]:
    """A job record of ours at its `shutdown` step of `domain`, its runner alive
    (the test holds the job's lock as a runner does)."""
    cfg = agent_config.load_config(str(tower.config), {})
    job = agent_jobs.create_job(cfg, "stop", domain, "cli")
    job.update(state="running", step=1)
    job["steps"][0].update(result="ok")
    agent_state.write_json_atomic(
        agent_jobs.job_path(cfg, job["id"]), job, cfg.state_dir
    )
    lock = Path(agent_jobs.jobs_dir(cfg)) / f"{job['id']}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def test_status_does_not_ping_a_domain_our_job_shuts_down(
    fake_tower: FakeTower,
) -> None:
    """libvirt's `shutdown --mode agent` holds the domain's agent job until
    the guest is off (up to 60 s); a ping would wait for it (up to 30 s,
    whatever its --timeout): that domain is not pinged, its agent_ready is
    None (unknown), the others are pinged as ever."""
    fake_tower.set_domain("win-1", state="running", reason="booted")
    with _running_shutdown_job(fake_tower, "gpu-node"):
        reply = fake_tower.run("status").reply
    domains = {d["name"]: d for d in reply["domains"]}
    assert domains["gpu-node"]["state"] == "running"
    assert domains["gpu-node"]["agent_ready"] is None
    assert domains["win-1"]["agent_ready"] is True
    assert [j["step"] for j in reply["active_jobs"]] == ["shutdown"]
    pings = [
        part
        for a in fake_tower.log()
        if len(a) == 3
        for part in a[2].split(" ; ")
        if part.startswith("qemu-agent-command")
    ]
    assert len(pings) == 2
    assert not [p for p in pings if "'gpu-node'" in p]


def test_a_session_status_asked_for_sees_a_shutdown_begun_since(
    fake_tower: FakeTower,
) -> None:
    """A session answers a status from its kept body while nothing changed;
    a job that began shutting the GPU node down since (libvirt now holds its
    guest agent) is a change, even before the session's own scan saw it: the
    answer is computed again, the GPU node not pinged (agent_ready None)."""
    fake_tower.configure(session_refresh=60)
    cfg = agent_config.load_config(str(fake_tower.config), {})
    session = agent_session.Session(cfg, io.StringIO(), io.StringIO(), "test")
    session.jobs.scan()
    session.recompute(force=True, drain=False)
    assert session.status_reply()["domains"][0]["agent_ready"] is True
    with _running_shutdown_job(fake_tower, "gpu-node"):
        reply = session.status_reply()
    gpu = next(d for d in reply["domains"] if d["name"] == "gpu-node")
    assert (gpu["state"], gpu["agent_ready"]) == ("running", None)
    assert [j["step"] for j in reply["active_jobs"]] == ["shutdown"]


def test_shutting_down_reads_only_a_running_shutdown_step() -> None:
    steps = [{"name": n, "domain": "g", "result": None} for n in wire.STOP_STEPS]
    job = {"state": "running", "step": 1, "steps": steps}
    assert agent_status.shutting_down(job) == ["g"]
    assert agent_status.shutting_down({**job, "step": 2}) == []
    assert agent_status.shutting_down({**job, "state": "queued"}) == []
    assert agent_status.shutting_down({**job, "step": 7}) == []
    assert agent_status.shutting_down({**job, "step": None}) == []
    assert agent_status.shutting_down({**job, "steps": None}) == []


def test_a_status_whose_pings_wait_is_read_again_without_them(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ping that waits anyway (someone else's agent shutdown holds the
    job): past STATUS_BATCH_TIMEOUT the batch is read again without pings;
    every running domain's agent_ready is then None."""
    monkeypatch.setattr(agent_observe, "STATUS_BATCH_TIMEOUT", 1.0)
    fake_tower.set_domain("gpu-node", ping_sleep=5)
    reply = fake_tower.run("status").reply
    domains = {d["name"]: d for d in reply["domains"]}
    assert domains["gpu-node"]["state"] == "running"
    assert domains["gpu-node"]["agent_ready"] is None
    assert domains["win-1"]["agent_ready"] is None  # shut off
    batches = [a[2] for a in fake_tower.log() if len(a) == 3]
    assert "qemu-agent-command" in batches[0]
    assert "qemu-agent-command" not in batches[1]


def test_a_status_without_pings_that_times_out_fails(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(
        self: agent_virsh.Virsh, args: list[str], timeout: float
    ) -> agent_virsh.VirshResult:
        return agent_virsh.VirshResult(
            124, "", "error: virsh timed out", timed_out=True
        )

    monkeypatch.setattr(agent_virsh.Virsh, "_run", slow)
    cfg = agent_config.load_config(str(fake_tower.config), {})
    with pytest.raises(agent_virsh.VirshTimeoutError):
        agent_observe.observe(cfg, agent_virsh.Virsh(cfg), ping=False)
