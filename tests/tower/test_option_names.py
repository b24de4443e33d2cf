"""Domain names that virsh could read as options (issue 11, finding 3).

virsh removes quotes before it decides what is an option: a domain named
`--bogus` (any domain on the connection, managed or not) made the status batch
a parse error, and a handoff stopped the GPU node and then failed at
`wait_devices_free` with no VM running. The agent passes every domain as the
value of `--domain`, which virsh takes whatever it looks like (pinned for the
simulator in tests/towersim/test_conformance.py).
"""

from __future__ import annotations

import json
from pathlib import Path
import shlex
import subprocess
import sys
import time

from tests.support.agentbuild import AGENT
from tests.support.simtower import write_agent_config
from tests.tower import nodes
from tests.tower.conftest import FakeTower, require_tool, run_agent, write_config
from tests.towersim import DomainSpec, realistic_tower

# The commands that name a domain, and where virsh would otherwise read it.
DOMAIN_COMMANDS = {
    "dumpxml",
    "domstate",
    "start",
    "shutdown",
    "qemu-agent-command",
    "screenshot",
}


def test_status_with_domains_named_like_options_on_real_virsh(tmp_path: Path) -> None:
    """libvirt's test driver, through real virsh: an unmanaged `--bogus` that
    claims a card of the GPU node, and a running `-x`."""
    require_tool("virsh")
    body = "".join(
        nodes.domain_xml(name, devices, running=name in ("gpu-node", "-x"))
        for name, devices in {
            **nodes.domains(),
            "--bogus": nodes.OTHER_DEVICES,
            "-x": "",
        }.items()
    )
    node = tmp_path / "node.xml"
    node.write_text(f"<node>{body}</node>\n", encoding="utf-8")
    config = write_config(
        tmp_path / "c.json",
        libvirt_uri=f"test://{node}",
        gpu_node="gpu-node",
        gaming=["win-1", "win-2"],
        state_dir=str(tmp_path / "state"),
    )
    run = run_agent(["--config", str(config), "status"])
    assert run.rc == 0, run.lines
    cards = {c["address"]: c for c in run.reply["cards"]}
    assert cards["0000:02:00.0"]["claimed_by"] == ["--bogus", "gpu-node", "win-2"]
    assert cards["0000:02:00.0"]["held_by"] == "gpu-node"
    findings = {(f["code"], f["domain"]) for f in run.reply["findings"]}
    assert ("claimed_by_unmanaged", "--bogus") in findings
    assert run.reply["virsh_calls"] == 2


def test_handoff_with_a_domain_named_like_an_option(tmp_path: Path) -> None:
    """The simulator (pinned to real virsh's parser) with `--bogus` defined:
    the handoff gets its VM running."""
    tower = realistic_tower(tmp_path / "tower", time_scale=0.002)
    try:
        tower.define(DomainSpec(name="--bogus", agent_delay=0.0))
        config = write_agent_config(tower, tmp_path / "agent")
        env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}

        def call(*argv: str) -> dict[str, object]:
            done = subprocess.run(
                [sys.executable, str(AGENT), "--config", str(config), *argv],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                check=False,
            )
            reply: dict[str, object] = json.loads(done.stdout)
            return reply

        submitted = call("handoff", "gaming-1")
        job_id = submitted["job"]["id"]  # type: ignore[index]
        deadline = time.monotonic() + 60
        while True:
            job = call("job", job_id)["job"]
            if job["state"] in ("succeeded", "failed"):  # type: ignore[index]
                break
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["state"] == "succeeded", job  # type: ignore[index]
        assert tower.domstate("gaming-1") == "running (booted)"
        assert tower.domstate("gpu-node") == "shut off (shutdown)"
        assert tower.domstate("--bogus") == "shut off (unknown)"
        assert tower.destroy_attempts() == []
    finally:
        tower.close()


def test_every_domain_goes_to_virsh_as_the_value_of_domain(
    fake_tower: FakeTower,
) -> None:
    assert fake_tower.run("status").rc == 0
    for argv in (("handoff", "win-1"), ("release", "win-1")):
        job_id = fake_tower.run(*argv).reply["job"]["id"]
        assert fake_tower.wait_job(job_id)["state"] == "succeeded"
    assert fake_tower.run("screenshot", "gpu-node").reply["ok"] is True
    seen = set()
    for argv in fake_tower.log():
        args = argv[2:]
        commands = (
            [shlex.split(part) for part in args[0].split(" ; ")]
            if len(args) == 1
            else [args]
        )
        for words in commands:
            if words[0] not in DOMAIN_COMMANDS:
                continue
            seen.add(words[0])
            assert "--domain" in words, words
            name = words[words.index("--domain") + 1]
            assert name in ("gpu-node", "win-1", "win-2"), words
            # ... and nowhere else: no bare word is a domain.
            assert words.count(name) == 1, words
    assert seen == DOMAIN_COMMANDS


def test_configured_names_may_not_start_with_a_dash(tmp_path: Path) -> None:
    for data in (
        {"gpu_node": "-x", "gaming": ["win-1"]},
        {"gpu_node": "gpu-node", "gaming": ["win-1", "--bogus"]},
    ):
        path = write_config(tmp_path / "c.json", **data)
        run = run_agent(["--config", str(path), "check-config"])
        assert run.reply["error"]["code"] == "config_invalid"
        assert (
            "starts with '-' (virsh would read it as an option)"
            in (run.reply["error"]["message"])
        )
