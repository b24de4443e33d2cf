"""The simulated ``virsh`` without a Python start per call: a fork server.

The real ``virsh`` is a small client of libvirtd; the simulated one was a
Python process per call (about 14 ms of CPU, 26 ms on the busy test machine,
thousands of calls a run), most of it starting Python and importing the
simulator. Now ``bin/virsh`` is a small C program (client.c) that hands its
call to a server which has imported the simulator once: the server forks,
and the copy runs the call exactly as the process of its own did, with the
caller's stdin, stdout and stderr (passed over the socket), arguments,
environment, working directory and umask, while the client waits and ends
as the copy ends (its exit code or its signal). The signals a caller sends
the client reach the copy, and a client killed outright takes the copy with
it (SIGIO from the socket), so a caller that kills ``virsh`` at its timeout
sees what it saw before. Each call is still its own process with its own
pid, which the simulator's records and the qemu hook's bookkeeping use.

Where the client cannot use the server (another user, another mount or PID
namespace: the box tests' agent; no server; no C compiler on the machine)
it runs the simulator as its own Python process, as before.

One server per Python (and environment) a test process creates towers
with; it serves every tower (the call names its state directory) and ends
with the process that started it (a pipe it holds). ``systemd-run`` and the
supervisor it starts stay processes of their own: a detached unit must not
be tied to the call that made it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
import socket
import subprocess
import sys
import time
from typing import NamedTuple


class Call(NamedTuple):
    """One client's request (client.c's ``request``), and its stdin, stdout
    and stderr."""

    state: str
    tool: str
    cwd: str
    umask: int
    ignored: int  # the signals the client was started ignoring, as a mask
    session: int
    argv: list[str]
    env: list[str]
    fds: list[int]

    @classmethod
    def parse(cls, data: bytes, fds: list[int]) -> Call:
        fields = [os.fsdecode(f) for f in data.split(b"\0")[:-1]]
        state, tool, cwd, umask, ignored, session, argc = fields[:7]
        end = 7 + int(argc)
        return cls(state, tool, cwd, int(umask, 8), int(ignored), int(session),
                   fields[7:end], fields[end:], fds)  # fmt: skip


# The server's replies: the process that runs the call, then its wait status.
STARTED, ENDED = b"P", b"S"
HEADER = 4  # the request's length, native byte order (the client's uint32_t)


# --- the test process's side ------------------------------------------------


class Server:
    """A running fork server: what a tower's client configuration names."""

    def __init__(self, socket: str, proc: subprocess.Popen[bytes], keep: int) -> None:
        self.socket = socket
        self.proc = proc
        self._keep = keep  # the pipe's end whose closing ends the server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def config(
        self, *, state: str, tool: str, fallback: list[str], env: dict[str, str]
    ) -> str:
        """The client's configuration (its ``.NAME.conf``)."""
        lines = [
            f"socket={self.socket}",
            f"uid={os.getuid()}",
            f"mntns={Path('/proc/self/ns/mnt').stat().st_ino}",
            f"pidns={Path('/proc/self/ns/pid').stat().st_ino}",
            f"state={state}",
            f"tool={tool}",
            *(f"exec={word}" for word in fallback),
            *(f"env={k}={v}" for k, v in env.items()),
        ]
        if any("\n" in line or "\0" in line for line in lines):
            raise ValueError("a line of the client's configuration has a newline")
        return "".join(f"{line}\n" for line in lines)


_servers: dict[tuple[str, tuple[tuple[str, str], ...]], Server] = {}


def server_for(python: str, env: dict[str, str]) -> Server | None:
    """This process's fork server for ``python`` run with ``env`` (started
    at the first call), or None where there is no client (no C compiler)."""
    if client_binary() is None:
        return None
    key = (python, tuple(sorted(env.items())))
    server = _servers.get(key)
    if server is None or not server.alive():
        server = _servers[key] = _start(python, env)
    return server


