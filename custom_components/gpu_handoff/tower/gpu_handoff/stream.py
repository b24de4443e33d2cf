"""Streams to Home Assistant: writes with a deadline, libvirt's events.

``watch`` (and a session) follow ``virsh event --loop`` in a child process and
the job records, and write what changed to a client that may be slow or gone;
a write that does not finish in time ends the stream, never the tower's work.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import selectors
import signal
import stat
import subprocess
import sys
import time

from .config import WRITE_TIMEOUT_DEFAULT, Config
from .jobs import _JOB_ERRORS, MAX_JOBS, job_summary, list_job_ids
from .state import existing_state_fd, open_lock_at, read_json_at, state_dir_fd
from .virsh import Virsh, VirshResult, parse_event
from .wire import (
    _STREAM_ERRORS,
    ERR_INTERNAL,
    ERR_LIBVIRT_UNREACHABLE,
    ERR_TOO_MANY_STREAMS,
    ERR_VIRSH_FAILED,
    ERR_VIRSH_MISSING,
    PROTOCOL,
    AgentError,
    JsonObj,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Tuple

# An event stream is up once its child has run this long: `virsh event` says
# nothing when it connects, and one that cannot connect ends within moments.
# Only then is an outage over, and a later loss news again.
EVENT_STEADY_SECONDS = 2.0
# Exception tuples are named: see wire.py.
_SELECT_ERRORS = (ValueError, OSError, AttributeError)


class StreamClosedError(Exception):
    """The client went away, or took nothing for write_timeout seconds."""


def _stream_fd(stream: IO[str]) -> Optional[int]:
    """The descriptor of a pipe or socket behind `stream` (flushed), else None."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except _STREAM_ERRORS:
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None
    stream.flush()
    return fd


def _write_bounded(fd: int, data: bytes, timeout: float) -> None:
    """Write all of `data`, giving up once the reader took nothing for `timeout` s."""
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        view = memoryview(data)
        since = time.monotonic()
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                written = 0
            if written:
                view = view[written:]
                since = time.monotonic()
                continue
            left = since + timeout - time.monotonic()
            if left <= 0:
                raise StreamClosedError(f"the client took nothing for {timeout:g} s")
            select.select([], [fd], [], left)
    finally:
        with contextlib.suppress(OSError):
            os.set_blocking(fd, blocking)


def _emit(
    stdout: IO[str], obj: JsonObj, timeout: float = WRITE_TIMEOUT_DEFAULT
) -> None:
    """One JSON line to the client; StreamClosedError once it is gone or stalled.

    To a pipe or socket (sshd's), bytes go straight to the descriptor, never
    waiting more than `timeout` seconds for the client to take some.
    """
    text = json.dumps(obj, sort_keys=True) + "\n"
    try:
        fd = _stream_fd(stdout)
        if fd is None:
            stdout.write(text)
            stdout.flush()
        else:
            _write_bounded(fd, text.encode(), timeout)
    except StreamClosedError:
        _discard_output(stdout)
        raise
    except _STREAM_ERRORS as err:
        _discard_output(stdout)
        raise StreamClosedError from err


def _discard_output(stdout: IO[str]) -> None:
    """Point the process's own stdout at /dev/null once its reader is gone.

    What could not be written stays buffered; Python flushes it again at exit
    and, failing, exits with status 120 instead of the one we return.
    """
    if stdout is not sys.__stdout__:
        return
    with contextlib.suppress(*_SELECT_ERRORS):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout.fileno())
        os.close(devnull)


def message(kind: str, **fields: Any) -> JsonObj:
    """A streamed line that is not a reply (hello, status, event, job, error)."""
    out: JsonObj = {"protocol": PROTOCOL, "type": kind}
    out.update(fields)
    return out


def _dies_with_parent() -> Optional[Callable[[], None]]:
    """A preexec_fn that has the child sent SIGTERM when this process ends
    (Linux's PR_SET_PDEATHSIG; None elsewhere): a stream killed outright
    leaves no `virsh event` behind."""
    try:
        import ctypes  # only where it exists

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # it ended before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


PR_SET_PDEATHSIG = 1


