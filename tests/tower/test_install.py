"""`install` into a relocated root."""

from __future__ import annotations

import json
import os
from pathlib import Path
import pwd
import subprocess

from custom_components.gpu_handoff.tower import gpu_handoff as agent
from tests.tower import nodes
from tests.tower.conftest import require_tool, run_agent


def install(
    root: Path, *extra: str, uri: str = "test:///default"
) -> tuple[int, dict[str, object], str]:
    user = pwd.getpwuid(os.getuid()).pw_name
    run = run_agent(
        [
            "install",
            "--root",
            str(root),
            "--user",
            user,
            "--gpu-node",
            "gpu-node",
            "--gaming",
            "win-1",
            "--gaming=win-2",
            "--uri",
            uri,
            *extra,
        ]
    )
    return run.rc, run.reply, run.stderr


def test_install_into_root(tmp_path: Path) -> None:
    require_tool("virsh")
    node = nodes.write_node_file(tmp_path / "node.xml")
    root = tmp_path / "root"
    rc, reply, stderr = install(root, uri=f"test://{node}")
    assert rc == 0, reply
    program = root / "usr/local/bin/gpu-handoff"
    assert program.read_bytes() == Path(agent.__file__).read_bytes()
    assert os.access(program, os.X_OK)
    config = json.loads(
        (root / "etc/gpu-handoff/config.json").read_text(encoding="utf-8")
    )
    assert config == {
        "libvirt_uri": f"test://{node}",
        "gpu_node": "gpu-node",
        "gaming": ["win-1", "win-2"],
        "state_dir": "/var/lib/gpu-handoff",
        # Every timeout is written, so the file says what applies.
        "timeouts": agent.TIMEOUT_DEFAULTS,
    }
    assert agent.validate_config(config) == []
    assert (root / "var/lib/gpu-handoff").is_dir()
    hook = root / "etc/libvirt/hooks/qemu.d/gpu-handoff"
    assert hook.read_text(encoding="utf-8").splitlines()[-1] == (
        'exec /usr/local/bin/gpu-handoff --config /etc/gpu-handoff/config.json hook "$@"'
    )
    assert hook.read_text(encoding="utf-8") == agent.hook_script(
        "/usr/local/bin/gpu-handoff", "/etc/gpu-handoff/config.json"
    )
    assert os.access(hook, os.X_OK)
    line = reply["authorized_keys_line"]
    assert line == (
        'restrict,command="/usr/local/bin/gpu-handoff --config '
        '/etc/gpu-handoff/config.json serve" <public key of Home Assistant>'
    )
    assert line in stderr  # type: ignore[operator]
    assert "libvirt group" in stderr
    codes = {f["code"] for f in reply["findings"]}  # type: ignore[attr-defined]
    assert codes == {"rom_bar_not_off", "no_agent_channel"}
    assert (root / "var/lib/gpu-handoff/claims.json").exists()
    # Refuses to overwrite the configuration without --force.
    rc, reply, _ = install(root, uri=f"test://{node}")
    assert rc == 1
    assert reply["error"]["code"] == "exists"  # type: ignore[index]
    rc, reply, _ = install(
        root,
        "--force",
        "--detach",
        "process",
        "--prefix",
        "/opt/gh",
        uri=f"test://{node}",
    )
    assert rc == 0
    assert (root / "opt/gh/bin/gpu-handoff").exists()


def test_installed_program_runs(tmp_path: Path) -> None:
    """The copied file runs as a program (shebang, no import of the package)."""
    root = tmp_path / "root"
    rc, reply, _ = install(root, uri=f"test+unix:///default?socket={tmp_path}/none")
    assert rc == 0
    assert reply["status_error"]["code"] == "libvirt_unreachable"  # type: ignore[index]
    out = subprocess.run(
        [
            str(root / "usr/local/bin/gpu-handoff"),
            "--config",
            str(root / "etc/gpu-handoff/config.json"),
            "check-config",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert json.loads(out.stdout)["ok"] is True


def test_install_argument_errors(tmp_path: Path) -> None:
    cases = [
        ["install"],
        ["install", "--user"],
        ["install", "--colour", "x"],
        ["install", "--user", "no-such-user-here", "--gpu-node", "a", "--gaming", "b"],
        [
            "install",
            "--user",
            "root",
            "--gpu-node",
            "a",
            "--gaming",
            "a",
            "--root",
            str(tmp_path),
        ],
    ]
    codes = [run_agent(argv).reply["error"]["code"] for argv in cases]
    assert codes == [
        "bad_request",
        "bad_request",
        "bad_request",
        "bad_request",
        "config_invalid",
    ]
    assert not any(tmp_path.iterdir())


def test_install_failure(tmp_path: Path) -> None:
    blocker = tmp_path / "root"
    blocker.write_text("a file, not a directory", encoding="utf-8")
    rc, reply, _ = install(blocker)
    assert rc == 1
    assert reply["error"]["code"] == "install_failed"  # type: ignore[index]


def test_install_config_option(tmp_path: Path) -> None:
    user = pwd.getpwuid(os.getuid()).pw_name
    base = [
        "install",
        "--user",
        user,
        "--gpu-node",
        "g",
        "--gaming",
        "w",
        "--root",
        str(tmp_path),
    ]
    base += ["--uri", f"test+unix:///default?socket={tmp_path}/none"]
    run = run_agent([*base, "--config", "relative.json"])
    assert run.reply["error"]["code"] == "bad_request"
    run = run_agent([*base, "--config", "/etc/gh/c.json"])
    assert run.rc == 0
    assert (tmp_path / "etc/gh/c.json").exists()
    assert (
        "--config /etc/gh/c.json hook"
        in (tmp_path / "etc/libvirt/hooks/qemu.d/gpu-handoff").read_text()
    )


def test_install_timeouts(tmp_path: Path) -> None:
    """--timeout-KIND sets one timeout; the others keep the agent's defaults."""
    rc, reply, _ = install(
        tmp_path,
        "--timeout-agent",
        "240",
        "--timeout-start=12.5",
        uri=f"test+unix:///default?socket={tmp_path}/none",
    )
    assert rc == 0, reply
    config = json.loads(
        (tmp_path / "etc/gpu-handoff/config.json").read_text(encoding="utf-8")
    )
    assert config["timeouts"] == {
        **agent.TIMEOUT_DEFAULTS,
        "agent": 240.0,
        "start": 12.5,
    }
    assert agent.validate_config(config) == []


def test_install_timeout_errors(tmp_path: Path) -> None:
    user = pwd.getpwuid(os.getuid()).pw_name
    base = ["install", "--user", user, "--gpu-node", "g", "--gaming", "w"]
    base += ["--root", str(tmp_path)]
    for value in ("0", "-5", "nan", "inf", "soon", ""):
        run = run_agent([*base, "--timeout-shutdown", value])
        assert run.reply["error"]["code"] == "bad_request", value
        assert "--timeout-shutdown" in run.reply["error"]["message"]
    assert run_agent([*base, "--timeout-later", "5"]).reply["error"]["code"] == (
        "bad_request"
    )
    assert not any(tmp_path.iterdir())
