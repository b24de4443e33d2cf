"""Configuration loading and validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    install as agent_install,
    virsh as agent_virsh,
    wire,
)
from tests.tower.conftest import run_agent, write_config

GOOD = {"gpu_node": "gpu-node", "gaming": ["win-1"]}


def test_defaults(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", **GOOD)
    run = run_agent(
        ["--config", str(path), "check-config"], env={"XDG_STATE_HOME": "/x"}
    )
    assert run.rc == 0
    config = run.reply["config"]
    assert config["libvirt_uri"] == "qemu:///system"
    assert config["timeouts"] == {"agent": 180, "shutdown": 180, "start": 300}
    assert config["shutdown_modes"] == ["agent"]
    assert config["state_dir"] == "/x/gpu-handoff"
    assert config["detach"] == "auto"
    assert config["screenshot_max_bytes"] == 8 * 1024 * 1024
    assert config["session_refresh"] == 5.0


def test_session_refresh(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", **GOOD, session_refresh=0.5)
    run = run_agent(["--config", str(path), "check-config"])
    assert run.rc == 0
    assert run.reply["config"]["session_refresh"] == 0.5


def test_state_dir_default_without_xdg(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", **GOOD)
    run = run_agent(["--config", str(path), "check-config"], env={"HOME": "/home/h"})
    assert run.reply["config"]["state_dir"] == "/home/h/.local/state/gpu-handoff"


def test_path_from_env_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(tmp_path / "c.json", **GOOD)
    run = run_agent(["check-config"], env={"GPU_HANDOFF_CONFIG": str(path)})
    assert run.rc == 0
    monkeypatch.setattr(
        agent_config, "DEFAULT_CONFIG_PATH", str(tmp_path / "none.json")
    )
    monkeypatch.setattr(
        agent_install, "DEFAULT_CONFIG_PATH", str(tmp_path / "none.json")
    )
    run = run_agent(["check-config"])
    assert run.rc == 1
    assert run.reply["error"]["code"] == wire.ERR_CONFIG_INVALID
    assert "none.json" in run.reply["error"]["message"]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({**GOOD, "colour": 1}, "colour: unknown key"),
        ({"gaming": ["a"]}, "gpu_node: required"),
        ({"gpu_node": "g"}, "gaming: required"),
        ({**GOOD, "gaming": []}, "gaming: must be a non-empty list"),
        ({**GOOD, "gaming": ["a", "a"]}, "gaming[1]: duplicate domain 'a'"),
        ({**GOOD, "gaming": ["gpu-node"]}, "gaming[0]: 'gpu-node' is the gpu_node"),
        ({**GOOD, "gaming": ["a/b"]}, "gaming[0]: 'a/b' is not a valid domain name"),
        ({**GOOD, "gaming": [7]}, "gaming[0]: must be a non-empty string"),
        ({**GOOD, "gpu_node": "x" * 201}, "gpu_node: longer than 200 characters"),
        ({**GOOD, "libvirt_uri": ""}, "libvirt_uri: must be a non-empty string"),
        ({**GOOD, "timeouts": []}, "timeouts: must be an object"),
        (
            {**GOOD, "timeouts": {"agent": 0}},
            "timeouts.agent: must be a positive number",
        ),
        (
            {**GOOD, "timeouts": {"start": True}},
            "timeouts.start: must be a positive number",
        ),
        ({**GOOD, "timeouts": {"boot": 3}}, "timeouts.boot: unknown key"),
        ({**GOOD, "shutdown_modes": []}, "shutdown_modes: must be a non-empty list"),
        (
            {**GOOD, "shutdown_modes": ["force"]},
            "shutdown_modes[0]: must be one of agent, acpi",
        ),
        (
            {**GOOD, "shutdown_modes": ["acpi", "acpi"]},
            "shutdown_modes[1]: duplicate mode 'acpi'",
        ),
        ({**GOOD, "state_dir": "rel"}, "state_dir: must be an absolute path"),
        ({**GOOD, "path": "/bin"}, "path: must be a list of absolute directories"),
        ({**GOOD, "path": ["bin"]}, "path[0]: must be an absolute directory"),
        ({**GOOD, "commands": []}, "commands: must be an object"),
        (
            {**GOOD, "commands": {"virsh": "virsh"}},
            "commands.virsh: must be an absolute path",
        ),
        ({**GOOD, "commands": {"ssh": "/x"}}, "commands.ssh: unknown key"),
        ({**GOOD, "detach": "nohup"}, "detach: must be one of auto, systemd, process"),
        (
            {**GOOD, "screenshot_max_bytes": 0},
            "screenshot_max_bytes: must be a positive integer",
        ),
        ({**GOOD, "poll_interval": 0}, "poll_interval: must be a number in (0, 60]"),
        ({**GOOD, "session_refresh": 0}, "session_refresh: must be a positive number"),
        (
            {**GOOD, "session_refresh": "5"},
            "session_refresh: must be a positive number",
        ),
        (
            {**GOOD, "session_refresh": True},
            "session_refresh: must be a positive number",
        ),
    ],
)
def test_invalid(tmp_path: Path, data: dict[str, Any], problem: str) -> None:
    path = write_config(tmp_path / "c.json", **data)
    run = run_agent(["--config", str(path), "check-config"])
    assert run.rc == 1
    assert run.reply["ok"] is False
    assert run.reply["error"]["code"] == "config_invalid"
    assert problem in run.reply["error"]["message"]


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.json", gaming=[], detach="x")
    message = run_agent(["--config", str(path), "status"]).reply["error"]["message"]
    assert "gpu_node: required" in message
    assert "gaming: must be" in message
    assert "detach: must be" in message


def test_not_json_and_not_object(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("{", encoding="utf-8")
    run = run_agent(["--config", str(path), "status"])
    assert "not valid JSON" in run.reply["error"]["message"]
    path.write_text(json.dumps([1]), encoding="utf-8")
    run = run_agent([f"--config={path}", "status"])
    assert "(top level): must be a JSON object" in run.reply["error"]["message"]


def test_cli_usage_errors(tmp_path: Path) -> None:
    assert run_agent([]).reply["error"]["code"] == "bad_request"
    assert run_agent(["--verbose", "status"]).reply["error"]["code"] == "bad_request"
    assert run_agent(["version", "x"]).reply["error"]["code"] == "bad_request"
    help_run = run_agent(["--help"])
    assert help_run.rc == 0
    assert "usage:" in help_run.stderr
    path = write_config(tmp_path / "c.json", **GOOD)
    for argv in (
        ["frobnicate"],
        ["status", "x"],
        ["stop"],
        ["run-job"],
        ["run-job", "A B"],
        ["serve", "x"],
    ):
        run = run_agent(["--config", str(path), *argv])
        assert run.rc == 1, argv
        assert run.reply["error"]["code"] == "bad_request", argv


def test_virsh_missing(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "c.json", **GOOD, commands={"virsh": str(tmp_path / "nope")}
    )
    run = run_agent(["--config", str(path), "status"])
    assert run.reply["error"]["code"] == wire.ERR_VIRSH_MISSING
    path = write_config(tmp_path / "c.json", **GOOD, path=[str(tmp_path)])
    run = run_agent(
        ["--config", str(path), "stop", "win-1"], env={"PATH": str(tmp_path / "empty")}
    )
    assert run.reply["error"]["code"] == wire.ERR_VIRSH_MISSING
    assert "config path" in run.reply["error"]["message"]


def test_path_entries_are_appended(tmp_path: Path) -> None:
    """A `path` directory never shadows the inherited PATH."""
    first, extra = tmp_path / "first", tmp_path / "extra"
    for directory in (first, extra):
        directory.mkdir()
        tool = directory / "virsh"
        tool.write_text("#!/bin/sh\n", encoding="utf-8")
        tool.chmod(0o755)
    cfg = agent_config.Config("c", {**GOOD, "path": [str(extra)]}, {"PATH": str(first)})
    assert agent_virsh.resolve_program("virsh", None, cfg) == str(first / "virsh")
    cfg = agent_config.Config(
        "c", {**GOOD, "path": [str(extra)]}, {"PATH": "/nonexistent"}
    )
    assert agent_virsh.resolve_program("virsh", None, cfg) == str(extra / "virsh")


# virsh looks `--domain WORD` up by a running domain's id first, then by UUID,
# then by name (tools/virsh-util.c virshLookupDomainInternal; the exact rules,
# pinned against real virsh: tests/towersim/test_lookup.py and
# test_conformance_lookup.py). A managed VM named so could make the agent
# ping, stop or report another VM: refused, for the GPU node and each gaming VM.
@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("1", "id"),
        ("01", "id"),
        ("+7", "id"),
        (" 2", "id"),
        ("2147483647", "id"),
        ("6695eb01-f6a4-8304-79aa-97f2502e193f", "UUID"),
        ("6695EB01F6A4830479AA97F2502E193F    ", "UUID"),
        ("6695eb01 f6a4 8304 79aa 97f2502e193f", "UUID"),
    ],
)
@pytest.mark.parametrize("key", ["gpu_node", "gaming"])
def test_names_virsh_reads_as_an_id_or_uuid_are_refused(
    tmp_path: Path, name: str, kind: str, key: str
) -> None:
    data = {**GOOD, key: [name] if key == "gaming" else name}
    path = write_config(tmp_path / "c.json", **data)
    run = run_agent(["--config", str(path), "check-config"])
    assert run.rc == 1
    assert run.reply["error"]["code"] == wire.ERR_CONFIG_INVALID
    where = "gaming[0]" if key == "gaming" else "gpu_node"
    assert (
        f"{where}: virsh would look {name!r} up as a domain {kind} first, and "
        "could act on another VM; rename the VM in libvirt (shut it off, then "
        "`virsh domrename OLD-NAME NEW-NAME`)"
    ) in run.reply["error"]["message"]


@pytest.mark.parametrize(
    "name",
    [
        "gaming-1",
        "1 ",  # virStrToLong_i reads to the end: not an id
        "1a",
        "2147483648",  # beyond an int
        "9" * 200,
        "0x1",
        "1.5",
        "6695eb01-f6a4-8304-79aa-97f2502e193",  # 35 bytes
        "6695eb01-f6a4-8304-79aa-97f2502e193f-",  # 37 bytes
        "6695eb01-f6a4-8304-79aa-97f2502e193g",
        "é695eb01-f6a4-8304-79aa-97f2502e193",  # 36 characters, 37 bytes
        "6695eb01f6a4830479aa97f2502e193f----",  # '-' after the last pair
    ],
)
def test_names_virsh_reads_only_as_names_are_accepted(
    tmp_path: Path, name: str
) -> None:
    assert wire.virsh_reads_as(name) is None
    path = write_config(tmp_path / "c.json", **{**GOOD, "gaming": [name]})
    run = run_agent(["--config", str(path), "check-config"])
    assert run.rc == 0, run.reply


def test_the_check_agrees_with_virshs_lookup_as_the_simulator_models_it() -> None:
    """The agent refuses exactly the words the simulator's virsh (pinned
    against real virsh) reads as an id or a UUID."""
    from tests.towersim.virsh import domain_id, domain_uuid

    uuid = "6695eb01-f6a4-8304-79aa-97f2502e193f"
    words = [
        *(
            f"{pad}{sign}{digits}{tail}"
            for pad in ("", " ", "\t", "\v")
            for sign in ("", "+", "-")
            for digits in ("0", "1", "007", "2147483647", "2147483648")
            for tail in ("", " ", "x")
        ),
        uuid,
        uuid.upper(),
        uuid.replace("-", " "),
        uuid.replace("-", "") + "    ",
        "  " + uuid.replace("-", "")[:-2] + "--",
        uuid[:-1] + "-",
        "\v" + uuid.replace("-", "") + "   ",
        "\t" + uuid.replace("-", "") + "   ",
        "-" + uuid[1:],
        "gaming-1",
        "",
    ]
    for word in words:
        modelled = domain_id(word) is not None or domain_uuid(word) is not None
        assert bool(wire.virsh_reads_as(word)) is modelled, repr(word)
