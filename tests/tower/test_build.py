"""The built agent: one executable file made from the agent's sources
(custom_components/gpu_handoff/tower/build.py).

The build must give the same bytes every time and on every Python the agent
claims; its prefix must say the version and the archive's hash without
running it, in the lines an ``update`` reads; and the file must do what the
source does, on Python 3.9 and on this one: answer, run a job through a
runner it spawns (itself, not the source), and install and update itself.
"""

from __future__ import annotations

from collections.abc import Callable
import hashlib
import json
import os
from pathlib import Path
import shutil
import stat
import subprocess
import sys
import time

import pytest

from custom_components.gpu_handoff.tower import build
from custom_components.gpu_handoff.tower.gpu_handoff import (
    install as agent_install,
    wire,
)
from tests.support.agentbuild import agent_variant
from tests.support.oldpython import oldest_python
from tests.support.testdriver import write_tower

BUILD = Path(build.__file__)
PACKAGE = BUILD.parent / build.PACKAGE


def agent_modules(program: Path) -> set[str]:
    """Each module of the agent's package as a start of ``program`` names
    it when it compiles it."""
    return {f"{program}/{entry}" for entry in build.package_modules()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("built") / "gpu-handoff"
    build.write(str(path))
    return path


@pytest.fixture(params=["newest", "oldest"])
def python(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """This Python, and the oldest the agent claims (3.9)."""
    if request.param == "newest":
        return sys.executable, {}
    return oldest_python()


def _run(
    python: tuple[str, dict[str, str]], *argv: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    interpreter, env = python
    return subprocess.run(
        [interpreter, "-I", "-S", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
        env={"PATH": os.environ.get("PATH", ""), **env},
    )


def _reply(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr
    reply: dict[str, object] = json.loads(done.stdout)
    return reply


def test_the_same_sources_build_the_same_bytes(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build.write(str(again))
    assert again.read_bytes() == built.read_bytes() == build.archive_bytes()
    assert stat.S_IMODE(built.stat().st_mode) == 0o755
    assert list(tmp_path.iterdir()) == [again]  # nothing staged is left


def test_the_oldest_python_builds_the_same_bytes(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu-handoff"
    done = _run(oldest_python(), str(BUILD), str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == built.read_bytes()


def test_the_prefix_says_version_and_hash_without_running(built: Path) -> None:
    data = built.read_bytes()
    version, digest = build.read_header(data)
    assert version == wire.VERSION
    head = data.split(b"\n", 4)
    assert head[:4] == [
        b"#!/usr/bin/env python3",
        agent_install.AGENT_MARKER.join([b"# ", b""]),
        f'VERSION = "{wire.VERSION}"'.encode(),
        f"# sha256 of the archive below: {digest}".encode(),
    ]
    assert hashlib.sha256(head[4]).hexdigest() == digest
    # What an update of either release looks for in an installed file.
    assert agent_install.AGENT_MARKER in data[: agent_install.AGENT_HEAD]
    other = build.archive_bytes(version="9.1.0")
    found = agent_install.VERSION_LINE_RE.search(other)
    assert found is not None
    assert found.group(1) == b"9.1.0"
    # The command prints the same.
    done = _run((sys.executable, {}), str(BUILD), "--header", str(built))
    assert done.stdout == f"{version} sha256={digest}\n"


def test_a_changed_or_damaged_archive_is_told_apart(
    built: Path, tmp_path: Path
) -> None:
    data = built.read_bytes()
    _, digest = build.read_header(data)
    damaged = bytearray(data)
    damaged[-100] ^= 0x01
    with pytest.raises(build.BuildError, match="does not match"):
        build.read_header(bytes(damaged))
    with pytest.raises(build.BuildError, match="not a built"):
        build.read_header((PACKAGE / "wire.py").read_bytes())
    sources = tmp_path / "sources"
    sources.mkdir()
    shutil.copy(BUILD, sources / BUILD.name)
    shutil.copytree(PACKAGE, sources / PACKAGE.name)
    module = sources / PACKAGE.name / "jobs.py"
    module.write_bytes(module.read_bytes() + b"# one more line\n")
    rebuilt = build.archive_bytes(str(sources))
    assert build.read_header(rebuilt)[1] != digest
    module.unlink()
    assert build.read_header(build.archive_bytes(str(sources)))[1] not in (
        digest,
        build.read_header(rebuilt)[1],
    )
    (sources / PACKAGE.name / "__init__.py").unlink()
    with pytest.raises(build.BuildError, match="not the agent's package"):
        build.archive_bytes(str(sources))
    shutil.rmtree(sources / PACKAGE.name)
    with pytest.raises(build.BuildError, match="cannot read"):
        build.archive_bytes(str(sources))
    (sources / BUILD.name).unlink()
    (sources / PACKAGE.name).mkdir()
    (sources / PACKAGE.name / "__init__.py").write_text("")
    with pytest.raises(build.BuildError, match="cannot read"):
        build.archive_bytes(str(sources))
    with pytest.raises(build.BuildError, match="not a version"):
        build.archive_bytes(version="1.0; rm")


def test_the_built_agent_answers_as_the_source_does(
    built: Path, python: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    config = write_tower(tmp_path / "tower")
    for verb in (["version"], ["--config", str(config), "status"]):
        from_file = _reply(_run(python, str(built), *verb))
        from_source = _reply(_run(python, str(PACKAGE), *verb))
        from_file.pop("time", None)
        from_source.pop("time", None)
        assert from_file == from_source
        assert from_file["ok"] is True


def test_the_built_agent_spawns_itself_as_a_jobs_runner(
    built: Path, python: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    """A job's runner is the built file again (program_path), not a path
    inside the archive: the job runs to its end."""
    config = write_tower(tmp_path / "tower")
    submitted = _reply(
        _run(python, str(built), "--config", str(config), "stop", "gaming-1")
    )
    job = submitted["job"]
    assert isinstance(job, dict)
    job_id = str(job["id"])
    deadline = time.monotonic() + 30  # a job of a domain that is off: a moment
    while time.monotonic() < deadline:
        answer = _reply(
            _run(python, str(built), "--config", str(config), "job", job_id)
        )
        job = answer["job"]
        assert isinstance(job, dict)
        if job["state"] in ("succeeded", "failed"):
            break
        time.sleep(0.05)
    assert job["state"] == "succeeded", job
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from gpu_handoff import accounts, jobs; "
        "print(jobs.program_path()); "
        "sys.stdout.flush(); "
        "sys.stdout.buffer.write(accounts.own_program())"
    )
    done = subprocess.run(
        [python[0], "-I", "-S", "-c", probe, str(built)],
        capture_output=True,
        timeout=60,
        check=True,
        env={"PATH": os.environ.get("PATH", ""), **python[1]},
    )
    path, _, program = done.stdout.partition(b"\n")
    assert path.decode() == os.path.realpath(built)
    assert program == built.read_bytes()


def test_the_built_agent_installs_and_updates_itself(
    built: Path, tmp_path: Path
) -> None:
    """install from the file puts the file on the tower; update from a newer
    build replaces it, reading the installed version from its prefix."""
    root = tmp_path / "root"
    me = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True)
    installed = _reply(
        _run(
            (sys.executable, {}),
            str(built),
            "install",
            "--root",
            str(root),
            "--user",
            me.stdout.strip(),
            "--gpu-node",
            "gpu-node",
            "--gaming",
            "win-1",
            "--uri",
            "test:///default",
        )
    )
    assert installed["ok"] is True
    program = root / "usr/local/bin/gpu-handoff"
    assert program.read_bytes() == built.read_bytes()
    newer = tmp_path / "newer"
    build.write(str(newer), build.archive_bytes(version="0.9.0"))
    updated = _reply(
        _run((sys.executable, {}), str(newer), "update", "--root", str(root))
    )
    assert (updated["previous"], updated["version"]) == (wire.VERSION, wire.VERSION)
    assert program.read_bytes() == newer.read_bytes()
    again = _reply(
        _run((sys.executable, {}), str(built), "update", "--root", str(root))
    )
    assert again["previous"] == "0.9.0"
    assert program.read_bytes() == built.read_bytes()


def test_the_build_command(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version, digest = build.read_header(built.read_bytes())
    out = tmp_path / "gpu-handoff"
    assert build.main([str(out)]) == 0
    assert out.read_bytes() == built.read_bytes()
    assert capsys.readouterr().out == (
        f"wrote {out}: gpu-handoff {version} sha256={digest}\n"
    )
    assert build.main(["--header", str(out)]) == 0
    assert capsys.readouterr().out == f"{version} sha256={digest}\n"
    # A file that is not a built agent, one that is not there, a bad call:
    # said on stderr, nothing written.
    assert build.main(["--header", str(BUILD)]) == 1
    assert capsys.readouterr().err == "build: not a built GPU Handoff agent\n"
    assert build.main(["--header", str(tmp_path / "none")]) == 1
    assert "No such file" in capsys.readouterr().err
    # A place the file cannot replace: nothing staged is left beside it.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    assert build.main([str(blocked)]) == 1
    assert "Is a directory" in capsys.readouterr().err
    blocked.rmdir()
    assert build.main([]) == 2
    assert build.main(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("usage: build.py OUT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-handoff"]


def test_sources_without_a_version_do_not_build(tmp_path: Path) -> None:
    shutil.copy(BUILD, tmp_path / "build.py")
    (tmp_path / PACKAGE.name).mkdir()
    (tmp_path / PACKAGE.name / "__init__.py").write_text('"""The package."""\n')
    (tmp_path / PACKAGE.name / "wire.py").write_text('"""No version here."""\n')
    with pytest.raises(build.BuildError, match="no VERSION line"):
        build.archive_bytes(str(tmp_path))
    with pytest.raises(build.BuildError, match="one line"):
        build.archive_bytes(version="1.0", interpreter="python3\nrm -rf /")


def compiled_at_start(python: tuple[str, dict[str, str]], program: Path) -> list[str]:
    """The sources a start of ``program`` (``version``) compiled, and then
    the imports of the modules a verb imports only when it runs (through
    the finder the start put in place), counted with the interpreter's own
    ``compile`` audit events; it must answer."""
    modules = sorted(
        entry.removesuffix(".py").replace("/", ".")
        for entry in build.package_modules()
        if not entry.endswith("__init__.py")
    )
    probe = (
        "import importlib, runpy, sys\n"
        "seen = []\n"
        "sys.addaudithook(lambda event, args: event == 'compile' "
        "and seen.append(str(args[1])))\n"
        "sys.argv = [sys.argv[1], 'version']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "sys.stderr.write(repr(seen))\n"
    )
    done = _run(python, "-c", probe, str(program))
    assert json.loads(done.stdout)["version"] == wire.VERSION, done.stderr
    return [name for name in eval(done.stderr) if name.endswith(".py")]  # noqa: S307


def test_a_start_compiles_the_agent_once(
    built: Path, python: tuple[str, dict[str, str]]
) -> None:
    """The archive's entry imports the agent's modules itself, compiling
    each once: an import through zipimport would compile each twice
    (find_spec's get_filename compiles it to learn its name), 60 ms more of
    every start on a tower."""
    compiled = compiled_at_start(python, built)
    # (runpy's own lookup compiles the few lines of __main__.py twice)
    agent = [name for name in compiled if name != f"{built}/__main__.py"]
    assert sorted(agent) == sorted(agent_modules(built)), compiled


def test_a_start_imports_only_what_its_verb_needs(built: Path) -> None:
    """A verb's heavier imports wait for the verb. A start that answers
    ``version`` imports none of install's, update's, the runner's, the
    session's or the screenshot's modules (its reply goes out through the
    stream's), nor typing, shutil, secrets, tempfile or socket. Those were a
    third of every start, the hook's too, which libvirt waits for: on the
    2-core test machine, ``version`` took about 55 ms of CPU before, 37 ms
    since, and a hook 55 ms and 35."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = [sys.argv[1], 'version']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write(repr(sorted(sys.modules)))\n"
    )
    done = _run((sys.executable, {}), "-c", probe, str(built))
    assert json.loads(done.stdout)["version"] == wire.VERSION, done.stderr
    imported = set(eval(done.stderr))  # noqa: S307 - our own probe's repr
    assert "gpu_handoff.cli" in imported
    lazy = {
        *(f"gpu_handoff.{name}" for name in ("install", "update", "accounts", "keys")),
        *(f"gpu_handoff.{name}" for name in ("runner", "session")),
        "gpu_handoff.screenshot",
        *("typing", "shutil", "secrets", "tempfile", "socket"),
    }
    assert imported & lazy == set()


def _with_cache(directory: Path) -> Path:
    directory.mkdir(parents=True)
    program = directory / "gpu-handoff"
    build.write(str(program))
    cache = Path(build.write_cache(str(program)))
    assert cache == directory / "__pycache__" / (
        f"gpu-handoff.{sys.implementation.cache_tag}.pyc"
    )
    assert stat.S_IMODE(cache.stat().st_mode) == 0o644
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o755
    return program


def test_a_start_with_its_compiled_module_compiles_nothing(
    tmp_path: Path, python: tuple[str, dict[str, str]]
) -> None:
    """``install`` and ``update`` leave the modules compiled for the tower's
    Python beside the program (build.write_cache): a start then compiles
    none of the agent. Another Python (3.9 here) finds none of its own and
    compiles each, as without."""
    program = _with_cache(tmp_path / "bin")
    compiled = compiled_at_start(python, program)
    if python[0] == sys.executable:
        assert set(compiled) == {f"{program}/__main__.py"}, compiled
    else:
        agent = [name for name in compiled if name != f"{program}/__main__.py"]
        assert sorted(agent) == sorted(agent_modules(program)), compiled


def _other_source(program: Path) -> None:
    other = agent_variant(program.parent / "other", version="9.9.9")
    cache = Path(build.write_cache(str(other)))
    shutil.copy(cache, build.cache_path(str(program)))


def _chmod_file(program: Path) -> None:
    Path(build.cache_path(str(program))).chmod(0o664)


def _chmod_directory(program: Path) -> None:
    Path(build.cache_path(str(program))).parent.chmod(0o775)


def _chown(program: Path) -> None:
    os.chown(build.cache_path(str(program)), 65534, 65534)


def _damage(program: Path) -> None:
    cache = Path(build.cache_path(str(program)))
    cache.write_bytes(cache.read_bytes()[:16] + b"\xff not marshal")


def _magic(program: Path) -> None:
    cache = Path(build.cache_path(str(program)))
    data = bytearray(cache.read_bytes())
    data[0] ^= 0x01
    cache.write_bytes(bytes(data))


def _fifo(program: Path) -> None:
    cache = Path(build.cache_path(str(program)))
    cache.unlink()
    os.mkfifo(cache, 0o644)


def _symlink(program: Path) -> None:
    cache = Path(build.cache_path(str(program)))
    elsewhere = program.parent / "elsewhere.pyc"
    cache.rename(elsewhere)
    cache.symlink_to(elsewhere)


@pytest.mark.parametrize(
    "spoil",
    [
        _other_source,
        _chmod_file,
        _chmod_directory,
        _chown,
        _damage,
        _magic,
        _fifo,
        _symlink,
    ],
    ids=lambda spoil: spoil.__name__.strip("_"),
)
def test_a_compiled_module_is_used_only_if_it_is_the_programs_own(
    tmp_path: Path, spoil: Callable[[Path], None]
) -> None:
    """The compiled module runs as the program does (as root, in libvirt's
    hook): it is used only if it was compiled from this program's very
    source (its hash, PEP 552) for this Python (the magic number), is a
    regular file, and only the program's owner can have written it (its
    and its directory's owner, no group or other write). Otherwise the
    start compiles the source, as without one; a fifo does not hang it."""
    program = _with_cache(tmp_path / "bin")
    spoil(program)
    compiled = compiled_at_start((sys.executable, {}), program)
    agent = [name for name in compiled if name != f"{program}/__main__.py"]
    assert sorted(agent) == sorted(agent_modules(program)), compiled
