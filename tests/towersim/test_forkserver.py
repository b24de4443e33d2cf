"""The simulated virsh through the fork server is the simulated virsh.

``bin/virsh`` hands each call to a server that has imported the simulator
(forkserver.py, client.c). The tests here run the same calls both ways:
through the client, and as the process of its own the client falls back to
(its configuration's ``exec`` lines), each on a tower of its own made
alike, and compare what a caller sees: output, errors, exit status, the
files a call writes and reads, what a signal does. How a call ran shows in
the simulator's record of it: a call run alone is the client's own process
(the client execs it), one the server ran is another process.
"""

from __future__ import annotations

from collections.abc import Callable
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.waiting import wait_until
from tests.towersim import DomainSpec, Tower, forkserver

pytestmark = pytest.mark.skipif(
    forkserver.client_binary() is None, reason="no C compiler: no client to test"
)
WAYS = ("served", "alone")


def make_tower(root: Path) -> Tower:
    tower = Tower.create(
        root,
        [DomainSpec("vm-a", agent_delay=0.0), DomainSpec("vm-b")],
        time_scale=0.01,
    )
    tower.set_screen("vm-a", width=7, height=5)
    return tower


@pytest.fixture
def towers(tmp_path: Path) -> dict[str, tuple[Tower, list[str]]]:
    """Two towers made alike, and the program each is asked with."""
    served = make_tower(tmp_path / "served")
    other = make_tower(tmp_path / "alone")
    return {"served": (served, [str(served.virsh)]), "alone": (other, alone(other))}


def alone(tower: Tower) -> list[str]:
    """The simulated virsh as a process of its own (the client's fallback)."""
    conf = (tower.bin / ".virsh.conf").read_text(encoding="utf-8").splitlines()
    return [line.removeprefix("exec=") for line in conf if line.startswith("exec=")]


