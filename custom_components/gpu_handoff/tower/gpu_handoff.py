#!/usr/bin/env python3
"""gpu-handoff: the tower agent of GPU Handoff.

One stdlib-only program (Python >= 3.9) that Home Assistant runs over SSH as a
forced command. It reads libvirt through ``virsh`` (argv lists, never a shell),
answers one JSON object per line, and runs long work (graceful stops, starts
that wait for PCI functions to free up) as detached jobs whose progress is kept
in JSON files under the state directory. A `session` keeps one connection
open: requests answered, and the tower's state pushed as it changes.

It never destroys a domain: every stop is a graceful shutdown, and a stop that
does not finish in time leaves the domain running and fails the job.

Trust: the state directory belongs to the user the agent runs as (Home
Assistant's SSH user) and nobody else may write to it. Run as root (the libvirt
hook, an administrator's command), the agent becomes that user before it
touches the directory; every file in it is reached from a directory descriptor
without following symbolic links, and runners act on what the configuration
allows, never on what a record says.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import fcntl
import functools
import grp
import json
import os
import pwd
import re
import secrets
import select
import selectors
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import types
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple
import xml.etree.ElementTree as ET
import zlib

# --- protocol: the Home Assistant side imports these ---------------------------

PROTOCOL = 2
VERSION = "0.3.6"

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
    "lend": (0, 0),
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
# A burst of libvirt events (a start is four of them) is one recompute.
SESSION_COALESCE_SECONDS = 0.1
EVENT_RESTART_SECONDS = 5.0
# A job's virsh call that finds libvirt away (libvirtd restarting) is tried
# again for this long: a restart takes seconds, a handoff must not fail on it.
JOB_LIBVIRT_WAIT = 60.0
# While libvirt does not answer (libvirtd restarting), its event stream is
# tried again this often, so that its return is seen at once.
EVENT_RETRY_UNREACHABLE = 0.5
# An event stream is up once its child has run this long: `virsh event` says
# nothing when it connects, and one that cannot connect ends within moments.
# Only then is an outage over, and a later loss news again.
EVENT_STEADY_SECONDS = 2.0
# Status fields left out when deciding whether the status changed.
VOLATILE_STATUS_KEYS = ("virsh_calls",)

JOB_ID_RE = re.compile(r"^[a-z0-9-]{1,64}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{7,63}$")
REQUEST_OPTION = "--request="
# Home Assistant may ask for a request's job after a reconnect: a record that
# carries a request id is kept at least this long, whatever MAX_JOBS says.
REQUEST_KEEP_SECONDS = 3600.0
JOB_STATES = ("queued", "running", "succeeded", "failed")
JOB_KINDS = ("stop", "start", "handoff", "release", "lend")
MAX_JOBS = 50
MAX_HOOK_REQUESTS = 20
# A job whose runner has not taken its lock this long after creation is dead.
QUEUED_GRACE_SECONDS = 60.0
# Limits, each a configuration key with this default: jobs waiting for their
# turn (each has a runner process waiting), and watch/session streams open at
# once on one tower.
MAX_QUEUED_JOBS_DEFAULT = 8
MAX_STREAMS_DEFAULT = 8
# A stream's client that takes nothing for this long is gone: the stream ends.
WRITE_TIMEOUT_DEFAULT = 30.0
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

DEFAULT_CONFIG_PATH = "/etc/gpu-handoff/config.json"
DEFAULT_PREFIX = "/usr/local"
DEFAULT_INSTALL_STATE_DIR = "/var/lib/gpu-handoff"
DEFAULT_SYSFS = "/sys"
HOOK_PATH = "/etc/libvirt/hooks/qemu.d/gpu-handoff"
SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
# logind keeps a user's systemd manager running without a session while a
# file of the user's name is here (loginctl(1), enable-linger): the manager
# the runners of an unprivileged agent are started in.
LINGER_DIR = "/var/lib/systemd/linger"
# systemd-tmpfiles(8) entries of packages set up by hand (tmpfiles.d(5)).
TMPFILES_PATH = "/etc/tmpfiles.d/gpu-handoff.conf"
AGENT_CHANNEL = "org.qemu.guest_agent.0"
GUEST_PING = '{"execute":"guest-ping"}'
STATUS_PING_TIMEOUT = 2
# The status batch with pings: libvirt makes a ping wait for the domain's
# agent job (virDomainObjBeginAgentJob, up to 30 s whatever its --timeout)
# while another call holds it (a `shutdown --mode agent` waits up to 60 s for
# the power-off); past this the status is read again without pings.
STATUS_BATCH_TIMEOUT = 10.0
VIRSH_TIMEOUT = 120.0
SHUTDOWN_MODES = ("agent", "acpi")
DETACH_MODES = ("auto", "systemd", "process")
POLL_INTERVAL_DEFAULT = 0.25
TIMEOUT_DEFAULTS = {"agent": 180.0, "shutdown": 180.0, "start": 300.0}
# A session recomputes the status at least this often, for what no libvirt
# event tells: guest-agent readiness, PCI ownership after a define.
SESSION_REFRESH_DEFAULT = 5.0
# The only virsh commands this program runs (see tests/towersim/CONTRACT.md).
VIRSH_COMMANDS = frozenset(
    {
        "list",
        "dumpxml",
        "domstate",
        "start",
        "shutdown",
        "qemu-agent-command",
        "event",
        "screenshot",
        "create",
    }
)

JsonObj = Dict[str, Any]

# Exception tuples are named: the formatter targets a newer Python than the
# tower's and would rewrite `except (A, B):` into a form Python 3.9 rejects.
_READ_ERRORS = (OSError, ValueError)
_SELECT_ERRORS = (ValueError, OSError, AttributeError)
_NUMBER_ERRORS = (TypeError, ValueError)
_STREAM_ERRORS = (OSError, ValueError, AttributeError)


class AgentError(Exception):
    """An error answered to the caller as {"code", "message"}, plus the
    `extra` fields some verbs add (install's "reason" and "left")."""

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


_JOB_ERRORS = (AgentError, KeyError, TypeError)


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


# --- configuration --------------------------------------------------------------


class Config:
    """The validated configuration."""

    def __init__(self, path: str, data: JsonObj, env: Dict[str, str]) -> None:
        self.path = path
        self.libvirt_uri: str = data.get("libvirt_uri", "qemu:///system")
        self.gpu_node: str = data["gpu_node"]
        self.gaming: List[str] = list(data["gaming"])
        timeouts = dict(TIMEOUT_DEFAULTS)
        timeouts.update(data.get("timeouts", {}))
        self.timeout_agent = float(timeouts["agent"])
        self.timeout_shutdown = float(timeouts["shutdown"])
        self.timeout_start = float(timeouts["start"])
        self.shutdown_modes: List[str] = list(data.get("shutdown_modes", ["agent"]))
        self.state_dir: str = data.get("state_dir") or default_state_dir(env)
        self.path_extra: List[str] = list(data.get("path", []))
        commands = data.get("commands", {})
        self.cmd_virsh: Optional[str] = commands.get("virsh")
        self.cmd_systemd_run: Optional[str] = commands.get("systemd_run")
        self.detach: str = data.get("detach", "auto")
        self.screenshot_max_bytes = int(data.get("screenshot_max_bytes", 8 << 20))
        # How often a job looks again (a shutdown finished, cards freed): a
        # virsh call costs ~30 ms, and every poll period is added to a
        # handoff's or a return's time.
        self.poll_interval = float(data.get("poll_interval", POLL_INTERVAL_DEFAULT))
        self.session_refresh = float(
            data.get("session_refresh", SESSION_REFRESH_DEFAULT)
        )
        self.max_queued_jobs = int(data.get("max_queued_jobs", MAX_QUEUED_JOBS_DEFAULT))
        self.max_streams = int(data.get("max_streams", MAX_STREAMS_DEFAULT))
        self.write_timeout = float(data.get("write_timeout", WRITE_TIMEOUT_DEFAULT))
        # What Home Assistant calls the tower (its entry and device) unless
        # the user renames them there: the machine's host name by default.
        self.name: str = data.get("name") or socket.gethostname()
        # Where sysfs is mounted: the IOMMU groups are read there (another
        # root only for tests and simulators).
        self.sysfs: str = data.get("sysfs", DEFAULT_SYSFS)
        self.env = env

    @property
    def managed(self) -> List[str]:
        return [self.gpu_node, *self.gaming]

    def as_json(self) -> JsonObj:
        return {
            "libvirt_uri": self.libvirt_uri,
            "gpu_node": self.gpu_node,
            "gaming": self.gaming,
            "timeouts": {
                "agent": self.timeout_agent,
                "shutdown": self.timeout_shutdown,
                "start": self.timeout_start,
            },
            "shutdown_modes": self.shutdown_modes,
            "state_dir": self.state_dir,
            "path": self.path_extra,
            "commands": {"virsh": self.cmd_virsh, "systemd_run": self.cmd_systemd_run},
            "detach": self.detach,
            "screenshot_max_bytes": self.screenshot_max_bytes,
            "poll_interval": self.poll_interval,
            "session_refresh": self.session_refresh,
            "max_queued_jobs": self.max_queued_jobs,
            "max_streams": self.max_streams,
            "write_timeout": self.write_timeout,
            "name": self.name,
            "sysfs": self.sysfs,
        }


def default_state_dir(env: Dict[str, str]) -> str:
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "gpu-handoff")


def config_path_from(option: Optional[str], env: Dict[str, str]) -> str:
    return option or env.get("GPU_HANDOFF_CONFIG") or DEFAULT_CONFIG_PATH


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


def _check_domain_name(where: str, value: Any, problems: List[str]) -> None:
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: must be a non-empty string")
    elif "/" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        problems.append(f"{where}: {value!r} is not a valid domain name")
    elif value.startswith("-"):
        problems.append(
            f"{where}: {value!r} starts with '-' (virsh would read it as an option)"
        )
    elif len(value) > 200:
        problems.append(f"{where}: longer than 200 characters")
    elif virsh_reads_as(value):
        problems.append(
            f"{where}: virsh would look {value!r} up as a domain "
            f"{virsh_reads_as(value)} first, and could act on another VM; "
            "rename the VM in libvirt (shut it off, then `virsh domrename "
            "OLD-NAME NEW-NAME`)"
        )


def validate_config(data: Any) -> List[str]:
    """Every problem of a configuration document, as "key path: problem"."""
    problems: List[str] = []
    if not isinstance(data, dict):
        return ["(top level): must be a JSON object"]
    known = {
        "libvirt_uri",
        "gpu_node",
        "gaming",
        "timeouts",
        "shutdown_modes",
        "state_dir",
        "path",
        "commands",
        "detach",
        "screenshot_max_bytes",
        "poll_interval",
        "session_refresh",
        "max_queued_jobs",
        "max_streams",
        "write_timeout",
        "name",
        "sysfs",
    }
    problems.extend(f"{key}: unknown key" for key in sorted(data) if key not in known)
    uri = data.get("libvirt_uri", "qemu:///system")
    if not isinstance(uri, str) or not uri.strip():
        problems.append("libvirt_uri: must be a non-empty string")
    if "gpu_node" not in data:
        problems.append("gpu_node: required")
    else:
        _check_domain_name("gpu_node", data["gpu_node"], problems)
    if "gaming" not in data:
        problems.append("gaming: required")
    elif not isinstance(data["gaming"], list) or not data["gaming"]:
        problems.append("gaming: must be a non-empty list of domain names")
    else:
        seen: List[str] = []
        for i, name in enumerate(data["gaming"]):
            where = f"gaming[{i}]"
            before = len(problems)
            _check_domain_name(where, name, problems)
            if len(problems) > before:
                continue
            if name in seen:
                problems.append(f"{where}: duplicate domain {name!r}")
            elif name == data.get("gpu_node"):
                problems.append(f"{where}: {name!r} is the gpu_node")
            seen.append(name)
    if "timeouts" in data:
        timeouts = data["timeouts"]
        if not isinstance(timeouts, dict):
            problems.append("timeouts: must be an object")
        else:
            for key in sorted(timeouts):
                if key not in TIMEOUT_DEFAULTS:
                    problems.append(f"timeouts.{key}: unknown key")
                elif not _is_number(timeouts[key]) or timeouts[key] <= 0:
                    problems.append(f"timeouts.{key}: must be a positive number")
    if "shutdown_modes" in data:
        modes = data["shutdown_modes"]
        if not isinstance(modes, list) or not modes:
            problems.append("shutdown_modes: must be a non-empty list")
        else:
            for i, mode in enumerate(modes):
                if mode not in SHUTDOWN_MODES:
                    problems.append(
                        f"shutdown_modes[{i}]: must be one of {', '.join(SHUTDOWN_MODES)}"
                    )
                elif modes.index(mode) != i:
                    problems.append(f"shutdown_modes[{i}]: duplicate mode {mode!r}")
    if "state_dir" in data:
        state_dir = data["state_dir"]
        if not isinstance(state_dir, str) or not os.path.isabs(state_dir):
            problems.append("state_dir: must be an absolute path")
    if "path" in data:
        extra = data["path"]
        if not isinstance(extra, list):
            problems.append("path: must be a list of absolute directories")
        else:
            for i, entry in enumerate(extra):
                if not isinstance(entry, str) or not os.path.isabs(entry):
                    problems.append(f"path[{i}]: must be an absolute directory")
    if "commands" in data:
        commands = data["commands"]
        if not isinstance(commands, dict):
            problems.append("commands: must be an object")
        else:
            for key in sorted(commands):
                if key not in ("virsh", "systemd_run"):
                    problems.append(f"commands.{key}: unknown key")
                elif not isinstance(commands[key], str) or not os.path.isabs(
                    commands[key]
                ):
                    problems.append(f"commands.{key}: must be an absolute path")
    if "detach" in data and data["detach"] not in DETACH_MODES:
        problems.append(f"detach: must be one of {', '.join(DETACH_MODES)}")
    if "screenshot_max_bytes" in data:
        limit = data["screenshot_max_bytes"]
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            problems.append("screenshot_max_bytes: must be a positive integer")
    if "poll_interval" in data:
        interval = data["poll_interval"]
        if not _is_number(interval) or not 0 < interval <= 60:
            problems.append("poll_interval: must be a number in (0, 60]")
    if "session_refresh" in data:
        refresh = data["session_refresh"]
        if not _is_number(refresh) or refresh <= 0:
            problems.append("session_refresh: must be a positive number")
    for key, high in (("max_queued_jobs", 100), ("max_streams", 64)):
        if key in data:
            value = data[key]
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 1 <= value <= high
            ):
                problems.append(f"{key}: must be an integer in 1..{high}")
    if "write_timeout" in data:
        timeout = data["write_timeout"]
        if not _is_number(timeout) or not 0 < timeout <= 3600:
            problems.append("write_timeout: must be a number in (0, 3600]")
    if "sysfs" in data:
        sysfs = data["sysfs"]
        if not isinstance(sysfs, str) or not os.path.isabs(sysfs):
            problems.append("sysfs: must be an absolute path")
    if "name" in data:
        name = data["name"]
        if (
            not isinstance(name, str)
            or not 1 <= len(name) <= NAME_MAX
            or not name.isprintable()
            or not name.strip()
        ):
            problems.append(
                f"name: must be 1 to {NAME_MAX} printable characters, "
                "not only spaces (the tower's name in Home Assistant)"
            )
    return problems


def load_config(path: str, env: Dict[str, str]) -> Config:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as err:
        raise AgentError(
            ERR_CONFIG_INVALID, f"cannot read {path}: {err.strerror or err}"
        ) from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise AgentError(ERR_CONFIG_INVALID, f"{path}: not valid JSON: {err}") from None
    problems = validate_config(data)
    if problems:
        raise AgentError(ERR_CONFIG_INVALID, f"{path}: " + "; ".join(problems))
    return Config(path, data, env)


# --- helper programs -------------------------------------------------------------


def resolve_program(name: str, override: Optional[str], cfg: Config) -> Optional[str]:
    """An executable's path: the override, else inherited PATH then cfg.path."""
    if override:
        return override if os.access(override, os.X_OK) else None
    dirs = [d for d in cfg.env.get("PATH", os.defpath).split(os.pathsep) if d]
    dirs.extend(cfg.path_extra)
    return shutil.which(name, path=os.pathsep.join(dirs))


class VirshResult:
    def __init__(self, rc: int, out: str, err: str, timed_out: bool = False) -> None:
        self.rc = rc
        self.out = out
        self.err = err
        self.timed_out = timed_out

    def error_text(self) -> str:
        lines = [ln.strip() for ln in self.err.splitlines() if ln.strip()]
        text = " / ".join(
            ln[len("error: ") :] if ln.startswith("error: ") else ln for ln in lines
        )
        return text or f"virsh exited with status {self.rc}"


def virsh_quote(token: str) -> str:
    """Quote one token for virsh's own command-string parser (no shell)."""
    return "'" + token.replace("'", "'\\''") + "'"


# Every domain goes to virsh as the value of `--domain`: virsh takes the word
# after an option that needs a value as that value whatever it looks like,
# while a bare word that starts with `--` (quoted or not: virsh removes quotes
# first) is read as an option. A domain named `--bogus` is then a domain.
def cmd_dumpxml(domain: str) -> List[str]:
    return ["dumpxml", "--domain", domain]


def cmd_domstate(domain: str) -> List[str]:
    return ["domstate", "--reason", "--domain", domain]


def cmd_ping(domain: str) -> List[str]:
    return [
        "qemu-agent-command",
        "--timeout",
        str(STATUS_PING_TIMEOUT),
        "--domain",
        domain,
        GUEST_PING,
    ]


def cmd_shutdown(domain: str, mode: str) -> List[str]:
    return ["shutdown", "--mode", mode, "--domain", domain]


def cmd_start(domain: str) -> List[str]:
    return ["start", "--domain", domain]


def cmd_inactive_xml(domain: str) -> List[str]:
    """The persistent definition (as `dumpxml` shows it while shut off)."""
    return ["dumpxml", "--inactive", "--domain", domain]


def cmd_defined_xml(domain: str) -> List[str]:
    """The persistent definition, secrets included (a graphics password must
    survive into a live definition made from it)."""
    return ["dumpxml", "--inactive", "--security-info", "--domain", domain]


def cmd_create(path: str) -> List[str]:
    """Start a domain from an XML file. With the name and UUID of a defined,
    inactive domain, libvirt starts THAT domain with the file as its live
    definition only: the persistent one is left as it is, and comes back when
    the domain stops (virDomainObjListAdd with VIR_DOMAIN_OBJ_LIST_ADD_LIVE)."""
    return ["create", "--file", path]


def cmd_screenshot(domain: str, path: str) -> List[str]:
    return ["screenshot", "--domain", domain, "--file", path]


def virsh_environment(env: Dict[str, str]) -> Dict[str, str]:
    """The caller's environment in the C locale: virsh translates states and
    errors (`ausgeschaltet` for `shut off` on a German tower), and the agent
    reads them."""
    out = {
        key: value
        for key, value in env.items()
        if not key.startswith("LC_") and key not in ("LANG", "LANGUAGE")
    }
    out["LC_ALL"] = "C"
    return out


