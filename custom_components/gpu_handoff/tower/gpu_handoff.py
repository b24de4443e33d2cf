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
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import pwd
import re
import secrets
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable, Dict, List, Optional, Tuple
import xml.etree.ElementTree as ET

# --- protocol: the Home Assistant side imports these ---------------------------

PROTOCOL = 2
VERSION = "0.2.0"

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
        "job",
        "jobs",
        "request",
        "screenshot",
    }
)
# Verbs that submit a job, and so take a request id.
JOB_VERBS = ("stop", "start", "handoff", "release")
# A session's request line, and the request's "id" (echoed in its reply).
SESSION_MAX_LINE = 4096
SESSION_MAX_ID = 64
SESSION_KEYS = ("id", "verb", "args", "request_id")
# A burst of libvirt events (a start is four of them) is one recompute.
SESSION_COALESCE_SECONDS = 0.1
EVENT_RESTART_SECONDS = 5.0
# Status fields left out when deciding whether the status changed.
VOLATILE_STATUS_KEYS = ("virsh_calls",)

JOB_ID_RE = re.compile(r"^[a-z0-9-]{1,64}$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{7,63}$")
REQUEST_OPTION = "--request="
# Home Assistant may ask for a request's job after a reconnect: a record that
# carries a request id is kept at least this long, whatever MAX_JOBS says.
REQUEST_KEEP_SECONDS = 3600.0
JOB_STATES = ("queued", "running", "succeeded", "failed")
JOB_KINDS = ("stop", "start", "handoff", "release")
MAX_JOBS = 50
MAX_HOOK_REQUESTS = 20
# A job whose runner has not taken its lock this long after creation is dead.
QUEUED_GRACE_SECONDS = 60.0

# Finding codes reported by `status`.
FINDING_ROM_BAR = "rom_bar_not_off"
FINDING_NO_AGENT_CHANNEL = "no_agent_channel"
FINDING_CLAIMED_BY_UNMANAGED = "claimed_by_unmanaged"
FINDING_DOMAIN_MISSING = "domain_missing"

DEFAULT_CONFIG_PATH = "/etc/gpu-handoff/config.json"
DEFAULT_PREFIX = "/usr/local"
DEFAULT_INSTALL_STATE_DIR = "/var/lib/gpu-handoff"
HOOK_PATH = "/etc/libvirt/hooks/qemu.d/gpu-handoff"
SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
AGENT_CHANNEL = "org.qemu.guest_agent.0"
GUEST_PING = '{"execute":"guest-ping"}'
STATUS_PING_TIMEOUT = 2
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
    }
)

JsonObj = Dict[str, Any]

# Exception tuples are named: the formatter targets a newer Python than the
# tower's and would rewrite `except (A, B):` into a form Python 3.9 rejects.
_READ_ERRORS = (OSError, ValueError)
_SELECT_ERRORS = (ValueError, OSError, AttributeError)
_NUMBER_ERRORS = (TypeError, ValueError)


class AgentError(Exception):
    """An error answered to the caller as {"code", "message"}."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


def reply_error(code: str, message: str) -> JsonObj:
    return {
        "protocol": PROTOCOL,
        "ok": False,
        "error": {"code": code, "message": message},
    }


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


def _check_domain_name(where: str, value: Any, problems: List[str]) -> None:
    if not isinstance(value, str) or not value:
        problems.append(f"{where}: must be a non-empty string")
    elif "/" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        problems.append(f"{where}: {value!r} is not a valid domain name")
    elif len(value) > 200:
        problems.append(f"{where}: longer than 200 characters")


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
    def __init__(self, rc: int, out: str, err: str) -> None:
        self.rc = rc
        self.out = out
        self.err = err

    def error_text(self) -> str:
        lines = [ln.strip() for ln in self.err.splitlines() if ln.strip()]
        text = " / ".join(
            ln[len("error: ") :] if ln.startswith("error: ") else ln for ln in lines
        )
        return text or f"virsh exited with status {self.rc}"


def virsh_quote(token: str) -> str:
    """Quote one token for virsh's own command-string parser (no shell)."""
    return "'" + token.replace("'", "'\\''") + "'"


