"""virsh, the one way the agent talks to libvirt, and its output parsed.

Every command runs with an argument list in the C locale (never through a
shell), within a timeout, and only from ``VIRSH_COMMANDS``; what virsh prints
is parsed here (domain states, domain XML, the lines of ``virsh event``).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import xml.etree.ElementTree as ET

from .config import Config
from .wire import (
    DOMAIN_STATES,
    ERR_INTERNAL,
    ERR_LIBVIRT_UNREACHABLE,
    ERR_VIRSH_FAILED,
    ERR_VIRSH_MISSING,
    UNKNOWN_STATE,
    AgentError,
    JsonObj,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

AGENT_CHANNEL = "org.qemu.guest_agent.0"
GUEST_PING = '{"execute":"guest-ping"}'
STATUS_PING_TIMEOUT = 2
VIRSH_TIMEOUT = 120.0
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


def resolve_program(name: str, override: Optional[str], cfg: Config) -> Optional[str]:
    """An executable's path: the override, else inherited PATH then cfg.path."""
    if override:
        return override if os.access(override, os.X_OK) else None
    dirs = [d for d in cfg.env.get("PATH", os.defpath).split(os.pathsep) if d]
    dirs.extend(cfg.path_extra)
    return _which(name, dirs)


def _which(name: str, dirs: List[str]) -> Optional[str]:
    """shutil.which(name, path=dirs) on a POSIX system, without shutil's
    imports (every start of the agent runs virsh, and would pay for them)."""
    if os.path.dirname(name):
        dirs, name = [os.path.dirname(name)], os.path.basename(name)
    for directory in dict.fromkeys(dirs):
        candidate = os.path.join(directory, name)
        if (
            os.path.exists(candidate)
            and os.access(candidate, os.X_OK)
            and not os.path.isdir(candidate)
        ):
            return candidate
    return None


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
        nonce = os.urandom(6).hex()
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