def _start(python: str, env: dict[str, str]) -> Server:
    import tempfile

    # in the machine's temporary directory whatever a test made Python's
    # (a test that checks what lands in its own must not find it there)
    directory = Path(tempfile.mkdtemp(prefix="towersim-", dir=_machine_tmp()))
    socket_path = str(directory / "s")  # short: a socket's path has 107 bytes
    keep_read, keep = os.pipe()
    here = Path(__file__).resolve()
    server = [str(here), "serve", str(here.parents[2]), socket_path]
    log_path = directory / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [python, "-I", "-S", *server, str(keep_read), ",".join(env)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            pass_fds=(keep_read,),
            env={"PATH": os.environ.get("PATH", os.defpath), **env},
        )
    os.close(keep_read)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    proc.stdout.close()
    if ready != b"ready\n":
        os.close(keep)
        proc.wait()
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        raise RuntimeError(f"the fork server did not start: {log_text}")
    return Server(socket_path, proc, keep)


def _machine_tmp() -> str:
    return os.environ.get("TMPDIR") or "/tmp"  # as tempfile's first choice


@functools.cache
def client_binary() -> Path | None:
    """client.c built for this machine (once per source, in the repository's
    ``.build``; looked for once per process), or None if the machine has no
    C compiler."""
    import hashlib
    import shutil

    source = Path(__file__).with_name("client.c")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    built = source.parents[2] / ".build" / f"towersim-virsh-{digest}"
    if built.exists():
        return built
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    built.parent.mkdir(mode=0o755, exist_ok=True)
    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")
    subprocess.run(
        [cc, "-O2", "-Wall", "-o", str(partial), str(source)],
        check=True,
        capture_output=True,
    )
    partial.replace(built)  # whole, whichever worker built it
    return built


# --- the server -------------------------------------------------------------