class Virsh:
    """Runs virsh with argv lists; never through a shell; only allowed commands."""

    def __init__(self, cfg: Config) -> None:
        path = resolve_program("virsh", cfg.cmd_virsh, cfg)
        if path is None:
            where = cfg.cmd_virsh or "PATH" + (
                " and config path" if cfg.path_extra else ""
            )
            raise AgentError(ERR_VIRSH_MISSING, f"virsh not found (looked in {where})")
        self.path = path
        self.uri = cfg.libvirt_uri
        self.env = dict(cfg.env)
        self.calls = 0

    def argv(self, args: List[str]) -> List[str]:
        return [self.path, "-c", self.uri, *args]

    def run(self, args: List[str], timeout: float = VIRSH_TIMEOUT) -> VirshResult:
        return self._run(self.check(args), timeout)

    @staticmethod
    def check(args: List[str]) -> List[str]:
        if not args or args[0] not in VIRSH_COMMANDS:
            raise AgentError(ERR_INTERNAL, f"virsh command {args[:1]!r} is not allowed")
        return args

    def _run(self, args: List[str], timeout: float) -> VirshResult:
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
            return VirshResult(124, "", f"error: virsh timed out after {timeout:g} s")
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
        if result.rc != 0 and f"@@gpu-handoff-{nonce}-0" not in result.out:
            raise AgentError(ERR_VIRSH_FAILED, result.error_text())
        return split_batch_output(result.out, nonce, len(commands))


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
    """`running (booted)` -> ("running", "booted"); `shut off` -> ("shut_off", None)."""
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    match = re.match(r"^(.*?)\s*(?:\((.*)\))?$", text)
    state = (match.group(1) if match else text).strip()
    reason = match.group(2) if match else None
    return state.replace(" ", "_"), reason


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
        self.virsh_calls = 0

    def all_domains(self) -> Dict[str, JsonObj]:
        merged = dict(self.others)
        merged.update(self.domains)
        return merged

    @staticmethod
    def holds(dom: JsonObj) -> bool:
        return bool(dom.get("exists")) and dom.get("state") not in ("shut_off", None)


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


def observe(cfg: Config, virsh: Virsh, ping: bool) -> Snapshot:
    """One virsh call for the managed domains (+ pings), one more for others."""
    snap = Snapshot()
    managed = cfg.managed
    cmds: List[List[str]] = [["list", "--all", "--name"]]
    for name in managed:
        cmds.append(["dumpxml", name])
        cmds.append(["domstate", "--reason", name])
    if ping:
        cmds.extend(
            [
                "qemu-agent-command",
                "--timeout",
                str(STATUS_PING_TIMEOUT),
                name,
                GUEST_PING,
            ]
            for name in managed
        )
    before = virsh.calls
    outs = virsh.batch(cmds)
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
            answer = outs[1 + 2 * len(managed) + i]
            record["agent_ready"] = (
                ('"return"' in answer) if record["state"] == "running" else None
            )
        snap.domains[name] = record
    others = [name for name in snap.existing if name not in managed]
    if others:
        cmds = []
        for name in others:
            cmds.append(["dumpxml", name])
            cmds.append(["domstate", "--reason", name])
        outs = virsh.batch(cmds)
        for i, name in enumerate(others):
            snap.others[name] = _domain_record(name, outs[2 * i], outs[2 * i + 1], True)
    snap.virsh_calls = virsh.calls - before
    return snap


def card_table(cfg: Config, snap: Snapshot) -> List[JsonObj]:
    """For each PCI function a managed domain claims: holder and claimants."""
    everything = snap.all_domains()
    addresses: List[str] = []
    for name in cfg.managed:
        for dev in snap.domains[name]["hostdevs"]:
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
            }
        )
    return cards


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
    return found


# --- state directory -----------------------------------------------------------------


