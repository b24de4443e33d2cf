"""`install` into a relocated root: files, rollback, accounts and services.

useradd, usermod, userdel, gpasswd, systemctl and loginctl change this
machine's accounts and services: here they are recording stand-ins, alone on
the PATH the agent gets, and their decisions are tested directly (the real
ones run on a throwaway tower booted under its own systemd: tests/box/ and
tests/test_guided_install.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
from dataclasses import dataclass
import fcntl
import grp
import importlib.util
import io
import json
import os
from pathlib import Path
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import sys
from typing import Any
import zipfile

import pytest

from custom_components.gpu_handoff import protocol
from custom_components.gpu_handoff.tower import build
from custom_components.gpu_handoff.tower.gpu_handoff import (
    accounts as agent_accounts,
    config as agent_config,
    install as agent_install,
    jobs as agent_jobs,
    wire,
)
from tests.support.account import as_user, give, shared_dir, split_account
from tests.support.agentbuild import AGENT, agent_bytes, old_agent_bytes
from tests.support.fresh_tower import private_mounts_argv
from tests.tower import nodes
from tests.tower.conftest import REQUIRE_SYSTEM, Run, require_tool, run_agent
from tests.tower.test_build import compiled_at_start

# A libvirt the status check cannot reach: install does not wait for it.
NO_LIBVIRT = "test+unix:///default?socket=/nonexistent/libvirt-sock"


def install_args(
    root: Path, user: str, *extra: str, uri: str = NO_LIBVIRT
) -> list[str]:
    """install's arguments: the root, the user, two gaming VMs."""
    return [
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


def me() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def install_run(
    root: Path, *extra: str, uri: str = NO_LIBVIRT, env: dict[str, str] | None = None
) -> Run:
    """install in this process, as whoever runs the tests, for themselves."""
    return run_agent(install_args(root, me(), *extra, uri=uri), env=env)


def install(
    root: Path, *extra: str, uri: str = "test:///default"
) -> tuple[int, dict[str, object], str]:
    run = install_run(root, *extra, uri=uri)
    return run.rc, run.reply, run.stderr


def agent_argv(*args: str) -> list[str]:
    """The agent as a program of its own."""
    return [sys.executable, str(AGENT), *args]


def tree(top: Path) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Everything under `top`: mode, owner, inode and (files, links) content."""
    out: dict[str, tuple[int, int, int, bytes | None]] = {}
    for path in sorted(top.rglob("*")):
        st = path.lstat()
        content = None
        if stat.S_ISREG(st.st_mode):
            content = path.read_bytes()
        elif stat.S_ISLNK(st.st_mode):
            content = str(path.readlink()).encode()
        inode = 0 if stat.S_ISDIR(st.st_mode) else st.st_ino
        out[str(path.relative_to(top))] = (st.st_mode, st.st_uid, inode, content)
    return out


def old_agent() -> bytes:
    """This agent as release 0.2.0 would have installed it."""
    return old_agent_bytes(version="0.2.0")


def public_key(
    directory: Path, kind: str = "ed25519", comment: str = "ha", bits: int = 0
) -> str:
    """A new OpenSSH public key line made by ssh-keygen."""
    require_tool("ssh-keygen")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"id_{kind}_{len(list(directory.iterdir()))}"
    size = ["-b", str(bits)] if bits else []
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, *size, "-N", "", "-C", comment, "-f", path],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text(encoding="utf-8").strip()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG, as writes on a full disk
    fail (RLIMIT_FSIZE; SIGXFSZ ignored, so the write fails instead)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def private_mounts() -> tuple[str, ...] | None:
    """`unshare` arguments for a private mount namespace (root only), or None."""
    return private_mounts_argv() if os.geteuid() == 0 else None


def run_read_only(read_only: Path, argv: list[str]) -> dict[str, Any]:
    """`argv`'s JSON reply, run where `read_only` is a read-only bind mount of
    itself (a private mount namespace: nothing else sees it)."""
    unshare = private_mounts()
    if unshare is None:
        reason = "read-only mounts need root and a private mount namespace"
        if REQUIRE_SYSTEM:
            pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM=1)")
        pytest.skip(reason)
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    done = subprocess.run(
        [*unshare, "sh", "-c", script, str(read_only), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout, done.stderr
    reply: dict[str, Any] = json.loads(done.stdout)
    return reply


STAND_IN = """#!{python}
import json, os, sys, time
record = [{name!r}, *sys.argv[1:]]
with open({log!r}, "a", encoding="utf-8") as log:
    log.write(json.dumps({{"argv": record, "env": sorted(os.environ),
        "saw": os.path.exists({check!r}) if {check!r} else None}}) + "\\n")
time.sleep({sleep!r})
sys.stdout.write({stdout!r})
sys.stderr.write({stderr!r})
sys.exit({rc!r})
"""


@dataclass
class StandIns:
    """Recording stand-ins of administration programs, alone on a PATH."""

    directory: Path

    def __post_init__(self) -> None:
        self.bin = self.directory / "bin"
        self.bin.mkdir(parents=True)
        self.log = self.directory / "calls.jsonl"
        self.log.touch()

    def add(
        self,
        name: str,
        rc: int = 0,
        stderr: str = "",
        sleep: float = 0.0,
        check: str = "",
        stdout: str = "",
    ) -> None:
        """`name` records its arguments (and whether `check` exists), waits
        `sleep` seconds, writes `stdout` and `stderr` and exits with `rc`."""
        program = self.bin / name
        program.write_text(
            STAND_IN.format(
                python=sys.executable,
                name=name,
                log=str(self.log),
                check=check,
                sleep=sleep,
                stderr=stderr,
                stdout=stdout,
                rc=rc,
            ),
            encoding="utf-8",
        )
        program.chmod(0o755)

    def records(self) -> list[dict[str, Any]]:
        lines = self.log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines]

    def calls(self) -> list[list[str]]:
        return [record["argv"] for record in self.records()]

    @property
    def env(self) -> dict[str, str]:
        return {"PATH": str(self.bin)}


@pytest.fixture
def stand_ins(tmp_path: Path) -> StandIns:
    return StandIns(tmp_path / "admin")


def test_install_into_root(tmp_path: Path) -> None:
    require_tool("virsh")
    node = nodes.write_node_file(tmp_path / "node.xml")
    root = tmp_path / "root"
    rc, reply, stderr = install(root, uri=f"test://{node}")
    assert rc == 0, reply
    program = root / "usr/local/bin/gpu-handoff"
    assert program.read_bytes() == agent_bytes()
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
        "timeouts": agent_config.TIMEOUT_DEFAULTS,
    }
    assert agent_config.validate_config(config) == []
    assert (root / "var/lib/gpu-handoff").is_dir()
    hook = root / "etc/libvirt/hooks/qemu.d/gpu-handoff"
    assert hook.read_text(encoding="utf-8").splitlines()[-1] == (
        'exec /usr/local/bin/gpu-handoff --config /etc/gpu-handoff/config.json hook "$@"'
    )
    assert hook.read_text(encoding="utf-8") == agent_install.hook_script(
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


def compiled_from(cache: Path, program: bytes) -> bool:
    """Whether ``cache`` is the modules of the built ``program`` compiled for
    this Python: its header that of a checked hash-based pyc (PEP 552) whose
    hash is of every module of the package, by name, in name order."""
    with zipfile.ZipFile(io.BytesIO(program)) as zipped:
        named = sorted(
            (build.module_name(entry), zipped.read(entry))
            for entry in zipped.namelist()
            if entry.startswith(f"{build.PACKAGE}/")
        )
    key = b"".join(name.encode() + b"\0" + source + b"\0" for name, source in named)
    data = cache.read_bytes()
    return data[:8] == importlib.util.MAGIC_NUMBER + build.PYC_FLAGS and data[
        8:16
    ] == importlib.util.source_hash(key)


def test_install_leaves_the_program_compiled_for_this_python(
    tmp_path: Path,
) -> None:
    """Beside the program, its module compiled for the Python that ran the
    install (the tower's): each start of the agent (every command Home
    Assistant sends, every hook call) then skips its 60 ms compile."""
    root = tmp_path / "root"
    rc, reply, _ = install(root, uri=f"test+unix:///default?socket={tmp_path}/none")
    assert rc == 0, reply
    program = root / "usr/local/bin/gpu-handoff"
    cache = Path(build.cache_path(str(program)))
    assert str(cache) in reply["installed"]  # type: ignore[operator]
    assert compiled_from(cache, agent_bytes())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o644
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o755
    compiled = compiled_at_start((sys.executable, {}), program)
    assert compiled == [f"{program}/__main__.py"] * 2, compiled


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


@pytest.mark.parametrize(
    "uri",
    [
        "qemu+ext:///system?command=/tmp/x",
        "qemu+ssh://root@elsewhere/system?keyfile=/root/.ssh/id_ed25519",
        "qemu+tcp://elsewhere/system",
        "qemu:///system?socket=/tmp/fake-libvirt-sock",
        "qemu:///embed?root=/tmp/x",
        "test:///../etc/shadow",
    ],
)
def test_install_takes_only_this_machines_libvirt(tmp_path: Path, uri: str) -> None:
    """install runs as root and runs virsh with its URI (its status): a URI
    that names a host, or carries parameters, could run a program
    (ext's command), read a key (ssh's keyfile) or reach another machine as
    root. Refused before anything is written."""
    run = install_run(tmp_path / "root", "--uri", uri)
    assert run.reply["error"]["code"] == "bad_request", run.reply
    assert "is not this machine's libvirt" in run.reply["error"]["message"]
    assert not (tmp_path / "root").exists()


def test_install_refuses_an_account_of_user_id_0() -> None:
    """root, by name or by another name of user id 0, on the system it
    installs on: the agent needs no privilege, and the key its account gets
    must not get one. Refused before anything is written (this system's own
    install, without --root; its relative --config would refuse it next,
    before anything is written, were the check gone)."""
    for name in ("root", *(p.pw_name for p in pwd.getpwall() if p.pw_uid == 0)):
        argv = install_args(Path("/"), name, "--config", "relative/config.json")
        argv.remove("--root")
        argv.remove("/")
        run = run_agent(argv)
        assert run.reply["error"]["code"] == "bad_request", run.reply
        assert "user id 0" in run.reply["error"]["message"]
    assert not Path("/etc/gpu-handoff/config.json").exists()


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
        **agent_config.TIMEOUT_DEFAULTS,
        "agent": 240.0,
        "start": 12.5,
    }
    assert agent_config.validate_config(config) == []


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


# --- the reply ---------------------------------------------------------------------------


def test_install_reply_without_the_guided_options(tmp_path: Path) -> None:
    """Without the guided options, install touches no account, no service
    and no key: the notes say what is left to do by hand."""
    run = install_run(tmp_path / "root")
    assert run.rc == 0, run.reply
    reply = run.reply
    assert reply["user_created"] is False
    for absent in ("authorized_key", "libvirt_group", "libvirt_restart"):
        assert absent not in reply
    assert reply["authorized_keys_line"].endswith(agent_install.PLACEHOLDER_KEY)
    assert f"Add this line to ~{me()}/.ssh/authorized_keys:" in reply["notes"]
    assert f"usermod -aG libvirt {me()}" in run.stderr
    assert "systemctl restart libvirtd" in run.stderr


def test_usage_names_every_option() -> None:
    run = run_agent(["--help"])
    for option in (
        "--authorize-key",
        "--create-user",
        "--join-libvirt-group",
        "--restart-libvirt",
        "update [--prefix DIR] [--root DIR]",
    ):
        assert option in run.stderr


# --- a failed install leaves the tower as it was -----------------------------------------


def test_a_failed_install_leaves_the_root_as_it_was(tmp_path: Path) -> None:
    """The hook's place is taken (a directory): the program, the configuration
    and the state directory written before it are removed again, and so are
    the directories made for them."""
    root = tmp_path / "root"
    obstacle = root / "etc/libvirt/hooks/qemu.d/gpu-handoff"
    (obstacle / "keep").mkdir(parents=True)
    before = tree(root)
    run = install_run(root)
    assert run.rc == 1
    error = run.reply["error"]
    assert error["code"] == "install_failed"
    assert error["reason"] == "EISDIR"
    assert error["left"] == []
    assert str(obstacle) in error["message"]
    assert "undone" in error["message"]
    assert tree(root) == before
    assert run.stderr == ""
    # Home Assistant's parser reads such an error (its extra fields ignored).
    assert protocol.error_of(run.reply) == protocol.AgentError(
        code="install_failed", message=error["message"]
    )


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path) -> None:
    """The program cannot be written in full (as on a full disk): the half
    written copy is removed, and the directories made for it."""
    size = len(agent_bytes())
    with file_size_limit(size // 2):
        run = install_run(tmp_path / "root")
    assert run.reply["error"]["reason"] == "EFBIG"
    assert run.reply["error"]["left"] == []
    assert not (tmp_path / "root").exists()


def test_a_failed_reinstall_gives_the_previous_files_back(tmp_path: Path) -> None:
    """--force over an install whose last step fails (the user's home is
    missing under the root, so its key cannot be written): the previous
    program, configuration and hook come back byte for byte, with their
    modes and inodes, and the state directory its mode."""
    root = tmp_path / "root"
    assert install_run(root, "--timeout-agent", "240").rc == 0
    program = root / "usr/local/bin/gpu-handoff"
    program.write_bytes(old_agent())
    program.chmod(0o750)
    (root / "var/lib/gpu-handoff").chmod(0o750)
    before = tree(root)
    key = public_key(tmp_path / "keys")
    run = install_run(root, "--force", "--gaming", "win-3", "--authorize-key", key)
    assert run.rc == 1
    error = run.reply["error"]
    assert (error["code"], error["reason"], error["left"]) == (
        "install_failed",
        "ENOENT",
        [],
    )
    assert tree(root) == before


@pytest.mark.parametrize(
    ("read_only", "made"),
    [("usr/local", "usr/local/bin"), ("etc/libvirt", "etc/libvirt")],
    ids=["the program's", "the hook's"],
)
def test_a_read_only_target_is_undone(
    tmp_path: Path, read_only: str, made: str
) -> None:
    """A read-only directory: where the program goes (the first file; its
    directory is there), or where the hook goes (the last file; what was
    written before it is removed)."""
    root = tmp_path / "root"
    (root / made).mkdir(parents=True)
    before = tree(root)
    reply = run_read_only(root / read_only, agent_argv(*install_args(root, me())))
    assert reply["ok"] is False
    assert reply["error"]["code"] == "install_failed"
    assert reply["error"]["reason"] == "EROFS"
    assert reply["error"]["left"] == []
    assert tree(root) == before


def test_a_read_only_target_gives_the_previous_install_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert install_run(root).rc == 0
    program = root / "usr/local/bin/gpu-handoff"
    program.write_bytes(old_agent())
    before = tree(root)
    argv = install_args(root, me(), "--force", "--timeout-start", "60")
    reply = run_read_only(root / "etc/libvirt", agent_argv(*argv))
    assert (reply["error"]["reason"], reply["error"]["left"]) == ("EROFS", [])
    assert tree(root) == before


def test_a_non_root_install_without_write_access_is_undone() -> None:
    """Run by the SSH user itself (no root), where it may not write the hook."""
    account = split_account()
    with shared_dir() as base:
        root = base / "root"
        (root / "etc/libvirt").mkdir(parents=True)
        for path in (root, root / "etc"):
            give(path, account, 0o755)
        give(root / "etc/libvirt", account, 0o555)
        before = tree(root)
        done = as_user(account, agent_argv(*install_args(root, account.pw_name)))
        reply = json.loads(done.stdout)
        assert reply["error"]["reason"] == "EACCES", reply
        assert reply["error"]["left"] == []
        assert tree(root) == before


def test_undo_reports_what_it_could_not_undo(tmp_path: Path) -> None:
    """A directory the install made and someone filled meanwhile stays, and
    is named; the rest is still undone."""
    undo = agent_accounts.Undo()
    made = tmp_path / "made"
    agent_accounts.make_dirs(str(made / "sub"), undo)
    agent_accounts.install_file(str(made / "sub/file"), b"x", 0o644, undo)
    (made / "someone-else").write_text("theirs", encoding="utf-8")
    assert undo.rollback() == [str(made)]
    assert sorted(p.name for p in made.iterdir()) == ["someone-else"]


def test_a_successful_install_keeps_no_backup(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert install_run(root).rc == 0
    first = tree(root)
    assert install_run(root, "--force").rc == 0
    # The same names: the previous files' backups are gone.
    assert sorted(tree(root)) == sorted(first)


def test_install_refuses_a_relative_prefix(tmp_path: Path) -> None:
    run = install_run(tmp_path, "--prefix", "opt/gh")
    assert run.reply["error"]["code"] == "bad_request"
    assert "--prefix" in run.reply["error"]["message"]
    assert not any(tmp_path.iterdir())


# --- accounts: --create-user and --join-libvirt-group ------------------------------------


@pytest.mark.parametrize(
    "extra", [["--create-user"], ["--join-libvirt-group"]], ids=["create", "join"]
)
def test_account_options_are_refused_with_a_root(
    tmp_path: Path, stand_ins: StandIns, extra: list[str]
) -> None:
    """--root relocates files, not this system's accounts."""
    run = install_run(tmp_path / "root", *extra, env=stand_ins.env)
    assert run.reply["error"]["code"] == "bad_request"
    assert extra[0] in run.reply["error"]["message"]
    assert not (tmp_path / "root").exists()
    assert stand_ins.calls() == []


@pytest.mark.parametrize(
    "name", ["Admin", "-rf", "1ha", "a" * 33, "ha tower", "ha/tower", "ha$"]
)
def test_create_user_refuses_names_useradd_could_misread(
    tmp_path: Path, stand_ins: StandIns, name: str
) -> None:
    for argv in (
        install_args(tmp_path / "root", name, "--create-user"),
        [
            "install",
            "--user",
            name,
            "--gpu-node",
            "n",
            "--gaming",
            "g",
            "--create-user",
        ],
    ):
        run = run_agent(argv, env=stand_ins.env)
        assert run.reply["error"]["code"] == "bad_request", argv
        assert "--create-user" in run.reply["error"]["message"]
    assert not (tmp_path / "root").exists()
    assert stand_ins.calls() == []


def test_a_missing_user_without_create_user(stand_ins: StandIns) -> None:
    argv = [
        "install",
        "--user",
        "no-such-user-here",
        "--gpu-node",
        "n",
        "--gaming",
        "g",
    ]
    run = run_agent(argv, env=stand_ins.env)
    assert run.reply["error"]["code"] == "bad_request"
    assert "--create-user makes it" in run.reply["error"]["message"]
    assert stand_ins.calls() == []


def made_by_useradd(
    stand_ins: StandIns, home: Path
) -> Callable[[str], pwd.struct_passwd | None]:
    """lookup_account over the stand-in's own user database: a user exists
    once the stand-in useradd ran for it."""

    def lookup(name: str) -> pwd.struct_passwd | None:
        if not any(c[0] == "useradd" and c[-1] == name for c in stand_ins.calls()):
            return None
        return pwd.struct_passwd(
            (name, "*", os.getuid(), 54321, "", str(home), "/bin/sh")
        )

    return lookup


def test_create_user_runs_useradd_and_undo_runs_userdel(
    tmp_path: Path, stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_ins.add("useradd")
    stand_ins.add("userdel")
    monkeypatch.setattr(
        agent_accounts, "lookup_account", made_by_useradd(stand_ins, tmp_path / "home")
    )
    undo = agent_accounts.Undo()
    account = agent_accounts.create_user("ha-tower", stand_ins.env, undo)
    assert (account.pw_name, account.pw_gid) == ("ha-tower", 54321)
    useradd = ["useradd", "--create-home", "--user-group", "--shell", "/bin/sh"]
    assert stand_ins.calls() == [[*useradd, "--password", "*", "ha-tower"]]
    # A clean environment: PATH, and the C locale for messages a program reads.
    assert stand_ins.records()[0]["env"] == ["LC_ALL", "PATH"]
    assert undo.rollback() == []
    assert stand_ins.calls()[1:] == [["userdel", "--remove", "ha-tower"]]


def test_create_user_failures(stand_ins: StandIns) -> None:
    stand_ins.add("useradd", rc=9, stderr="useradd: user 'ha-tower' already exists\n")
    undo = agent_accounts.Undo()
    with pytest.raises(agent_accounts.StepError) as failed:
        agent_accounts.create_user("ha-tower", stand_ins.env, undo)
    assert failed.value.reason == "command"
    assert "exited with 9: useradd: user 'ha-tower' already exists" in str(failed.value)
    # useradd made nothing: nothing to remove.
    assert undo.rollback() == []
    assert [c[0] for c in stand_ins.calls()] == ["useradd"]
    # useradd says it made a user nobody can find; and userdel fails too.
    stand_ins.add("useradd")
    stand_ins.add("userdel", rc=6, stderr="userdel: user 'gh-ghost' does not exist")
    with pytest.raises(agent_accounts.StepError, match="there is no user 'gh-ghost'"):
        agent_accounts.create_user("gh-ghost", stand_ins.env, undo)
    assert undo.rollback() == ["user gh-ghost"]
    assert stand_ins.calls()[-1] == ["userdel", "--remove", "gh-ghost"]


def test_a_useradd_that_fails_half_way_is_undone(
    tmp_path: Path, stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    """useradd exits 12 when it cannot make the home directory, after it
    wrote the account: the install's rollback removes that account."""
    stand_ins.add(
        "useradd", rc=12, stderr="useradd: cannot create directory /home/ha-tower\n"
    )
    stand_ins.add("userdel")
    monkeypatch.setattr(
        agent_accounts, "lookup_account", made_by_useradd(stand_ins, tmp_path / "home")
    )
    undo = agent_accounts.Undo()
    with pytest.raises(agent_accounts.StepError, match="exited with 12"):
        agent_accounts.create_user("ha-tower", stand_ins.env, undo)
    assert undo.rollback() == []
    assert stand_ins.calls()[-1] == ["userdel", "--remove", "ha-tower"]


@contextlib.contextmanager
def holding_the_admin_lock(top: Path) -> Iterator[None]:
    """As an install or update that is still running there would."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_one_install_or_update_at_a_time(tmp_path: Path) -> None:
    """An install Home Assistant gave up on still runs on the tower as root;
    a retry beside it, or an update, is refused (translated as install_busy
    by Home Assistant), and changes nothing. Once it ends, they run."""
    root = tmp_path / "root"
    root.mkdir()
    with holding_the_admin_lock(root):
        run = install_run(root)
        assert run.reply["error"]["code"] == "install_failed", run.reply
        assert run.reply["error"]["reason"] == "EBUSY"
        assert "another install or update" in run.reply["error"]["message"]
        assert not any(root.iterdir())
    assert install_run(root).rc == 0
    before = tree(root)
    with holding_the_admin_lock(root):
        run = run_agent(["update", "--root", str(root)])
        assert run.reply["error"]["reason"] == "EBUSY", run.reply
    assert tree(root) == before
    assert run_agent(["update", "--root", str(root)]).rc == 0


def libvirt_group() -> grp.struct_group:
    try:
        return grp.getgrnam("libvirt")
    except KeyError:
        if REQUIRE_SYSTEM:
            pytest.fail("no group libvirt (GPU_HANDOFF_REQUIRE_SYSTEM=1)")
        pytest.skip("no group libvirt here")


def account(name: str, gid: int) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "*", 4321, gid, "", "/home/" + name, "/bin/sh"))


def test_libvirt_membership() -> None:
    group = grp.struct_group(("libvirt", "x", 990, ["ha", "other"]))
    assert agent_accounts.libvirt_membership(account("ha", 100), group) == "member"
    assert agent_accounts.libvirt_membership(account("primary", 990), group) == "member"
    assert agent_accounts.libvirt_membership(account("new", 100), group) == "add"
    assert agent_accounts.libvirt_membership(account("ha", 100), None) == "missing"


def test_join_libvirt_group(
    stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = libvirt_group()
    stranger = account("ha-tower", group.gr_gid + 1)
    assert "ha-tower" not in group.gr_mem
    for name in ("usermod", "gpasswd"):
        stand_ins.add(name)
    undo = agent_accounts.Undo()
    assert agent_accounts.join_libvirt_group(stranger, stand_ins.env, undo) == "added"
    assert stand_ins.calls() == [["usermod", "-aG", "libvirt", "ha-tower"]]
    assert undo.rollback() == []
    assert stand_ins.calls()[1:] == [["gpasswd", "--delete", "ha-tower", "libvirt"]]
    # Already in it (its primary group), or no such group: nothing runs.
    member = account("ha-tower", group.gr_gid)
    assert agent_accounts.join_libvirt_group(member, stand_ins.env, undo) == "member"
    monkeypatch.setattr(agent_accounts, "LIBVIRT_GROUP", "no-such-group-here")
    monkeypatch.setattr(agent_install, "LIBVIRT_GROUP", "no-such-group-here")
    assert agent_accounts.join_libvirt_group(stranger, stand_ins.env, undo) == "missing"
    assert len(stand_ins.calls()) == 2


def test_join_libvirt_group_failure(stand_ins: StandIns) -> None:
    libvirt_group()
    stand_ins.add("usermod", rc=6, stderr="usermod: user 'ha-tower' does not exist\n")
    undo = agent_accounts.Undo()
    with pytest.raises(agent_accounts.StepError, match="exited with 6") as failed:
        agent_accounts.join_libvirt_group(
            account("ha-tower", 4321), stand_ins.env, undo
        )
    assert failed.value.reason == "command"
    assert undo.rollback() == []
    assert len(stand_ins.calls()) == 1


def test_a_failed_install_removes_the_user_it_made(
    tmp_path: Path, stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps of `install --create-user --join-libvirt-group` (run here
    under a root, which the command line refuses for these options) fail at
    the hook: the files go, then the group membership, then the user, in
    that order."""
    libvirt_group()
    for name in ("useradd", "userdel", "usermod", "gpasswd"):
        stand_ins.add(name)
    made = made_by_useradd(stand_ins, tmp_path / "home")
    monkeypatch.setattr(agent_accounts, "lookup_account", made)
    monkeypatch.setattr(agent_install, "lookup_account", made)
    root = tmp_path / "root"
    (root / "etc/libvirt/hooks/qemu.d/gpu-handoff/keep").mkdir(parents=True)
    before = tree(root)
    opts = agent_install._install_options(
        [
            *["--user", "ha-tower", "--gpu-node", "n", "--gaming", "g"],
            *["--create-user", "--join-libvirt-group"],
        ],
        None,
    )
    files = {
        "root": str(root),
        "program_name": "/usr/local/bin/gpu-handoff",
        "config_name": "/etc/gpu-handoff/config.json",
        "program": str(root / "usr/local/bin/gpu-handoff"),
        "config": str(root / "etc/gpu-handoff/config.json"),
        "state": str(root / "var/lib/gpu-handoff"),
        "hook": str(root / "etc/libvirt/hooks/qemu.d/gpu-handoff"),
    }
    undo = agent_accounts.Undo()
    with pytest.raises(IsADirectoryError):
        agent_install._install_steps(
            opts=opts,
            account=None,
            files=files,
            data=agent_install._install_data(opts),
            env=stand_ins.env,
            undo=undo,
        )
    assert (root / "usr/local/bin/gpu-handoff").exists()
    assert undo.rollback() == []
    assert tree(root) == before
    assert [c[:2] for c in stand_ins.calls()] == [
        ["useradd", "--create-home"],
        ["usermod", "-aG"],
        ["gpasswd", "--delete"],
        ["userdel", "--remove"],
    ]


# --- administration programs and --restart-libvirt ------------------------------------------


def test_run_admin(stand_ins: StandIns) -> None:
    stand_ins.add("ok")
    agent_accounts.run_admin(["ok", "--flag", "a b", "*"], stand_ins.env)
    assert stand_ins.calls() == [["ok", "--flag", "a b", "*"]]
    stand_ins.add("fails", rc=3, stderr="first line\n  second   line\n")
    with pytest.raises(agent_accounts.StepError) as failed:
        agent_accounts.run_admin(["fails"], stand_ins.env)
    assert failed.value.message == "fails exited with 3: first line second line"
    stand_ins.add("chatty", rc=1, stderr="x" * 5000)
    with pytest.raises(agent_accounts.StepError) as failed:
        agent_accounts.run_admin(["chatty"], stand_ins.env)
    said = failed.value.message.split(": ", 1)[1]
    assert len(said) == agent_accounts.ADMIN_OUTPUT_MAX
    assert said.endswith("...")
    stand_ins.add("mute", rc=1)
    with pytest.raises(
        agent_accounts.StepError, match=r"exited with 1: \(it said nothing\)"
    ):
        agent_accounts.run_admin(["mute"], stand_ins.env)
    stand_ins.add("slow", sleep=30)
    with pytest.raises(agent_accounts.StepError, match=r"did not finish within 0\.5 s"):
        agent_accounts.run_admin(["slow"], stand_ins.env, timeout=0.5)
    broken = stand_ins.bin / "broken"
    broken.write_text("#!/nonexistent/interpreter\n", encoding="utf-8")
    broken.chmod(0o755)
    with pytest.raises(agent_accounts.StepError, match="No such file") as failed:
        agent_accounts.run_admin(["broken"], stand_ins.env)
    with pytest.raises(
        agent_accounts.StepError, match="absent is not on PATH"
    ) as failed:
        agent_accounts.run_admin(["absent"], stand_ins.env)
    assert failed.value.reason == "command"


def test_run_admin_without_a_path() -> None:
    """No PATH (a bare environment): the usual one of sudo, where the
    system's own harmless `true` and `false` live."""
    agent_accounts.run_admin(["true"], {})
    with pytest.raises(agent_accounts.StepError, match="false exited with 1"):
        agent_accounts.run_admin(["false"], {})


def test_restart_libvirt(stand_ins: StandIns) -> None:
    """Only the libvirt daemons that run are restarted: `systemctl
    is-active` prints one state per unit (systemctl(1)), "inactive" or
    "unknown" for one that does not run or does not exist, so a tower with
    the monolithic libvirtd never asks for a virqemud it lacks."""
    stand_ins.add("systemctl", stdout="active\nunknown\n")
    assert agent_accounts.restart_libvirt(stand_ins.env) == {
        "done": True,
        "restarted": ["libvirtd.service"],
        "message": "restarted libvirtd.service",
    }
    assert stand_ins.calls() == [
        ["systemctl", "is-active", "libvirtd.service", "virtqemud.service"],
        ["systemctl", "restart", "libvirtd.service"],
    ]
    # The modular daemons: virtqemud loads the QEMU hooks.
    stand_ins.add("systemctl", stdout="inactive\nactive\n")
    assert agent_accounts.restart_libvirt(stand_ins.env)["done"] is True
    assert stand_ins.calls()[-1] == ["systemctl", "restart", "virtqemud.service"]
    # Neither runs (socket activation between uses): nothing to restart,
    # the daemon reads the hook when it starts.
    stand_ins.add("systemctl", rc=3, stdout="inactive\ninactive\n")
    calls = len(stand_ins.calls())
    restart = agent_accounts.restart_libvirt(stand_ins.env)
    assert restart["done"] is True
    assert "loads the hook when it starts" in restart["message"]
    assert len(stand_ins.calls()) == calls + 1  # only the question
    # systemd is not running: said, not taken for "inactive".
    stand_ins.add(
        "systemctl",
        rc=1,
        stderr="System has not been booted with systemd as init system (PID 1).",
    )
    restart = agent_accounts.restart_libvirt(stand_ins.env)
    assert restart == {
        "done": False,
        "message": "systemctl is-active libvirtd.service virtqemud.service "
        "exited with 1: System has not been booted with systemd as init system "
        "(PID 1).",
    }
    (stand_ins.bin / "systemctl").unlink()
    restart = agent_accounts.restart_libvirt(stand_ins.env)
    assert restart["done"] is False
    assert "systemctl is not on PATH" in restart["message"]


def test_install_restarts_libvirt_once_everything_is_written(
    tmp_path: Path, stand_ins: StandIns
) -> None:
    root = tmp_path / "root"
    hook = root / "etc/libvirt/hooks/qemu.d/gpu-handoff"
    stand_ins.add("systemctl", check=str(hook), stdout="active\ninactive\n")
    run = install_run(root, "--restart-libvirt", env=stand_ins.env)
    assert run.rc == 0, run.reply
    assert run.reply["libvirt_restart"]["done"] is True
    assert [r["saw"] for r in stand_ins.records()] == [True, True]
    assert stand_ins.calls()[-1] == ["systemctl", "restart", "libvirtd.service"]
    assert "Restarted libvirtd" in run.stderr
    assert "systemctl restart libvirtd" not in run.stderr
    # A restart that fails is reported; the install stands.
    stand_ins.add("systemctl", rc=1, stderr="Failed to connect to bus")
    run = install_run(root, "--force", "--restart-libvirt", env=stand_ins.env)
    assert run.rc == 0, run.reply
    restart = run.reply["libvirt_restart"]
    assert restart["done"] is False
    assert "exited with 1: Failed to connect to bus" in restart["message"]
    assert hook.exists()
    assert "libvirtd was not restarted" in run.stderr
    assert "systemctl restart libvirtd" in run.stderr
    # Without the option, nothing is restarted.
    calls = len(stand_ins.calls())
    run = install_run(root, "--force", env=stand_ins.env)
    assert "libvirt_restart" not in run.reply
    assert len(stand_ins.calls()) == calls


def test_install_notes_follow_what_was_done() -> None:
    """The notes say what install did and leave out what it need not ask
    for (the account steps cannot run under a root: their notes here)."""
    opts = {"user": "ha-tower", "uri": "qemu:///system"}
    key = {"path": "/home/ha-tower/.ssh/authorized_keys", "action": "added"}
    done = {
        "user_created": True,
        "authorized_key": key,
        "libvirt_group": "added",
        "libvirt_restart": {"done": True, "restarted": ["libvirtd.service"]},
    }
    assert agent_install._install_notes(opts, done, "unused") == [
        "Made the user ha-tower (key logins only: no password).",
        f"Home Assistant's key is in {key['path']} (added).",
        "Added ha-tower to the libvirt group.",
        "Restarted libvirtd: it loads the new hook.",
    ]
    done["libvirt_restart"] = {"done": True, "restarted": [], "message": "none runs"}
    assert "libvirtd was not restarted: none runs." in agent_install._install_notes(
        opts, done, "unused"
    )
    done.update(user_created=False, libvirt_group="member")
    notes = agent_install._install_notes(opts, done, "unused")
    assert not any("libvirt group" in note or "Made" in note for note in notes)
    done["libvirt_group"] = "missing"
    notes = agent_install._install_notes(opts, done, "unused")
    assert (
        "This system has no libvirt group: ha-tower needs access to libvirt some "
        "other way (virsh -c qemu:///system must work as ha-tower)." in notes
    )


def test_an_install_failure_names_what_is_left() -> None:
    failure = agent_install._install_failed(
        agent_accounts.StepError("command", "install: useradd exited with 1: no"),
        ["/etc/gpu-handoff", "user ha-tower"],
    )
    assert failure.code == "install_failed"
    assert failure.message == (
        "install: useradd exited with 1: no; could not undo: /etc/gpu-handoff, "
        "user ha-tower"
    )
    assert failure.extra == {
        "reason": "command",
        "left": ["/etc/gpu-handoff", "user ha-tower"],
    }
    reply = wire.reply_error(failure.code, failure.message, **failure.extra)
    assert reply["error"] == {
        "code": "install_failed",
        "message": failure.message,
        "reason": "command",
        "left": ["/etc/gpu-handoff", "user ha-tower"],
    }
    assert agent_accounts.errno_name(OSError(30, "Read-only file system")) == "EROFS"
    assert agent_accounts.errno_name(OSError("no number")) == "unknown"


def test_the_state_directory_has_a_tmpfiles_entry(tmp_path: Path) -> None:
    """On a systemd system the install leaves systemd-tmpfiles a line for
    the state directory (made at boot if missing, owner and mode set back);
    the real systemd-tmpfiles reads it and makes the directory as install
    does. A failed install takes the line away with the rest."""
    require_tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "usr/lib/tmpfiles.d").mkdir(parents=True)
    run = install_run(root)
    assert run.rc == 0, run.reply
    entry = root / "etc/tmpfiles.d/gpu-handoff.conf"
    group = grp.getgrgid(os.getgid()).gr_name
    assert entry.read_text(encoding="utf-8").splitlines()[-1] == (
        f"d /var/lib/gpu-handoff 0700 {me()} {group} -"
    )
    assert stat.S_IMODE(entry.stat().st_mode) == 0o644
    assert str(entry) in run.reply["installed"]
    state = root / "var/lib/gpu-handoff"
    shutil.rmtree(state)
    subprocess.run(
        ["systemd-tmpfiles", f"--root={root}", "--create", str(entry)], check=True
    )
    info = state.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, os.getuid())
    # Without systemd-tmpfiles on the system, no line.
    bare = tmp_path / "bare"
    assert install_run(bare).rc == 0
    assert not (bare / "etc/tmpfiles.d").exists()
    # A failed install leaves no line behind.
    failing = tmp_path / "failing"
    (failing / "usr/lib/tmpfiles.d").mkdir(parents=True)
    (failing / "etc/libvirt/hooks").mkdir(parents=True)
    (failing / "etc/libvirt/hooks/qemu.d").write_text("a file, not a directory")
    run = install_run(failing)
    assert run.rc == 1
    assert not (failing / "etc/tmpfiles.d/gpu-handoff.conf").exists()


def test_the_ssh_user_lingers_where_systemd_runs(
    tmp_path: Path, stand_ins: StandIns, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user manager nothing keeps is stopped 10 s after the user's last
    session (logind.conf(5) UserStopDelaySec), and a job's unit in it with
    it: install makes the SSH user linger (loginctl enable-linger) where
    systemd is the init; undo turns it off again. A lingering user is left
    alone; without systemd there is nothing to do."""
    linger = tmp_path / "linger"
    linger.mkdir()
    running = tmp_path / "systemd"
    running.mkdir()
    monkeypatch.setattr(agent_accounts, "LINGER_DIR", str(linger))
    monkeypatch.setattr(agent_jobs, "LINGER_DIR", str(linger))
    monkeypatch.setattr(agent_accounts, "SYSTEMD_RUNTIME_DIR", str(running))
    monkeypatch.setattr(agent_jobs, "SYSTEMD_RUNTIME_DIR", str(running))
    stand_ins.add("loginctl")
    account = pwd.getpwuid(os.getuid())
    undo = agent_accounts.Undo()
    assert agent_accounts.enable_linger(account, stand_ins.env, undo) == "enabled"
    assert stand_ins.calls() == [["loginctl", "enable-linger", account.pw_name]]
    assert undo.rollback() == []
    assert stand_ins.calls()[-1] == ["loginctl", "disable-linger", account.pw_name]
    (linger / account.pw_name).touch()
    assert (
        agent_accounts.enable_linger(account, stand_ins.env, agent_accounts.Undo())
        == "already"
    )
    assert agent_jobs.user_lingers()
    (linger / account.pw_name).unlink()
    assert not agent_jobs.user_lingers()
    running.rmdir()
    assert (
        agent_accounts.enable_linger(account, stand_ins.env, agent_accounts.Undo())
        == "no_systemd"
    )
    assert len(stand_ins.calls()) == 2
    stand_ins.add("loginctl", rc=1, stderr="Could not enable linger: Access denied")
    running.mkdir()
    with pytest.raises(agent_accounts.StepError, match="Access denied"):
        agent_accounts.enable_linger(account, stand_ins.env, agent_accounts.Undo())
    notes = agent_install._install_notes(
        {"user": "gpu-handoff", "uri": "qemu:///system"},
        {"user_created": False, "linger": "enabled", "libvirt_restart": None},
        "unused",
    )
    assert (
        "gpu-handoff lingers (loginctl enable-linger): its jobs outlive the SSH "
        "session that starts them." in notes
    )