class Virsh:
    """Runs virsh with argv lists; never through a shell; only allowed commands."""

    def __init__(self, cfg: Config, unreachable_wait: float = 0.0) -> None:
        """`unreachable_wait`: for this long, a call that cannot connect to
        libvirt (libvirtd restarting without socket activation: its socket is
        gone) is tried again instead of failing. virsh connects to the URI
        given with -c before it runs anything, so such a call did nothing."""
        path = resolve_program("virsh", cfg.cmd_virsh, cfg)
        if path is None:
            where = cfg.cmd_virsh or "PATH" + (
                " and config path" if cfg.path_extra else ""
            )
            raise AgentError(ERR_VIRSH_MISSING, f"virsh not found (looked in {where})")
        self.path = path
        self.uri = cfg.libvirt_uri
        self.env = virsh_environment(cfg.env)
        # coreutils' stdbuf, to make a long-running virsh's output line
        # buffered (event_argv), where it is found.
        self.stdbuf = resolve_program("stdbuf", None, cfg)
        self.calls = 0
        self.unreachable_wait = unreachable_wait
        self.retry_pause = max(0.05, min(cfg.poll_interval, 0.5))

    def argv(self, args: List[str]) -> List[str]:
        return [self.path, "-c", self.uri, *args]

    def event_argv(self, args: List[str]) -> List[str]:
        """``argv`` for a virsh that prints events as they come into a pipe.
        virsh prints through stdio, and virsh before 9.0 (Debian 11's 7.0)
        does not flush after each line (newer ones do, in tools/vsh.c's
        vshPrintVa): into a pipe, its lines wait in a 4 KiB buffer, and a
        session would get libvirt's events dozens at a time, or never.
        ``stdbuf -oL`` (exec'ing virsh, so the same process) makes stdout
        line buffered as on a terminal."""
        argv = self.argv(args)
        return [self.stdbuf, "-oL", *argv] if self.stdbuf else argv

    def run(self, args: List[str], timeout: float = VIRSH_TIMEOUT) -> VirshResult:
        return self._run(self.check(args), timeout)

    @staticmethod
    def check(args: List[str]) -> List[str]:
        if not args or args[0] not in VIRSH_COMMANDS:
            raise AgentError(ERR_INTERNAL, f"virsh command {args[:1]!r} is not allowed")
        return args

    def _run(self, args: List[str], timeout: float) -> VirshResult:
        deadline = time.monotonic() + self.unreachable_wait
        while True:
            try:
                return self._run_once(args, timeout)
            except AgentError as err:
                if err.code != ERR_LIBVIRT_UNREACHABLE or time.monotonic() >= deadline:
                    raise
            time.sleep(self.retry_pause)

    def _run_once(self, args: List[str], timeout: float) -> VirshResult:
        self.calls += 1
        try:
            proc = subprocess.run(
                self.argv(args),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return VirshResult(
                124, "", f"error: virsh timed out after {timeout:g} s", timed_out=True
            )
        except OSError as err:
            raise AgentError(
                ERR_VIRSH_MISSING, f"cannot run {self.path}: {err}"
            ) from None
        result = VirshResult(proc.returncode, proc.stdout, proc.stderr)
        if result.rc != 0 and "failed to connect to the hypervisor" in result.err:
            raise AgentError(ERR_LIBVIRT_UNREACHABLE, result.error_text())
        return result

    def batch(
        self, commands: List[List[str]], timeout: float = VIRSH_TIMEOUT
    ) -> List[str]:
        """Run several commands in one virsh process; each one's stdout.

        virsh runs `a ; b ; c` given as one argument with its own parser; a
        command that fails prints to stderr and the next one still runs, so a
        marker line is echoed before each command and a failed command's
        output is the empty string.
        """
        nonce = secrets.token_hex(6)
        parts: List[str] = []
        for i, cmd in enumerate(commands):
            self.check(cmd)
            parts.append(f"echo @@gpu-handoff-{nonce}-{i}")
            parts.append(
                " ".join(virsh_quote(tok) if j else tok for j, tok in enumerate(cmd))
            )
        result = self._run([" ; ".join(parts)], timeout)
        if result.timed_out:
            raise VirshTimeoutError(ERR_VIRSH_FAILED, result.error_text())
        if result.rc != 0 and f"@@gpu-handoff-{nonce}-0" not in result.out:
            raise AgentError(ERR_VIRSH_FAILED, result.error_text())
        return split_batch_output(result.out, nonce, len(commands))


class VirshTimeoutError(AgentError):
    """A virsh call that did not end within its time (and was killed)."""


def split_batch_output(text: str, nonce: str, count: int) -> List[str]:
    """Each command's stdout of a batch; "" for a command that failed."""
    outputs = [""] * count
    marker = re.compile(rf"^@@gpu-handoff-{re.escape(nonce)}-(\d+)$")
    chunks: Dict[int, List[str]] = {}
    current = -1
    for line in text.splitlines():
        match = marker.match(line)
        if match:
            current = int(match.group(1))
            chunks[current] = []
        elif current >= 0:
            chunks[current].append(line)
    for i, lines in chunks.items():
        if i < count:
            outputs[i] = "\n".join(lines).strip()
    return outputs


# --- parsing libvirt output ----------------------------------------------------------


def parse_domstate(text: str) -> Tuple[str, Optional[str]]:
    """`running (booted)` -> ("running", "booted"); `shut off` -> ("shut_off", None).

    The state is one of DOMAIN_STATES' values, whatever virsh printed.
    """
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    match = re.match(r"^(.*?)\s*(?:\((.*)\))?$", text)
    state = (match.group(1) if match else text).strip()
    reason = match.group(2) if match else None
    return DOMAIN_STATES.get(state, UNKNOWN_STATE), reason


def pci_address(elem: ET.Element) -> str:
    def num(attr: str) -> int:
        value = elem.get(attr, "0")
        return int(value, 16) if value.lower().startswith("0x") else int(value)

    return "%04x:%02x:%02x.%x" % (
        num("domain"),
        num("bus"),
        num("slot"),
        num("function"),
    )


def parse_domain_xml(text: str) -> JsonObj:
    """Hostdevs and guest-agent channel of one domain's XML."""
    root = ET.fromstring(text)  # noqa: S314 - XML from libvirt itself
    hostdevs: List[JsonObj] = []
    for dev in root.iterfind("./devices/hostdev"):
        if dev.get("mode", "subsystem") != "subsystem" or dev.get("type") != "pci":
            continue
        addr = dev.find("./source/address")
        if addr is None:
            continue
        rom = dev.find("./rom")
        hostdevs.append(
            {
                "address": pci_address(addr),
                "rom_bar": rom.get("bar") if rom is not None else None,
                "managed": dev.get("managed", "no") == "yes",
            }
        )
    channel = any(
        target.get("type") == "virtio" and target.get("name") == AGENT_CHANNEL
        for target in root.iterfind("./devices/channel/target")
    )
    return {
        "name": root.findtext("./name"),
        "title": (root.findtext("./title") or "").strip() or None,
        "hostdevs": hostdevs,
        "agent_channel": channel,
    }


EVENT_RE = re.compile(
    r"^(?:(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\+\d{4}): )?"
    r"event '(?P<event>[a-z-]+)' for domain '(?P<domain>.*)': (?P<rest>.*)$"
)
AGENT_RE = re.compile(r"^state: '(?P<state>[^']*)' reason: '(?P<reason>[^']*)'$")


def parse_event(line: str) -> Optional[JsonObj]:
    """One line of `virsh event --loop --all --timestamp`, or None."""
    match = EVENT_RE.match(line.rstrip("\n"))
    if not match:
        return None
    out: JsonObj = {
        "time": match.group("time"),
        "domain": match.group("domain"),
        "event": match.group("event"),
    }
    rest = match.group("rest")
    if out["event"] == "lifecycle":
        words = rest.split(" ", 1)
        out["action"] = words[0].lower()
        out["detail"] = words[1] if len(words) > 1 else ""
    elif out["event"] == "agent-lifecycle":
        agent = AGENT_RE.match(rest)
        out["state"] = agent.group("state") if agent else None
        out["reason"] = agent.group("reason") if agent else None
        if not agent:
            out["detail"] = rest
    else:
        out["detail"] = rest
    return out


# --- observing the tower -------------------------------------------------------------


class Snapshot:
    """What libvirt says about the managed domains (and who else claims cards)."""

    def __init__(self) -> None:
        self.existing: List[str] = []
        self.domains: Dict[str, JsonObj] = {}
        self.others: Dict[str, JsonObj] = {}
        # The IOMMU group of each PCI function any domain claims (none: the
        # tower has no IOMMU groups, or not for that function).
        self.groups: Dict[str, int] = {}
        self.virsh_calls = 0

    def all_domains(self) -> Dict[str, JsonObj]:
        merged = dict(self.others)
        merged.update(self.domains)
        return merged

    @staticmethod
    def holds(dom: JsonObj) -> bool:
        return bool(dom.get("exists")) and dom.get("state") not in ("shut_off", None)

    def addresses(self) -> List[str]:
        """Every PCI function a domain claims (the GPU node's whole definition
        included, while it runs with a live one)."""
        found = {
            dev["address"]
            for dom in self.all_domains().values()
            for dev in [*dom["hostdevs"], *dom.get("defined_hostdevs", [])]
        }
        return sorted(found)

    def units(self, address: str) -> List[str]:
        """What a PCI function moves with: its card (one card's functions go
        to one domain), and its IOMMU group (libvirt passes a group through
        whole: see busy_cards)."""
        units = ["card " + card_of(address)]
        if address in self.groups:
            units.append(f"group {self.groups[address]}")
        return units


def _domain_record(name: str, xml_text: str, state_text: str, exists: bool) -> JsonObj:
    record: JsonObj = {
        "name": name,
        "exists": exists,
        "state": None,
        "reason": None,
        "title": None,
        "hostdevs": [],
        "agent_channel": False,
    }
    if exists and state_text:
        record["state"], record["reason"] = parse_domstate(state_text)
    if exists and xml_text:
        try:
            parsed = parse_domain_xml(xml_text)
        except ET.ParseError:
            parsed = {"hostdevs": [], "agent_channel": False, "title": None}
        record["title"] = parsed["title"]
        record["hostdevs"] = parsed["hostdevs"]
        record["agent_channel"] = parsed["agent_channel"]
    return record


def _observe_commands(cfg: Config, pinged: List[str]) -> List[List[str]]:
    cmds: List[List[str]] = [["list", "--all", "--name"]]
    for name in cfg.managed:
        cmds.append(cmd_dumpxml(name))
        cmds.append(cmd_domstate(name))
    cmds.extend(cmd_ping(name) for name in pinged)
    # The GPU node's persistent definition: while it runs with a live-only
    # one (some cards lent to players), its own cards are still these.
    cmds.append(cmd_inactive_xml(cfg.gpu_node))
    return cmds


def observe(
    cfg: Config, virsh: Virsh, ping: bool, busy: Optional[Set[str]] = None
) -> Snapshot:
    """One virsh call for the managed domains (+ pings), one more for others.

    No domain in `busy` is pinged (a job of ours stops it through its guest
    agent: libvirt would make the ping wait for that), and a batch whose
    pings wait anyway is read again without pings: the status never waits
    on a guest agent; an unpinged running domain's agent_ready is None.
    """
    snap = Snapshot()
    managed = cfg.managed
    pinged = [name for name in managed if name not in (busy or set())] if ping else []
    before = virsh.calls
    try:
        outs = virsh.batch(
            _observe_commands(cfg, pinged),
            STATUS_BATCH_TIMEOUT if pinged else VIRSH_TIMEOUT,
        )
    except VirshTimeoutError:
        if not pinged:
            raise
        pinged = []
        outs = virsh.batch(_observe_commands(cfg, pinged))
    if not outs[0] and not any(outs[1:]):
        # Not even `list` answered: ask again alone for its error.
        listing = virsh.run(["list", "--all", "--name"])
        if listing.rc != 0:
            raise AgentError(ERR_VIRSH_FAILED, listing.error_text())
        outs[0] = listing.out.strip()
    snap.existing = [ln.strip() for ln in outs[0].splitlines() if ln.strip()]
    for i, name in enumerate(managed):
        record = _domain_record(
            name, outs[1 + 2 * i], outs[2 + 2 * i], name in snap.existing
        )
        if ping:
            answer = (
                outs[1 + 2 * len(managed) + pinged.index(name)]
                if name in pinged
                else None
            )
            record["agent_ready"] = (
                ('"return"' in answer)
                if record["state"] == "running" and answer is not None
                else None
            )
        snap.domains[name] = record
    gpu = snap.domains[cfg.gpu_node]
    gpu["defined_hostdevs"] = gpu["hostdevs"]
    if gpu["exists"] and outs[-1]:
        with contextlib.suppress(ET.ParseError):
            gpu["defined_hostdevs"] = parse_domain_xml(outs[-1])["hostdevs"]
    others = [name for name in snap.existing if name not in managed]
    if others:
        cmds = []
        for name in others:
            cmds.append(cmd_dumpxml(name))
            cmds.append(cmd_domstate(name))
        outs = virsh.batch(cmds)
        for i, name in enumerate(others):
            snap.others[name] = _domain_record(name, outs[2 * i], outs[2 * i + 1], True)
    snap.virsh_calls = virsh.calls - before
    for address in snap.addresses():
        group = iommu_group(cfg.sysfs, address)
        if group is not None:
            snap.groups[address] = group
    return snap


PCI_NAME_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def iommu_group(sysfs: str, address: str) -> Optional[int]:
    """The IOMMU (VFIO) group of a PCI function, read as libvirt reads it
    (src/util/virpci.c, virPCIDeviceAddressGetIOMMUGroupNum): the last
    component of the `iommu_group` link in the device's sysfs directory.
    Readable by anyone, so the agent needs no root for it. None when there
    is none: no IOMMU, or no such function on this machine."""
    if not PCI_NAME_RE.match(address):
        return None
    link = os.path.join(sysfs, "bus", "pci", "devices", address, "iommu_group")
    try:
        target = os.readlink(link)
    except OSError:
        return None
    number = os.path.basename(target.rstrip("/"))
    return int(number) if number.isdigit() else None


def card_table(cfg: Config, snap: Snapshot) -> List[JsonObj]:
    """For each PCI function a managed domain claims: holder and claimants."""
    everything = snap.all_domains()
    addresses: List[str] = []
    gpu = snap.domains[cfg.gpu_node]
    for devs in [gpu.get("defined_hostdevs", [])] + [
        snap.domains[name]["hostdevs"] for name in cfg.managed
    ]:
        for dev in devs:
            if dev["address"] not in addresses:
                addresses.append(dev["address"])
    cards = []
    for address in sorted(addresses):
        claimed = sorted(
            name
            for name, dom in everything.items()
            if any(d["address"] == address for d in dom["hostdevs"])
        )
        held = [name for name in claimed if Snapshot.holds(everything[name])]
        cards.append(
            {
                "address": address,
                "held_by": held[0] if held else None,
                "claimed_by": claimed,
                "iommu_group": snap.groups.get(address),
            }
        )
    return cards


def card_owner(cfg: Config, card: JsonObj, own: List[str]) -> str:
    """Whose card a PCI function is: the gaming VMs that claim it (the GPU
    node only borrows theirs), else the GPU node if its persistent definition
    (`own`) has it, even while it runs without it."""
    gaming = [name for name in card["claimed_by"] if name in cfg.gaming]
    if gaming:
        return ", ".join(gaming)
    return cfg.gpu_node if card["address"] in own else ""


def shared_group_findings(
    cfg: Config, snap: Snapshot, cards: List[JsonObj]
) -> List[JsonObj]:
    """IOMMU groups that hold the cards of different VMs (a board without
    ACS): libvirt passes a group through whole, so those cards can only move
    together; the group is lent and handed off as one."""
    gpu = snap.domains[cfg.gpu_node]
    defined: List[JsonObj] = gpu.get("defined_hostdevs") or gpu["hostdevs"]
    own = [dev["address"] for dev in defined]
    groups: Dict[int, Dict[str, List[str]]] = {}
    for card in cards:
        owner = card_owner(cfg, card, own)
        if card.get("iommu_group") is None or not owner:
            continue
        by_owner = groups.setdefault(card["iommu_group"], {})
        by_owner.setdefault(owner, []).append(card["address"])
    found = []
    for number, by_owner in sorted(groups.items()):
        if len(by_owner) < 2:
            continue
        owners = sorted(by_owner, key=lambda owner: (owner == cfg.gpu_node, owner))
        held = " and ".join(
            f"{', '.join(by_owner[owner])} ({owner})" for owner in owners
        )
        found.append(
            {
                "code": FINDING_SHARED_IOMMU_GROUP,
                "domain": owners[0].split(", ")[0],
                "detail": f"IOMMU group {number} holds {held}: these cards can "
                "only be passed through together",
            }
        )
    return found


def findings_for(cfg: Config, snap: Snapshot, cards: List[JsonObj]) -> List[JsonObj]:
    found: List[JsonObj] = []
    for name in cfg.managed:
        dom = snap.domains[name]
        if not dom["exists"]:
            found.append(
                {
                    "code": FINDING_DOMAIN_MISSING,
                    "domain": name,
                    "detail": f"configured domain {name!r} is not defined in libvirt",
                }
            )
            continue
        if not dom["agent_channel"]:
            found.append(
                {
                    "code": FINDING_NO_AGENT_CHANNEL,
                    "domain": name,
                    "detail": f"no <channel> with target name {AGENT_CHANNEL}: graceful stops cannot work",
                }
            )
    found.extend(
        {
            "code": FINDING_ROM_BAR,
            "domain": cfg.gpu_node,
            "detail": f"hostdev {dev['address']} has no <rom bar='off'/>",
        }
        for dev in snap.domains[cfg.gpu_node]["hostdevs"]
        if dev["rom_bar"] != "off"
    )
    found.extend(
        {
            "code": FINDING_CLAIMED_BY_UNMANAGED,
            "domain": name,
            "detail": f"{card['address']} is also claimed by unmanaged domain {name!r}",
        }
        for card in cards
        for name in card["claimed_by"]
        if name not in cfg.managed
    )
    found.extend(shared_group_findings(cfg, snap, cards))
    return found


# --- state directory -----------------------------------------------------------------
#
# The state directory belongs to the user the agent runs as, and nobody else
# may write to it: the agent refuses it otherwise (state_dir_unsafe). Root never
# works in it as root: act_as_state_owner() makes the process the directory's
# owner first. Below it, every file is reached from a directory descriptor and
# never through a symbolic link (O_NOFOLLOW), new files are made with O_EXCL and
# their mode set on the descriptor, and only names the agent writes itself are
# ever removed.

STATE_DIR_MODE = 0o700
STATE_FILE_MODE = 0o600
MAX_STATE_FILE = 1 << 20
CLAIMS_FILE = "claims.json"
ALIASES_FILE = "aliases.json"
MAX_ALIASES = 200
AGENT_LOG = "agent.log"
AGENT_LOG_MAX = 256 << 10
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)
_NEW_FILE = os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _unsafe(message: str) -> AgentError:
    return AgentError(ERR_STATE_DIR_UNSAFE, message)


