"""Never destroy; Python 3.9 compatibility; the protocol constants."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
import re
import socket
import subprocess

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    virsh as agent_virsh,
    wire,
)
from tests.support.agentbuild import AGENT, MODULES, SOURCE
from tests.support.oldpython import oldest_python
from tests.tower.conftest import FakeTower, run_agent, write_config


def test_no_destroy_anywhere_in_the_agent() -> None:
    """No string constant in the agent names the destroy command, in any form."""
    assert len(MODULES) > 10
    nodes = (
        node
        for module in MODULES
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8")))
    )
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for word in re.findall(r"[a-z-]+", node.value.lower()):
                assert word != "destroy", f"line {node.lineno}: {node.value!r}"
                assert not word.endswith("destroy"), node.value
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            assert "destroy" not in name.lower()
    # Built from pieces (e.g. "des" + "troy") cannot pass the allow-list either.
    assert "destroy" not in agent_virsh.VIRSH_COMMANDS
    with pytest.raises(wire.AgentError):
        agent_virsh.Virsh.check(["des" + "troy", "gpu-node"])


def test_virsh_refuses_commands_outside_the_contract(fake_tower: FakeTower) -> None:
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    virsh = agent_virsh.Virsh(cfg)
    for args in (["undefine", "x"], [], ["destroy", "gpu-node"]):
        with pytest.raises(wire.AgentError):
            virsh.run(args)
    with pytest.raises(wire.AgentError):
        virsh.batch([["list", "--all", "--name"], ["destroy", "gpu-node"]])
    assert fake_tower.log() == []


def test_every_path_against_recording_virsh(fake_tower: FakeTower) -> None:
    """Failure paths included: the recorded invocations never contain destroy."""
    fake_tower.configure(timeouts={"agent": 0.1, "shutdown": 0.1, "start": 0.1})
    fake_tower.set_domain("gpu-node", shutdown_polls=-1)
    for argv in (
        ["stop", "gpu-node"],
        ["handoff", "win-1"],
        ["release", "win-2"],
        ["start", "win-1"],
    ):
        job_id = fake_tower.run(*argv).reply["job"]["id"]
        fake_tower.wait_job(job_id)
    fake_tower.set_domain("gpu-node", agent_after=10**6)
    fake_tower.wait_job(fake_tower.run("stop", "gpu-node").reply["job"]["id"])
    words = {w for argv in fake_tower.log() for arg in argv for w in arg.split()}
    assert "destroy" not in words
    assert "shutdown" in words


def test_protocol_constants() -> None:
    assert wire.PROTOCOL == 2
    assert wire.VERSION == "0.3.7"
    codes = {v for k, v in vars(wire).items() if k.startswith("ERR_")}
    assert codes == wire.ERROR_CODES
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", code) for code in codes)
    run = run_agent(["version"])
    assert run.rc == 0
    assert run.reply["version"] == wire.VERSION
    assert "run-job" not in run.reply["verbs"]
    assert {"session", "request", "watch"} <= set(run.reply["verbs"])
    assert set(wire.SESSION_VERBS) < set(wire.SERVE_VERBS)
    assert not {"watch", "session"} & wire.SESSION_VERBS
    assert wire.REQUEST_ID_RE.match("ha-0123456789")


def old_python() -> tuple[str, dict[str, str]]:
    python, extra = oldest_python()
    return python, {**os.environ, **extra}


def test_python39(tmp_path: Path) -> None:
    python, env = old_python()
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert version.stdout.strip() == "(3, 9)"
    # Every module, and the build, compiles on 3.9.
    for module in (*MODULES, SOURCE.parent / "build.py"):
        subprocess.run([python, "-m", "py_compile", str(module)], env=env, check=True)

    def run(*argv: str) -> dict[str, object]:
        proc = subprocess.run(
            [python, str(AGENT), *argv],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        reply: dict[str, object] = json.loads(proc.stdout)
        assert (proc.returncode == 0) == reply["ok"]
        return reply

    reply = run("version")
    assert reply == {
        "protocol": wire.PROTOCOL,
        "ok": True,
        "version": wire.VERSION,
        "verbs": sorted(wire.SERVE_VERBS),
        "host_name": socket.gethostname(),
    }
    good = write_config(
        tmp_path / "good.json", gpu_node="g", gaming=["w"], state_dir=str(tmp_path)
    )
    assert run("--config", str(good), "check-config")["ok"] is True
    bad = write_config(
        tmp_path / "bad.json", gpu_node="g", gaming=["g"], timeouts={"agent": -1}
    )
    reply = run("--config", str(bad), "check-config")
    assert reply["error"]["code"] == "config_invalid"  # type: ignore[index]
    assert "timeouts.agent" in reply["error"]["message"]  # type: ignore[index]
