"""Lending the free cards: the GPU node started with a live-only definition.

Against real libvirt (the test driver in a private libvirtd, with state across
calls): `virsh create` with the name and UUID of a defined, inactive domain
starts that domain with the file as its live definition and leaves the
persistent one as it was (libvirt's virDomainObjListAdd with
VIR_DOMAIN_OBJ_LIST_ADD_LIVE); when the domain stops, the persistent one is
what it has again. The agent never writes the persistent definition, so no
interruption can leave it changed.
"""

from __future__ import annotations

from collections.abc import Iterator
import json
import os
from pathlib import Path
import re
import xml.etree.ElementTree as ET

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    runner as agent_runner,
    status as agent_status,
    virsh as agent_virsh,
    wire,
)
from tests.support.libvirtd import LibvirtTestDriver
from tests.tower.conftest import require_tool, write_config

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"


def _hostdevs(*buses: int) -> str:
    return "\n".join(
        f"<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x0000' bus='0x{bus:02x}' slot='0x00' function='0x{fn}'/>"
        f"</source><rom bar='off'/></hostdev>"
        for bus in buses
        for fn in (0, 1)
    )


def _domain(name: str, uuid: str, *buses: int, extra: str = "") -> str:
    return f"""<domain type='test'>
  <name>{name}</name>
  <uuid>{uuid}</uuid>
  <memory unit='MiB'>256</memory>
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    {_hostdevs(*buses)}
    {extra}
  </devices>
</domain>"""


# The GPU node's VNC password must survive into its live definition.
GRAPHICS = "<graphics type='vnc' port='-1' autoport='yes' passwd='s3cret-vnc'/>"


@pytest.fixture
def lv(tmp_path: Path) -> Iterator[LibvirtTestDriver]:
    require_tool("virsh", "libvirtd")
    (tmp_path / "libvirtd").mkdir()
    with LibvirtTestDriver(tmp_path / "libvirtd") as daemon:
        daemon.define(
            _domain(
                "gpu-node",
                "0b1e0000-0000-4000-8000-000000000001",
                1,
                2,
                3,
                extra=GRAPHICS,
            )
        )
        daemon.define(_domain("gaming-1", "0b1e0000-0000-4000-8000-000000000002", 2))
        daemon.define(_domain("gaming-2", "0b1e0000-0000-4000-8000-000000000003", 3))
        yield daemon


@pytest.fixture
def cfg(lv: LibvirtTestDriver, tmp_path: Path) -> agent_config.Config:
    config = write_config(
        tmp_path / "agent.json",
        libvirt_uri=lv.test_uri,
        gpu_node="gpu-node",
        gaming=["gaming-1", "gaming-2"],
        state_dir=str(tmp_path / "state"),
        poll_interval=0.05,
    )
    return agent_config.load_config(str(config), dict(os.environ))


def _lend(cfg: agent_config.Config, keep: str | None = None) -> dict[str, object]:
    """Run a lend job in this process (``keep``: the gaming VM whose cards
    it leaves alone); its record."""
    job_id = str(agent_jobs.create_job(cfg, "lend", keep, "cli")["id"])
    agent_runner.run_job(cfg, job_id)
    return dict(agent_jobs.load_job(cfg, job_id))


def _buses(xml_text: str) -> list[str]:
    return re.findall(
        r"""bus=['"](0x[0-9a-f]+)['"] slot=['"]0x00['"] function=['"]0x0['"]""",
        xml_text,
    )


def _persistent(lv: LibvirtTestDriver) -> str:
    return lv.virsh(
        "dumpxml", "--inactive", "--security-info", "gpu-node", check=True
    ).stdout


