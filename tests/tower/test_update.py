"""`update`: the installed program replaced by this one, atomically; the
configuration, the hook, the state directory and the keys as they were."""

from __future__ import annotations

from pathlib import Path
import stat
import sys

import pytest

from custom_components.gpu_handoff.tower import build, gpu_handoff
from custom_components.gpu_handoff.tower.gpu_handoff import (
    install as agent_install,
    wire,
)
from tests.support.agentbuild import agent_bytes, old_agent_bytes
from tests.tower.conftest import run_agent
from tests.tower.test_install import (
    agent_argv,
    compiled_from,
    file_size_limit,
    install_run,
    old_agent,
    run_read_only,
    tree,
)
from tests.tower.test_nixos import nixos_root

PROGRAM = "usr/local/bin/gpu-handoff"
# The program compiled for this Python, beside it (build.cache_path).
CACHE = f"usr/local/bin/__pycache__/gpu-handoff.{sys.implementation.cache_tag}.pyc"


def installed(root: Path, program: bytes | None = None) -> Path:
    """An install under `root`, its program replaced by `program`."""
    assert install_run(root).rc == 0
    path = root / PROGRAM
    if program is not None:
        path.write_bytes(program)
    return path


def test_update_replaces_a_previous_agent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    program = installed(root, old_agent())
    (root / "var/lib/gpu-handoff/claims.json").write_text("{}\n", encoding="utf-8")
    (root / CACHE).unlink()  # (a 0.3 install compiled nothing)
    (root / CACHE).parent.rmdir()
    kept = {k: v for k, v in tree(root).items() if k != PROGRAM}
    run = run_agent(["update", "--root", str(root)])
    assert run.rc == 0, run.reply
    assert run.reply["updated"] == str(program)
    assert run.reply["previous"] == "0.2.0"
    assert run.reply["version"] == wire.VERSION
    assert program.read_bytes() == agent_bytes()
    assert stat.S_IMODE(program.stat().st_mode) == 0o755
    # The program compiled for this Python beside it, as install leaves it.
    assert compiled_from(root / CACHE, agent_bytes())
    assert stat.S_IMODE((root / CACHE).stat().st_mode) == 0o644
    assert stat.S_IMODE((root / CACHE).parent.stat().st_mode) == 0o755
    # The configuration, the hook, the state directory: byte for byte; and
    # nothing else new beside the program (no temporary file).
    after = tree(root)
    assert {k for k in after if k.startswith("usr/local/bin/")} == {
        PROGRAM,
        str(Path(CACHE).parent),
        CACHE,
    }
    bin_dir = "usr/local/bin/"
    assert {k: v for k, v in after.items() if not k.startswith(bin_dir)} == {
        k: v for k, v in kept.items() if not k.startswith(bin_dir)
    }
    assert "from 0.2.0 to" in run.stderr
    assert run.reply["notes"] == [run.stderr.strip()]


def test_an_update_that_cannot_write_the_compiled_program_still_updates(
    tmp_path: Path,
) -> None:
    """The compiled program only saves its compile at each start: an update
    that cannot write it (here a file where its directory goes) replaces
    the program all the same, and says so."""
    root = tmp_path / "root"
    program = installed(root, old_agent())
    (root / CACHE).unlink()
    (root / CACHE).parent.rmdir()
    (root / CACHE).parent.write_bytes(b"in the way\n")
    run = run_agent(["update", "--root", str(root)])
    assert run.rc == 0, run.reply
    assert program.read_bytes() == agent_bytes()
    assert (root / CACHE).parent.read_bytes() == b"in the way\n"
    assert len(run.reply["notes"]) == 2
    assert "the program compiles itself at each start" in run.reply["notes"][1]
    assert run.stderr.splitlines() == run.reply["notes"]


def test_update_under_another_prefix(tmp_path: Path) -> None:
    """An agent that says no version (a version line it cannot read) is
    updated all the same; previous is null."""
    root = tmp_path / "root"
    assert install_run(root, "--prefix", "/opt/gh").rc == 0
    program = root / "opt/gh/bin/gpu-handoff"
    program.write_bytes(
        old_agent_bytes(replace=[(f'VERSION = "{wire.VERSION}"\n', "VERSION = None\n")])
    )
    run = run_agent(["update", f"--root={root}", "--prefix=/opt/gh"])
    assert run.rc == 0, run.reply
    assert run.reply["previous"] is None
    assert program.read_bytes() == agent_bytes()
    assert "an unknown version" in run.stderr