def check_state_dir_fd(fd: int, where: str) -> None:
    """A state directory (or one below it) must be this user's, and only theirs
    to write to."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(f"{where} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise _unsafe(
            f"{where} belongs to uid {st.st_uid}, not to uid {uid} that runs the "
            "agent: chown it to that user"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise _unsafe(
            f"{where} is writable by its group or by others (mode {mode:04o}): "
            f"chmod go-w {where}"
        )


def _open_subdir(parent: int, name: str, where: str, create: bool) -> Optional[int]:
    for _ in range(2):
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, STATE_DIR_MODE, dir_fd=parent)
            continue
        except OSError as err:
            if err.errno in _LINK_ERRNOS:
                raise _unsafe(
                    f"{where} is not a directory (a symbolic link?); the agent "
                    "made no such thing: remove it"
                ) from None
            raise
        try:
            check_state_dir_fd(fd, where)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise _unsafe(f"cannot make {where}")


def open_state_dir(state_dir: str, sub: str = "", create: bool = True) -> Optional[int]:
    """A descriptor of the checked state directory, or of its subdirectory
    `sub`; None when it is missing and `create` is false."""
    try:
        try:
            top = os.open(state_dir, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
            os.makedirs(state_dir, mode=STATE_DIR_MODE, exist_ok=True)
            top = os.open(state_dir, _DIR_FLAGS)
    except OSError as err:
        raise _unsafe(
            f"cannot open the state directory {state_dir}: {err.strerror or err}"
        ) from None
    try:
        check_state_dir_fd(top, state_dir)
        if not sub:
            return top
        fd = _open_subdir(top, sub, os.path.join(state_dir, sub), create)
    except BaseException:
        os.close(top)
        raise
    os.close(top)
    return fd


@contextlib.contextmanager
def state_dir_fd(state_dir: str, sub: str = "") -> Iterator[int]:
    """The state directory (or `sub` below it), made if missing."""
    fd = open_state_dir(state_dir, sub, create=True)
    if fd is None:  # pragma: no cover - create=True makes it or raises
        raise _unsafe(f"cannot make {os.path.join(state_dir, sub)}")
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def existing_state_fd(state_dir: str, sub: str = "") -> Iterator[Optional[int]]:
    """The state directory (or `sub` below it) if it exists; else None."""
    fd = open_state_dir(state_dir, sub, create=False)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _exists_at(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _read_at(dfd: int, name: str) -> Optional[bytes]:
    """A regular file's bytes (at most MAX_STATE_FILE); None otherwise."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: List[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_STATE_FILE:
                return None
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_json_at(dfd: int, name: str) -> Optional[Any]:
    data = _read_at(dfd, name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_json_at(dfd: int, name: str, data: Any) -> None:
    """Replace `name` in the directory atomically (see replace_file_at), as a
    state record: mode 0600, not synced (a record lost with the machine is
    read as missing, and every reader copes with that)."""
    payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    replace_file_at(dfd, name, payload, STATE_FILE_MODE, durable=False)


def open_file_at(dfd: int, name: str, flags: int, where: str) -> int:
    """A regular file opened (made if missing) in the directory, mode 0600,
    never through a symbolic link."""
    try:
        fd = os.open(name, flags | _NEW_FILE, STATE_FILE_MODE, dir_fd=dfd)
    except OSError as err:
        if err.errno in _LINK_ERRNOS:
            raise _unsafe(
                f"{where} is a symbolic link; the agent made no such thing: remove it"
            ) from None
        if err.errno == errno.ENXIO:  # a FIFO or socket nobody reads
            raise _unsafe(
                f"{where} is not a regular file; the agent made no such thing"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _unsafe(f"{where} is not a regular file; the agent made no such thing")
    return fd


def open_lock_at(dfd: int, name: str, where: str) -> int:
    """A lock file's descriptor (see open_file_at); flock it."""
    return open_file_at(dfd, name, os.O_RDWR, where)


def _split_state_path(path: str, state_dir: str) -> Tuple[str, str]:
    """(subdirectory or "", name) of a file of the state directory."""
    parts = os.path.relpath(path, state_dir).split(os.sep)
    if len(parts) > 2 or any(p in ("", os.curdir, os.pardir) for p in parts):
        raise AgentError(ERR_INTERNAL, f"{path} is not in the state directory")
    return (parts[0] if len(parts) == 2 else ""), parts[-1]


def write_json_atomic(path: str, data: Any, state_dir: str) -> None:
    """write_json_at for a path in the state directory."""
    sub, name = _split_state_path(path, state_dir)
    with state_dir_fd(state_dir, sub) as dfd:
        write_json_at(dfd, name, data)


def act_as_state_owner(cfg: Config) -> None:
    """As root, become the state directory's owner for good before touching it:
    nothing its owner planted there (a symbolic link, a rewritten record) can
    then make root do more than its owner could."""
    if os.geteuid() != 0:
        return
    try:
        st = os.stat(cfg.state_dir)
    except OSError:
        return  # made by root, for root (install makes it for its user)
    if st.st_uid != 0:
        drop_privileges(st.st_uid, st.st_gid, cfg.env)


def drop_privileges(uid: int, gid: int, env: Dict[str, str]) -> None:
    """Become `uid` for good: its groups, then its gid, then its uid."""
    try:
        account: Optional[pwd.struct_passwd] = pwd.getpwuid(uid)
    except KeyError:
        account = None
    try:
        if account is not None:
            os.initgroups(account.pw_name, account.pw_gid)
            os.setgid(account.pw_gid)
        else:
            os.setgroups([])
            os.setgid(gid)
        os.setuid(uid)
    except OSError as err:
        raise _unsafe(
            f"cannot become uid {uid}, the state directory's owner: "
            f"{err.strerror or err}"
        ) from None
    if (os.getuid(), os.geteuid()) != (uid, uid):  # pragma: no cover - setuid said so
        raise _unsafe(f"could not become uid {uid}, the state directory's owner")
    for key in (
        "XDG_RUNTIME_DIR",
        "XDG_CONFIG_HOME",
        "XDG_CACHE_HOME",
        "DBUS_SESSION_BUS_ADDRESS",
    ):
        env.pop(key, None)
    if account is not None:
        env["HOME"] = account.pw_dir
        env["USER"] = env["LOGNAME"] = account.pw_name
    runtime = f"/run/user/{uid}"
    if os.path.isdir(runtime):  # its systemd user manager, if it lingers
        env["XDG_RUNTIME_DIR"] = runtime


def _append_log(dfd: int, text: str) -> None:
    with contextlib.suppress(OSError):
        if (
            os.stat(AGENT_LOG, dir_fd=dfd, follow_symlinks=False).st_size
            > AGENT_LOG_MAX
        ):
            os.replace(AGENT_LOG, AGENT_LOG + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
    fd = open_file_at(dfd, AGENT_LOG, os.O_WRONLY | os.O_APPEND, AGENT_LOG)
    try:
        _write_all(fd, text.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def log_internal(cfg: Optional[Config], where: str, err: BaseException) -> str:
    """Log an unexpected error on the tower; the incident id to answer with.

    The log is STATE_DIR/agent.log (0600; past 256 KiB it moves to agent.log.1);
    without a usable state directory, syslog (tag gpu-handoff). The client only
    learns the incident id: never the exception's text.
    """
    import traceback  # noqa: PLC0415 - 17 ms of every start, needed only here

    incident = secrets.token_hex(4)
    detail = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    text = (
        f"{now_iso()} [{os.getpid()}] internal error {incident} in {where}:\n{detail}"
    )
    if cfg is not None:
        try:
            with existing_state_fd(cfg.state_dir) as dfd:
                if dfd is not None:
                    _append_log(dfd, text)
                    return incident
        except Exception:  # noqa: BLE001, S110 - syslog below, then
            pass
    try:
        import syslog  # noqa: PLC0415 - only needed here

        syslog.openlog("gpu-handoff", syslog.LOG_PID, syslog.LOG_USER)
        for line in text.splitlines():
            syslog.syslog(syslog.LOG_ERR, line)
    except Exception:  # noqa: BLE001, S110 - nowhere left to log to
        pass
    return incident


def internal_error(incident: str) -> JsonObj:
    """The `error` a client gets for an unexpected error: a code and an id."""
    return {
        "code": ERR_INTERNAL,
        "message": f"internal error {incident}; the details are in the tower's log",
    }


def claims_cache_path(cfg: Config) -> str:
    return os.path.join(cfg.state_dir, CLAIMS_FILE)


# --- jobs -------------------------------------------------------------------------------


def jobs_dir(cfg: Config) -> str:
    return os.path.join(cfg.state_dir, "jobs")


def job_path(cfg: Config, job_id: str) -> str:
    return os.path.join(jobs_dir(cfg), job_id + ".json")


def new_job_id() -> str:
    """Time-ordered (sorts as created) and unique: date-time-micros-random."""
    now = dt.datetime.now(dt.timezone.utc)
    return (
        f"{now.strftime('%Y%m%d-%H%M%S')}-{now.microsecond:06d}-{secrets.token_hex(3)}"
    )


STOP_STEPS = ("wait_agent", "shutdown", "wait_shut_off")


def _stop_steps(domain: str) -> List[JsonObj]:
    return [_step(name, domain) for name in STOP_STEPS]


def _start_steps(domain: str) -> List[JsonObj]:
    return [_step(name, domain) for name in ("wait_devices_free", "start")]


def _step(name: str, domain: str) -> JsonObj:
    return {
        "name": name,
        "domain": domain,
        "started": None,
        "finished": None,
        "result": None,
        "detail": None,
    }


def plan_job(cfg: Config, kind: str, target: Optional[str]) -> List[JsonObj]:
    if kind == "stop":
        return _stop_steps(str(target))
    if kind == "start":
        return _start_steps(str(target))
    if kind == "handoff":
        return _stop_steps(cfg.gpu_node) + _start_steps(str(target))
    if kind == "lend":
        # Restart the GPU node with the cards no running gaming VM holds.
        return [*_stop_steps(cfg.gpu_node), _step("start_free", cfg.gpu_node)]
    steps = _stop_steps(target) if target else []
    return steps + _start_steps(cfg.gpu_node)


def check_work(cfg: Config, kind: str, target: Optional[str]) -> None:
    """The domains a job of this kind may act on: configured ones only."""
    if kind in ("stop", "start"):
        if target not in cfg.managed:
            raise AgentError(
                ERR_UNKNOWN_DOMAIN, f"{str(target)[:80]!r} is not a configured domain"
            )
    elif kind == "lend":
        if target is not None:
            raise AgentError(ERR_BAD_REQUEST, "a lend job names no domain")
    elif (kind == "handoff" or target is not None) and target not in cfg.gaming:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN,
            f"{str(target)[:80]!r} is not a configured gaming domain",
        )


def job_work(cfg: Config, job: JsonObj) -> Tuple[str, Optional[str]]:
    """A job record's kind and domain, checked against the configuration."""
    kind = job.get("kind")
    args = job.get("args")
    target = args.get("domain") if isinstance(args, dict) else None
    if not isinstance(kind, str) or kind not in JOB_KINDS:
        raise AgentError(ERR_BAD_REQUEST, f"{str(kind)[:40]!r} is not a job kind")
    if target is not None and not isinstance(target, str):
        raise AgentError(ERR_BAD_REQUEST, "the job's domain is not a string")
    check_work(cfg, kind, target)
    return kind, target


def create_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> JsonObj:
    """A new job's record (under submit.lock): its id, and with it the name
    of its systemd unit, is one no record in jobs/ has, even for jobs made
    in the same microsecond."""
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        job_id = new_job_id()
        while _exists_at(jfd, job_id + ".json"):
            job_id = new_job_id()
    job: JsonObj = {
        "id": job_id,
        "kind": kind,
        "args": {"domain": target},
        "state": "queued",
        "step": None,
        "steps": plan_job(cfg, kind, target),
        "created": now_iso(),
        "created_epoch": time.time(),
        "started": None,
        "finished": None,
        "error": None,
        "requested_by": requested_by,
        "request_id": request_id,
        "runner": None,
    }
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        write_json_at(jfd, job_id + ".json", job)
    prune_jobs(cfg)
    return job


def list_job_ids(cfg: Config) -> List[str]:
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        if jfd is None:
            return []
        names = os.listdir(jfd)
    ids = [
        n[: -len(".json")]
        for n in names
        if n.endswith(".json") and not n.startswith(".")
    ]
    return sorted(i for i in ids if JOB_ID_RE.match(i))


def read_job(cfg: Config, job_id: str) -> Optional[Any]:
    """A job record as stored (no liveness check); None if there is none."""
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        return None if jfd is None else read_json_at(jfd, job_id + ".json")


def _kept_for_request(job: JsonObj) -> bool:
    """A young record with a request id: Home Assistant may still ask for it."""
    if not job.get("request_id"):
        return False
    try:
        created = float(job.get("created_epoch") or 0)
    except _NUMBER_ERRORS:
        return False
    return time.time() - created < REQUEST_KEEP_SECONDS


def read_aliases(cfg: Config) -> Dict[str, str]:
    """Young request ids answered with another request's queued job: job ids."""
    with existing_state_fd(cfg.state_dir) as sfd:
        data = read_json_at(sfd, ALIASES_FILE) if sfd is not None else None
    out: Dict[str, str] = {}
    if not isinstance(data, dict):
        return out
    for request_id, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("job"), str):
            continue
        try:
            age = time.time() - float(entry.get("time") or 0)
        except _NUMBER_ERRORS:
            continue
        if age < REQUEST_KEEP_SECONDS:
            out[str(request_id)] = entry["job"]
    return out


def add_alias(cfg: Config, request_id: str, job_id: str) -> None:
    """Remember that `request_id` was answered with `job_id` (under submit.lock)."""
    with state_dir_fd(cfg.state_dir) as sfd:
        data = read_json_at(sfd, ALIASES_FILE)
        entries = data if isinstance(data, dict) else {}
        young = read_aliases(cfg)
        kept = {k: v for k, v in entries.items() if k in young}
        kept[request_id] = {"job": job_id, "time": time.time()}
        newest = sorted(kept, key=lambda k: float(kept[k]["time"]))[-MAX_ALIASES:]
        write_json_at(sfd, ALIASES_FILE, {k: kept[k] for k in newest})


def prune_jobs(cfg: Config) -> None:
    """Keep the newest MAX_JOBS records (and any active or still asked-for one).

    Only names the agent writes itself are removed: ID.json, ID.lock, ID.log.
    """
    ids = list_job_ids(cfg)
    if len(ids) <= MAX_JOBS:
        return
    aliased = set(read_aliases(cfg).values())
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        for job_id in ids[: len(ids) - MAX_JOBS]:
            job = read_json_at(jfd, job_id + ".json")
            if job_id in aliased or (
                isinstance(job, dict)
                and (
                    job.get("state") in ("queued", "running") or _kept_for_request(job)
                )
            ):
                continue
            for suffix in (".json", ".lock", ".log"):
                with contextlib.suppress(OSError):
                    os.unlink(job_id + suffix, dir_fd=jfd)


def _lock_is_free(path: str) -> bool:
    """Whether no process holds the lock file at `path` (a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDWR | _NEW_FILE, STATE_FILE_MODE)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def load_job(cfg: Config, job_id: str) -> JsonObj:
    """A job's record; a job whose runner died is reported (and stored) as failed.

    A runner holds jobs/ID.lock from before it reads its job until it has
    written the job's end, and it waits for that lock rather than taking a busy
    one for a rival's: so this probe may take it for an instant. Held: the
    runner lives. Free: a job still queued and young has a runner starting (or
    about to), anything else not finished lost its runner.
    """
    if not JOB_ID_RE.match(job_id):
        raise AgentError(ERR_BAD_REQUEST, f"invalid job id {job_id!r}")
    name = job_id + ".json"
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        job = read_json_at(jfd, name) if jfd is not None else None
        if jfd is None or not isinstance(job, dict):
            raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
        if job.get("state") not in ("queued", "running"):
            return job
        lock_name = job_id + ".lock"
        young = _young_job(job)
        if job["state"] == "queued" and young and not _exists_at(jfd, lock_name):
            return job
        try:
            lock = open_lock_at(jfd, lock_name, os.path.join(jobs_dir(cfg), lock_name))
        except (OSError, AgentError):
            return job
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return job  # the runner holds it: alive
            job = read_json_at(jfd, name)
            if not isinstance(job, dict):
                raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
            if job.get("state") == "running" or (
                job.get("state") == "queued" and not _young_job(job)
            ):
                job["state"] = "failed"
                job["finished"] = now_iso()
                job["error"] = {
                    "code": ERR_RUNNER_DIED,
                    "message": "the job's runner is gone before the job finished",
                }
                write_json_at(jfd, name, job)
        finally:
            os.close(lock)
    return job


def _young_job(job: JsonObj) -> bool:
    try:
        created = float(job.get("created_epoch") or 0)
    except _NUMBER_ERRORS:
        return False
    return time.time() - created < QUEUED_GRACE_SECONDS


def job_summary(job: JsonObj) -> JsonObj:
    step = job.get("step")
    current = (
        job["steps"][step]
        if isinstance(step, int) and step < len(job["steps"])
        else None
    )
    return {
        "id": job["id"],
        "kind": job["kind"],
        "args": job["args"],
        "state": job["state"],
        "step": current["name"] if current else None,
        "created": job["created"],
        "finished": job["finished"],
        "error": job["error"],
        "requested_by": job["requested_by"],
        # Records written before protocol 2 have none.
        "request_id": job.get("request_id"),
    }


def find_request(cfg: Config, request_id: str) -> Optional[str]:
    """The id of the job made for this request id (or that answered it)."""
    for job_id in reversed(list_job_ids(cfg)):
        job = read_job(cfg, job_id)
        if isinstance(job, dict) and job.get("request_id") == request_id:
            return job_id
    aliased = read_aliases(cfg).get(request_id)
    if aliased is not None and JOB_ID_RE.match(aliased) and read_job(cfg, aliased):
        return aliased
    return None


def program_path() -> str:
    """This program's file: the built agent (a zip archive of these sources,
    see build.py) this module was loaded from, or this source file when run
    as it is (a checkout, the tests)."""
    archive = getattr(globals().get("__loader__"), "archive", None)
    return os.path.realpath(archive if isinstance(archive, str) else __file__)


def program_argv(cfg: Config, job_id: str) -> List[str]:
    """A runner's command line: this program, under this interpreter, without
    site-packages if this process was started without (-S: the agent is the
    standard library alone)."""
    return [
        sys.executable,
        *(["-S"] if sys.flags.no_site else []),
        program_path(),
        "--config",
        os.path.abspath(cfg.path),
        "run-job",
        job_id,
        "--state-dir",
        os.path.abspath(cfg.state_dir),
    ]


# Runners this process started as plain child processes: a long-lived session
# reaps them (reap_runners), or they would stay zombies until it ends.
_RUNNERS: List["subprocess.Popen[bytes]"] = []


def reap_runners() -> None:
    _RUNNERS[:] = [child for child in _RUNNERS if child.poll() is None]


def user_lingers() -> bool:
    """Whether this user's systemd manager outlives its sessions. One that
    does not is stopped when the last SSH session of the user has ended
    (logind.conf(5), UserStopDelaySec, 10 s by default), and every job unit
    in it with it: such a user's runners are plain detached processes."""
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return False
    return os.path.isfile(os.path.join(LINGER_DIR, name))


def spawn_runner(cfg: Config, job: JsonObj) -> JsonObj:
    """Start the job's runner detached from this process; describe how."""
    job_id = job["id"]
    mode = cfg.detach
    systemd_run = resolve_program("systemd-run", cfg.cmd_systemd_run, cfg)
    if mode == "auto":
        mode = (
            "systemd"
            if systemd_run
            and os.path.isdir(SYSTEMD_RUNTIME_DIR)
            and (os.geteuid() == 0 or user_lingers())
            else "process"
        )
    if mode == "systemd":
        if systemd_run is None:
            raise AgentError(ERR_SPAWN_FAILED, "systemd-run not found")
        unit = f"gpu-handoff-job-{job_id}"
        argv = [systemd_run]
        if os.geteuid() != 0:
            argv.append("--user")
        argv += [
            "--collect",
            "--quiet",
            f"--unit={unit}",
            "--",
            *program_argv(cfg, job_id),
        ]
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=cfg.env,
            timeout=60,
            check=False,
        )
        if proc.returncode == 0:
            return {"mode": "systemd", "unit": unit}
        if cfg.detach == "systemd":
            raise AgentError(
                ERR_SPAWN_FAILED,
                f"systemd-run failed ({proc.returncode}): {proc.stderr.strip()}",
            )
    name = job_id + ".log"
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        log = open_file_at(
            jfd, name, os.O_WRONLY | os.O_APPEND, os.path.join(jobs_dir(cfg), name)
        )
    try:
        child = subprocess.Popen(
            program_argv(cfg, job_id),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            close_fds=True,
            start_new_session=True,
            env=cfg.env,
        )
    except OSError as err:
        raise AgentError(ERR_SPAWN_FAILED, f"cannot start runner: {err}") from None
    finally:
        os.close(log)
    reap_runners()
    _RUNNERS.append(child)
    return {"mode": "process", "pid": child.pid}