def test_the_gpu_node_runs_without_the_cards_players_hold(
    lv: LibvirtTestDriver, cfg: agent_config.Config
) -> None:
    """Gaming station 1 plays (card 02): the GPU node starts with 01 and 03,
    through a live definition; its persistent definition is byte for byte
    the same, during the run and after the GPU node stopped."""
    lv.virsh("start", "gaming-1", check=True)
    before = _persistent(lv)

    job = _lend(cfg)

    assert job["state"] == "succeeded", job
    steps = job["steps"]
    assert isinstance(steps, list)
    assert [(s["name"], s["result"]) for s in steps] == [
        ("wait_agent", "skipped"),
        ("shutdown", "skipped"),
        ("wait_shut_off", "skipped"),
        ("start_free", "ok"),
    ]
    assert "without 0000:02:00" in steps[-1]["detail"]
    live = lv.virsh("dumpxml", "--security-info", "gpu-node", check=True).stdout
    assert _buses(live) == ["0x01", "0x03"]
    assert "s3cret-vnc" in live  # the live definition kept the password
    assert _persistent(lv) == before

    status = agent_status.status_body(cfg)
    gpu = next(d for d in status["domains"] if d["name"] == "gpu-node")
    assert {d["address"][:10] for d in gpu["hostdevs"]} == {"0000:01:00", "0000:03:00"}
    assert {d["address"][:10] for d in gpu["defined_hostdevs"]} == {
        "0000:01:00",
        "0000:02:00",
        "0000:03:00",
    }
    held = {card["address"]: card["held_by"] for card in status["cards"]}
    assert held["0000:02:00.0"] == "gaming-1"
    assert held["0000:01:00.0"] == held["0000:03:00.1"] == "gpu-node"

    lv.virsh("shutdown", "gpu-node", check=True)
    after = lv.virsh("dumpxml", "--security-info", "gpu-node", check=True).stdout
    assert _buses(after) == ["0x01", "0x02", "0x03"]
    assert _persistent(lv) == before
    listed = lv.virsh("list", "--all", "--name", check=True).stdout.split()
    assert "gpu-node" in listed  # still defined: only its live state went away


def test_the_cards_held_for_a_gaming_vm_are_not_lent(
    lv: LibvirtTestDriver, cfg: agent_config.Config
) -> None:
    """Gaming station 2 plays (card 03) and cards are held for gaming
    station 1 (card 02: it is shut off, and starts soon): the lend that
    names it starts the GPU node with 01 alone; gaming station 1 then starts
    with its card. The same lend without the name would have taken 02."""
    lv.virsh("start", "gaming-2", check=True)
    before = _persistent(lv)

    job = _lend(cfg, keep="gaming-1")

    assert job["state"] == "succeeded", job
    assert job["args"] == {"domain": "gaming-1"}
    steps = job["steps"]
    assert isinstance(steps, list)
    assert [s["domain"] for s in steps] == ["gpu-node"] * 4
    assert "without 0000:02:00, 0000:03:00" in steps[-1]["detail"]
    live = lv.virsh("dumpxml", "gpu-node", check=True).stdout
    assert _buses(live) == ["0x01"]
    assert _persistent(lv) == before
    lv.virsh("start", "gaming-1", check=True)
    state = lv.virsh("domstate", "gaming-1", check=True).stdout.strip()
    assert state == "running"


def test_with_every_card_free_it_is_a_plain_start(
    lv: LibvirtTestDriver, cfg: agent_config.Config
) -> None:
    """Nobody plays: the GPU node starts from its own definition."""
    before = _persistent(lv)
    job = _lend(cfg)
    steps = job["steps"]
    assert isinstance(steps, list)
    assert steps[-1]["detail"] == "started with every card"
    live = lv.virsh("dumpxml", "gpu-node", check=True).stdout
    assert _buses(live) == ["0x01", "0x02", "0x03"]
    assert _persistent(lv) == before


def test_with_no_card_free_the_gpu_node_stays_off(
    lv: LibvirtTestDriver, cfg: agent_config.Config
) -> None:
    """Every card is in use (a domain GPU Handoff does not manage holds the
    one no gaming VM claims): nothing is started, and that is no failure."""
    lv.define(_domain("other", "0b1e0000-0000-4000-8000-000000000004", 1))
    for name in ("other", "gaming-1", "gaming-2"):
        lv.virsh("start", name, check=True)
    job = _lend(cfg)
    assert job["state"] == "succeeded", job
    steps = job["steps"]
    assert isinstance(steps, list)
    assert steps[-1]["result"] == "skipped"
    state = lv.virsh("domstate", "gpu-node", check=True).stdout.strip()
    assert state == "shut off"


