"""What the tower agent and Home Assistant both read, defined once.

The protocol version and the agent's version, the verbs and their argument
counts, job kinds and states and the names of their steps, every error code
and finding code a reply carries, the shape of a reply, and the rules both
sides apply to what a user types (how virsh reads a domain's name, which
libvirt URIs are this machine's). Home Assistant imports this module alone
(``custom_components/gpu_handoff/protocol.py``); it imports nothing of the
agent, and runs on the tower's Python (3.9 or newer) and on Home Assistant's.
"""

from __future__ import annotations

import datetime as dt
from enum import Enum
import re

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

PROTOCOL = 2
VERSION = "0.3.7"

ERR_BAD_REQUEST = "bad_request"
ERR_NOT_ALLOWED = "not_allowed"
ERR_UNKNOWN_DOMAIN = "unknown_domain"
ERR_UNKNOWN_JOB = "unknown_job"
ERR_UNKNOWN_REQUEST = "unknown_request"
ERR_CONFIG_INVALID = "config_invalid"
ERR_VIRSH_MISSING = "virsh_missing"
ERR_LIBVIRT_UNREACHABLE = "libvirt_unreachable"
ERR_VIRSH_FAILED = "virsh_failed"
ERR_DOMAIN_MISSING = "domain_missing"
ERR_AGENT_TIMEOUT = "agent_timeout"
ERR_SHUTDOWN_REFUSED = "shutdown_refused"
ERR_SHUTDOWN_TIMEOUT = "shutdown_timeout"
ERR_DEVICES_BUSY = "devices_busy"
ERR_START_FAILED = "start_failed"
ERR_SPAWN_FAILED = "spawn_failed"
ERR_RUNNER_DIED = "runner_died"
ERR_TOO_LARGE = "too_large"
ERR_SCREENSHOT_FAILED = "screenshot_failed"
ERR_EXISTS = "exists"
ERR_INSTALL_FAILED = "install_failed"
ERR_NOT_INSTALLED = "not_installed"
ERR_NIXOS = "nixos"
ERR_STATE_DIR_UNSAFE = "state_dir_unsafe"
ERR_QUEUE_FULL = "queue_full"
ERR_TOO_MANY_STREAMS = "too_many_streams"
ERR_INTERNAL = "internal"

ERROR_CODES = frozenset(
    {
        ERR_BAD_REQUEST,
        ERR_NOT_ALLOWED,
        ERR_UNKNOWN_DOMAIN,
        ERR_UNKNOWN_JOB,
        ERR_UNKNOWN_REQUEST,
        ERR_CONFIG_INVALID,
        ERR_VIRSH_MISSING,
        ERR_LIBVIRT_UNREACHABLE,
        ERR_VIRSH_FAILED,
        ERR_DOMAIN_MISSING,
        ERR_AGENT_TIMEOUT,
        ERR_SHUTDOWN_REFUSED,
        ERR_SHUTDOWN_TIMEOUT,
        ERR_DEVICES_BUSY,
        ERR_START_FAILED,
        ERR_SPAWN_FAILED,
        ERR_RUNNER_DIED,
        ERR_TOO_LARGE,
        ERR_SCREENSHOT_FAILED,
        ERR_EXISTS,
        ERR_INSTALL_FAILED,
        ERR_NOT_INSTALLED,
        ERR_NIXOS,
        ERR_STATE_DIR_UNSAFE,
        ERR_QUEUE_FULL,
        ERR_TOO_MANY_STREAMS,
        ERR_INTERNAL,
    }
)

# Verbs Home Assistant may run through `serve`, with their argument counts.
SERVE_VERBS: Dict[str, Tuple[int, int]] = {
    "version": (0, 0),
    "status": (0, 0),
    "stop": (1, 1),
    "start": (1, 1),
    "handoff": (1, 1),
    "release": (0, 1),
    "lend": (0, 1),
    "job": (1, 1),
    "jobs": (0, 0),
    "request": (1, 1),
    "watch": (0, 0),
    "session": (0, 0),
    "screenshot": (1, 1),
}
SERVE_MAX_LENGTH = 512
# Verbs a `session` answers (argument counts as in SERVE_VERBS); the streaming
# verbs are not among them: the session itself streams.
SESSION_VERBS = frozenset(
    {
        "version",
        "status",
        "stop",
        "start",
        "handoff",
        "release",
        "lend",
        "job",
        "jobs",
        "request",
        "screenshot",
    }
)
# Verbs that submit a job, and so take a request id.
JOB_VERBS = ("stop", "start", "handoff", "release", "lend")
# A session's request line, and the request's "id" (echoed in its reply).
SESSION_MAX_LINE = 4096
SESSION_MAX_ID = 64
SESSION_KEYS = ("id", "verb", "args", "request_id")

JOB_ID_RE = re.compile(r"^[a-z0-9-]{1,64}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{7,63}$")
REQUEST_OPTION = "--request="


class Word(str, Enum):
    """A word of the protocol, one of a fixed set. A member is the string
    itself (it compares, hashes, prints and serialises as its word), as
    ``enum.StrEnum`` makes it, which Python 3.9 lacks."""

    def __str__(self) -> str:
        return str.__str__(self)


class JobKind(Word):
    """What a tower job does."""

    STOP = "stop"
    START = "start"
    HANDOFF = "handoff"
    RELEASE = "release"
    LEND = "lend"