def _submitted(job: JsonObj, runner: Optional[JsonObj]) -> JsonObj:
    """The `job` of a submit's reply."""
    return {
        "id": job["id"],
        "state": job["state"],
        "kind": job["kind"],
        "runner": runner,
        "request_id": job.get("request_id"),
    }


def _create_and_spawn(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str],
) -> JsonObj:
    job = create_job(cfg, kind, target, requested_by, request_id)
    try:
        runner = spawn_runner(cfg, job)
    except AgentError as err:
        job["state"] = "failed"
        job["finished"] = now_iso()
        job["error"] = {"code": err.code, "message": err.message}
        write_json_atomic(job_path(cfg, job["id"]), job, cfg.state_dir)
        raise
    # The runner may already have written its own record: only add the spawn info.
    return _submitted(job, runner)


def queued_jobs(cfg: Config) -> List[JsonObj]:
    """The jobs still waiting for their turn, newest first (liveness checked)."""
    out = []
    for job_id in reversed(list_job_ids(cfg)):
        try:
            job = load_job(cfg, job_id)
        except AgentError:
            continue
        if job.get("state") == "queued":
            out.append(job)
    return out


def _same_work(job: JsonObj, kind: str, target: Optional[str]) -> bool:
    args = job.get("args")
    return (
        job.get("kind") == kind
        and isinstance(args, dict)
        and args.get("domain") == target
    )


def submit_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> Tuple[JsonObj, bool]:
    """Create a job and start its runner: (the reply's `job`, whether it existed).

    A request id that a job record already carries creates nothing: that job
    is answered. Neither does the same work (kind and domain) as a job still
    queued: that job is answered (and the request id remembered for it). A
    queue of max_queued_jobs is full: refused. All of it holds submit.lock, so
    processes asking at once (sessions, one-shot commands, the hook) agree.
    """
    with state_dir_fd(cfg.state_dir) as sfd:
        lock = open_lock_at(
            sfd, "submit.lock", os.path.join(cfg.state_dir, "submit.lock")
        )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if request_id is not None:
            existing = find_request(cfg, request_id)
            if existing is not None:
                job = load_job(cfg, existing)
                return _submitted(job, job.get("runner")), True
        queued = queued_jobs(cfg)
        same = next((job for job in queued if _same_work(job, kind, target)), None)
        if same is not None:
            if request_id is not None:
                add_alias(cfg, request_id, same["id"])
            return _submitted(same, same.get("runner")), True
        if len(queued) >= cfg.max_queued_jobs:
            raise AgentError(
                ERR_QUEUE_FULL,
                f"{len(queued)} jobs wait for their turn already "
                f"(max_queued_jobs = {cfg.max_queued_jobs}); ask again once one has started",
            )
        return _create_and_spawn(cfg, kind, target, requested_by, request_id), False
    finally:
        os.close(lock)


