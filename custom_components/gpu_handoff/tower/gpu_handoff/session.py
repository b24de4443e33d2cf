"""The session verb: one connection, requests answered, status pushed.

A session answers request lines (each with its id) and pushes the tower's
status when libvirt's events or a job's record change it, coalesced, and at
least every ``session_refresh`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import time

from .config import Config
from .hook import _request_names
from .jobs import reap_runners
from .requests import check_request, check_request_id, run_request
from .state import existing_state_fd, internal_error, log_internal
from .status import status_body
from .stream import (
    _SELECT_ERRORS,
    EventChild,
    JobScanner,
    StreamClosedError,
    StreamEndError,
    _emit,
    ending_signals,
    message,
    stream_slot,
)
from .virsh import Virsh
from .wire import (
    ERR_BAD_REQUEST,
    ERR_INTERNAL,
    ERR_LIBVIRT_UNREACHABLE,
    ERR_NOT_ALLOWED,
    JOB_VERBS,
    SESSION_KEYS,
    SESSION_MAX_ID,
    SESSION_MAX_LINE,
    SESSION_VERBS,
    VERSION,
    AgentError,
    JsonObj,
    reply_error,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Optional, Tuple

# A burst of libvirt events (a start is four of them) is one recompute.
SESSION_COALESCE_SECONDS = 0.1
EVENT_RESTART_SECONDS = 5.0
# While libvirt does not answer (libvirtd restarting), its event stream is
# tried again this often, so that its return is seen at once.
EVENT_RETRY_UNREACHABLE = 0.5
# Status fields left out when deciding whether the status changed.
VOLATILE_STATUS_KEYS = ("virsh_calls",)


def _session_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str) and len(value) <= SESSION_MAX_ID


def parse_session_line(line: bytes) -> JsonObj:
    """One request line as an object with a valid id (not yet its verb)."""
    if len(line) > SESSION_MAX_LINE:
        raise AgentError(ERR_BAD_REQUEST, f"line longer than {SESSION_MAX_LINE} bytes")
    try:
        request = json.loads(line)
    except ValueError:
        raise AgentError(ERR_BAD_REQUEST, "not JSON") from None
    if not isinstance(request, dict):
        raise AgentError(ERR_BAD_REQUEST, "a request is a JSON object")
    if not _session_id(request.get("id")):
        raise AgentError(
            ERR_BAD_REQUEST,
            f"id must be an integer or a string of at most {SESSION_MAX_ID} characters",
        )
    return request


def _requests_state(cfg: Config) -> Tuple[Tuple[str, int, int], ...]:
    """Names, mtimes and sizes of the hook requests: changes when they do."""
    out = []
    with existing_state_fd(cfg.state_dir, "requests") as rfd:
        if rfd is None:
            return ()
        for name in _request_names(rfd):
            try:
                st = os.stat(name, dir_fd=rfd, follow_symlinks=False)
            except OSError:
                continue
            out.append((name, st.st_mtime_ns, st.st_size))
    return tuple(out)


class Session:
    """`session`: requests answered and the tower's state pushed, as JSON lines.

    One connection instead of one SSH command per question. The status is
    kept: recomputed after libvirt events, job record and hook request changes
    and every session_refresh seconds (guest-agent readiness and PCI ownership
    after a define raise no event), and pushed when it changed.
    """

    def __init__(
        self, cfg: Config, stdin: IO[str], stdout: IO[str], requested_by: str
    ) -> None:
        self.virsh = Virsh(cfg)
        self.cfg = cfg
        self.stdin = stdin
        self.stdout = stdout
        self.requested_by = requested_by
        self.managed = set(cfg.managed)
        self.sel = selectors.DefaultSelector()
        self.events: Optional[EventChild] = None
        # the failure of the event stream pushed last; None once libvirt
        # answers again with the stream running
        self.events_failure: Optional[JsonObj] = None
        self.restart_at = 0.0
        self.jobs = JobScanner(cfg)
        self.scanned_at = 0.0
        self.requests = _requests_state(cfg)
        self.body: Optional[JsonObj] = None
        self.failure: Optional[JsonObj] = None
        self.computed_at = 0.0
        self.pushed: Optional[JsonObj] = None
        self.dirty_at: Optional[float] = None
        self.pending = b""
        self.skipping = False
        self.open = True

    def send(self, obj: JsonObj) -> None:
        _emit(self.stdout, obj, self.cfg.write_timeout)

    def run(self) -> int:
        try:
            with ending_signals():
                self.jobs.scan()  # the records as they are now: pushed when they change
                # Listen before the first status. virsh says nothing once it
                # has registered for events, a moment after it starts: a
                # change in that moment is seen at the next event or refresh.
                failure = self.start_events()
                self.send(
                    message(
                        "hello",
                        ok=True,
                        version=VERSION,
                        verbs=sorted(SESSION_VERBS),
                        host_name=self.cfg.name,
                    )
                )
                self.recompute(force=True, drain=False)
                if failure is not None:
                    self.send(message("error", source="events", error=failure))
                self.attach_stdin()
                while self.open:
                    self.step()
        except (StreamClosedError, StreamEndError):
            pass
        finally:
            self.stop_events()
            self.sel.close()
            reap_runners()
        return 0

    # --- inputs

    def attach_stdin(self) -> None:
        try:
            self.sel.register(self.stdin, selectors.EVENT_READ, "stdin")
        except _SELECT_ERRORS:
            # Not a pipe or socket (a file; in memory in tests): read it all.
            try:
                data = self.stdin.read()
            except _SELECT_ERRORS:
                data = ""
            self.feed(data.encode() if isinstance(data, str) else bytes(data))
            self.end_of_input()

    def step(self) -> None:
        now = time.monotonic()
        wake = [
            now + min(self.cfg.poll_interval, 0.5),
            self.computed_at + self.cfg.session_refresh,
        ]
        if self.dirty_at is not None:
            wake.append(max(self.dirty_at, self.computed_at + SESSION_COALESCE_SECONDS))
        if self.events is None:
            wake.append(self.restart_at)
        for key, _ in self.sel.select(timeout=max(0.0, min(wake) - now)):
            if key.data == "stdin":
                self.read_stdin(key.fd)
            elif self.events is not None:
                self.read_events(self.events)
            if not self.open:
                return
        reap_runners()
        now = time.monotonic()
        if now - self.scanned_at >= SESSION_COALESCE_SECONDS:
            self.scan_jobs()
            requests = _requests_state(self.cfg)
            if requests != self.requests:
                self.requests = requests
                self.mark_dirty()
        if self.events is None and now >= self.restart_at:
            failure = self.start_events()
            if failure is None:
                self.mark_dirty()  # events were missed while it was down
            else:
                self.events_lost(failure)
        elif (
            self.events_failure is not None
            and self.events is not None
            and self.failure is None
            and self.events.steady(now)
        ):
            # libvirt answers and the stream stayed up: the outage is over,
            # a later loss is news (a child that dies as it starts is not up)
            self.events_failure = None
        if self.due(time.monotonic()):
            self.recompute()

    def scan_jobs(self) -> None:
        self.scanned_at = time.monotonic()
        for line in self.jobs.scan():
            self.send(line)
            self.mark_dirty()

    def read_stdin(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if data:
            self.feed(data)
        else:
            self.end_of_input()

    def feed(self, data: bytes) -> None:
        self.pending += data
        while True:
            cut = self.pending.find(b"\n")
            if self.skipping:
                # The rest of a line already answered as too long.
                if cut < 0:
                    self.pending = b""
                    return
                self.skipping = False
            elif cut < 0:
                if len(self.pending) > SESSION_MAX_LINE:
                    self.pending = b""
                    self.skipping = True
                    self.reply_too_long()
                return
            else:
                self.handle_line(self.pending[:cut])
            self.pending = self.pending[cut + 1 :]

    def end_of_input(self) -> None:
        if self.pending and not self.skipping:
            self.handle_line(self.pending)
        self.pending = b""
        self.open = False

    def read_events(self, child: EventChild) -> None:
        events, failure = child.read()
        for event in events:
            if event["domain"] in self.managed:
                self.send(message("event", **event))
            # Unmanaged domains too: they may hold the managed domains' cards.
            self.mark_dirty()
        if failure is not None:
            self.events_lost(failure)

    def events_lost(self, failure: JsonObj) -> None:
        """libvirt's event stream ended (libvirtd restarted or went away).

        The error is pushed once per outage (its code), not at every retry
        (the first says "Disconnected ...", the next ones "failed to
        connect"). The first retry is at once: a restarted libvirtd
        (socket-activated) takes the new connection as soon as it is back. While libvirt does not answer,
        it is tried every EVENT_RETRY_UNREACHABLE seconds, each retry followed
        by a status (which fails, unchanged and unpushed, until libvirt is
        back: then it is pushed at once); other failures wait longer.
        """
        before = self.events_failure
        first = before is None
        if before is None or failure["code"] != before["code"]:
            self.send(message("error", source="events", error=failure))
        self.events_failure = failure
        self.stop_events()
        if first:
            delay = 0.0
        elif failure["code"] == ERR_LIBVIRT_UNREACHABLE:
            delay = EVENT_RETRY_UNREACHABLE
        else:
            delay = EVENT_RESTART_SECONDS
        self.restart_at = time.monotonic() + delay
        self.mark_dirty()

    def start_events(self) -> Optional[JsonObj]:
        try:
            child = EventChild(self.virsh)
        except AgentError as err:
            self.restart_at = time.monotonic() + EVENT_RESTART_SECONDS
            return {"code": err.code, "message": err.message}
        self.events = child
        self.sel.register(child.stdout, selectors.EVENT_READ, "events")
        return None

    def stop_events(self) -> None:
        child, self.events = self.events, None
        if child is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(child.stdout)
            child.close()

    # --- requests

    def reply_too_long(self) -> None:
        text = f"line longer than {SESSION_MAX_LINE} bytes"
        self.send(self.reply(None, reply_error(ERR_BAD_REQUEST, text)))

    @staticmethod
    def reply(ident: Any, answer: JsonObj) -> JsonObj:
        answer["type"] = "reply"
        answer["id"] = ident
        return answer

    def handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        ident: Any = None
        try:
            request = parse_session_line(line)
            ident = request["id"]
            answer = self.answer(request)
        except AgentError as err:
            answer = reply_error(err.code, err.message)
        except StreamClosedError:
            raise
        except Exception as err:  # noqa: BLE001 - logged, answered; the session goes on
            incident = log_internal(self.cfg, "a session request", err)
            answer = reply_error(**internal_error(incident))
        self.send(self.reply(ident, answer))

    def answer(self, request: JsonObj) -> JsonObj:
        unknown = sorted(str(k) for k in request if k not in SESSION_KEYS)
        if unknown:
            raise AgentError(
                ERR_BAD_REQUEST, f"unknown keys: {', '.join(unknown)[:200]}"
            )
        verb = request.get("verb")
        if not isinstance(verb, str):
            raise AgentError(ERR_BAD_REQUEST, "verb must be a string")
        if verb not in SESSION_VERBS:
            raise AgentError(
                ERR_NOT_ALLOWED, f"verb {verb[:40]!r} is not allowed in a session"
            )
        args = request.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise AgentError(ERR_BAD_REQUEST, "args must be a list of strings")
        request_id = request.get("request_id")
        if request_id is not None:
            if verb not in JOB_VERBS:
                raise AgentError(
                    ERR_BAD_REQUEST, f"{verb} takes no request_id (only job verbs do)"
                )
            check_request_id(request_id)
        check_request(self.cfg, verb, args)
        if verb == "status":
            return self.status_reply()
        return run_request(self.cfg, verb, args, request_id, self.requested_by)

    # --- the kept status

    def mark_dirty(self) -> None:
        if self.dirty_at is None:
            self.dirty_at = time.monotonic()

    def due(self, now: float) -> bool:
        if self.dirty_at is not None and now >= max(
            self.dirty_at, self.computed_at + SESSION_COALESCE_SECONDS
        ):
            return True
        return now >= self.computed_at + self.cfg.session_refresh

    def recompute(self, force: bool = False, drain: bool = True) -> None:
        self.dirty_at = None
        try:
            body = status_body(self.cfg, self.virsh)
        except AgentError as err:
            failure: Optional[JsonObj] = {"code": err.code, "message": err.message}
        except Exception as err:  # noqa: BLE001 - logged, reported; the session goes on
            failure = internal_error(log_internal(self.cfg, "a session's status", err))
        else:
            failure = None
        self.computed_at = time.monotonic()
        if drain:
            # What happened while it was computed goes out first, so that a
            # status never shows a job state or libvirt event before its own
            # message does (they mark it dirty: it is recomputed once more).
            if self.events is not None:
                self.read_events(self.events)
            self.scan_jobs()
        if failure is not None:
            if not _same_failure(failure, self.failure):
                self.send(message("error", source="status", error=failure))
            self.failure = failure
            self.body = None
            self.pushed = None  # the next good status is pushed, changed or not
            return
        self.failure = None
        self.body = body
        comparable = {k: v for k, v in body.items() if k not in VOLATILE_STATUS_KEYS}
        if force or comparable != self.pushed:
            self.pushed = comparable
            self.send(message("status", status=body))

    def status_reply(self) -> JsonObj:
        # A status asked for shows every job step written before the ask: a
        # step begun since the last scan (a shutdown now holding a guest
        # agent) makes the cached body stale.
        self.scan_jobs()
        stale = time.monotonic() - self.computed_at >= self.cfg.session_refresh
        if self.body is None or self.dirty_at is not None or stale:
            self.recompute()
        if self.body is None:
            failure = self.failure or {"code": ERR_INTERNAL, "message": "no status"}
            raise AgentError(failure["code"], failure["message"])
        return reply_ok(age=round(time.monotonic() - self.computed_at, 3), **self.body)


def _same_failure(new: JsonObj, old: Optional[JsonObj]) -> bool:
    """Whether a status failure was pushed already (an internal error's incident
    id changes every time: its code is what counts)."""
    if old is None or new["code"] != old["code"]:
        return False
    return new["code"] == ERR_INTERNAL or new == old


def verb_session(
    cfg: Config, stdin: IO[str], stdout: IO[str], requested_by: str
) -> int:
    with stream_slot(cfg):
        return Session(cfg, stdin, stdout, requested_by).run()