class JobState(Word):
    """Where a tower job is."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        """Queued or running: it may still act on the tower."""
        return self in (JobState.QUEUED, JobState.RUNNING)


class StepName(Word):
    """One step of a tower job."""

    WAIT_AGENT = "wait_agent"
    SHUTDOWN = "shutdown"
    WAIT_SHUT_OFF = "wait_shut_off"
    WAIT_DEVICES_FREE = "wait_devices_free"
    START = "start"
    START_FREE = "start_free"


# The same, as the words a job record holds.
JOB_STATES = tuple(state.value for state in JobState)
JOB_KINDS = tuple(kind.value for kind in JobKind)
# A graceful stop's steps, in order.
STOP_STEPS = tuple(
    step.value
    for step in (StepName.WAIT_AGENT, StepName.SHUTDOWN, StepName.WAIT_SHUT_OFF)
)
# A start's steps (of a gaming VM), in order.
START_VM_STEPS = tuple(
    step.value for step in (StepName.WAIT_DEVICES_FREE, StepName.START)
)
# The steps in which a job of ours runs `virsh start` or `virsh create`.
START_STEPS = tuple(step.value for step in (StepName.START, StepName.START_FREE))
# The tower's name ("name"): at most what a host name label may hold.
NAME_MAX = 63

# Finding codes reported by `status`.
FINDING_ROM_BAR = "rom_bar_not_off"
FINDING_NO_AGENT_CHANNEL = "no_agent_channel"
FINDING_CLAIMED_BY_UNMANAGED = "claimed_by_unmanaged"
FINDING_DOMAIN_MISSING = "domain_missing"
FINDING_SHARED_IOMMU_GROUP = "shared_iommu_group"

# What virsh prints for each virDomainState (tools/virsh-domain-monitor.c,
# virshDomainState; in the C locale, which the agent always runs virsh in) and
# the value the agent reports. virsh's "idle" is VIR_DOMAIN_BLOCKED ("the domain
# is blocked on resource"), so it is reported as "blocked"; "blocked" itself is
# accepted too. Anything else (a future state, a translated word) is
# "no_state", as virsh itself says for a state it does not know.
DOMAIN_STATES = {
    "no state": "no_state",
    "running": "running",
    "idle": "blocked",
    "blocked": "blocked",
    "paused": "paused",
    "in shutdown": "in_shutdown",
    "shut off": "shut_off",
    "crashed": "crashed",
    "pmsuspended": "pmsuspended",
}
UNKNOWN_STATE = "no_state"

if TYPE_CHECKING:
    JsonObj = Dict[str, Any]
else:
    JsonObj = dict  # the alias, at run time


# Exception tuples are named: the formatter targets a newer Python than the
# tower's and would rewrite `except (A, B):` into a form Python 3.9 rejects.
# These: a stream (a client's pipe or socket) that is gone.
_STREAM_ERRORS = (OSError, ValueError, AttributeError)


class AgentError(Exception):
    """An error answered to the caller as {"code", "message"}, plus the
    `extra` fields some verbs add (install's "reason" and "left")."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


def now_iso() -> str:
    """Now, UTC, ISO 8601 with milliseconds."""
    return (
        dt.datetime.now(dt.timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def reply_ok(**fields: Any) -> JsonObj:
    out: JsonObj = {"protocol": PROTOCOL, "ok": True}
    out.update(fields)
    return out


def reply_error(code: str, message: str, **extra: Any) -> JsonObj:
    error: JsonObj = {"code": code, "message": message}
    error.update(extra)
    return {"protocol": PROTOCOL, "ok": False, "error": error}


# virsh looks `--domain WORD` up by id first, then by UUID, then by name
# (tools/virsh-util.c, virshLookupDomainInternal). An id is what
# virStrToLong_i reads whole in base 10 (C whitespace and a sign may come
# first: " 1", "+1", "01", "-0") that is an int >= 0; a UUID is a word of 36
# bytes that virUUIDParse reads (src/util/viruuid.c: GLib whitespace around
# 32 hex digits in pairs, any '-' or ' ' between the pairs).
_VIRSH_ID_RE = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_VIRSH_UUID_RE = re.compile(r"[ \t\n\f\r]*(?:[- ]*[0-9A-Fa-f]{2}){16}[ \t\n\f\r]*")


def virsh_reads_as(name: str) -> Optional[str]:
    """Whether virsh would look `name` up as a domain id or UUID before it
    tries it as a name (and so could find another domain): "id", "UUID" or
    None."""
    number = _VIRSH_ID_RE.fullmatch(name)
    digits = number.group(1) if number else ""
    if (
        digits
        and len(digits.lstrip("+-").lstrip("0")) <= 10
        and 0 <= int(digits) < 2**31
    ):
        return "id"
    size = len(name.encode("utf-8", "surrogateescape"))
    if size == 36 and _VIRSH_UUID_RE.fullmatch(name):
        return "UUID"
    return None


# What install (run as root, as the guided install's survey runs virsh) takes
# as a libvirt URI: this machine's QEMU driver (system or session), or the
# test driver (its default node, or a node file); a socket only with the
# unix transport. No host (another machine, as whom), and no other
# parameter: libvirt's ext transport runs its "command", ssh reads a
# "keyfile", "netcat" and "proxy" run or reach elsewhere.
LOCAL_URI_RE = re.compile(
    r"(?P<driver>qemu|test)(?P<unix>\+unix)?://(?P<path>/[A-Za-z0-9_.+/-]*)"
    r"(?:\?socket=(?P<socket>/[A-Za-z0-9_.+/-]+))?"
)


def local_libvirt_uri(uri: str) -> bool:
    """Whether ``uri`` is this machine's libvirt, reached without running a
    program, reading a key or connecting anywhere else (LOCAL_URI_RE)."""
    found = LOCAL_URI_RE.fullmatch(uri)
    if found is None or "/../" in f"{found['path']}/{found['socket'] or ''}/":
        return False
    if found["socket"] is not None and found["unix"] is None:
        return False
    if found["driver"] == "qemu":
        return found["path"] in ("/system", "/session")
    return True
