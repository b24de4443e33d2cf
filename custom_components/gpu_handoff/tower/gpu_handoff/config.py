"""The agent's configuration file: read, checked, and its defaults.

A configuration names the GPU node and the gaming VMs, libvirt's URI, the
timeouts of a job's steps and the limits of a tower. ``load_config`` refuses
a file that is not exactly what this module describes (``ERR_CONFIG_INVALID``
with the reason), so nothing later acts on a guess.
"""

from __future__ import annotations

import json
import os

from .wire import ERR_CONFIG_INVALID, NAME_MAX, AgentError, JsonObj, virsh_reads_as

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

# Limits, each a configuration key with this default: jobs waiting for their
# turn (each has a runner process waiting), and watch/session streams open at
# once on one tower.
MAX_QUEUED_JOBS_DEFAULT = 8
MAX_STREAMS_DEFAULT = 8
# A stream's client that takes nothing for this long is gone: the stream ends.
WRITE_TIMEOUT_DEFAULT = 30.0

DEFAULT_CONFIG_PATH = "/etc/gpu-handoff/config.json"
DEFAULT_SYSFS = "/sys"
SHUTDOWN_MODES = ("agent", "acpi")
DETACH_MODES = ("auto", "systemd", "process")
POLL_INTERVAL_DEFAULT = 0.25
TIMEOUT_DEFAULTS = {"agent": 180.0, "shutdown": 180.0, "start": 300.0}
# A session recomputes the status at least this often, for what no libvirt
# event tells: guest-agent readiness, PCI ownership after a define.
SESSION_REFRESH_DEFAULT = 5.0


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
        self.name: str = data.get("name") or os.uname().nodename  # gethostname()
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


DEFAULT_LIBVIRT_URI = "qemu:///system"