class EventChild:
    """`virsh event --loop --all --timestamp`, read without blocking.

    `watch` and `session` share it: they read when its pipe is readable, get
    the events of the complete lines so far, and why it ended once it has. It
    ends with the stream: closed by it, or sent SIGTERM when the stream's
    process ends any other way.
    """

    def __init__(self, virsh: Virsh) -> None:
        try:
            self.proc = subprocess.Popen(
                virsh.event_argv(
                    Virsh.check(["event", "--loop", "--all", "--timestamp"])
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=virsh.env,
                preexec_fn=_dies_with_parent(),  # noqa: PLW1509 - one call, async-signal-safe enough
            )
        except OSError as err:
            raise AgentError(
                ERR_VIRSH_MISSING, f"cannot run {virsh.path}: {err}"
            ) from None
        if self.proc.stdout is None:  # pragma: no cover - stdout=PIPE was given
            raise AgentError(ERR_INTERNAL, "no pipe from virsh event")
        self.stdout: IO[bytes] = self.proc.stdout
        os.set_blocking(self.stdout.fileno(), False)
        self.buffer = b""
        self.started = time.monotonic()

    def steady(self, now: float) -> bool:
        """Whether it has run for EVENT_STEADY_SECONDS and still runs."""
        return now - self.started >= EVENT_STEADY_SECONDS and self.proc.poll() is None

    def read(self) -> Tuple[List[JsonObj], Optional[JsonObj]]:
        """The events (of every domain) read now; the error once the child ended."""
        try:
            chunk = os.read(self.stdout.fileno(), 65536)
        except BlockingIOError:
            return [], None
        if not chunk:
            stderr = self.proc.stderr
            err = stderr.read().decode(errors="replace") if stderr else ""
            code = ERR_LIBVIRT_UNREACHABLE if "connect" in err else ERR_VIRSH_FAILED
            return [], {"code": code, "message": VirshResult(1, "", err).error_text()}
        self.buffer += chunk
        events: List[JsonObj] = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            event = parse_event(line.decode(errors="replace"))
            if event is not None:
                events.append(event)
        return events, None

    def close(self) -> None:
        """End the child (terminate; kill if it is still there after 5 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class JobScanner:
    """The `job` messages of records that changed since the last scan."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.seen: Dict[str, Tuple[str, int, int, int]] = {}

    def scan(self) -> List[JsonObj]:
        messages: List[JsonObj] = []
        seen: Dict[str, Tuple[str, int, int, int]] = {}
        ids = list_job_ids(self.cfg)[-MAX_JOBS:]
        with existing_state_fd(self.cfg.state_dir, "jobs") as jfd:
            if jfd is None:
                self.seen = seen
                return messages
            for job_id in ids:
                name = job_id + ".json"
                try:
                    st = os.stat(name, dir_fd=jfd, follow_symlinks=False)
                except OSError:
                    continue
                job = read_json_at(jfd, name)
                if not isinstance(job, dict):
                    continue
                # Records are replaced, never rewritten in place: a new inode
                # or size tells a change that fell in the same mtime tick.
                key = (str(job.get("state")), st.st_mtime_ns, st.st_ino, st.st_size)
                seen[job_id] = key
                if self.seen.get(job_id) == key:
                    continue
                try:
                    messages.append(
                        message("job", job=job_summary(job), steps=job["steps"])
                    )
                except _JOB_ERRORS:
                    continue
        self.seen = seen
        return messages


@contextlib.contextmanager
def stream_slot(cfg: Config) -> Iterator[None]:
    """One of max_streams slots, held while a `watch` or `session` runs.

    A slot is a flock on streams/slot-N.lock: a stream that ends, however it
    ends, frees its slot. None free: too_many_streams.
    """
    held: Optional[int] = None
    with state_dir_fd(cfg.state_dir, "streams") as dfd:
        for index in range(cfg.max_streams):
            name = f"slot-{index}.lock"
            fd = open_lock_at(dfd, name, os.path.join(cfg.state_dir, "streams", name))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            held = fd
            break
    if held is None:
        raise AgentError(
            ERR_TOO_MANY_STREAMS,
            f"{cfg.max_streams} watch and session streams are open on this tower "
            "already (max_streams); close one first",
        )
    try:
        yield
    finally:
        os.close(held)


class StreamEndError(BaseException):
    """SIGTERM or SIGHUP: a stream ends as at the end of its input.

    A BaseException, so that no handler of a single request catches it.
    """


def _end_stream(signum: int, frame: Any) -> None:
    raise StreamEndError


@contextlib.contextmanager
def ending_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end a stream cleanly (its `virsh event` with it)."""
    previous: Dict[signal.Signals, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, _end_stream)
        except ValueError:  # not the main thread (tests): no handlers
            break
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def verb_watch(cfg: Config, stdin: IO[str], stdout: IO[str]) -> int:
    with stream_slot(cfg):
        return _watch(cfg, stdin, stdout)


def _watch(cfg: Config, stdin: IO[str], stdout: IO[str]) -> int:
    child = EventChild(Virsh(cfg))
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ, "virsh")
    # A stdin that cannot be selected: only a broken stdout ends the stream.
    with contextlib.suppress(*_SELECT_ERRORS):
        sel.register(stdin, selectors.EVENT_READ, "stdin")
    jobs = JobScanner(cfg)
    managed = set(cfg.managed)
    timeout = cfg.write_timeout
    code = 0
    try:
        with ending_signals():
            jobs.scan()
            _emit(stdout, reply_ok(type="watching", domains=cfg.managed), timeout)
            running = True
            while running:
                for key, _ in sel.select(timeout=min(cfg.poll_interval, 0.5)):
                    if key.data == "stdin":
                        data = os.read(key.fd, 4096)
                        if not data:
                            running = False
                        continue
                    events, error = child.read()
                    for event in events:
                        if event["domain"] in managed:
                            _emit(stdout, message("event", **event), timeout)
                    if error is not None:
                        _emit(stdout, message("error", error=error), timeout)
                        code = 1
                        running = False
                        break
                if running:
                    for line in jobs.scan():
                        _emit(stdout, line, timeout)
    except (StreamClosedError, StreamEndError):
        code = 0
    finally:
        sel.close()
        child.close()
    return code