def ask(
    program: list[str], *args: str, **kwargs: object
) -> tuple[int, bytes, bytes, int]:
    """Exit status, stdout, stderr and pid of one call."""
    proc = subprocess.Popen(  # type: ignore[call-overload]
        [*program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err, proc.pid


def subscribed(
    tower: Tower, seen: int, proc: subprocess.Popen[bytes]
) -> Callable[[], bool]:
    """Whether an event stream started after the first ``seen`` calls
    subscribed (``proc``, the stream's caller, still running)."""

    def check() -> bool:
        assert proc.poll() is None, "the event stream ended"
        return any(c.subscribed for c in tower.commands()[seen:])

    return check


SESSION = [
    ["list", "--all"],
    ["domstate", "--reason", "vm-b"],
    ["domstate", "nosuch"],
    ["start", "vm-b"],
    ["start", "vm-b"],
    ["list --name; domstate vm-b; bogus"],
    ["list --name; domstate nosuch; echo done"],
    ["--version"],
    ["--bogus"],
    [],
    ["qemu-agent-command", "vm-a", '{"execute":"guest-ping"}'],
    ["dumpxml", "vm-a"],
    ["shutdown", "--mode", "agent", "vm-a"],  # not running
]


def test_calls_are_the_same_served_or_alone(
    towers: dict[str, tuple[Tower, list[str]]],
) -> None:
    """The same calls on towers made alike: the same output, errors and exit
    statuses, recorded alike; a served call is another process than the
    client, a call run alone is the client itself."""
    seen: dict[str, list[tuple[int, bytes, bytes]]] = {}
    for way, (tower, program) in towers.items():
        seen[way] = []
        for args in SESSION:
            before = len(tower.commands())
            rc, out, err, pid = ask(program, "-c", tower.uri, *args)
            seen[way].append((rc, out, err))
            records = tower.commands()[before:]
            if args in (["--version"], ["--bogus"]):
                assert records == []  # options are read before anything is recorded
                continue
            assert [(r.argv, r.rc) for r in records] == [(["-c", tower.uri, *args], rc)]
            assert (records[0].pid == pid) == (way == "alone")
    assert seen["served"] == seen["alone"]
    assert seen["served"][3][0] == 0  # the start, then the one refused
    assert seen["served"][4][1:] == (b"\n", b"error: Domain is already active\n")


def test_the_callers_stdin_directory_and_umask(
    towers: dict[str, tuple[Tower, list[str]]], tmp_path: Path
) -> None:
    """A served call reads the caller's stdin and works in the caller's
    directory with the caller's umask: what it reads and writes is what a
    process of its own would have."""
    results: dict[str, tuple[Any, ...]] = {}
    for way, (_tower, program) in towers.items():
        where = tmp_path / f"{way}-cwd"
        where.mkdir()
        xml = ask(program, "dumpxml", "vm-a")[1]
        empty = ask(program, "create", "--file", "/dev/stdin", stdin=subprocess.DEVNULL)
        from_stdin = subprocess.run(
            [*program, "create", "--file", "/dev/stdin"],
            input=xml,
            capture_output=True,
            check=False,
        )
        (where / "vm.xml").write_bytes(xml)
        relative = ask(program, "create", "vm.xml", cwd=where)
        shot = ask(
            program,
            "screenshot",
            "vm-a",
            "--file",
            "shot.png",
            cwd=where,
            preexec_fn=lambda: os.umask(0o027),
        )
        results[way] = (
            empty[:3],
            (from_stdin.returncode, from_stdin.stdout, from_stdin.stderr),
            relative[:3],
            shot[:3],
            oct((where / "shot.png").stat().st_mode & 0o777),
        )
    assert results["served"] == results["alone"]
    empty, created, relative, shot, mode = results["served"]
    assert empty[0] == 1
    assert created == (0, b"Domain 'vm-a' created from /dev/stdin\n\n", b"")
    assert relative == (  # vm.xml was read
        1,
        b"\n",
        (
            b"error: Failed to create domain from vm.xml\n"
            b"error: Requested operation is not valid: domain 'vm-a' is already active\n"
        ),
    )
    assert (shot[0], mode) == (0, "0o640")


@pytest.mark.parametrize("way", WAYS)
def test_the_callers_time_zone(
    towers: dict[str, tuple[Tower, list[str]]], way: str, tmp_path: Path
) -> None:
    """A screenshot without a file name is named by the local time: the
    caller's time zone (TZ), whichever way the call runs."""
    _tower, program = towers[way]
    assert ask(program, "start", "vm-a")[0] == 0
    offset = 5 * 3600 + 17 * 60
    stamp = "%Y-%m-%d-%H:%M:%S"
    before = time.strftime(stamp, time.gmtime(time.time() + offset))
    rc, _out, err, _pid = ask(
        program,
        "screenshot",
        "vm-a",
        cwd=tmp_path,
        env={**os.environ, "TZ": "<+0517>-5:17"},
    )
    after = time.strftime(stamp, time.gmtime(time.time() + offset))
    assert rc == 0, err
    (path,) = tmp_path.glob("vm-a-*.png")
    assert before <= path.name.removeprefix("vm-a-").removesuffix(".png") <= after


@pytest.mark.parametrize("way", WAYS)
def test_sigint_ends_an_event_loop_sigterm_kills_it(
    towers: dict[str, tuple[Tower, list[str]]], way: str
) -> None:
    tower, program = towers[way]
    ends = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        seen = len(tower.commands())
        proc = subprocess.Popen(
            [*program, "event", "--loop", "--all"], stdout=subprocess.PIPE
        )
        wait_until(
            subscribed(tower, seen, proc), timeout=20, what="the stream to subscribe"
        )
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
        ends.append((proc.returncode, out))
    assert ends == [
        (0, b"event loop interrupted\nevents received: 0\n\n"),
        (-signal.SIGTERM, b""),
    ]


@pytest.mark.parametrize("way", WAYS)
def test_a_signal_the_caller_ignores_stays_ignored(
    towers: dict[str, tuple[Tower, list[str]]], way: str
) -> None:
    """A caller that ignores SIGHUP and SIGINT (nohup, a shell's background
    job) starts virsh ignoring them: the event loop goes on after a SIGHUP,
    and ends at SIGINT, which virsh's event loop catches itself."""
    tower, program = towers[way]

    def ignoring() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [*program, "event", "--loop", "--all"],
        stdout=subprocess.PIPE,
        preexec_fn=ignoring,  # noqa: PLW1509 - signal dispositions only
    )
    wait_until(subscribed(tower, 0, proc), timeout=20, what="the stream to subscribe")
    proc.send_signal(signal.SIGHUP)
    # the SIGHUP is taken (or not) before the stream's next read, every 20 ms
    time.sleep(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0


def test_a_killed_client_takes_its_call_with_it(
    towers: dict[str, tuple[Tower, list[str]]],
) -> None:
    """SIGKILL cannot be passed on: the call the server runs for the client
    ends with the client's end of the socket, as the process of its own
    that the caller killed would have."""
    tower, program = towers["served"]
    proc = subprocess.Popen(
        [*program, "event", "--loop", "--all"], stdout=subprocess.PIPE
    )
    wait_until(subscribed(tower, 0, proc), timeout=20, what="the stream to subscribe")
    (stream,) = tower.commands()
    assert stream.pid != proc.pid
    assert Path(f"/proc/{stream.pid}").exists()
    proc.kill()
    proc.wait()
    wait_until(
        lambda: not Path(f"/proc/{stream.pid}").exists(),
        timeout=5,
        what="the served call to end",
    )


@pytest.mark.parametrize("change", ["uid", "mntns", "pidns", "socket"])
def test_the_client_runs_the_call_alone_where_the_server_cannot(
    towers: dict[str, tuple[Tower, list[str]]], change: str
) -> None:
    """Another user or namespace (the box tests' agent), or no server: the
    client runs the simulator itself, and the call is the same."""
    tower, program = towers["served"]
    expected = ask(program, "list", "--all")
    assert tower.commands()[-1].pid != expected[3]
    conf = tower.bin / ".virsh.conf"
    lines = conf.read_text(encoding="utf-8").splitlines()
    other = {"uid": "65534", "mntns": "1", "pidns": "1", "socket": "/nonexistent"}
    conf.write_text(
        "".join(
            f"{change}={other[change]}\n"
            if line.startswith(f"{change}=")
            else f"{line}\n"
            for line in lines
        ),
        encoding="utf-8",
    )
    rc, out, err, pid = ask(program, "list", "--all")
    assert (rc, out, err) == expected[:3]
    assert tower.commands()[-1].pid == pid


def test_the_server_lives_and_goes_with_the_process_that_made_it(
    tmp_path: Path,
) -> None:
    """The server's directory is the machine's temporary one, whatever a
    test made Python's (a test that checks what lands in its own must find
    nothing of the server's), and it is gone once the process that started
    the server ends."""
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    script = f"""
import sys, tempfile
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
tempfile.tempdir = {str(own_tmp)!r}
from tests.towersim import Tower, forkserver
Tower.create({str(tmp_path / "tower")!r})
(server,) = forkserver._servers.values()
print(server.socket, server.proc.pid, flush=True)
sys.stdin.read()
"""
    maker = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None
    socket_path, pid = maker.stdout.readline().split()
    directory = Path(socket_path).parent
    assert directory.parent == Path(os.environ.get("TMPDIR") or "/tmp")
    assert list(own_tmp.iterdir()) == []
    assert Path(socket_path).is_socket()
    served = Tower(tmp_path / "tower")
    assert ask([str(served.virsh)], "list", "--name")[0] == 0
    assert served.commands()[-1].pid != maker.pid
    maker.communicate("")  # ends
    wait_until(
        lambda: not Path(f"/proc/{pid}").exists() and not directory.exists(),
        timeout=10,
        what="the server and its directory to go",
    )
    # and the tower still answers: its client runs the simulator itself
    rc, _out, err, pid_alone = ask([str(served.virsh)], "list", "--name")
    assert rc == 0, err
    assert served.commands()[-1].pid == pid_alone


def test_a_signal_the_server_ignores_is_the_callers_to_decide(tmp_path: Path) -> None:
    """A server started ignoring SIGHUP (its process was) serves a caller
    that does not: the call dies of SIGHUP, as a process of its own does."""
    script = f"""
import signal, sys
signal.signal(signal.SIGHUP, signal.SIG_IGN)
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.towersim import Tower
Tower.create({str(tmp_path / "tower")!r})
print("made", flush=True)
sys.stdin.read()
"""
    maker = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert maker.stdout is not None
        assert maker.stdout.readline() == b"made\n"
        tower = Tower(tmp_path / "tower")
        ends = {}
        for way, program in (("served", [str(tower.virsh)]), ("alone", alone(tower))):
            seen = len(tower.commands())
            proc = subprocess.Popen(
                [*program, "event", "--loop", "--all"],
                stdout=subprocess.PIPE,
                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # noqa: PLW1509
            )
            wait_until(subscribed(tower, seen, proc), timeout=20, what="the stream")
            assert (tower.commands()[-1].pid == proc.pid) == (way == "alone")
            proc.send_signal(signal.SIGHUP)
            ends[way] = proc.wait(timeout=20)
        assert ends == {"served": -signal.SIGHUP, "alone": -signal.SIGHUP}
    finally:
        maker.communicate(b"")