class JobRunner:
    """Executes one job's steps (inside the detached runner)."""

    def __init__(self, cfg: Config, job: JsonObj, virsh: Virsh) -> None:
        self.cfg = cfg
        self.job = job
        self.virsh = virsh
        self.path = job_path(cfg, job["id"])

    def save(self) -> None:
        write_json_atomic(self.path, self.job, self.cfg.state_dir)

    def begin(self, index: int) -> JsonObj:
        step: JsonObj = self.job["steps"][index]
        self.job["step"] = index
        step["started"] = now_iso()
        self.save()
        return step

    def end(self, step: JsonObj, result: str, detail: Optional[str]) -> None:
        step["finished"] = now_iso()
        step["result"] = result
        step["detail"] = detail
        self.save()

    def skip_rest(self, index: int, domain: str, detail: str) -> None:
        """Skip the rest of this stop (or start) of `domain`: a lend job's
        start of the GPU node still runs after its stop was skipped."""
        group = STOP_STEPS if self.job["steps"][index]["name"] in STOP_STEPS else None
        for step in self.job["steps"][index:]:
            if group is not None and step["name"] not in group:
                continue
            if step["domain"] == domain and step["result"] is None:
                step["started"] = step["started"] or now_iso()
                self.end(step, "skipped", detail)

    def state_of(self, domain: str) -> str:
        result = self.virsh.run(cmd_domstate(domain))
        if result.rc != 0:
            raise AgentError(ERR_DOMAIN_MISSING, result.error_text())
        return parse_domstate(result.out)[0]

    def agent_ready(self, domain: str) -> bool:
        result = self.virsh.run(cmd_ping(domain))
        return result.rc == 0 and '"return"' in result.out

    def run(self) -> None:
        for index, step in enumerate(self.job["steps"]):
            if step["result"] is None:
                handler: Callable[[int, JsonObj], None] = getattr(
                    self, "step_" + step["name"]
                )
                handler(index, step)

    def step_wait_agent(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_agent
        while True:
            state = self.state_of(domain)
            if state == "shut_off":
                self.skip_rest(index, domain, "already shut off")
                return
            if state == "in_shutdown":
                self.end(step, "ok", "already shutting down")
                return
            self.refuse_held(step, domain, state)
            if self.agent_ready(domain):
                self.end(step, "ok", "guest agent answered guest-ping")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"guest agent of {domain!r} did not answer within "
                    f"{self.cfg.timeout_agent:g} s; no stop was sent, the domain is left running"
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_AGENT_TIMEOUT, message)
            time.sleep(self.cfg.poll_interval)

    def refuse_held(self, step: JsonObj, domain: str, state: str) -> None:
        """Fail the step at once for a domain that is running but cannot shut
        down: libvirt refuses a guest agent command and every shutdown of a
        domain that is not RUNNING ("domain is not running",
        qemuDomainAgentAvailable, qemuDomainShutdownFlagsAgent/Monitor), so
        waiting would only reach a timeout without saying why."""
        why = HELD_STATES.get(state)
        if why is None:
            return
        message = (
            f"{domain!r} is {state.replace('_', ' ')}: {why}; "
            "it was left as it is (never forced off)"
        )
        self.end(step, "failed", message)
        raise AgentError(ERR_SHUTDOWN_REFUSED, message)

    def step_shutdown(self, index: int, step: JsonObj) -> None:
        """Ask each shutdown mode in turn until one is accepted.

        `shutdown --mode agent` waits until the guest is off, or fails after
        libvirt's 60 s (`Guest agent is not responding: Guest agent not
        available for now`) although the guest may still be going down; and
        a guest shutting itself down has let its guest agent go seconds
        before the power-off (`QEMU guest agent is not connected`). After
        such a refusal the domain is given the shutdown timeout to be shut
        off: then it is stopped; else the step fails. Never destroyed.
        """
        domain = step["domain"]
        self.begin(index)
        refusals: List[str] = []
        going_down = False
        for mode in self.cfg.shutdown_modes:
            result = self.virsh.run(cmd_shutdown(domain, mode))
            if result.rc == 0:
                self.end(step, "ok", f"shutdown --mode {mode} accepted")
                return
            going_down = going_down or may_be_going_down(result)
            if not going_down:
                state = self.state_of(domain)
                if state == "shut_off" and (refusals or not was_not_running(result)):
                    # An earlier mode's request (or this one) took it down
                    # while libvirt answered with an error: this step did.
                    error = "; ".join([*refusals, f"{mode}: {result.error_text()}"])
                    self.end(step, "ok", f"shut off; libvirt answered: {error}")
                    return
                if state == "shut_off":
                    self.skip_rest(index, domain, "already shut off")
                    return
                # the guest powered off itself meanwhile: libvirt ends it
                going_down = state == "in_shutdown"
                if not going_down:
                    self.refuse_held(step, domain, state)
            refusals.append(f"{mode}: {result.error_text()}")
        refused = "; ".join(refusals)
        if going_down and self.shut_off_within(domain, self.cfg.timeout_shutdown):
            self.end(step, "ok", f"shut off after the shutdown was refused ({refused})")
            return
        message = f"{domain!r} refused every shutdown mode: {refused}"
        if going_down:
            message += (
                f"; still running {self.cfg.timeout_shutdown:g} s later, "
                "left running (never forced off)"
            )
        self.end(step, "failed", message)
        raise AgentError(ERR_SHUTDOWN_REFUSED, message)

    def shut_off_within(self, domain: str, seconds: float) -> bool:
        """Whether the domain is shut off within `seconds` (polled)."""
        deadline = time.monotonic() + seconds
        while True:
            if self.state_of(domain) == "shut_off":
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.cfg.poll_interval)

    def step_wait_shut_off(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_shutdown
        while True:
            if self.state_of(domain) == "shut_off":
                self.end(step, "ok", "shut off")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"{domain!r} did not shut off within {self.cfg.timeout_shutdown:g} s; "
                    "it is left running (never forced off)"
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_SHUTDOWN_TIMEOUT, message)
            time.sleep(self.cfg.poll_interval)

    def defined(self, step: JsonObj) -> Tuple[Snapshot, JsonObj]:
        """The tower now and the step's domain in it; the step fails with
        domain_missing when libvirt does not define it (any more)."""
        domain = step["domain"]
        snap = observe(self.cfg, self.virsh, ping=False)
        mine = snap.domains.get(domain)
        if mine is None or not mine["exists"]:
            message = f"domain {domain!r} is not defined in libvirt"
            self.end(step, "failed", message)
            raise AgentError(ERR_DOMAIN_MISSING, message)
        return snap, mine

    def step_wait_devices_free(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_start
        while True:
            snap, mine = self.defined(step)
            if Snapshot.holds(mine):
                self.skip_rest(index, domain, "already running")
                return
            # libvirt refuses a function another domain holds, or any
            # function of its IOMMU group (see busy_cards).
            wanted = {d["address"] for d in mine["hostdevs"]}
            groups = {snap.groups.get(address) for address in wanted} - {None}
            busy = sorted(
                f"{d['address']} held by {name}"
                for name, other in snap.all_domains().items()
                if name != domain and Snapshot.holds(other)
                for d in other["hostdevs"]
                if d["address"] in wanted or snap.groups.get(d["address"]) in groups
            )
            if not busy:
                self.end(step, "ok", "no running domain holds its PCI functions")
                return
            if time.monotonic() >= deadline:
                message = (
                    f"PCI functions of {domain!r} still busy after "
                    f"{self.cfg.timeout_start:g} s: " + ", ".join(busy)
                )
                self.end(step, "failed", message)
                raise AgentError(ERR_DEVICES_BUSY, message)
            step["detail"] = "waiting: " + ", ".join(busy)
            self.save()
            time.sleep(self.cfg.poll_interval)

    def start_retrying(
        self, domain: str, attempt: Callable[[], VirshResult]
    ) -> VirshResult:
        """A start, tried again while it fails on a VFIO device still busy.

        Just after a domain stopped, its QEMU process may not be gone yet and
        the VFIO group it held still open: the next start's QEMU fails to open
        it ("failed to open /dev/vfio/N: Device or resource busy") although
        libvirt released the device. A few seconds later the same start works;
        so such a failure of a domain that stayed shut off is tried again, a
        bounded number of times (START_BUSY_RETRIES)."""
        result = attempt()
        for delay in START_BUSY_RETRIES:
            if result.rc == 0 or not vfio_busy(result):
                return result
            if self.state_of(domain) != "shut_off":
                return result
            time.sleep(delay)
            result = attempt()
        return result

    def step_start(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        result = self.start_retrying(domain, lambda: self.virsh.run(cmd_start(domain)))
        if result.rc == 0:
            self.end(step, "ok", "started")
            return
        if self.state_of(domain) not in ("shut_off",):
            self.end(step, "ok", "already running")
            return
        message = f"start of {domain!r} failed: {result.error_text()}"
        self.end(step, "failed", message)
        raise AgentError(ERR_START_FAILED, message)

    def step_start_free(self, index: int, step: JsonObj) -> None:
        """Start the GPU node with every card of its persistent definition
        that no other running domain holds: with all of them through its own
        definition (`start`), with some through a live-only definition
        (`create`), with none not at all.

        The persistent definition is never written: a crash, a power cut or
        a kill at any instruction leaves it as it was, and the GPU node's next
        plain start has every card again.
        """
        domain = step["domain"]
        self.begin(index)
        snap, mine = self.defined(step)
        if Snapshot.holds(mine):
            self.end(step, "ok", "already running")
            return
        busy = busy_cards(snap, domain)
        defined = self.virsh.run(cmd_defined_xml(domain))
        if defined.rc != 0:
            message = (
                f"cannot read the definition of {domain!r}: {defined.error_text()}"
            )
            self.end(step, "failed", message)
            raise AgentError(ERR_START_FAILED, message)
        try:
            live, kept, left = live_definition(defined.out, busy)
        except ET.ParseError as err:
            message = (
                f"the definition of {domain!r} is not XML libvirt would give: {err}"
            )
            self.end(step, "failed", message)
            raise AgentError(ERR_START_FAILED, message) from err
        if not kept and left:
            self.end(step, "skipped", "every card is in use: the GPU node stays off")
            return
        if not left:
            result = self.start_retrying(
                domain, lambda: self.virsh.run(cmd_start(domain))
            )
            detail = "started with every card"
        else:
            result = self.start_retrying(domain, lambda: self._create(live))
            detail = "started without " + ", ".join(left) + " (live definition only)"
        if result.rc == 0:
            self.end(step, "ok", detail)
            return
        if self.state_of(domain) != "shut_off":
            self.end(step, "ok", "already running")
            return
        message = f"start of {domain!r} failed: {result.error_text()}"
        self.end(step, "failed", message)
        raise AgentError(ERR_START_FAILED, message)

    def _create(self, xml_text: str) -> VirshResult:
        """`virsh create` from a private temporary file, removed afterwards."""
        tmpdir = tempfile.mkdtemp(prefix="gpu-handoff-live-")
        try:
            path = os.path.join(tmpdir, "live.xml")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(xml_text)
            return self.virsh.run(cmd_create(path))
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


# A refused shutdown after which the guest may still be going down: the
# guest agent did not answer in time or is gone (VIR_ERR_AGENT_UNRESPONSIVE:
# qemuAgentSend's 60 s wait for the power-off, an agent that left with the
# guest's own shutdown), the agent job was held by another call
# (VIR_ERR_OPERATION_TIMEOUT), or virsh itself was given up on.
GOING_DOWN_ERRORS = (
    "error: Guest agent is not responding:",
    "error: Timed out during operation:",
)


# Running domains that cannot be shut down: libvirt needs VIR_DOMAIN_RUNNING
# for the guest agent and for every shutdown mode; why, for the user.
HELD_STATES = {
    "paused": "a paused domain answers neither its guest agent nor a shutdown "
    "until it is resumed (virsh resume)",
    "crashed": "the guest crashed (it panicked) and is kept for inspection; "
    "it cannot shut down",
    "pmsuspended": "the guest is suspended (sleeping); wake it first",
    "blocked": "the domain is blocked on a resource",
}

# After a stop the next start may find the VFIO group still open by the old
# QEMU for a moment: it is tried again after these pauses (seconds).
START_BUSY_RETRIES = (1.0, 2.0, 4.0)
VFIO_BUSY_RE = re.compile(r"vfio .*Device or resource busy")


def vfio_busy(result: VirshResult) -> bool:
    """Whether a failed start failed on a VFIO device still busy (QEMU's
    EBUSY opening /dev/vfio/N)."""
    return bool(VFIO_BUSY_RE.search(result.err))


def was_not_running(result: VirshResult) -> bool:
    """libvirt refused a shutdown because the domain was not running when it
    looked (virDomainObjCheckActive: VIR_ERR_OPERATION_INVALID, "domain is
    not running")."""
    return "domain is not running" in result.err


def may_be_going_down(result: VirshResult) -> bool:
    return result.timed_out or any(
        line.startswith(GOING_DOWN_ERRORS) for line in result.err.splitlines()
    )


def card_of(address: str) -> str:
    """The card a PCI function belongs to (`0000:03:00.1` -> `0000:03:00`):
    the functions of one card go to one domain together."""
    return address.rsplit(".", 1)[0]


def busy_cards(snap: Snapshot, domain: str) -> List[str]:
    """The cards `domain` cannot start with now: those a running domain other
    than `domain` holds a function of, and every card of an IOMMU group it
    holds a function of.

    libvirt passes a VFIO group through whole: before a start it checks every
    function of the group of each of the domain's functions, and refuses the
    start when another domain holds one ("PCI device ADDR is in use by driver
    QEMU, domain X", src/hypervisor/virhostdev.c,
    virHostdevPreparePCIDevicesImpl), even one the domain does not have. On a
    board without ACS two cards can share a group: the group, not the card,
    is then what can be lent.
    """
    blocked = {
        unit
        for name, other in snap.all_domains().items()
        if name != domain and Snapshot.holds(other)
        for dev in other["hostdevs"]
        for unit in snap.units(dev["address"])
    }
    return sorted(
        {
            card_of(address)
            for address in snap.addresses()
            if blocked.intersection(snap.units(address))
        }
    )


# Namespaces libvirt domain XML uses, kept under their usual prefixes when a
# live definition is written back (ElementTree would call them ns0, ns1...).
LIBVIRT_NAMESPACES = {
    "qemu": "http://libvirt.org/schemas/domain/qemu/1.0",
    "lxc": "http://libvirt.org/schemas/domain/lxc/1.0",
    "bhyve": "http://libvirt.org/schemas/domain/bhyve/1.0",
    "xen": "http://libvirt.org/schemas/domain/xen/1.0",
    "vmware": "http://libvirt.org/schemas/domain/vmware/1.0",
    "test": "http://libvirt.org/schemas/domain/test/1.0",
}


def live_definition(xml_text: str, busy: List[str]) -> Tuple[str, List[str], List[str]]:
    """The persistent definition without the PCI hostdevs of `busy` cards:
    (XML, cards kept, cards left out)."""
    for prefix, uri in LIBVIRT_NAMESPACES.items():
        ET.register_namespace(prefix, uri)
    root = ET.fromstring(xml_text)  # noqa: S314 - XML from libvirt itself
    kept: List[str] = []
    left: List[str] = []
    devices = root.find("./devices")
    for dev in list(devices) if devices is not None else []:
        if dev.tag != "hostdev" or dev.get("type") != "pci":
            continue
        if dev.get("mode", "subsystem") != "subsystem":
            continue
        addr = dev.find("./source/address")
        if addr is None:
            continue
        card = card_of(pci_address(addr))
        target = left if card in busy else kept
        if card not in target:
            target.append(card)
        if card in busy and devices is not None:
            devices.remove(dev)
    return ET.tostring(root, encoding="unicode"), kept, left


# What stops a runner before its job is over, and why that comes: systemd
# stops its unit with SIGTERM (`systemctl stop`, the user's manager or the
# system shutting down), sent to every process of the unit (KillMode=
# control-group: a virsh the runner waits for gets it too); SIGHUP and SIGINT
# reach a runner started by hand from a terminal.
RUNNER_STOP_SIGNALS: Dict[int, str] = {
    signal.SIGTERM: "the system is shutting down or its unit was stopped",
    signal.SIGHUP: "its terminal or session went away",
    signal.SIGINT: "it was interrupted",
}


class RunnerStopped(BaseException):
    """A stop signal reached the runner. Not an Exception: no step's `except
    Exception` takes it for a failure of its own."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def message(self) -> str:
        return (
            f"the job's runner was stopped ({signal.Signals(self.signum).name}) "
            f"before the job finished: {RUNNER_STOP_SIGNALS[self.signum]}"
        )


class RunnerSignals:
    """The runner's stop signals while it runs (a context manager).

    The first one raises RunnerStopped where the runner is: in a sleep, in a
    wait for a lock or for virsh (subprocess.run kills and reaps its child on
    the way out). Once the runner holds (`hold`: it is writing its job's
    end) or has been stopped, a signal is only kept. Handlers are set in the
    main thread only (Python runs them nowhere else), never for a signal the
    runner was started with ignored, and the previous ones are back on exit.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.holding = False
        self._previous: Dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if not self.holding:
            self.holding = True
            raise RunnerStopped(signum)

    def hold(self) -> None:
        self.holding = True

    def __enter__(self) -> "RunnerSignals":
        for signum in RUNNER_STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            try:
                signal.signal(signum, self._handler)
            except ValueError:  # not the main thread
                break
            self._previous[signum] = signal.SIG_DFL if previous is None else previous
        return self

    def __exit__(self, *exc: object) -> None:
        self.holding = True
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def run_job(cfg: Config, job_id: str) -> int:
    """The detached runner: one job, serialised per tower by a flock.

    It waits for its job's lock (a `job`, `jobs` or `status` probe holds it for
    an instant; a rival runner until its job is over: then the job is no longer
    queued and this runner has nothing to do). It runs only queued work that
    the configuration allows, with steps made anew from the job's kind and
    domain: never the steps or domains a record lists.

    A stop signal (RUNNER_STOP_SIGNALS) ends it early: the job is recorded as
    failed (runner_died, naming the signal), its locks are released, and the
    signal is then delivered again with the handler the runner had before: by
    default it ends the process as it would have (for systemd, a clean stop).
    """
    with RunnerSignals() as signals:
        try:
            code = _run_job(cfg, job_id, signals)
        except RunnerStopped:
            code = 1  # before it held its job's lock: the job is not its to write
    if signals.received is not None:
        with contextlib.suppress(*_STREAM_ERRORS):
            sys.stderr.flush()
        os.kill(os.getpid(), signals.received)
        return 128 + signals.received  # a handler that did not end the process
    return code


def record_stopped(jfd: int, name: str, stop: RunnerStopped) -> None:
    """A stopped runner's job, failed: the record as last written (whole:
    records are replaced atomically, so no step is half-recorded there; what
    the runner had not written yet is left out), a step under way left as
    begun. A job that had already ended is left as it is."""
    job = read_json_at(jfd, name)
    if not isinstance(job, dict) or job.get("state") not in ("queued", "running"):
        return
    job["state"] = "failed"
    job["finished"] = now_iso()
    job["error"] = {"code": ERR_RUNNER_DIED, "message": stop.message()}
    write_json_at(jfd, name, job)
    with contextlib.suppress(*_STREAM_ERRORS):
        sys.stderr.write(f"gpu-handoff: job {job.get('id')}: {stop.message()}\n")


def _run_job(cfg: Config, job_id: str, signals: RunnerSignals) -> int:
    name = job_id + ".json"
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        lock = open_lock_at(
            jfd, job_id + ".lock", os.path.join(jobs_dir(cfg), job_id + ".lock")
        )
        locked = False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            locked = True
            job = read_json_at(jfd, name)
            if not isinstance(job, dict) or job.get("state") != "queued":
                return 0  # another runner ran it, or no such job
            try:
                kind, target = job_work(cfg, job)
            except AgentError as err:
                job["state"] = "failed"
                job["finished"] = now_iso()
                job["error"] = {"code": err.code, "message": err.message}
                write_json_at(jfd, name, job)
                return 1
            job["steps"] = plan_job(cfg, kind, target)
            job["step"] = None
            job["runner"] = {"pid": os.getpid()}
            write_json_at(jfd, name, job)
            try:
                with state_dir_fd(cfg.state_dir) as sfd:
                    tower = open_lock_at(
                        sfd, "tower.lock", os.path.join(cfg.state_dir, "tower.lock")
                    )
            except AgentError as err:
                job["state"] = "failed"
                job["finished"] = now_iso()
                job["error"] = {"code": err.code, "message": err.message}
                write_json_at(jfd, name, job)
                return 1
            try:
                fcntl.flock(tower, fcntl.LOCK_EX)
                job["state"] = "running"
                job["started"] = now_iso()
                write_json_at(jfd, name, job)
                try:
                    try:
                        JobRunner(
                            cfg, job, Virsh(cfg, unreachable_wait=JOB_LIBVIRT_WAIT)
                        ).run()
                    finally:
                        signals.hold()  # the job's end is written whatever comes
                    job["state"] = "succeeded"
                except AgentError as err:
                    job["state"] = "failed"
                    job["error"] = {"code": err.code, "message": err.message}
                except Exception as err:  # noqa: BLE001 - logged, recorded in the job
                    job["state"] = "failed"
                    job["error"] = internal_error(
                        log_internal(cfg, f"job {job_id}", err)
                    )
                job["finished"] = now_iso()
                write_json_at(jfd, name, job)
            finally:
                os.close(tower)
        except RunnerStopped as stop:
            if not locked:
                raise
            record_stopped(jfd, name, stop)
            return 1
        finally:
            os.close(lock)
    return 0 if job["state"] == "succeeded" else 1


# --- verbs --------------------------------------------------------------------------------


# The hook's request records: requests/JOBID-DOMAIN.json (JOBID as new_job_id).
REQUEST_FILE_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9]{6}-[0-9a-f]{6}-.+\.json$")


def _request_names(rfd: int) -> List[str]:
    """The request records in requests/, oldest first: only names the hook writes."""
    return sorted(n for n in os.listdir(rfd) if REQUEST_FILE_RE.match(n))


def hook_requests(cfg: Config) -> List[JsonObj]:
    out: List[JsonObj] = []
    with existing_state_fd(cfg.state_dir, "requests") as rfd:
        if rfd is None:
            return out
        for name in _request_names(rfd)[-MAX_HOOK_REQUESTS:]:
            data = read_json_at(rfd, name)
            if isinstance(data, dict):
                out.append(data)
    return out


def status_body(cfg: Config, virsh: Optional[Virsh] = None) -> JsonObj:
    """What `status` answers (without protocol/ok): one-shot and sessions."""
    virsh = virsh or Virsh(cfg)
    # Jobs before libvirt: a job that is over when read has done all it does
    # to libvirt by then, so no status shows a job gone but not its effect.
    active = []
    stopping: Set[str] = set()
    for job_id in list_job_ids(cfg):
        try:
            job = load_job(cfg, job_id)
            if job.get("state") in ("queued", "running"):
                active.append(job_summary(job))
                stopping.update(shutting_down(job))
        except _JOB_ERRORS:
            continue
    requests = hook_requests(cfg)
    snap = observe(cfg, virsh, ping=True, busy=stopping)
    cards = card_table(cfg, snap)
    found = findings_for(cfg, snap, cards)
    gpu = snap.domains[cfg.gpu_node]
    with state_dir_fd(cfg.state_dir) as sfd:
        write_json_at(
            sfd,
            CLAIMS_FILE,
            {
                "gpu_node": cfg.gpu_node,
                "addresses": sorted(d["address"] for d in gpu["hostdevs"]),
                "written": now_iso(),
            },
        )
    domains = []
    for name in cfg.managed:
        dom = dict(snap.domains[name])
        dom["role"] = "gpu_node" if name == cfg.gpu_node else "gaming"
        domains.append(dom)
    return {
        "uri": cfg.libvirt_uri,
        "gpu_node": cfg.gpu_node,
        "gaming": cfg.gaming,
        "domains": domains,
        "cards": cards,
        "findings": found,
        "hook_requests": requests,
        "active_jobs": active,
        "virsh_calls": snap.virsh_calls,
    }


def shutting_down(job: JsonObj) -> List[str]:
    """The domain a running job is shutting down (its `shutdown` step runs):
    libvirt's `shutdown --mode agent` holds that domain's guest agent until
    the guest is off (or 60 s), and a ping would wait for it."""
    step = job.get("step")
    steps = job.get("steps")
    if job.get("state") != "running" or not isinstance(steps, list):
        return []
    if not isinstance(step, int) or not 0 <= step < len(steps):
        return []
    current = steps[step]
    if (
        isinstance(current, dict)
        and current.get("name") == "shutdown"
        and current.get("result") is None
        and isinstance(current.get("domain"), str)
    ):
        return [current["domain"]]
    return []


def verb_status(cfg: Config) -> JsonObj:
    return reply_ok(**status_body(cfg))


# --- screenshots ----------------------------------------------------------------

MIME_PNG = "image/png"
# What `virsh screenshot` saves where libvirt is older than 9.0 or QEMU older
# than 7.1 (QEMU's screendump in its default format): browsers cannot show a
# PPM, so the agent sends it as a PNG.
MIME_PPM = "image/x-portable-pixmap"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# zlib's default level: within a few percent of level 9's size on a screen,
# in a fraction of its time.
PNG_LEVEL = 6
# A PPM header is "P6 WIDTH HEIGHT MAXVAL" and one whitespace byte (QEMU
# writes 15 bytes); Netpbm allows comments between the fields, not pages.
PPM_HEADER_MAX = 256
# The widest and tallest screen converted (QEMU's own limit on a display).
SCREEN_SIDE_MAX = 16384
# The largest PPM read: a 4K screen is 24 MiB of PPM, a 5K one 42 MiB. It is
# read in blocks, never whole; what is sent is bounded by screenshot_max_bytes.
PPM_MAX_BYTES = 64 << 20
# Rows are filtered and compressed this many bytes at a time.
PPM_BLOCK_BYTES = 1 << 20
_PPM_SPACE = rb"[ \t\n\r\v\f]"
# Between two fields: whitespace and comments ("#" to the end of the line).
_PPM_GAP = rb"(?:" + _PPM_SPACE + rb"|#[^\n\r]*[\n\r])+"
_PPM_HEADER = re.compile(rb"P6" + (_PPM_GAP + rb"([0-9]{1,7})") * 3 + _PPM_SPACE)


def parse_ppm_header(head: bytes, size: int) -> Tuple[int, int, int, int]:
    """(width, height, maxval, offset of the pixels) of a binary PPM of ``size``
    bytes whose first bytes are ``head``, as Netpbm defines the format.

    One image of 8-bit samples (maxval 1 to 255), exactly as many pixel bytes
    as the header says: anything else is refused, not guessed at.
    """
    found = _PPM_HEADER.match(head[:PPM_HEADER_MAX])
    if found is None:
        raise AgentError(
            ERR_SCREENSHOT_FAILED, "the screenshot is not a PPM this agent can read"
        )
    width, height, maxval = (int(value) for value in found.groups())
    if width == 0 or height == 0:
        raise AgentError(ERR_SCREENSHOT_FAILED, f"the PPM is empty ({width}x{height})")
    if width > SCREEN_SIDE_MAX or height > SCREEN_SIDE_MAX:
        raise AgentError(
            ERR_TOO_LARGE,
            f"the screen is {width}x{height}; at most {SCREEN_SIDE_MAX} pixels a side"
            " are read",
        )
    if not 0 < maxval < 256:
        raise AgentError(
            ERR_SCREENSHOT_FAILED,
            f"the PPM's maximum value is {maxval}; only 8-bit samples are read",
        )
    offset = found.end()
    if size != offset + width * height * 3:
        raise AgentError(
            ERR_SCREENSHOT_FAILED,
            f"the PPM is {size} bytes, not the {offset + width * height * 3}"
            f" its {width}x{height} header says",
        )
    return width, height, maxval, offset


def png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(kind)) & 0xFFFFFFFF
    return len(body).to_bytes(4, "big") + kind + body + crc.to_bytes(4, "big")


def _too_large(size: int, limit: int, what: str = "") -> AgentError:
    return AgentError(
        ERR_TOO_LARGE,
        f"screenshot is {size} bytes{what}, more than screenshot_max_bytes={limit}",
    )