def test_a_running_gpu_node_is_left_as_it_runs(
    lv: LibvirtTestDriver, cfg: agent_config.Config
) -> None:
    """The GPU node already runs (with every card): nothing is created, the
    start step says so (a lend job's stop steps come first: the test driver
    has no guest agent, so this job starts at its last step)."""
    lv.virsh("start", "gpu-node", check=True)
    job = agent_jobs.create_job(cfg, "lend", None, "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    runner.step_start_free(3, job["steps"][3])
    assert job["steps"][3]["detail"] == "already running"


def test_a_failed_create_leaves_the_definition_and_says_why(
    lv: LibvirtTestDriver, cfg: agent_config.Config, tmp_path: Path
) -> None:
    """The persistent definition's UUID changed under the agent (someone
    redefined the GPU node between the read and the create, as a stand-in
    for any refusal of `virsh create`): the job fails with libvirt's reason
    and the definition is the one the operator wrote."""
    lv.virsh("start", "gaming-1", check=True)
    job = agent_jobs.create_job(cfg, "lend", None, "cli")
    runner = agent_runner.JobRunner(cfg, job, agent_virsh.Virsh(cfg))
    real_run = runner.virsh.run

    def redefine_before_create(args: list[str], timeout: float = 120.0) -> object:
        if args[:1] == ["create"]:
            lv.virsh("undefine", "gpu-node", check=True)
            lv.define(_domain("gpu-node", "0b1e0000-0000-4000-8000-0000000000ff", 1))
        return real_run(args, timeout)

    runner.virsh.run = redefine_before_create  # type: ignore[method-assign,assignment]
    with pytest.raises(wire.AgentError) as failed:
        runner.step_start_free(3, job["steps"][3])
    assert failed.value.code == "start_failed"
    assert "already exists with uuid" in failed.value.message
    assert _buses(_persistent(lv)) == ["0x01"]
    assert lv.virsh("domstate", "gpu-node").stdout.strip() == "shut off"
    leftovers = [p for p in Path("/tmp").glob("gpu-handoff-live-*") if p.is_dir()]
    assert all(p.stat().st_mtime < job["created_epoch"] for p in leftovers)


def test_live_definition_keeps_everything_but_the_busy_cards() -> None:
    """Both functions of a busy card go; a card with one busy function goes
    whole; USB hostdevs, other devices and foreign namespaces stay as libvirt
    wrote them (prefix included)."""
    xml_text = f"""<domain type='kvm' xmlns:qemu='{QEMU_NS}'>
  <name>gpu-node</name>
  <devices>
    {_hostdevs(1, 2)}
    <hostdev mode='subsystem' type='usb'><source><vendor id='0x046d'/><product id='0xc52b'/></source></hostdev>
    <interface type='network'><source network='default'/></interface>
  </devices>
  <qemu:commandline><qemu:arg value='-no-hpet'/></qemu:commandline>
</domain>"""
    live, kept, left = agent_runner.live_definition(xml_text, ["0000:02:00"])
    assert (kept, left) == (["0000:01:00"], ["0000:02:00"])
    assert _buses(live) == ["0x01"]
    assert "0x02" not in live
    assert "type='usb'" in live.replace('"', "'")
    assert "<interface" in live
    assert "<qemu:commandline>" in live
    root = ET.fromstring(live)  # noqa: S314 - the agent's own output
    assert root.find(f"{{{QEMU_NS}}}commandline") is not None


def test_lend_is_a_verb_home_assistant_may_ask_for(tmp_path: Path) -> None:
    """`lend` takes at most one argument through serve: a gaming VM whose
    cards stay free (held for it), never another domain."""
    assert wire.SERVE_VERBS["lend"] == (0, 1)
    assert "lend" in wire.SESSION_VERBS
    assert "lend" in wire.JOB_KINDS
    config = write_config(
        tmp_path / "agent.json",
        libvirt_uri="test:///default",
        gpu_node="gpu-node",
        gaming=["gaming-1"],
        state_dir=str(tmp_path / "state"),
    )
    cfg = agent_config.load_config(str(config), dict(os.environ))
    assert [s["name"] for s in agent_jobs.plan_job(cfg, "lend", None)] == [
        "wait_agent",
        "shutdown",
        "wait_shut_off",
        "start_free",
    ]
    agent_jobs.check_work(cfg, "lend", "gaming-1")
    for other in ("gpu-node", "nobody"):
        with pytest.raises(wire.AgentError):
            agent_jobs.check_work(cfg, "lend", other)
    assert json.dumps(agent_jobs.plan_job(cfg, "lend", None))