def serve(socket_path: str, keep_fd: int, env_names: list[str]) -> None:
    import fcntl  # noqa: F401 - what the copies use, imported once
    import select
    import signal  # noqa: F401 - as the simulator's hooks import it

    # the simulator, imported once for every call
    from tests.towersim import domxml, entry, hooks, lean, model, virsh  # noqa: F401

    overrides = {name: os.environ[name] for name in env_names if name}
    # what is imported stays out of the copies' garbage collections, which
    # would otherwise write to (and so copy) every page of it
    import gc

    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(128)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    poller.register(keep_fd, select.POLLIN)
    calls: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, connection)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.close(1)
    os.open(os.devnull, os.O_WRONLY)  # fd 1 again, for the copies' dup2
    while True:
        for fd, _event in poller.poll():
            if fd == keep_fd:  # the test process is gone: so is the server
                directory = Path(socket_path).parent
                for path in (Path(socket_path), directory / "server.log"):
                    path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    directory.rmdir()
                return
            if fd == listener.fileno():
                conn, _ = listener.accept()
                started = _fork(conn, listener, keep_fd, calls, overrides)
                if started is not None:
                    calls[started[0]] = (started[1], conn)
                    poller.register(started[0], select.POLLIN)
                else:
                    conn.close()
                continue
            pid, conn = calls.pop(fd)
            poller.unregister(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            # OSError: the client is gone (killed), and its copy went with it
            with contextlib.suppress(OSError):
                conn.sendall(ENDED + status.to_bytes(4, sys.byteorder, signed=True))
            conn.close()


def _request(conn: socket.socket) -> Call | None:
    """A client's whole request and its three descriptors, or None."""
    conn.settimeout(5)
    fds: list[int] = []
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
        size = int.from_bytes(data[:HEADER], sys.byteorder) + HEADER
        while len(fds) == 3 and HEADER <= len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                break
            data += more
    except OSError:
        data = b""
    conn.settimeout(None)
    if len(fds) == 3 and len(data) >= HEADER and len(data) == size:
        return Call.parse(data[HEADER:], fds)
    for fd in fds:
        os.close(fd)
    return None


def _fork(
    conn: socket.socket,
    listener: socket.socket,
    keep_fd: int,
    calls: dict[int, tuple[int, socket.socket]],
    overrides: dict[str, str],
) -> tuple[int, int] | None:
    """Read a call and fork its copy: (its pidfd, its pid), or None if the
    request was incomplete (the client died or broke off: nothing runs, and
    a client still there reports the call failed)."""
    call = _request(conn)
    if call is None:
        return None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the copy (its coverage is not collected)
        try:
            _in_copy(call, conn, listener, keep_fd, calls, overrides)
        except BaseException:  # noqa: BLE001 - the copy itself broke
            import traceback

            traceback.print_exc()
        finally:
            os._exit(70)
    for fd in call.fds:
        os.close(fd)
    conn.sendall(STARTED + pid.to_bytes(4, sys.byteorder, signed=True))
    return os.pidfd_open(pid), pid


def _in_copy(
    call: Call,
    conn: socket.socket,
    listener: socket.socket,
    keep_fd: int,
    calls: dict[int, tuple[int, socket.socket]],
    overrides: dict[str, str],
) -> None:
    """The call, in the forked copy: as ``sys.exit(run(...))`` in a Python
    of its own with the client's stdio, environment, directory, umask and
    ignored signals, and the client's session where the simulator asks for
    the caller's (hooks.CALLER)."""
    import fcntl
    import io
    import select
    import signal

    # nothing of the server's stays open in the copy but its own connection
    for pidfd, (_pid, other) in calls.items():
        os.close(pidfd)
        os.close(other.detach())
    os.close(listener.detach())
    os.close(keep_fd)
    own = conn.detach()
    # named as the process it stands for (ps, top; the server is python)
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:  # noqa: PTH123
        comm.write(call.tool)
    for target, fd in enumerate(call.fds):
        os.dup2(fd, target)
        os.close(fd)
    # the client's end closing (it was killed) ends this copy: SIGIO, whose
    # default is to terminate
    fcntl.fcntl(own, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(own, fcntl.F_SETFL, fcntl.fcntl(own, fcntl.F_GETFL) | os.O_ASYNC)
    hung_up = select.poll()
    hung_up.register(own, select.POLLIN | select.POLLHUP)
    if hung_up.poll(0):  # it was, before the signal was armed
        os.kill(os.getpid(), signal.SIGIO)
    _fresh_dispositions(call.ignored)
    os.umask(call.umask)
    with contextlib.suppress(OSError):  # as a process started in a gone one
        os.chdir(call.cwd)
    os.environ.clear()
    for item in call.env:
        name, sep, value = item.partition("=")
        if sep and name:
            os.environ[name] = value
    os.environ.update(overrides)
    time.tzset()  # the caller's TZ, as a process of its own reads it
    errors = _stdio_errors(os.environ)
    for stream in (sys.stdin, sys.stdout):
        assert isinstance(stream, io.TextIOWrapper)
        stream.reconfigure(
            errors=errors, line_buffering=stream is sys.stdout and os.isatty(1)
        )
    sys.argv = [f"<{call.tool} of the tower in {call.state}>", *call.argv]
    from tests.towersim import hooks
    from tests.towersim.entry import run

    hooks.CALLER["session"] = call.session

    try:
        code = _exit_code(run(call.state, call.tool, call.argv, []))
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - as Python's own top level
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
    except OSError:
        code = 120  # Python's exit code when stdout cannot be flushed at exit
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


def _fresh_dispositions(ignored: int) -> None:
    """The signal dispositions of a Python started by the client: the
    signals the client was started ignoring stay ignored (SIGINT's handler
    is Python's only if it was not), SIGPIPE and SIGXFSZ are ignored (Python
    ignores them at its start), the rest are the default, whatever the
    server itself was started with."""
    import signal

    python_ignores = {signal.SIGPIPE, signal.SIGXFSZ}
    for number in range(1, 32):  # the standard signals (Linux numbers them so)
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if ignored & (1 << (number - 1)) or number in python_ignores:
            wanted: object = signal.SIG_IGN
        elif number == signal.SIGINT:
            wanted = signal.default_int_handler
        else:
            wanted = signal.SIG_DFL
        if signal.getsignal(number) is not wanted:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(number, wanted)  # type: ignore[arg-type]


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _stdio_errors(env: os._Environ[str]) -> str:
    """stdin's and stdout's error handler in a Python started with ``env``:
    in the C or POSIX locale (or none) Python's UTF-8 mode uses
    surrogateescape, else strict (with -I, PYTHONUTF8 and PYTHONIOENCODING
    are ignored)."""
    for name in ("LC_ALL", "LC_CTYPE", "LANG"):
        value = env.get(name)
        if value:
            return "surrogateescape" if value in ("C", "POSIX") else "strict"
    return "surrogateescape"


if __name__ == "__main__":  # pragma: no cover - the server process
    if sys.argv[1:2] == ["serve"]:
        sys.path.insert(0, sys.argv[2])
        serve(sys.argv[3], int(sys.argv[4]), sys.argv[5].split(","))