def png_from_ppm(handle: IO[bytes], size: int, limit: int) -> Tuple[bytes, int, int]:
    """The PPM in ``handle`` (``size`` bytes) as a PNG of at most ``limit``
    bytes, with its width and height.

    8-bit RGB, every row with filter type 0 (none): a screen compresses well
    as it is, and the tower spends no time choosing filters. The PPM is read
    and compressed a block of rows at a time, and the work stops as soon as
    the PNG would exceed ``limit``.
    """
    if size > PPM_MAX_BYTES:
        raise AgentError(
            ERR_TOO_LARGE,
            f"the PPM is {size} bytes; at most {PPM_MAX_BYTES} are converted",
        )
    width, height, maxval, offset = parse_ppm_header(handle.read(PPM_HEADER_MAX), size)
    handle.seek(offset)
    row = width * 3
    # Samples scaled to 0-255 where maxval is lower (values above maxval are
    # invalid in a PPM: they are shown at full intensity).
    scale = (
        None
        if maxval == 255
        else bytes(min(255, (v * 255 + maxval // 2) // maxval) for v in range(256))
    )
    rows_per_block = max(1, PPM_BLOCK_BYTES // row)
    squeeze = zlib.compressobj(PNG_LEVEL)
    parts: List[bytes] = []
    produced = 0
    done = 0
    while done < height:
        count = min(rows_per_block, height - done)
        pixels = handle.read(count * row)
        if len(pixels) != count * row:
            raise AgentError(ERR_SCREENSHOT_FAILED, "the PPM ended early")
        if scale is not None:
            pixels = pixels.translate(scale)
        view = memoryview(pixels)
        rows = b"\x00" + b"\x00".join(
            view[start : start + row] for start in range(0, len(pixels), row)
        )
        parts.append(squeeze.compress(rows))
        produced += len(parts[-1])
        if produced > limit:
            raise _too_large(produced, limit, " as PNG before its end")
        done += count
    parts.append(squeeze.flush())
    # 8-bit samples, RGB, deflate, filters of method 0, not interlaced.
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + b"\x08\x02\0\0\0"
    png = b"".join(
        (
            PNG_SIGNATURE,
            png_chunk(b"IHDR", header),
            png_chunk(b"IDAT", b"".join(parts)),
            png_chunk(b"IEND", b""),
        )
    )
    if len(png) > limit:
        raise _too_large(len(png), limit, " as PNG")
    return png, width, height


def verb_screenshot(cfg: Config, domain: str) -> JsonObj:
    """The domain's screen as `virsh screenshot` saves it; a PPM (older
    libvirt or QEMU) is sent as a PNG. At most screenshot_max_bytes are sent."""
    virsh = Virsh(cfg)
    limit = cfg.screenshot_max_bytes
    tmpdir = tempfile.mkdtemp(prefix="gpu-handoff-shot-")
    try:
        target = os.path.join(tmpdir, "screen")
        result = virsh.run(cmd_screenshot(domain, target))
        if result.rc != 0:
            raise AgentError(ERR_SCREENSHOT_FAILED, result.error_text())
        match = re.search(r"with type of (\S+?)\.?$", result.out.strip())
        mime = match.group(1) if match else "application/octet-stream"
        with open(target, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if mime == MIME_PPM:
                data, _width, _height = png_from_ppm(handle, size, limit)
                mime = MIME_PNG
            elif size > limit:
                raise _too_large(size, limit)
            else:
                data = handle.read(size)  # virsh has finished writing it
        return reply_ok(
            domain=domain,
            mime=mime,
            size=len(data),
            data=base64.b64encode(data).decode("ascii"),
        )
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# The steps in which a job of ours runs `virsh start` or `virsh create`.
START_STEPS = ("start", "start_free")


def starting_job(cfg: Config, domain: str) -> Optional[str]:
    """The id of a live job of ours that is starting `domain` now (its
    runner began a start step of it and has not ended it), if any.

    A runner writes the step's begin before it calls virsh, and libvirtd runs
    the qemu hook inside that call: so the hook always sees its own job's
    step. A job whose runner died is not one (load_job checks its lock).
    """
    for job_id in reversed(list_job_ids(cfg)):
        try:
            job = load_job(cfg, job_id)
        except _JOB_ERRORS:
            continue
        index = job.get("step")
        steps = job.get("steps")
        if job.get("state") != "running" or not isinstance(index, int):
            continue
        if not isinstance(steps, list) or not 0 <= index < len(steps):
            continue
        step = steps[index]
        if (
            isinstance(step, dict)
            and step.get("name") in START_STEPS
            and step.get("domain") == domain
            and step.get("started")
            and step.get("result") is None
        ):
            return str(job["id"])
    return None


def verb_hook(cfg: Config, args: List[str], xml_text: str) -> None:
    """libvirt's qemu hook: never waits, never calls libvirt, prints nothing.

    libvirt writes the domain XML to stdin and, for some operations, reads the
    hook's stdout as new XML: so stdin is always read and stdout never written.
    libvirtd runs it as root: it becomes the state directory's owner before it
    reads or writes anything there, and so does the runner it starts.
    """
    if len(args) < 3:
        return
    domain, operation, subop = args[0], args[1], args[2]
    if operation != "prepare" or subop != "begin" or domain not in cfg.gaming:
        return
    try:
        wanted = {d["address"] for d in parse_domain_xml(xml_text)["hostdevs"]}
    except ET.ParseError:
        return
    act_as_state_owner(cfg)
    if starting_job(cfg, domain) is not None:
        # libvirtd runs the hook on every start, the agent's own too: a
        # start a job of ours makes is that job's, never a request.
        return
    with existing_state_fd(cfg.state_dir) as sfd:
        cache = read_json_at(sfd, CLAIMS_FILE) if sfd is not None else None
    if not isinstance(cache, dict) or cache.get("gpu_node") != cfg.gpu_node:
        return
    shared = sorted(wanted & set(cache.get("addresses") or []))
    if not shared:
        return
    request: JsonObj = {
        "domain": domain,
        "operation": f"{operation} {subop}",
        "addresses": shared,
        "time": now_iso(),
        "job": None,
    }
    try:
        submitted, _ = submit_job(cfg, "stop", cfg.gpu_node, "hook")
        request["job"] = submitted["id"]
    except AgentError as err:
        request["error"] = {"code": err.code, "message": err.message}
    with state_dir_fd(cfg.state_dir, "requests") as rfd:
        write_json_at(rfd, f"{new_job_id()}-{domain}.json", request)
        names = _request_names(rfd)
        for old in names[: max(0, len(names) - MAX_HOOK_REQUESTS)]:
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=rfd)


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
        import ctypes  # noqa: PLC0415 - only where it exists

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


# --- session ---------------------------------------------------------------------------------


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
                # Listen before the first status, so no change falls in between.
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


# --- requests (serve, the command line, sessions) -------------------------------------------


def check_request_id(value: Any) -> str:
    if not isinstance(value, str) or not REQUEST_ID_RE.fullmatch(value):
        raise AgentError(
            ERR_BAD_REQUEST,
            "invalid request id (a letter or digit, then 7..63 letters, digits, _ or -)",
        )
    return value


def split_request_option(verb: str, args: List[str]) -> Tuple[List[str], Optional[str]]:
    """A job verb's `--request=RID` word (anywhere), taken out of its arguments."""
    if verb not in JOB_VERBS:
        return list(args), None
    request_id: Optional[str] = None
    rest: List[str] = []
    for word in args:
        if not word.startswith(REQUEST_OPTION):
            rest.append(word)
        elif request_id is not None:
            raise AgentError(ERR_BAD_REQUEST, "--request given more than once")
        else:
            request_id = check_request_id(word[len(REQUEST_OPTION) :])
    return rest, request_id


def check_request(cfg: Config, verb: str, args: List[str]) -> None:
    """Validate a user verb's arguments before anything runs."""
    low, high = SERVE_VERBS[verb]
    if not low <= len(args) <= high:
        raise AgentError(
            ERR_BAD_REQUEST, f"{verb} takes {low}..{high} arguments, got {len(args)}"
        )
    if verb == "screenshot" and args[0] not in cfg.managed:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN, f"{args[0][:80]!r} is not a configured domain"
        )
    if verb in JOB_VERBS:
        check_work(cfg, verb, args[0] if args else None)
    if verb == "job":
        if not JOB_ID_RE.fullmatch(args[0]):
            raise AgentError(ERR_BAD_REQUEST, "invalid job id")
        if not os.path.exists(job_path(cfg, args[0])):
            raise AgentError(ERR_UNKNOWN_JOB, f"no job {args[0]!r}")
    if verb == "request":
        check_request_id(args[0])


def run_request(
    cfg: Config,
    verb: str,
    args: List[str],
    request_id: Optional[str],
    requested_by: str,
) -> JsonObj:
    """The reply to one validated request (any user verb but watch and session)."""
    if verb == "version":
        return version_reply(cfg)
    if verb == "status":
        return verb_status(cfg)
    if verb in JOB_VERBS:
        Virsh(cfg)  # fail now, not in the runner, when virsh is missing
        job, existing = submit_job(
            cfg, verb, args[0] if args else None, requested_by, request_id
        )
        return reply_ok(job=job, existing=existing)
    if verb == "job":
        return reply_ok(job=load_job(cfg, args[0]))
    if verb == "request":
        job_id = find_request(cfg, args[0])
        if job_id is None:
            raise AgentError(ERR_UNKNOWN_REQUEST, f"no job has request id {args[0]!r}")
        return reply_ok(job=load_job(cfg, job_id))
    if verb == "jobs":
        summaries = []
        for job_id in reversed(list_job_ids(cfg)):
            try:
                summaries.append(job_summary(load_job(cfg, job_id)))
            except _JOB_ERRORS:
                continue
        return reply_ok(jobs=summaries)
    if verb == "screenshot":
        return verb_screenshot(cfg, args[0])
    raise AgentError(ERR_NOT_ALLOWED, f"verb {verb[:40]!r} is not a request")


# --- serve (forced command) ------------------------------------------------------------


def parse_serve_request(
    cfg: Config, command: Optional[str]
) -> Tuple[str, List[str], Optional[str]]:
    """Validate SSH_ORIGINAL_COMMAND: (verb, arguments, request id)."""
    if command is None or not command.strip():
        raise AgentError(
            ERR_BAD_REQUEST, "no command given (SSH_ORIGINAL_COMMAND is unset)"
        )
    if len(command) > SERVE_MAX_LENGTH:
        raise AgentError(
            ERR_BAD_REQUEST, f"command longer than {SERVE_MAX_LENGTH} characters"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in command):
        raise AgentError(ERR_BAD_REQUEST, "control characters in command")
    try:
        words = shlex.split(command)
    except ValueError as err:
        raise AgentError(ERR_BAD_REQUEST, f"cannot parse command: {err}") from None
    if not words:
        raise AgentError(ERR_BAD_REQUEST, "empty command")
    verb = words[0]
    if verb not in SERVE_VERBS:
        raise AgentError(ERR_NOT_ALLOWED, f"verb {verb[:40]!r} is not allowed")
    args, request_id = split_request_option(verb, words[1:])
    check_request(cfg, verb, args)
    return verb, args, request_id


# --- install ------------------------------------------------------------------------------

DEFAULT_LIBVIRT_URI = "qemu:///system"
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


PLACEHOLDER_KEY = "<public key of Home Assistant>"
# NixOS marks itself twice: every activation creates /etc/NIXOS
# (nixos/modules/system/etc/setup-etc.pl), and its os-release says ID=nixos
# (nixos/modules/misc/version.nix). os-release is read from /etc, or from
# /usr/lib where /etc has none (os-release(5)).
NIXOS_MARKER = "/etc/NIXOS"
OS_RELEASE_FILES = ("/etc/os-release", "/usr/lib/os-release")
OS_RELEASE_MAX = 64 << 10
# The NixOS module, in a checkout of the repository this file comes from.
NIXOS_MODULE_IN_CHECKOUT = os.path.join("nixos", "module.nix")
NIXOS_MODULE_PLACEHOLDER = "/path/to/gpu-handoff/nixos/module.nix"
# A Nix string literal needs these escaped (`${` would interpolate).
_NIX_ESCAPES = (
    ("\\", "\\\\"),
    ('"', '\\"'),
    ("${", "\\${"),
    ("\n", "\\n"),
    ("\r", "\\r"),
    ("\t", "\\t"),
)


def agent_config(
    *,
    gpu_node: str,
    gaming: List[str],
    libvirt_uri: str = DEFAULT_LIBVIRT_URI,
    state_dir: str = DEFAULT_INSTALL_STATE_DIR,
    timeouts: Optional[Dict[str, float]] = None,
    path: Optional[List[str]] = None,
    detach: Optional[str] = None,
) -> JsonObj:
    """The configuration `install` writes for these options.

    The NixOS module writes the same for the same options: nixos/config.nix
    (agentConfig, with these defaults) is its twin, and
    tests/tower/test_nixos.py holds the two to each other. Every timeout is
    written, as seconds in floating point, so the file says what applies.
    """
    seconds: Dict[str, float] = dict(TIMEOUT_DEFAULTS)
    seconds.update(timeouts or {})
    data: JsonObj = {
        "libvirt_uri": libvirt_uri,
        "gpu_node": gpu_node,
        "gaming": list(gaming),
        "state_dir": state_dir,
        "timeouts": {kind: float(value) for kind, value in seconds.items()},
    }
    if path:
        data["path"] = list(path)
    if detach:
        data["detach"] = detach
    return data


def hook_script(program: str, config_path: str) -> str:
    """The libvirt qemu hook: libvirt's arguments to the `hook` verb, as is
    (nixos/config.nix, hookScript, writes the same text).

    libvirtd runs the hook, and waits for it, at every step of every
    domain's start and stop (prepare, start, started, stopped, release: five
    times a start and stop), and only "prepare begin" may ask for the cards
    (verb_hook): the shell answers the other four itself, sparing a start of
    this program on the way to each VM's boot. Leaving the domain XML on
    stdin unread is safe: libvirt's vircommand.c (virCommandProcessIO)
    ignores the EPIPE ("child closed stdin early")."""
    return (
        "#!/bin/sh\n# libvirt qemu hook of gpu-handoff: records, never waits.\n"
        '[ "$2 $3" = "prepare begin" ] || exit 0\n'
        f'exec {shlex.quote(program)} --config {shlex.quote(config_path)} hook "$@"\n'
    )


def authorized_keys_line(program: str, config_path: str, key: str) -> str:
    """The line that lets `key` run the agent's `serve` and nothing else
    (nixos/config.nix, authorizedKeysLine, builds the same)."""
    return f'restrict,command="{program} --config {config_path} serve" {key}'


def _os_release_id(text: str) -> str:
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key == "ID":
            return value.strip().strip("\"'")
    return ""


def is_nixos(root: str) -> bool:
    """Whether the system under `root` ("" for this one) is NixOS."""
    if os.path.lexists(_rooted(root, NIXOS_MARKER)):
        return True
    for name in OS_RELEASE_FILES:
        try:
            with open(_rooted(root, name), encoding="utf-8") as handle:
                text = handle.read(OS_RELEASE_MAX)
        except _READ_ERRORS:
            continue
        return _os_release_id(text) == "nixos"
    return False


def nix_string(text: str) -> str:
    """`text` as a Nix string literal."""
    for plain, escaped in _NIX_ESCAPES:
        text = text.replace(plain, escaped)
    return f'"{text}"'


def nix_number(value: float) -> str:
    """A positive finite number as a Nix literal (Nix has no `1e-05`)."""
    if value.is_integer() and value < 1e15:
        return str(int(value))
    text = repr(value)
    mantissa, sep, exponent = text.partition("e")
    if sep and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def nixos_module_path() -> Optional[str]:
    """nixos/module.nix of the checkout this program runs from, if it is one."""
    here = os.path.dirname(program_path())
    top = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    module = os.path.join(top, NIXOS_MODULE_IN_CHECKOUT)
    return module if os.path.isfile(module) else None


# What install adds to a tower's accounts and services, when asked.
# sudo runs commands with its secure_path; this is the usual one where PATH is unset.
ADMIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ADMIN_TIMEOUT = 120.0
ADMIN_OUTPUT_MAX = 400
# A name every useradd takes (POSIX portable characters, lower case, 32 at
# most): never an option, never a path.
USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
LIBVIRT_GROUP = "libvirt"
# libvirt loads its hooks when its daemon starts: the monolithic libvirtd, or
# the QEMU driver's own virtqemud where the modular daemons run.
LIBVIRT_UNITS = ("libvirtd.service", "virtqemud.service")
# The key types an OpenSSH public key line for Home Assistant may name.
KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
# A 16384-bit RSA key is 2.8 KB of base64.
KEY_LINE_MAX = 8192
SSH_DIR = ".ssh"
SSH_DIR_MODE = 0o700
AUTHORIZED_KEYS = "authorized_keys"
AUTHORIZED_KEYS_MODE = 0o600
AUTHORIZED_KEYS_MAX = 4 << 20
PROGRAM_MODE = 0o755
CONFIG_MODE = 0o644
# The first line of this module's docstring: how `update` knows the program
# it replaces is this agent (in the first AGENT_HEAD bytes of the file).
AGENT_MARKER = b"gpu-handoff: the tower agent of GPU Handoff."
AGENT_HEAD = 4096
PROGRAM_MAX = 16 << 20
VERSION_LINE_RE = re.compile(rb'^VERSION = "([0-9A-Za-z.+-]{1,40})"$', re.MULTILINE)


def nixos_snippet(opts: Dict[str, Any], module: Optional[str]) -> str:
    """What to add to a NixOS configuration for `install`'s options: the
    module's options, only those that differ from its defaults."""
    settings = [
        "enable = true;",
        f"user = {nix_string(opts['user'])};",
        f"gpuNode = {nix_string(opts['gpu_node'])};",
        "gaming = [ " + " ".join(nix_string(g) for g in opts["gaming"]) + " ];",
    ]
    if opts["uri"] != DEFAULT_LIBVIRT_URI:
        settings.append(f"libvirtUri = {nix_string(opts['uri'])};")
    if opts["state_dir"] != DEFAULT_INSTALL_STATE_DIR:
        settings.append(f"stateDir = {nix_string(opts['state_dir'])};")
    settings.extend(
        f"timeouts.{kind} = {nix_number(seconds)};"
        for kind, seconds in opts["timeouts"].items()
    )
    if opts["detach"]:
        settings.append(f"detach = {nix_string(opts['detach'])};")
    if opts["key"]:
        settings += [
            "# Home Assistant's public key.",
            f"authorizedKeys = [ {nix_string(opts['key'])} ];",
        ]
    else:
        settings += [
            "# Home Assistant's public key: the end of the line its setup shows.",
            f"authorizedKeys = [ {nix_string(PLACEHOLDER_KEY)} ];",
        ]
    where = nix_string(module or NIXOS_MODULE_PLACEHOLDER)
    return "\n".join(
        [
            "# GPU Handoff on NixOS: a module for the system configuration",
            "# (README, Tower setup, NixOS); then run nixos-rebuild switch.",
            "{",
            f"  imports = [ {where} ];",
            "  services.gpu-handoff = {",
            *(f"    {line}" for line in settings),
            "  };",
            "}",
        ]
    )


def _as_account(
    account: pwd.struct_passwd, work: Callable[[], JsonObj], what: str
) -> JsonObj:
    """`work`'s reply, computed in a child process that is `account` (root only)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, measured by its result
        try:
            os.close(read_fd)
            try:
                drop_privileges(account.pw_uid, account.pw_gid, {})
                result = work()
            except AgentError as error:
                result = reply_error(error.code, error.message, **error.extra)
            except Exception as error:  # noqa: BLE001 - reported to the parent
                result = reply_error(ERR_INTERNAL, f"{type(error).__name__}: {error}")
            _write_all(write_fd, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    try:
        answer: Any = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return reply_error(ERR_INTERNAL, f"{what} as the SSH user said nothing")
    return answer


def as_user(
    account: pwd.struct_passwd, work: Callable[[], JsonObj], what: str
) -> JsonObj:
    """`work`'s reply (an error reply for an AgentError), computed as the SSH
    user: run as root, in a child process that becomes the user first, so that
    nothing the user controls (a symbolic link in its home or its state
    directory) can make root act where the user could not."""
    if os.geteuid() == 0 and account.pw_uid != 0:
        return _as_account(account, work, what)
    try:
        return work()
    except AgentError as error:
        return reply_error(error.code, error.message, **error.extra)


def _rooted(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


# Options that take no value, and the option each sets.
_INSTALL_FLAGS = {
    "--force": "force",
    "--create-user": "create_user",
    "--join-libvirt-group": "join_libvirt_group",
    "--restart-libvirt": "restart_libvirt",
}


def _install_options(args: List[str], config_option: Optional[str]) -> Dict[str, Any]:
    opts: Dict[str, Any] = {
        "user": None,
        "gpu_node": None,
        "gaming": [],
        "uri": DEFAULT_LIBVIRT_URI,
        "prefix": None,
        "root": "",
        "state_dir": DEFAULT_INSTALL_STATE_DIR,
        "detach": None,
        "config": config_option,
        "timeouts": {},
        "key": None,
        "key_blob": b"",
    }
    opts.update(dict.fromkeys(_INSTALL_FLAGS.values(), False))
    names = {
        "--user": "user",
        "--gpu-node": "gpu_node",
        "--gaming": "gaming",
        "--uri": "uri",
        "--prefix": "prefix",
        "--root": "root",
        "--state-dir": "state_dir",
        "--detach": "detach",
        "--config": "config",
        "--authorize-key": "key",
    }
    names.update({f"--timeout-{kind}": kind for kind in TIMEOUT_DEFAULTS})
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _INSTALL_FLAGS:
            opts[_INSTALL_FLAGS[arg]] = True
            i += 1
            continue
        key, _, value = arg.partition("=")
        if key not in names:
            raise AgentError(ERR_BAD_REQUEST, f"install: unknown option {arg!r}")
        if not _:
            if i + 1 >= len(args):
                raise AgentError(ERR_BAD_REQUEST, f"install: {key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if names[key] == "gaming":
            opts["gaming"].append(value)
        elif names[key] in TIMEOUT_DEFAULTS:
            opts["timeouts"][names[key]] = _install_seconds(key, value)
        elif names[key] == "key":
            opts["key"], opts["key_blob"] = parse_public_key(value)
        else:
            opts[names[key]] = value
    if not opts["user"] or not opts["gpu_node"] or not opts["gaming"]:
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --user, --gpu-node and at least one --gaming are required",
        )
    if not local_libvirt_uri(opts["uri"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: --uri {opts['uri']!r} is not this machine's libvirt: "
            "qemu:///system or qemu:///session (a URI naming a host, or with "
            "parameters, could run programs or read keys as root)",
        )
    if opts["create_user"] and not USER_NAME_RE.match(opts["user"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: --create-user makes only a user named like {USER_NAME_RE.pattern}",
        )
    return opts


def _install_seconds(option: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise AgentError(
            ERR_BAD_REQUEST, f"install: {option} takes a positive number of seconds"
        )
    return seconds


def _install_data(opts: Dict[str, Any]) -> JsonObj:
    data = agent_config(
        gpu_node=opts["gpu_node"],
        gaming=opts["gaming"],
        libvirt_uri=opts["uri"],
        state_dir=opts["state_dir"],
        timeouts=opts["timeouts"],
        detach=opts["detach"],
    )
    problems = validate_config(data)
    if problems:
        raise AgentError(ERR_CONFIG_INVALID, "; ".join(problems))
    return data


# --- install: Home Assistant's key -------------------------------------------------------


def _key_type_of(blob: bytes) -> bytes:
    """The first field of an SSH key blob: the key type, as an RFC 4253 string
    (a 32-bit big-endian length, then the bytes); b"" if it is not one."""
    size = int.from_bytes(blob[:4], "big")
    name = blob[4 : 4 + size]
    return name if len(blob) >= 4 and len(name) == size else b""


def _decoded_key(kind: bytes, text: bytes) -> Optional[bytes]:
    """A base64 key blob's bytes, if they name the key type `kind`."""
    try:
        blob = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        return None
    return blob if blob and _key_type_of(blob) == kind else None


def parse_public_key(line: str) -> Tuple[str, bytes]:
    """An OpenSSH public key line `TYPE BASE64 [COMMENT]`, checked: the line
    as authorized_keys will hold it, and the key's bytes."""
    prefix = "install: --authorize-key takes an OpenSSH public key line"
    if len(line) > KEY_LINE_MAX or not line.isprintable():
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: one line, printable characters")
    fields = line.split(None, 2)
    if len(fields) < 2:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: TYPE BASE64 [COMMENT]")
    kind, text = fields[0], fields[1]
    comment = fields[2].strip() if len(fields) == 3 else ""
    if kind not in KEY_TYPES:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"{prefix}: {kind[:40]!r} is not one of {', '.join(KEY_TYPES)}",
        )
    blob = _decoded_key(kind.encode(), text.encode())
    if blob is None:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: its key is not a {kind} key")
    if '"' in comment or "'" in comment:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: its comment has quotes")
    return " ".join(field for field in (kind, text, comment) if field), blob


def _past_options(text: bytes) -> bytes:
    """What follows an authorized_keys line's options, as sshd skips them
    (sshkey_advance_past_options): up to the first blank outside double
    quotes, a backslash-quote being no quote."""
    quoted = False
    i = 0
    while i < len(text) and (quoted or text[i] not in b" \t"):
        if text[i : i + 2] == b'\\"':
            i += 1
        elif text[i : i + 1] == b'"':
            quoted = not quoted
        i += 1
    return text[i:]


def authorized_key_of(line: bytes) -> Optional[bytes]:
    """The key an authorized_keys line holds (its bytes), with or without
    options before it; None for a comment, a blank line or a line sshd
    could not read a key from."""
    text = line.strip()
    if not text or text.startswith(b"#"):
        return None
    for rest in (text, _past_options(text)):
        fields = rest.split(None, 2)
        if len(fields) >= 2:
            blob = _decoded_key(fields[0], fields[1])
            if blob is not None:
                return blob
    return None


def authorized_keys_content(
    old: bytes, line: str, blob: bytes
) -> Tuple[Optional[bytes], str]:
    """authorized_keys with `line` in it (None: unchanged), and what changed:
    "present" (the line is there, the key's only one), "replaced" (the key's
    first line becomes `line`, its other lines go) or "added" (at the end).
    Every other line is kept byte for byte, and the file ends with a newline."""
    new = line.encode()
    parts = old.split(b"\n")
    last = parts.pop()
    lines = [part + b"\n" for part in parts] + ([last + b"\n"] if last else [])
    mine = [i for i, text in enumerate(lines) if authorized_key_of(text) == blob]
    if len(mine) == 1 and lines[mine[0]].rstrip(b"\r\n") == new:
        return None, "present"
    if not mine:
        return b"".join([*lines, new + b"\n"]), "added"
    lines[mine[0]] = new + b"\n"
    kept = [text for i, text in enumerate(lines) if i not in mine[1:]]
    return b"".join(kept), "replaced"


def _read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from the descriptor, up to its end."""
    chunks: List[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _read_authorized_keys(ssh_fd: int) -> Tuple[bytes, int]:
    """authorized_keys' bytes and mode (b"" and 0600 when missing); never
    through a symbolic link."""
    try:
        fd = os.open(
            AUTHORIZED_KEYS,
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            dir_fd=ssh_fd,
        )
    except FileNotFoundError:
        return b"", AUTHORIZED_KEYS_MODE
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", AUTHORIZED_KEYS)
        data = _read_fd(fd, AUTHORIZED_KEYS_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > AUTHORIZED_KEYS_MAX:
        raise OSError(errno.EFBIG, "too large for authorized_keys", AUTHORIZED_KEYS)
    return data, stat.S_IMODE(st.st_mode)


def write_authorized_key(home: str, line: str, blob: bytes) -> JsonObj:
    """Put `line` in HOME/.ssh/authorized_keys, as whoever runs this (as_user
    makes it the account): ~/.ssh made 0700 and the file 0600 when missing,
    the file never reached through a symbolic link, and replaced atomically
    (its mode kept). On failure, nothing is changed."""
    home_fd = os.open(home, _DIR_FLAGS)
    try:
        made = False
        try:
            ssh_fd = os.open(SSH_DIR, _DIR_FLAGS, dir_fd=home_fd)
        except FileNotFoundError:
            os.mkdir(SSH_DIR, SSH_DIR_MODE, dir_fd=home_fd)
            made = True
            ssh_fd = os.open(SSH_DIR, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=home_fd)
        try:
            if made:
                os.fchmod(ssh_fd, SSH_DIR_MODE)
            old, mode = _read_authorized_keys(ssh_fd)
            new, action = authorized_keys_content(old, line, blob)
            if new is not None:
                replace_file_at(ssh_fd, AUTHORIZED_KEYS, new, mode)
        except BaseException:
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(SSH_DIR, dir_fd=home_fd)
            raise
        finally:
            os.close(ssh_fd)
    finally:
        os.close(home_fd)
    return {"path": os.path.join(home, SSH_DIR, AUTHORIZED_KEYS), "action": action}


def authorize_key(
    account: pwd.struct_passwd, home: str, line: str, blob: bytes
) -> JsonObj:
    """write_authorized_key as the account; a failure is a StepError."""

    def work() -> JsonObj:
        try:
            return reply_ok(authorized_key=write_authorized_key(home, line, blob))
        except OSError as error:
            raise AgentError(
                ERR_INSTALL_FAILED, f"install: {error}", reason=errno_name(error)
            ) from None

    answer = as_user(account, work, "writing authorized_keys")
    if not answer.get("ok"):
        error = answer["error"]
        raise StepError(str(error.get("reason", "internal")), str(error["message"]))
    result: JsonObj = answer["authorized_key"]
    return result


# --- install: files, accounts and services, each step undone if a later one fails -------


class StepError(Exception):
    """An install step failed; `reason` is an errno name or "command"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


_STEP_ERRORS = (OSError, StepError)


def errno_name(error: BaseException) -> str:
    """EROFS, EACCES, ENOSPC...: what failed, for a program to read."""
    return errno.errorcode.get(getattr(error, "errno", 0) or 0, "unknown")


class Undo:
    """What one install did so far, undone in reverse when a later step
    fails: a failed install leaves the tower as it found it."""

    def __init__(self) -> None:
        self._steps: List[Tuple[str, Callable[[], None]]] = []
        self._tidy: List[Callable[[], None]] = []

    def add(self, what: str, action: Callable[[], None]) -> None:
        """`action` undoes a step; `what` names what is left if it cannot."""
        self._steps.append((what, action))

    def on_success(self, action: Callable[[], None]) -> None:
        """`action` tidies up once every step succeeded (drops a backup)."""
        self._tidy.append(action)

    def rollback(self) -> List[str]:
        """Undo every step, the last one first; what could not be undone."""
        left: List[str] = []
        for what, action in reversed(self._steps):
            try:
                action()
            except _STEP_ERRORS:
                left.append(what)
        self._steps, self._tidy = [], []
        return left

    def commit(self) -> None:
        for action in self._tidy:
            with contextlib.suppress(OSError):
                action()
        self._steps, self._tidy = [], []


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def make_dirs(path: str, undo: Undo) -> None:
    """`path` and its missing parents, 0755 whatever the umask; undo removes
    each one made (if it is empty: rmdir)."""
    missing: List[str] = []
    while not os.path.isdir(path) and path not in missing:
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory, PROGRAM_MODE)
        undo.add(directory, functools.partial(os.rmdir, directory))
        os.chmod(directory, PROGRAM_MODE)


def replace_file_at(
    dfd: int, name: str, data: bytes, mode: int, durable: bool = True
) -> None:
    """`name` in the directory holds `data` with `mode`, atomically: a new file
    (O_EXCL, never through a link) written, renamed over the old name (a
    symbolic link there is replaced, never followed), and, when `durable`,
    synced first and the rename synced after. On failure the old file is as
    it was and the new one is removed."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_EXCL | _NEW_FILE, 0o600, dir_fd=dfd)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if durable:
        with contextlib.suppress(OSError):
            os.fsync(dfd)  # the rename, on disk


def install_file(path: str, data: bytes, mode: int, undo: Undo) -> None:
    """One file of the install, replaced atomically. Undo removes it, or gives
    back the file it replaced: a hard link keeps that one until the install
    succeeds, so restoring it takes no space and restores it byte for byte,
    with its mode and owner."""
    directory, name = os.path.split(path)
    make_dirs(directory, undo)
    dfd = os.open(directory, _DIR_FLAGS)
    try:
        try:
            previous: Optional[os.stat_result] = os.stat(
                name, dir_fd=dfd, follow_symlinks=False
            )
        except FileNotFoundError:
            previous = None
        if previous is None:
            # Registered once made: removing a file that is not there fails
            # on a read-only file system.
            replace_file_at(dfd, name, data, mode)
            undo.add(path, functools.partial(_remove_file, path))
            return
        if stat.S_ISDIR(previous.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        backup = f".{name}.previous-{secrets.token_hex(6)}"
        os.link(name, backup, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        kept = os.path.join(directory, backup)
        undo.add(path, functools.partial(os.replace, kept, path))
        undo.on_success(functools.partial(os.unlink, kept))
        replace_file_at(dfd, name, data, mode)
    finally:
        os.close(dfd)


def _restore_dir(path: str, uid: int, gid: int, mode: int) -> None:
    fd = os.open(path, _DIR_FLAGS)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def install_state_dir(path: str, account: pwd.struct_passwd, undo: Undo) -> None:
    """The state directory, the SSH user's alone: nobody else may write to it
    (or read it). Undo gives a directory that was there its owner and mode back."""
    existed = os.path.isdir(path)
    make_dirs(path, undo)
    fd = os.open(path, _DIR_FLAGS)
    try:
        if existed:
            st = os.fstat(fd)
            undo.add(
                path,
                functools.partial(
                    _restore_dir, path, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)
                ),
            )
        if os.geteuid() == 0:
            os.fchown(fd, account.pw_uid, account.pw_gid)
        os.fchmod(fd, STATE_DIR_MODE)
    finally:
        os.close(fd)


def systemd_runs() -> bool:
    """Whether systemd is this system's init (sd_booted(3))."""
    return os.path.isdir(SYSTEMD_RUNTIME_DIR)


def enable_linger(account: pwd.struct_passwd, env: Dict[str, str], undo: Undo) -> str:
    """The SSH user's systemd manager kept running without a session, so a
    job's unit outlives the SSH request that started it (see user_lingers):
    "enabled", "already" or "no_systemd" (an init without user managers:
    the runners are plain processes there). Undo turns it off again."""
    name = account.pw_name
    if not systemd_runs():
        return "no_systemd"
    if os.path.isfile(os.path.join(LINGER_DIR, name)):
        return "already"
    run_admin(["loginctl", "enable-linger", name], env)
    undo.add(
        f"lingering of {name}",
        functools.partial(run_admin, ["loginctl", "disable-linger", name], env),
    )
    return "enabled"


def tmpfiles_entry(state_dir: str, account: pwd.struct_passwd) -> bytes:
    """systemd-tmpfiles' line for the state directory (tmpfiles.d(5), type
    d): made at boot if it is missing, its owner and mode set back if they
    were changed; never cleaned (age "-")."""
    try:
        group = grp.getgrgid(account.pw_gid).gr_name
    except KeyError:
        group = str(account.pw_gid)
    return (
        "# GPU Handoff's state directory: the SSH user's alone.\n"
        f"d {state_dir} {STATE_DIR_MODE:04o} {account.pw_name} {group} -\n"
    ).encode()


def own_program() -> bytes:
    """This program's bytes: what install and update put on the tower. Run
    from its sources (a checkout), the agent first builds the one file a
    tower runs from them (build.py beside this file); a lone source file, as
    a 0.3 release installed it, is its own program."""
    path = program_path()
    if path.endswith(".py") and os.path.isfile(_checkout_builder(path)):
        built: bytes = build_tool().archive_bytes(os.path.dirname(path))
        return built
    with open(path, "rb") as handle:
        return handle.read()


def _checkout_builder(path: str) -> str:
    return os.path.join(os.path.dirname(path), "build.py")


def build_tool() -> Any:
    """The agent's build (build.py): from this program's archive, or beside
    this source file in a checkout."""
    archive = getattr(globals().get("__loader__"), "archive", None)
    if isinstance(archive, str):
        source: bytes = globals()["__loader__"].get_data("build.py")
        path = f"{archive}/build.py"
    else:
        path = _checkout_builder(program_path())
        with open(path, "rb") as handle:
            source = handle.read()
    module = types.ModuleType("gpu_handoff_build")
    module.__file__ = path
    exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    return module


def compiled_program(program: str, data: bytes) -> Optional[Tuple[str, bytes]]:
    """Where the program ``data``, run as ``program``, finds its module
    compiled for this Python (it compiles it at each start without), and
    the compiled module; None if this Python keeps none (or ``data`` is a
    0.3 agent's single source file)."""
    tool = build_tool()
    try:
        return tool.cache_path(program), tool.compiled(data, program)
    except tool.BuildError:
        return None


def _trimmed(text: str) -> str:
    """A program's output on one line, bounded."""
    text = " ".join(text.split())
    if len(text) > ADMIN_OUTPUT_MAX:
        text = text[: ADMIN_OUTPUT_MAX - 3] + "..."
    return text or "(it said nothing)"


def _admin_process(
    argv: List[str], env: Dict[str, str], timeout: float
) -> "subprocess.CompletedProcess[bytes]":
    """Run an administration program (useradd, usermod, systemctl...) found on
    the caller's PATH (sudo's secure_path), with an argument list, never
    through a shell; StepError (reason "command") if it cannot run."""
    search = env.get("PATH") or ADMIN_PATH
    command = shlex.join(argv)
    program = shutil.which(argv[0], path=search)
    if program is None:
        raise StepError("command", f"{command}: {argv[0]} is not on PATH ({search})")
    try:
        return subprocess.run(
            [program, *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={"PATH": search, "LC_ALL": "C"},
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise StepError(
            "command", f"{command} did not finish within {timeout:g} s"
        ) from None
    except OSError as error:
        raise StepError("command", f"{command}: {error}") from None


def _admin_failure(
    argv: List[str], done: "subprocess.CompletedProcess[bytes]"
) -> StepError:
    said = (done.stderr.strip() or done.stdout).decode(errors="replace")
    return StepError(
        "command",
        f"{shlex.join(argv)} exited with {done.returncode}: {_trimmed(said)}",
    )


def run_admin(
    argv: List[str], env: Dict[str, str], timeout: float = ADMIN_TIMEOUT
) -> None:
    """Run an administration program (see _admin_process); StepError unless
    it succeeds."""
    done = _admin_process(argv, env, timeout)
    if done.returncode != 0:
        raise _admin_failure(argv, done)


def lookup_account(name: str) -> Optional[pwd.struct_passwd]:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def create_user(name: str, env: Dict[str, str], undo: Undo) -> pwd.struct_passwd:
    """The SSH user, made: a home, a group of its own, a shell (sshd runs a
    forced command through it) and "*" for a password: no password, yet not
    locked, which sshd requires of a key login where PAM is off."""
    argv = ["useradd", "--create-home", "--user-group", "--shell", "/bin/sh"]
    remove = functools.partial(run_admin, ["userdel", "--remove", name], env)
    try:
        run_admin([*argv, "--password", "*", name], env)
    except StepError:
        # useradd can fail half-way and leave the account behind (exit 12:
        # the home directory could not be made, after the account was
        # written): the install removes what it made.
        if lookup_account(name) is not None:
            undo.add(f"user {name}", remove)
        raise
    undo.add(f"user {name}", remove)
    account = lookup_account(name)
    if account is None:
        raise StepError("command", f"useradd succeeded, yet there is no user {name!r}")
    return account


def libvirt_membership(
    account: pwd.struct_passwd, group: Optional[grp.struct_group]
) -> str:
    """What to do: "missing" (no such group), "member" (already) or "add"."""
    if group is None:
        return "missing"
    if account.pw_name in group.gr_mem or account.pw_gid == group.gr_gid:
        return "member"
    return "add"


def join_libvirt_group(
    account: pwd.struct_passwd, env: Dict[str, str], undo: Undo
) -> str:
    """The SSH user in the libvirt group (libvirt's system socket is the
    group's): "added", "member" or "missing" (a tower without the group)."""
    try:
        group: Optional[grp.struct_group] = grp.getgrnam(LIBVIRT_GROUP)
    except KeyError:
        group = None
    decision = libvirt_membership(account, group)
    if decision != "add":
        return decision
    name = account.pw_name
    run_admin(["usermod", "-aG", LIBVIRT_GROUP, name], env)
    undo.add(
        f"{name} in the group {LIBVIRT_GROUP}",
        functools.partial(run_admin, ["gpasswd", "--delete", name, LIBVIRT_GROUP], env),
    )
    return "added"


def restart_libvirt(env: Dict[str, str]) -> JsonObj:
    """Restart the libvirt daemons that run now, so they load the hook
    (running guests keep running); a failure is reported, not an install
    failure. `systemctl is-active` prints one state per unit (systemctl(1)),
    whether the unit exists or not; a daemon that does not run loads the hook
    when it starts (socket activation included), so it is left alone."""
    ask = ["systemctl", "is-active", *LIBVIRT_UNITS]
    try:
        states = _admin_process(ask, env, ADMIN_TIMEOUT)
        words = states.stdout.decode(errors="replace").split()
        if len(words) != len(LIBVIRT_UNITS):
            raise _admin_failure(ask, states)
        running = [
            unit for unit, state in zip(LIBVIRT_UNITS, words) if state == "active"
        ]
        if running:
            run_admin(["systemctl", "restart", *running], env)
    except StepError as failure:
        return {"done": False, "message": failure.message}
    if not running:
        return {
            "done": True,
            "restarted": [],
            "message": "neither libvirtd nor virtqemud runs now: libvirt loads "
            "the hook when it starts",
        }
    return {
        "done": True,
        "restarted": running,
        "message": f"restarted {' and '.join(running)}",
    }


def install_on_nixos(opts: Dict[str, Any], err: IO[str]) -> JsonObj:
    """NixOS installs nothing by hand (/etc, the accounts and the libvirt hooks
    are the system configuration's): what to add to it instead, writing
    nothing. --create-user, --join-libvirt-group and --restart-libvirt do
    nothing here: the module declares the user and its groups."""
    if opts["prefix"] is not None or opts["config"] not in (None, DEFAULT_CONFIG_PATH):
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --prefix and --config do not apply on NixOS, where the "
            "module decides where the program and its configuration live",
        )
    _install_data(opts)  # the same checks as elsewhere, before anything is shown
    snippet = nixos_snippet(opts, nixos_module_path())
    notes = [
        "This is NixOS: nothing was written. Add this to the system configuration:",
        snippet,
        "Once switched, restart libvirtd so it loads the hook: systemctl restart libvirtd",
    ]
    for line in notes:
        err.write(line + "\n")
    return reply_ok(installed=[], nixos=True, nixos_module=snippet, notes=notes)


def _install_steps(
    *,
    opts: Dict[str, Any],
    account: Optional[pwd.struct_passwd],
    files: Dict[str, str],
    data: JsonObj,
    env: Dict[str, str],
    undo: Undo,
) -> Tuple[pwd.struct_passwd, JsonObj]:
    """Every step that changes the tower, in order; each registers its undo."""
    done: JsonObj = {"user_created": account is None}
    if account is None:
        account = create_user(opts["user"], env, undo)
    if opts["join_libvirt_group"]:
        done["libvirt_group"] = join_libvirt_group(account, env, undo)
    program = own_program()
    install_file(files["program"], program, PROGRAM_MODE, undo)
    installed = [files["program"]]
    cache = compiled_program(files["program_name"], program)
    if cache is not None:
        cached = _rooted(files["root"], cache[0])
        install_file(cached, cache[1], CONFIG_MODE, undo)
        installed.append(cached)
    config_text = json.dumps(data, indent=2) + "\n"
    install_file(files["config"], config_text.encode(), CONFIG_MODE, undo)
    install_state_dir(files["state"], account, undo)
    installed += [files[k] for k in ("config", "state")]
    if os.path.isdir(_rooted(files["root"], "/usr/lib/tmpfiles.d")):
        entry = tmpfiles_entry(opts["state_dir"], account)
        install_file(files["tmpfiles"], entry, CONFIG_MODE, undo)
        installed.append(files["tmpfiles"])
    hook = hook_script(files["program_name"], files["config_name"])
    install_file(files["hook"], hook.encode(), PROGRAM_MODE, undo)
    done["installed"] = [*installed, files["hook"]]
    if not files["root"]:
        done["linger"] = enable_linger(account, env, undo)
    # Last: nothing after it can fail, and it leaves nothing behind when it does.
    if opts["key"]:
        home = _rooted(files["root"], account.pw_dir)
        line = authorized_keys_line(
            files["program_name"], files["config_name"], opts["key"]
        )
        done["authorized_key"] = authorize_key(account, home, line, opts["key_blob"])
    return account, done


def _install_failed(error: Exception, left: List[str]) -> AgentError:
    if isinstance(error, StepError):
        reason, message = error.reason, error.message
    else:
        reason, message = errno_name(error), f"install: {error}"
    if left:
        message += f"; could not undo: {', '.join(left)}"
    else:
        message += "; everything this install did was undone"
    return AgentError(ERR_INSTALL_FAILED, message, reason=reason, left=left)


def _install_notes(opts: Dict[str, Any], done: JsonObj, key_line: str) -> List[str]:
    user = opts["user"]
    notes: List[str] = []
    if done["user_created"]:
        notes.append(f"Made the user {user} (key logins only: no password).")
    if "authorized_key" in done:
        key = done["authorized_key"]
        notes.append(f"Home Assistant's key is in {key['path']} ({key['action']}).")
    else:
        notes += [f"Add this line to ~{user}/.ssh/authorized_keys:", f"  {key_line}"]
    if done.get("linger") == "enabled":
        notes.append(
            f"{user} lingers (loginctl enable-linger): its jobs outlive the SSH "
            "session that starts them."
        )
    group = done.get("libvirt_group")
    if group is None:
        notes.append(
            f"{user} must be in the libvirt group: usermod -aG {LIBVIRT_GROUP} {user}"
        )
    elif group == "added":
        notes.append(f"Added {user} to the libvirt group.")
    elif group == "missing":
        notes.append(
            f"This system has no {LIBVIRT_GROUP} group: {user} needs access to "
            f"libvirt some other way (virsh -c {opts['uri']} must work as {user})."
        )
    restart = done.get("libvirt_restart")
    if restart is None:
        notes.append(
            "Restart libvirtd so it loads the new hook: systemctl restart libvirtd"
        )
    elif restart["done"] and restart.get("restarted"):
        notes.append("Restarted libvirtd: it loads the new hook.")
    elif restart["done"]:
        notes.append(f"libvirtd was not restarted: {restart['message']}.")
    else:
        notes.append(
            f"libvirtd was not restarted ({restart['message']}): restart it so it "
            "loads the new hook: systemctl restart libvirtd"
        )
    return notes


@contextlib.contextmanager
def admin_lock(root: str, verb: str) -> Iterator[None]:
    """One install or update at a time on a system (``root``: its top
    directory, "/" without --root): an exclusive lock on that directory,
    which only root can open for it there, held until the verb ends. An
    install that Home Assistant gave up on may still run on the tower as
    root: a retry beside it would reuse what it makes, and its rollback
    remove it from under the retry. The second one is refused. (A --root
    not made yet: its nearest directory that is.)"""
    top = root or "/"
    while not os.path.isdir(top):
        top = os.path.dirname(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentError(
                ERR_INSTALL_FAILED,
                f"{verb}: another install or update of GPU Handoff is running on "
                "this tower; try again once it has ended",
                reason="EBUSY",
            ) from None
        yield
    finally:
        os.close(fd)


def verb_install(
    args: List[str], config_option: Optional[str], env: Dict[str, str], err: IO[str]
) -> JsonObj:
    opts = _install_options(args, config_option)
    root = os.path.abspath(opts["root"]) if opts["root"] else ""
    if is_nixos(root):
        return install_on_nixos(opts, err)
    if root and (opts["create_user"] or opts["join_libvirt_group"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --create-user and --join-libvirt-group change this system's "
            "accounts: not with --root",
        )
    with admin_lock(root, "install"):
        return _install(opts, root, env, err)


def _install(
    opts: Dict[str, Any], root: str, env: Dict[str, str], err: IO[str]
) -> JsonObj:
    """install, under admin_lock."""
    account = lookup_account(opts["user"])
    # Not under --root: the accounts looked up are then those of the system
    # running install, not of the tree it fills, whose user ids it cannot
    # know. (The tests' --root installs are made as root, for themselves.)
    if account is not None and account.pw_uid == 0 and not root:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: {opts['user']!r} is root (user id 0): the agent needs no "
            "privilege, and Home Assistant's key must not get one",
        )
    if account is None and not opts["create_user"]:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: no user {opts['user']!r} (--create-user makes it)",
        )
    config_path = config_path_from(opts["config"], {})
    if not os.path.isabs(config_path):
        raise AgentError(ERR_BAD_REQUEST, "install: --config must be an absolute path")
    prefix = opts["prefix"] or DEFAULT_PREFIX
    if not os.path.isabs(prefix):
        raise AgentError(ERR_BAD_REQUEST, "install: --prefix must be an absolute path")
    program = os.path.join(prefix, "bin", "gpu-handoff")
    data = _install_data(opts)
    files = {
        "root": root,
        "program_name": program,
        "config_name": config_path,
        "program": _rooted(root, program),
        "config": _rooted(root, config_path),
        "state": _rooted(root, opts["state_dir"]),
        "hook": _rooted(root, HOOK_PATH),
        "tmpfiles": _rooted(root, TMPFILES_PATH),
    }
    if os.path.exists(files["config"]) and not opts["force"]:
        raise AgentError(
            ERR_EXISTS, f"{files['config']} exists; pass --force to overwrite it"
        )
    undo = Undo()
    try:
        account, done = _install_steps(
            opts=opts, account=account, files=files, data=data, env=env, undo=undo
        )
    except _STEP_ERRORS as error:
        raise _install_failed(error, undo.rollback()) from None
    undo.commit()
    if opts["restart_libvirt"]:
        done["libvirt_restart"] = restart_libvirt(env)
    # Check the tower with the configuration just written (relocated under
    # --root), as the SSH user: root never works in its state directory.
    check_data = dict(data)
    check_data["state_dir"] = files["state"]
    check_cfg = Config(files["config"], check_data, dict(env))
    status = as_user(account, lambda: verb_status(check_cfg), "the status check")
    findings: List[JsonObj] = status["findings"] if status.get("ok") else []
    status_error: Optional[JsonObj] = None if status.get("ok") else status["error"]
    key_line = authorized_keys_line(
        program, config_path, opts["key"] or PLACEHOLDER_KEY
    )
    notes = _install_notes(opts, done, key_line)
    if status_error:
        notes.append(f"status failed: {status_error['message']}")
    notes.extend(
        f"finding {finding['code']} ({finding['domain']}): {finding['detail']}"
        for finding in findings
    )
    for line in notes:
        err.write(line + "\n")
    return reply_ok(
        **done,
        program=program,
        config=config_path,
        hook=HOOK_PATH,
        authorized_keys_line=key_line,
        findings=findings,
        status_error=status_error,
        notes=notes,
    )


# --- update ---------------------------------------------------------------------------------


def _update_options(args: List[str]) -> Tuple[str, str]:
    opts = {"--prefix": DEFAULT_PREFIX, "--root": ""}
    i = 0
    while i < len(args):
        key, sep, value = args[i].partition("=")
        if key not in opts:
            raise AgentError(ERR_BAD_REQUEST, f"update: unknown option {args[i]!r}")
        if not sep:
            if i + 1 >= len(args):
                raise AgentError(ERR_BAD_REQUEST, f"update: {key} needs a value")
            i += 1
            value = args[i]
        opts[key] = value
        i += 1
    if not os.path.isabs(opts["--prefix"]):
        raise AgentError(ERR_BAD_REQUEST, "update: --prefix must be an absolute path")
    return opts["--prefix"], opts["--root"]


def installed_agent(path: str) -> bytes:
    """The bytes of the agent installed at `path`; not_installed if there is
    none, or what is there is not this agent."""
    missing = AgentError(
        ERR_NOT_INSTALLED,
        f"update: no GPU Handoff agent at {path}; install it first, or pass --prefix",
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            data = _read_fd(fd, PROGRAM_MAX) if regular else b""
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise missing from None
    except OSError as error:
        raise AgentError(
            ERR_INSTALL_FAILED, f"update: {error}", reason=errno_name(error)
        ) from None
    if AGENT_MARKER not in data[:AGENT_HEAD]:
        raise missing
    return data


def verb_update(args: List[str], err: IO[str]) -> JsonObj:
    """Replace the installed program with this one, atomically; the
    configuration, the hook, the state directory and the keys stay as they are."""
    prefix, root = _update_options(args)
    root = os.path.abspath(root) if root else ""
    if is_nixos(root):
        raise AgentError(
            ERR_NIXOS,
            "update: this is NixOS: the program lives in the Nix store. Update the "
            "package of the GPU Handoff module (its source), then nixos-rebuild switch",
        )
    with admin_lock(root, "update"):
        return _update(prefix, root, err)


def _update(prefix: str, root: str, err: IO[str]) -> JsonObj:
    """update, under admin_lock."""
    path = _rooted(root, os.path.join(prefix, "bin", "gpu-handoff"))
    found = VERSION_LINE_RE.search(installed_agent(path))
    previous = found.group(1).decode() if found else None
    directory, name = os.path.split(path)
    program = own_program()
    try:
        dfd = os.open(directory, _DIR_FLAGS)
        try:
            replace_file_at(dfd, name, program, PROGRAM_MODE)
        finally:
            os.close(dfd)
    except OSError as error:
        raise AgentError(
            ERR_INSTALL_FAILED,
            f"update: {error}; {path} is as it was",
            reason=errno_name(error),
        ) from None
    notes = [
        (
            f"Updated {path} from {previous or 'an unknown version'} to "
            f"{VERSION}; the configuration, the hook and the state are as they "
            "were. Sessions already open run the previous program until they "
            "reconnect."
        )
    ]
    notes.extend(
        _update_cache(root, os.path.join(prefix, "bin", "gpu-handoff"), program)
    )
    for note in notes:
        err.write(note + "\n")
    return reply_ok(updated=path, previous=previous, version=VERSION, notes=notes)


def _update_cache(root: str, program: str, data: bytes) -> List[str]:
    """The updated program compiled beside it for this Python: a start
    without it compiles the program (slower, nothing else). A compiled
    module of the previous program is never used by this one (its source's
    hash differs)."""
    cache = compiled_program(program, data)
    if cache is None:
        return []
    path = _rooted(root, cache[0])
    directory, name = os.path.split(path)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, PROGRAM_MODE)
        dfd = os.open(directory, _DIR_FLAGS)
        try:
            replace_file_at(dfd, name, cache[1], CONFIG_MODE)
        finally:
            os.close(dfd)
    except OSError as error:
        return [
            f"{path} not written ({error}): the program compiles itself at each start"
        ]
    return []


# --- entry point ---------------------------------------------------------------------------

USAGE = (
    "usage: gpu-handoff [--config PATH] VERB [ARGS]\n"
    "verbs: version, status, stop DOMAIN, start DOMAIN, handoff GAMING, release [GAMING]\n"
    "       (the four job verbs take --request=RID: one job per request id),\n"
    "       job ID, request RID, jobs, watch, session, screenshot DOMAIN,\n"
    "       hook DOMAIN OP SUBOP EXTRA, serve, check-config,\n"
    "       install --user U --gpu-node N --gaming G [--gaming G2]\n"
    "       [--uri URI] [--prefix DIR] [--state-dir DIR] [--root DIR] [--force]\n"
    "       [--timeout-agent S] [--timeout-shutdown S] [--timeout-start S]\n"
    "       [--detach MODE] [--authorize-key 'TYPE BASE64 [COMMENT]']\n"
    "       [--create-user] [--join-libvirt-group] [--restart-libvirt]\n"
    "       (on NixOS: prints the module's settings instead),\n"
    "       update [--prefix DIR] [--root DIR] (replaces the installed program)"
)


def _dispatch(
    *,
    verb: str,
    args: List[str],
    request_id: Optional[str],
    cfg: Config,
    requested_by: str,
    stdin: IO[str],
    stdout: IO[str],
) -> Tuple[Optional[JsonObj], int]:
    """Run one validated user verb; (reply or None if it streamed, exit code)."""
    if verb == "watch":
        return None, verb_watch(cfg, stdin, stdout)
    if verb == "session":
        return None, verb_session(cfg, stdin, stdout, requested_by)
    return run_request(cfg, verb, args, request_id, requested_by), 0


def version_reply(cfg: Optional[Config] = None) -> JsonObj:
    """The protocol (in every reply), the agent's version, its verbs and the
    tower's name. Without a configuration (the command line's ``version``,
    which answers even when the configuration is broken) the name is the
    machine's host name, the configuration's default."""
    host_name = cfg.name if cfg is not None else socket.gethostname()
    return reply_ok(version=VERSION, verbs=sorted(SERVE_VERBS), host_name=host_name)


def _run_verb(
    *,
    verb: str,
    args: List[str],
    config_option: Optional[str],
    env: Dict[str, str],
    stdin: IO[str],
    stdout: IO[str],
    stderr: IO[str],
    loaded: List[Config],
) -> Tuple[Optional[JsonObj], int]:
    """Any verb; (reply to print, or None when it printed itself; exit code).

    The configuration, once loaded, is appended to `loaded` (for the log of an
    unexpected error). Run as root, every verb that uses the state directory
    first becomes its owner (act_as_state_owner).
    """
    path = config_path_from(config_option, env)
    if verb == "version":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "version takes no arguments")
        return version_reply(), 0
    if verb == "install":
        return verb_install(args, config_option, env, stderr), 0
    if verb == "update":
        return verb_update(args, stderr), 0
    if verb == "hook":
        try:
            # libvirt writes the domain XML to stdin: always read it.
            xml_text = "" if stdin.isatty() else stdin.read()
            verb_hook(load_config(path, env), args, xml_text)
        except Exception as err:  # noqa: BLE001 - a hook must never fail libvirt
            # To libvirtd's log, on the tower; never to stdout (read as XML).
            with contextlib.suppress(*_STREAM_ERRORS):
                stderr.write(f"gpu-handoff hook: {err}\n")
        return None, 0
    cfg = load_config(path, env)
    loaded.append(cfg)
    if verb == "check-config":
        return reply_ok(config=cfg.as_json()), 0
    if verb == "run-job":
        if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--state-dir"):
            raise AgentError(ERR_BAD_REQUEST, "usage: run-job ID [--state-dir DIR]")
        if not JOB_ID_RE.match(args[0]):
            raise AgentError(ERR_BAD_REQUEST, "invalid job id")
        if len(args) == 3:
            cfg.state_dir = args[2]
        act_as_state_owner(cfg)
        return None, run_job(cfg, args[0])
    if verb == "serve":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "serve takes no arguments")
        verb, args, request_id = parse_serve_request(
            cfg, env.get("SSH_ORIGINAL_COMMAND")
        )
        act_as_state_owner(cfg)
        return _dispatch(
            verb=verb,
            args=args,
            request_id=request_id,
            cfg=cfg,
            requested_by="ssh",
            stdin=stdin,
            stdout=stdout,
        )
    if verb in SERVE_VERBS:
        args, request_id = split_request_option(verb, args)
        check_request(cfg, verb, args)
        act_as_state_owner(cfg)
        return _dispatch(
            verb=verb,
            args=args,
            request_id=request_id,
            cfg=cfg,
            requested_by="cli",
            stdin=stdin,
            stdout=stdout,
        )
    raise AgentError(ERR_BAD_REQUEST, f"unknown verb {verb[:40]!r}\n{USAGE}")


