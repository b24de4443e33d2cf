"""A recording stand-in for virsh, for job tests.

Why a stand-in: libvirt's test driver has no guest agent (no ``shutdown --mode
agent``, no ``qemu-agent-command``), and a tower simulator pinned to real virsh
is being written in parallel (tests/towersim); once it exists, job tests should
move to its public API. This stand-in reproduces the output and error texts of
real virsh measured here (see fixtures/ and the project's notes on real QEMU
guests) for exactly the commands the agent runs, keeps domain state in a JSON
file, appends every invocation to a log, and refuses ``destroy``.

State file (env FAKEVIRSH_STATE): {"domains": {NAME: {"state": "running" |
"shut off", "reason": str, "xml": str, "agent_after": pings that fail before
the agent answers, "shutdown_polls": domstate calls after an accepted shutdown
before it is shut off (-1 = never), "acpi": whether ACPI is honoured,
"agent_shutdown": "timed_out" (libvirt's 60 s passed: refused, the guest
still going down) or "agent_left" (the guest shuts itself down and its agent
left: refused, the guest going down), "ping_sleep": seconds a ping waits (an
agent job held elsewhere)}},
"event_fails": `event` fails at once as when libvirt is unreachable, and a
running `event` ends as virsh's does when libvirtd goes away ("Disconnected
from URI due to end of file"),
"screenshot_no_file": `screenshot` says it saved a file but writes none}.
`event` prints nothing otherwise: the tower simulator has events.

The domain is the value of `--domain` (as the agent passes it) or the first
word that is not an option, as for real virsh. Like a virsh with translations
installed, it prints states in German unless the locale is C: LC_ALL, else
LC_MESSAGES, else LANG decides, and LANGUAGE=de is honoured in any locale but C.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path
import shlex
import sys
from typing import Any

AGENT_NOT_CONNECTED = (
    "error: Guest agent is not responding: QEMU guest agent is not connected\n"
)


# What virsh's German catalogue (po/de.po) says for the states it prints.
GERMAN = {
    "running": "laufend",
    "shut off": "ausgeschaltet",
    "paused": "pausiert",
    "idle": "leerlaufend",
    "in shutdown": "im Herunterfahren",
    "crashed": "abgestürzt",
    "pmsuspended": "pmsuspendiert",
    "no state": "kein Status",
}
# Options of the commands the agent runs that take a value.
VALUED = {"--mode", "--timeout", "--file", "--domain"}


def _german(env: dict[str, str]) -> bool:
    """Whether a virsh with translations would print German here (gettext's rules)."""
    locale = next(
        (env[k] for k in ("LC_ALL", "LC_MESSAGES", "LANG") if env.get(k)), "C"
    )
    if locale.split(".")[0] in ("C", "POSIX"):
        return False
    return locale.startswith("de") or env.get("LANGUAGE", "").startswith("de")


def _split(rest: list[str]) -> tuple[dict[str, str], list[str]]:
    """(options with their values, the other words) of one command's words."""
    options: dict[str, str] = {}
    words: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word in VALUED and i + 1 < len(rest):
            options[word] = rest[i + 1]
            i += 2
            continue
        if word.startswith("--"):
            options[word] = ""
        else:
            words.append(word)
        i += 1
    return options, words


def _pci_addresses(xml: str) -> set[str]:
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)  # noqa: S314 - test data
    out = set()
    for addr in root.iterfind("./devices/hostdev/source/address"):
        d, b, s, f = (
            int(addr.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function")
        )
        out.add(f"{d:04x}:{b:02x}:{s:02x}.{f:x}")
    return out


class Fake:
    """One virsh process."""

    def __init__(self, state: dict[str, Any], german: bool = False) -> None:
        self.state = state
        self.german = german
        self.out: list[str] = []
        self.err: list[str] = []

    def dom(self, name: str) -> dict[str, Any] | None:
        return self.state["domains"].get(name)

    def missing(self, name: str) -> int:
        self.err.append(f"error: failed to get domain '{name}'\n")
        return 1

    def command(self, args: list[str]) -> int:
        if not args:
            return 0
        verb, rest = args[0], args[1:]
        if verb == "echo":
            self.out.append(" ".join(rest) + "\n")
            return 0
        if verb == "destroy":
            self.err.append("error: destroy is refused by the stand-in\n")
            return 1
        if verb == "list":
            self.out.append(
                "".join(f"{n}\n" for n in sorted(self.state["domains"])) + "\n"
            )
            return 0
        options, words = _split(rest)
        name = [options["--domain"]] if "--domain" in options else words[:1]
        dom = self.dom(name[0])
        if dom is None:
            return self.missing(name[0])
        if verb == "dumpxml":
            self.out.append(dom["xml"].rstrip("\n") + "\n\n")
            return 0
        if verb == "domstate":
            polls = dom.get("pending_shutdown")
            if polls is not None and polls >= 0:
                if polls == 0:
                    dom.update(
                        state="shut off", reason="shutdown", pending_shutdown=None
                    )
                else:
                    dom["pending_shutdown"] = polls - 1
            state = dom["state"]
            if self.german:
                state = GERMAN.get(state, state)
            self.out.append(f"{state} ({dom['reason']})\n\n")
            return 0
        if verb == "qemu-agent-command":
            if dom.get("ping_sleep"):
                import time

                time.sleep(float(dom["ping_sleep"]))
            if dom["state"] != "running":
                self.err.append(
                    "error: Requested operation is not valid: domain is not running\n"
                )
                return 1
            if dom.get("agent_after", 0) > 0:
                dom["agent_after"] -= 1
                self.err.append(AGENT_NOT_CONNECTED)
                return 1
            self.out.append('{"return":{}}\n\n')
            return 0
        if verb == "shutdown":
            mode = options["--mode"]
            if dom["state"] != "running":
                self.err.append(
                    f"error: Failed to shutdown domain '{name[0]}'\n"
                    "error: Requested operation is not valid: domain is not running\n"
                )
                return 1
            going = {
                "timed_out": "error: Guest agent is not responding: "
                "Guest agent not available for now\n",
                "agent_left": AGENT_NOT_CONNECTED,
            }.get(dom.get("agent_shutdown", ""))
            if mode == "agent" and dom.get("agent_shutdown") == "ended_with_error":
                # The guest went down at once and QEMU exited while libvirt
                # still waited: the call fails, the domain is off.
                dom.update(state="shut off", reason="shutdown", pending_shutdown=None)
                self.err.append(
                    f"error: Failed to shutdown domain '{name[0]}'\n"
                    "error: internal error: End of file from qemu monitor\n"
                )
                return 1
            if mode == "agent" and going is not None:
                dom["pending_shutdown"] = dom.get("shutdown_polls", 0)
                self.err.append(
                    f"error: Failed to shutdown domain '{name[0]}'\n" + going
                )
                return 1
            if mode == "agent" and dom.get("agent_after", 0) > 0:
                self.err.append(
                    f"error: Failed to shutdown domain '{name[0]}'\n"
                    + AGENT_NOT_CONNECTED
                )
                return 1
            if mode == "agent" or dom.get("acpi"):
                dom["pending_shutdown"] = dom.get("shutdown_polls", 0)
            self.out.append(f"Domain '{name[0]}' is being shutdown\n\n")
            return 0
        if verb == "start":
            if dom["state"] != "shut off":
                self.err.append("error: Domain is already active\n")
                return 1
            mine = _pci_addresses(dom["xml"])
            for other_name, other in sorted(self.state["domains"].items()):
                if other_name != name[0] and other["state"] != "shut off":
                    busy = sorted(mine & _pci_addresses(other["xml"]))
                    if busy:
                        self.err.append(
                            f"error: Failed to start domain '{name[0]}'\n"
                            f"error: Requested operation is not valid: PCI device {busy[0]} "
                            f"is in use by driver QEMU, domain {other_name}\n"
                        )
                        return 1
            dom.update(state="running", reason="booted")
            dom["agent_after"] = dom.get("agent_after_start", 0)
            self.out.append(f"Domain '{name[0]}' started\n\n")
            return 0
        if verb == "screenshot":
            target = options["--file"]
            if not self.state.get("screenshot_no_file"):
                with Path(target).open("wb") as handle:
                    handle.write(
                        bytes.fromhex(self.state.get("screenshot_hex", "89504e47"))
                    )
            self.out.append(f"Screenshot saved to {target}, with type of image/png\n\n")
            return 0
        self.err.append(f"error: unknown command: '{verb}'\n")
        return 1


def main(argv: list[str]) -> int:
    """One virsh invocation: ``-c URI ARGS...`` or ``-c URI 'batch ; string'``."""
    import os

    state_path = Path(os.environ["FAKEVIRSH_STATE"])
    with Path(os.environ["FAKEVIRSH_LOG"]).open("a", encoding="utf-8") as log:
        log.write(json.dumps(argv) + "\n")
    if os.environ.get("FAKEVIRSH_UIDS"):  # who ran it (the privilege split tests)
        with Path(os.environ["FAKEVIRSH_UIDS"]).open("a", encoding="utf-8") as log:
            log.write(json.dumps({"uid": os.getuid(), "argv": argv}) + "\n")
    if len(argv) < 2 or argv[0] != "-c":
        sys.stderr.write("error: the stand-in needs -c URI\n")
        return 1
    args = argv[2:]
    if args[:1] == ["event"]:
        import time

        if json.loads(state_path.read_text(encoding="utf-8")).get("event_fails"):
            sys.stderr.write(
                "error: failed to connect to the hypervisor\n"
                "error: Failed to connect socket to '/run/libvirt/libvirt-sock': "
                "No such file or directory\n"
            )
            return 1
        seen = state_path.stat().st_mtime_ns
        while True:
            time.sleep(0.1)
            now = state_path.stat().st_mtime_ns
            if now == seen:
                continue
            seen = now
            if json.loads(state_path.read_text(encoding="utf-8")).get("event_fails"):
                sys.stderr.write(
                    f"error: Disconnected from {argv[1]} due to end of file\n"
                )
                return 1
    with state_path.with_suffix(".lock").open("a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(state_path.read_text(encoding="utf-8"))
        if state.get("unreachable"):
            sys.stderr.write(
                "error: failed to connect to the hypervisor\n"
                "error: Failed to connect socket to '/run/libvirt/libvirt-sock': "
                "No such file or directory\n"
            )
            return 1
        fake = Fake(state, _german(dict(os.environ)))
        if len(args) == 1:
            rc = 0
            part: list[str] = []
            for word in [*shlex.split(args[0]), ";"]:
                if word == ";":
                    rc = fake.command(part)
                    part = []
                else:
                    part.append(word)
        else:
            rc = fake.command(args)
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state), encoding="utf-8")
        tmp.replace(state_path)
    sys.stdout.write("".join(fake.out))
    sys.stderr.write("".join(fake.err))
    return rc


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main(sys.argv[1:]))