@pytest.mark.parametrize(
    "content",
    [
        b"#!/bin/sh\necho something else\n",
        # The agent's first line, past the first 4 KiB: not this agent's file.
        b"#" * agent_install.AGENT_HEAD + agent_install.AGENT_MARKER,
        None,
    ],
    ids=["another program", "marker too late", "a directory"],
)
def test_update_refuses_what_is_not_the_agent(
    tmp_path: Path, content: bytes | None
) -> None:
    root = tmp_path / "root"
    path = root / PROGRAM
    path.parent.mkdir(parents=True)
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    before = tree(root)
    run = run_agent(["update", "--root", str(root)])
    assert run.rc == 1
    assert run.reply["error"]["code"] == "not_installed"
    assert str(path) in run.reply["error"]["message"]
    assert tree(root) == before


def test_update_without_an_install(tmp_path: Path) -> None:
    run = run_agent(["update", "--root", str(tmp_path)])
    assert run.reply["error"]["code"] == "not_installed"
    message = run.reply["error"]["message"]
    assert message == (
        f"update: no GPU Handoff agent at {tmp_path / PROGRAM}; "
        "install it first, or pass --prefix"
    )
    assert not any(tmp_path.iterdir())


def test_update_does_not_follow_a_link(tmp_path: Path) -> None:
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(old_agent())
    (root / PROGRAM).parent.mkdir(parents=True)
    (root / PROGRAM).symlink_to(elsewhere)
    run = run_agent(["update", "--root", str(root)])
    assert (run.reply["error"]["code"], run.reply["error"]["reason"]) == (
        "install_failed",
        "ELOOP",
    )
    assert elsewhere.read_bytes() == old_agent()
    assert (root / PROGRAM).is_symlink()


def test_update_on_nixos(tmp_path: Path) -> None:
    root = nixos_root(tmp_path)
    (root / PROGRAM).parent.mkdir(parents=True)
    (root / PROGRAM).write_bytes(old_agent())
    run = run_agent(["update", "--root", str(root)])
    assert run.reply["error"]["code"] == "nixos"
    assert "Nix store" in run.reply["error"]["message"]
    assert (root / PROGRAM).read_bytes() == old_agent()


@pytest.mark.parametrize(
    "args",
    [["--colour"], ["--prefix"], ["--prefix", "relative/dir"], ["--root=/x", "y"]],
)
def test_update_argument_errors(tmp_path: Path, args: list[str]) -> None:
    run = run_agent(["update", *args])
    assert run.reply["error"]["code"] == "bad_request", args


def test_a_failed_update_leaves_the_old_program(tmp_path: Path) -> None:
    """The new program cannot be written in full (as on a full disk): the old
    one stays, and no temporary file."""
    root = tmp_path / "root"
    program = installed(root, old_agent())
    before = tree(root)
    with file_size_limit(len(agent_bytes()) // 2):
        run = run_agent(["update", "--root", str(root)])
    assert run.reply["error"]["code"] == "install_failed"
    assert run.reply["error"]["reason"] == "EFBIG"
    assert f"{program} is as it was" in run.reply["error"]["message"]
    assert tree(root) == before


def test_a_read_only_update_leaves_the_old_program(tmp_path: Path) -> None:
    root = tmp_path / "root"
    installed(root, old_agent())
    before = tree(root)
    bin_dir = root / PROGRAM.rsplit("/", 1)[0]
    reply = run_read_only(bin_dir, agent_argv("update", "--root", str(root)))
    assert (reply["error"]["code"], reply["error"]["reason"]) == (
        "install_failed",
        "EROFS",
    )
    assert tree(root) == before


def test_the_marker_is_the_agents_first_line() -> None:
    """update knows the agent by the marker line of the built file's prefix,
    the first line of the package's docstring, as a 0.3 agent's was."""
    assert gpu_handoff.__doc__ is not None
    assert agent_install.AGENT_MARKER.decode() == gpu_handoff.__doc__.splitlines()[0]
    assert f"# {agent_install.AGENT_MARKER.decode()}" == build.MARKER
    assert agent_install.AGENT_MARKER in agent_bytes()[: agent_install.AGENT_HEAD]