def main(
    argv: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
    stdin: Optional[IO[str]] = None,
    stdout: Optional[IO[str]] = None,
    stderr: Optional[IO[str]] = None,
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr

    def answer(reply: JsonObj) -> int:
        try:
            _emit(stdout, reply)
        except StreamClosedError:
            return 1
        return 0 if reply.get("ok") else 1

    config_option: Optional[str] = None
    while argv and argv[0].startswith("--"):
        option = argv.pop(0)
        if option == "--config" and argv:
            config_option = argv.pop(0)
        elif option.startswith("--config="):
            config_option = option.split("=", 1)[1]
        elif option in ("--help", "-h"):
            stderr.write(USAGE + "\n")
            return 0
        else:
            return answer(
                reply_error(ERR_BAD_REQUEST, f"unknown option {option!r}\n{USAGE}")
            )
    if not argv:
        return answer(reply_error(ERR_BAD_REQUEST, "no verb given\n" + USAGE))
    verb, args = argv[0], argv[1:]
    loaded: List[Config] = []
    try:
        reply, code = _run_verb(
            verb=verb,
            args=args,
            config_option=config_option,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            loaded=loaded,
        )
    except AgentError as err:
        return answer(reply_error(err.code, err.message, **err.extra))
    except Exception as err:  # noqa: BLE001 - logged on the tower, answered with a code
        incident = log_internal(loaded[0] if loaded else None, f"verb {verb[:40]}", err)
        return answer(reply_error(**internal_error(incident)))
    if reply is None:
        return code
    return answer(reply)


if __name__ == "__main__":
    sys.exit(main())