def _owner_of(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_uid, st.st_gid


def fix_owner(path: str, state_dir: str) -> None:
    """Files root writes into state_dir belong to the state_dir's owner."""
    if os.geteuid() != 0:
        return
    owner = _owner_of(state_dir)
    if owner is None or owner == (0, 0):
        return
    with contextlib.suppress(OSError):
        os.chown(path, owner[0], owner[1])


def ensure_dir(path: str, state_dir: str) -> None:
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        fix_owner(path, state_dir)


def write_json_atomic(path: str, data: Any, state_dir: str) -> None:
    directory = os.path.dirname(path)
    ensure_dir(directory, state_dir)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        fix_owner(tmp, state_dir)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: str) -> Optional[Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except _READ_ERRORS:
        return None


def open_lock(path: str, state_dir: str) -> IO[str]:
    existed = os.path.exists(path)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held as a lock
    if not existed:
        fix_owner(path, state_dir)
    return handle


def claims_cache_path(cfg: Config) -> str:
    return os.path.join(cfg.state_dir, "claims.json")


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


def _stop_steps(domain: str) -> List[JsonObj]:
    return [_step(name, domain) for name in ("wait_agent", "shutdown", "wait_shut_off")]


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
    steps = _stop_steps(target) if target else []
    return steps + _start_steps(cfg.gpu_node)


def create_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> JsonObj:
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
    ensure_dir(cfg.state_dir, cfg.state_dir)
    write_json_atomic(job_path(cfg, job_id), job, cfg.state_dir)
    prune_jobs(cfg)
    return job


def list_job_ids(cfg: Config) -> List[str]:
    try:
        names = os.listdir(jobs_dir(cfg))
    except OSError:
        return []
    ids = [
        n[: -len(".json")]
        for n in names
        if n.endswith(".json") and not n.startswith(".")
    ]
    return sorted(i for i in ids if JOB_ID_RE.match(i))


def _kept_for_request(job: JsonObj) -> bool:
    """A young record with a request id: Home Assistant may still ask for it."""
    if not job.get("request_id"):
        return False
    try:
        created = float(job.get("created_epoch") or 0)
    except _NUMBER_ERRORS:
        return False
    return time.time() - created < REQUEST_KEEP_SECONDS


def prune_jobs(cfg: Config) -> None:
    ids = list_job_ids(cfg)
    for job_id in ids[: max(0, len(ids) - MAX_JOBS)]:
        job = read_json(job_path(cfg, job_id))
        if isinstance(job, dict) and (
            job.get("state") in ("queued", "running") or _kept_for_request(job)
        ):
            continue
        for suffix in (".json", ".lock", ".log"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(jobs_dir(cfg), job_id + suffix))


def _lock_is_free(path: str) -> bool:
    try:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def load_job(cfg: Config, job_id: str) -> JsonObj:
    """A job's record; a job whose runner died is reported (and stored) as failed."""
    if not JOB_ID_RE.match(job_id):
        raise AgentError(ERR_BAD_REQUEST, f"invalid job id {job_id!r}")
    path = job_path(cfg, job_id)
    job = read_json(path)
    if not isinstance(job, dict):
        raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
    if job.get("state") not in ("queued", "running"):
        return job
    lock_path = os.path.join(jobs_dir(cfg), job_id + ".lock")
    young = time.time() - float(job.get("created_epoch") or 0) < QUEUED_GRACE_SECONDS
    if job["state"] == "queued" and young and not os.path.exists(lock_path):
        return job
    try:
        handle = open_lock(lock_path, cfg.state_dir)
    except OSError:
        return job
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return job  # the runner holds it: alive
        # Lock free: the runner finished (re-read) or died.
        job = read_json(path)
        if not isinstance(job, dict):
            raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
        if job.get("state") == "running" or (
            job.get("state") == "queued" and not young
        ):
            job["state"] = "failed"
            job["finished"] = now_iso()
            job["error"] = {
                "code": ERR_RUNNER_DIED,
                "message": "the job's runner is gone before the job finished",
            }
            write_json_atomic(path, job, cfg.state_dir)
        fcntl.flock(handle, fcntl.LOCK_UN)
    return job


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
    """The id of the job record that carries this request id, if one exists."""
    for job_id in reversed(list_job_ids(cfg)):
        job = read_json(job_path(cfg, job_id))
        if isinstance(job, dict) and job.get("request_id") == request_id:
            return job_id
    return None


def program_argv(cfg: Config, job_id: str) -> List[str]:
    return [
        sys.executable,
        os.path.realpath(__file__),
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


def spawn_runner(cfg: Config, job: JsonObj) -> JsonObj:
    """Start the job's runner detached from this process; describe how."""
    job_id = job["id"]
    mode = cfg.detach
    systemd_run = resolve_program("systemd-run", cfg.cmd_systemd_run, cfg)
    if mode == "auto":
        mode = (
            "systemd"
            if systemd_run and os.path.isdir(SYSTEMD_RUNTIME_DIR)
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
    log_path = os.path.join(jobs_dir(cfg), job_id + ".log")
    with open(log_path, "ab") as log:
        fix_owner(log_path, cfg.state_dir)
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


def submit_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> Tuple[JsonObj, bool]:
    """Create a job and start its runner: (the reply's `job`, whether it existed).

    A request id that a job record already carries creates nothing: that job
    is answered. Looking up, creating and spawning hold submit.lock, so two
    processes (sessions, one-shot commands) with the same id make one job.
    """
    if request_id is None:
        return _create_and_spawn(cfg, kind, target, requested_by, None), False
    ensure_dir(cfg.state_dir, cfg.state_dir)
    lock = open_lock(os.path.join(cfg.state_dir, "submit.lock"), cfg.state_dir)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = find_request(cfg, request_id)
        if existing is not None:
            job = load_job(cfg, existing)
            return _submitted(job, job.get("runner")), True
        return _create_and_spawn(cfg, kind, target, requested_by, request_id), False


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
        for step in self.job["steps"][index:]:
            if step["domain"] == domain and step["result"] is None:
                step["started"] = step["started"] or now_iso()
                self.end(step, "skipped", detail)

    def state_of(self, domain: str) -> str:
        result = self.virsh.run(["domstate", "--reason", domain])
        if result.rc != 0:
            raise AgentError(ERR_DOMAIN_MISSING, result.error_text())
        return parse_domstate(result.out)[0]

    def agent_ready(self, domain: str) -> bool:
        result = self.virsh.run(
            [
                "qemu-agent-command",
                "--timeout",
                str(STATUS_PING_TIMEOUT),
                domain,
                GUEST_PING,
            ]
        )
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

    def step_shutdown(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        refusals = []
        for mode in self.cfg.shutdown_modes:
            result = self.virsh.run(["shutdown", "--mode", mode, domain])
            if result.rc == 0:
                self.end(step, "ok", f"shutdown --mode {mode} accepted")
                return
            if self.state_of(domain) == "shut_off":
                self.skip_rest(index, domain, "already shut off")
                return
            refusals.append(f"{mode}: {result.error_text()}")
        message = f"{domain!r} refused every shutdown mode: " + "; ".join(refusals)
        self.end(step, "failed", message)
        raise AgentError(ERR_SHUTDOWN_REFUSED, message)

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

    def step_wait_devices_free(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        deadline = time.monotonic() + self.cfg.timeout_start
        while True:
            snap = observe(self.cfg, self.virsh, ping=False)
            mine = snap.domains.get(domain)
            if mine is None or not mine["exists"]:
                message = f"domain {domain!r} is not defined in libvirt"
                self.end(step, "failed", message)
                raise AgentError(ERR_DOMAIN_MISSING, message)
            if Snapshot.holds(mine):
                self.skip_rest(index, domain, "already running")
                return
            wanted = {d["address"] for d in mine["hostdevs"]}
            busy = sorted(
                f"{d['address']} held by {name}"
                for name, other in snap.all_domains().items()
                if name != domain and Snapshot.holds(other)
                for d in other["hostdevs"]
                if d["address"] in wanted
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

    def step_start(self, index: int, step: JsonObj) -> None:
        domain = step["domain"]
        self.begin(index)
        result = self.virsh.run(["start", domain])
        if result.rc == 0:
            self.end(step, "ok", "started")
            return
        if self.state_of(domain) not in ("shut_off",):
            self.end(step, "ok", "already running")
            return
        message = f"start of {domain!r} failed: {result.error_text()}"
        self.end(step, "failed", message)
        raise AgentError(ERR_START_FAILED, message)


def run_job(cfg: Config, job_id: str) -> int:
    """The detached runner: one job, serialised per tower by a flock."""
    path = job_path(cfg, job_id)
    lock = open_lock(os.path.join(jobs_dir(cfg), job_id + ".lock"), cfg.state_dir)
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another runner has it
        job = read_json(path)
        if not isinstance(job, dict) or job.get("state") != "queued":
            return 0
        job["runner"] = {"pid": os.getpid()}
        write_json_atomic(path, job, cfg.state_dir)
        tower = open_lock(os.path.join(cfg.state_dir, "tower.lock"), cfg.state_dir)
        with tower:
            fcntl.flock(tower, fcntl.LOCK_EX)
            job["state"] = "running"
            job["started"] = now_iso()
            write_json_atomic(path, job, cfg.state_dir)
            runner: Optional[JobRunner] = None
            try:
                runner = JobRunner(cfg, job, Virsh(cfg))
                runner.run()
                job["state"] = "succeeded"
            except AgentError as err:
                job["state"] = "failed"
                job["error"] = {"code": err.code, "message": err.message}
            except Exception as err:  # noqa: BLE001 - recorded in the job
                job["state"] = "failed"
                job["error"] = {
                    "code": ERR_INTERNAL,
                    "message": f"{type(err).__name__}: {err}",
                }
            job["finished"] = now_iso()
            write_json_atomic(path, job, cfg.state_dir)
    return 0 if job["state"] == "succeeded" else 1


# --- verbs --------------------------------------------------------------------------------


def hook_requests(cfg: Config) -> List[JsonObj]:
    directory = os.path.join(cfg.state_dir, "requests")
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names[-MAX_HOOK_REQUESTS:]:
        data = read_json(os.path.join(directory, name))
        if isinstance(data, dict):
            out.append(data)
    return out


def status_body(cfg: Config, virsh: Optional[Virsh] = None) -> JsonObj:
    """What `status` answers (without protocol/ok): one-shot and sessions."""
    virsh = virsh or Virsh(cfg)
    # Jobs before libvirt: a job that is over when read has done all it does
    # to libvirt by then, so no status shows a job gone but not its effect.
    active = []
    for job_id in list_job_ids(cfg):
        try:
            job = load_job(cfg, job_id)
        except AgentError:
            continue
        if job["state"] in ("queued", "running"):
            active.append(job_summary(job))
    requests = hook_requests(cfg)
    snap = observe(cfg, virsh, ping=True)
    cards = card_table(cfg, snap)
    found = findings_for(cfg, snap, cards)
    gpu = snap.domains[cfg.gpu_node]
    try:
        ensure_dir(cfg.state_dir, cfg.state_dir)
        write_json_atomic(
            claims_cache_path(cfg),
            {
                "gpu_node": cfg.gpu_node,
                "addresses": sorted(d["address"] for d in gpu["hostdevs"]),
                "written": now_iso(),
            },
            cfg.state_dir,
        )
    except OSError:
        pass
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


def verb_status(cfg: Config) -> JsonObj:
    return reply_ok(**status_body(cfg))


def verb_screenshot(cfg: Config, domain: str) -> JsonObj:
    virsh = Virsh(cfg)
    tmpdir = tempfile.mkdtemp(prefix="gpu-handoff-shot-")
    try:
        target = os.path.join(tmpdir, "screen")
        result = virsh.run(["screenshot", domain, "--file", target])
        if result.rc != 0:
            raise AgentError(ERR_SCREENSHOT_FAILED, result.error_text())
        match = re.search(r"with type of (\S+?)\.?$", result.out.strip())
        mime = match.group(1) if match else "application/octet-stream"
        size = os.path.getsize(target)
        if size > cfg.screenshot_max_bytes:
            raise AgentError(
                ERR_TOO_LARGE,
                f"screenshot is {size} bytes, more than screenshot_max_bytes={cfg.screenshot_max_bytes}",
            )
        with open(target, "rb") as handle:
            data = handle.read(cfg.screenshot_max_bytes + 1)
        return reply_ok(
            domain=domain,
            mime=mime,
            size=len(data),
            data=base64.b64encode(data).decode("ascii"),
        )
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def verb_hook(cfg: Config, args: List[str], xml_text: str) -> None:
    """libvirt's qemu hook: never waits, never calls libvirt, prints nothing.

    libvirt writes the domain XML to stdin and, for some operations, reads the
    hook's stdout as new XML: so stdin is always read and stdout never written.
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
    cache = read_json(claims_cache_path(cfg))
    if not isinstance(cache, dict) or cache.get("gpu_node") != cfg.gpu_node:
        return
    shared = sorted(wanted & set(cache.get("addresses") or []))
    if not shared:
        return
    ensure_dir(cfg.state_dir, cfg.state_dir)
    request: JsonObj = {
        "domain": domain,
        "operation": f"{operation} {subop}",
        "addresses": shared,
        "time": now_iso(),
        "job": None,
    }
    name = f"{new_job_id()}-{domain}".replace("/", "_")
    request_path = os.path.join(cfg.state_dir, "requests", name + ".json")
    try:
        submitted, _ = submit_job(cfg, "stop", cfg.gpu_node, "hook")
        request["job"] = submitted["id"]
    except AgentError as err:
        request["error"] = {"code": err.code, "message": err.message}
    write_json_atomic(request_path, request, cfg.state_dir)
    directory = os.path.dirname(request_path)
    names = sorted(os.listdir(directory))
    for old in names[: max(0, len(names) - MAX_HOOK_REQUESTS)]:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, old))


class StreamClosedError(Exception):
    """The client of `watch` or `session` went away."""


def _emit(stdout: IO[str], obj: JsonObj) -> None:
    try:
        stdout.write(json.dumps(obj, sort_keys=True) + "\n")
        stdout.flush()
    except (BrokenPipeError, ValueError) as err:
        _discard_output(stdout)
        raise StreamClosedError from err
    except OSError as err:
        if err.errno in (errno.EPIPE, errno.EBADF):
            _discard_output(stdout)
            raise StreamClosedError from err
        raise


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


class EventChild:
    """`virsh event --loop --all --timestamp`, read without blocking.

    `watch` and `session` share it: they read when its pipe is readable, get
    the events of the complete lines so far, and why it ended once it has.
    """

    def __init__(self, virsh: Virsh) -> None:
        try:
            self.proc = subprocess.Popen(
                virsh.argv(Virsh.check(["event", "--loop", "--all", "--timestamp"])),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=virsh.env,
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
        for job_id in list_job_ids(self.cfg)[-MAX_JOBS:]:
            path = job_path(self.cfg, job_id)
            try:
                st = os.stat(path)
            except OSError:
                continue
            job = read_json(path)
            if not isinstance(job, dict):
                continue
            # Records are replaced, never rewritten in place: a new inode or
            # size tells a change that fell in the same mtime tick.
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


def verb_watch(cfg: Config, stdin: IO[str], stdout: IO[str]) -> int:
    child = EventChild(Virsh(cfg))
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ, "virsh")
    # A stdin that cannot be selected: only a broken stdout ends the stream.
    with contextlib.suppress(*_SELECT_ERRORS):
        sel.register(stdin, selectors.EVENT_READ, "stdin")
    jobs = JobScanner(cfg)
    managed = set(cfg.managed)
    code = 0
    try:
        jobs.scan()
        _emit(stdout, reply_ok(type="watching", domains=cfg.managed))
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
                        _emit(stdout, message("event", **event))
                if error is not None:
                    _emit(stdout, message("error", error=error))
                    code = 1
                    running = False
                    break
            if running:
                for line in jobs.scan():
                    _emit(stdout, line)
    except StreamClosedError:
        code = 0
    finally:
        sel.close()
        child.close()
    return code


# --- session ---------------------------------------------------------------------------------


class SessionEndError(BaseException):
    """SIGTERM or SIGHUP: the session ends as at the end of its input.

    A BaseException, so that no handler of a single request catches it.
    """


def _end_session(signum: int, frame: Any) -> None:
    raise SessionEndError


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
    directory = os.path.join(cfg.state_dir, "requests")
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return ()
    out = []
    for name in names:
        try:
            st = os.stat(os.path.join(directory, name))
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
        _emit(self.stdout, obj)

    def run(self) -> int:
        previous: Dict[signal.Signals, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                previous[signum] = signal.signal(signum, _end_session)
            except ValueError:  # not the main thread (tests): no handlers
                break
        try:
            self.jobs.scan()  # the records as they are now: pushed when they change
            # Listen before the first status, so no change falls in between.
            failure = self.start_events()
            self.send(
                message("hello", ok=True, version=VERSION, verbs=sorted(SESSION_VERBS))
            )
            self.recompute(force=True, drain=False)
            if failure is not None:
                self.send(message("error", source="events", error=failure))
            self.attach_stdin()
            while self.open:
                self.step()
        except (StreamClosedError, SessionEndError):
            pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
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
                self.send(message("error", source="events", error=failure))
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
            self.send(message("error", source="events", error=failure))
            self.stop_events()
            self.restart_at = time.monotonic() + EVENT_RESTART_SECONDS
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
        except Exception as err:  # noqa: BLE001 - answered; the session goes on
            answer = reply_error(ERR_INTERNAL, f"{type(err).__name__}: {err}")
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
        except Exception as err:  # noqa: BLE001 - reported; the session goes on
            failure = {"code": ERR_INTERNAL, "message": f"{type(err).__name__}: {err}"}
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
            if failure != self.failure:
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
        stale = time.monotonic() - self.computed_at >= self.cfg.session_refresh
        if self.body is None or self.dirty_at is not None or stale:
            self.recompute()
        if self.body is None:
            failure = self.failure or {"code": ERR_INTERNAL, "message": "no status"}
            raise AgentError(failure["code"], failure["message"])
        return reply_ok(age=round(time.monotonic() - self.computed_at, 3), **self.body)


def verb_session(
    cfg: Config, stdin: IO[str], stdout: IO[str], requested_by: str
) -> int:
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
    if verb in ("stop", "start", "screenshot") and args[0] not in cfg.managed:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN, f"{args[0][:80]!r} is not a configured domain"
        )
    if verb in ("handoff", "release") and args and args[0] not in cfg.gaming:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN, f"{args[0][:80]!r} is not a configured gaming domain"
        )
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
        return version_reply()
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


def _rooted(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


def verb_install(
    args: List[str], config_option: Optional[str], env: Dict[str, str], err: IO[str]
) -> JsonObj:
    opts: Dict[str, Any] = {
        "user": None,
        "gpu_node": None,
        "gaming": [],
        "uri": "qemu:///system",
        "prefix": DEFAULT_PREFIX,
        "root": "",
        "force": False,
        "state_dir": DEFAULT_INSTALL_STATE_DIR,
        "detach": None,
        "config": config_option,
    }
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
    }
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--force":
            opts["force"] = True
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
        else:
            opts[names[key]] = value
    if not opts["user"] or not opts["gpu_node"] or not opts["gaming"]:
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --user, --gpu-node and at least one --gaming are required",
        )
    try:
        account = pwd.getpwnam(opts["user"])
    except KeyError:
        raise AgentError(
            ERR_BAD_REQUEST, f"install: no user {opts['user']!r}"
        ) from None
    root = os.path.abspath(opts["root"]) if opts["root"] else ""
    config_path = config_path_from(opts["config"], {})
    if not os.path.isabs(config_path):
        raise AgentError(ERR_BAD_REQUEST, "install: --config must be an absolute path")
    program = os.path.join(opts["prefix"], "bin", "gpu-handoff")
    data: JsonObj = {
        "libvirt_uri": opts["uri"],
        "gpu_node": opts["gpu_node"],
        "gaming": opts["gaming"],
        "state_dir": opts["state_dir"],
    }
    if opts["detach"]:
        data["detach"] = opts["detach"]
    problems = validate_config(data)
    if problems:
        raise AgentError(ERR_CONFIG_INVALID, "; ".join(problems))
    real_config = _rooted(root, config_path)
    if os.path.exists(real_config) and not opts["force"]:
        raise AgentError(
            ERR_EXISTS, f"{real_config} exists; pass --force to overwrite it"
        )
    written: List[str] = []
    try:
        real_program = _rooted(root, program)
        os.makedirs(os.path.dirname(real_program), exist_ok=True)
        shutil.copyfile(os.path.realpath(__file__), real_program)
        os.chmod(real_program, 0o755)  # noqa: S103 - programs and the state dir are world-readable
        written.append(real_program)
        os.makedirs(os.path.dirname(real_config), exist_ok=True)
        with open(real_config, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.chmod(real_config, 0o644)
        written.append(real_config)
        real_state = _rooted(root, opts["state_dir"])
        os.makedirs(real_state, exist_ok=True)
        if os.geteuid() == 0:
            os.chown(real_state, account.pw_uid, account.pw_gid)
        os.chmod(real_state, 0o755)  # noqa: S103 - programs and the state dir are world-readable
        written.append(real_state)
        real_hook = _rooted(root, HOOK_PATH)
        os.makedirs(os.path.dirname(real_hook), exist_ok=True)
        with open(real_hook, "w", encoding="utf-8") as handle:
            handle.write(
                "#!/bin/sh\n# libvirt qemu hook of gpu-handoff: records, never waits.\n"
                f'exec {shlex.quote(program)} --config {shlex.quote(config_path)} hook "$@"\n'
            )
        os.chmod(real_hook, 0o755)  # noqa: S103 - programs and the state dir are world-readable
        written.append(real_hook)
    except OSError as error:
        raise AgentError(ERR_INSTALL_FAILED, f"install: {error}") from None
    # Check the tower with the configuration just written (relocated under --root).
    check_data = dict(data)
    check_data["state_dir"] = _rooted(root, opts["state_dir"])
    check_cfg = Config(real_config, check_data, env)
    findings: List[JsonObj] = []
    status_error: Optional[JsonObj] = None
    try:
        status = verb_status(check_cfg)
        findings = status["findings"]
        if os.geteuid() == 0:
            for path in (claims_cache_path(check_cfg),):
                if os.path.exists(path):
                    os.chown(path, account.pw_uid, account.pw_gid)
    except AgentError as error:
        status_error = {"code": error.code, "message": error.message}
    key_line = (
        f'restrict,command="{program} --config {config_path} serve" '
        "<public key of Home Assistant>"
    )
    notes = [
        f"Add this line to ~{opts['user']}/.ssh/authorized_keys:",
        f"  {key_line}",
        f"{opts['user']} must be in the libvirt group: usermod -aG libvirt {opts['user']}",
        "Restart libvirtd so it loads the new hook: systemctl restart libvirtd",
    ]
    if status_error:
        notes.append(f"status failed: {status_error['message']}")
    notes.extend(
        f"finding {finding['code']} ({finding['domain']}): {finding['detail']}"
        for finding in findings
    )
    for line in notes:
        err.write(line + "\n")
    return reply_ok(
        installed=written,
        program=program,
        config=config_path,
        hook=HOOK_PATH,
        authorized_keys_line=key_line,
        findings=findings,
        status_error=status_error,
        notes=notes,
    )


# --- entry point ---------------------------------------------------------------------------

USAGE = (
    "usage: gpu-handoff [--config PATH] VERB [ARGS]\n"
    "verbs: version, status, stop DOMAIN, start DOMAIN, handoff GAMING, release [GAMING]\n"
    "       (the four job verbs take --request=RID: one job per request id),\n"
    "       job ID, request RID, jobs, watch, session, screenshot DOMAIN,\n"
    "       hook DOMAIN OP SUBOP EXTRA, serve, check-config,\n"
    "       install --user U --gpu-node N --gaming G [--gaming G2]\n"
    "       [--uri URI] [--prefix DIR] [--state-dir DIR] [--root DIR] [--force]"
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


def version_reply() -> JsonObj:
    return reply_ok(
        version=VERSION,
        python=".".join(str(v) for v in sys.version_info[:3]),
        verbs=sorted(SERVE_VERBS),
    )


def _run_verb(
    *,
    verb: str,
    args: List[str],
    config_option: Optional[str],
    env: Dict[str, str],
    stdin: IO[str],
    stdout: IO[str],
    stderr: IO[str],
) -> Tuple[Optional[JsonObj], int]:
    """Any verb; (reply to print, or None when it printed itself; exit code)."""
    path = config_path_from(config_option, env)
    if verb == "version":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "version takes no arguments")
        return version_reply(), 0
    if verb == "install":
        return verb_install(args, config_option, env, stderr), 0
    if verb == "hook":
        try:
            # libvirt writes the domain XML to stdin: always read it.
            xml_text = "" if stdin.isatty() else stdin.read()
            verb_hook(load_config(path, env), args, xml_text)
        except Exception as err:  # noqa: BLE001 - a hook must never fail libvirt
            stderr.write(f"gpu-handoff hook: {err}\n")
        return None, 0
    cfg = load_config(path, env)
    if verb == "check-config":
        return reply_ok(config=cfg.as_json()), 0
    if verb == "run-job":
        if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--state-dir"):
            raise AgentError(ERR_BAD_REQUEST, "usage: run-job ID [--state-dir DIR]")
        if not JOB_ID_RE.match(args[0]):
            raise AgentError(ERR_BAD_REQUEST, "invalid job id")
        if len(args) == 3:
            cfg.state_dir = args[2]
        return None, run_job(cfg, args[0])
    if verb == "serve":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "serve takes no arguments")
        verb, args, request_id = parse_serve_request(
            cfg, env.get("SSH_ORIGINAL_COMMAND")
        )
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
    try:
        reply, code = _run_verb(
            verb=verb,
            args=args,
            config_option=config_option,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )
    except AgentError as err:
        return answer(reply_error(err.code, err.message))
    except Exception as err:  # noqa: BLE001 - answered, never a traceback
        return answer(reply_error(ERR_INTERNAL, f"{type(err).__name__}: {err}"))
    if reply is None:
        return code
    return answer(reply)


if __name__ == "__main__":
    sys.exit(main())
