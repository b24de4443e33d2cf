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
before it is shut off (-1 = never), "acpi": whether ACPI is honoured}},
"event_fails": `event` fails at once as when libvirt is unreachable}. `event`
prints nothing otherwise (and never ends): the tower simulator has events.
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

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
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
        name = [a for a in rest if not a.startswith("--")]
        if verb in ("qemu-agent-command", "shutdown"):
            name = [rest[2]]
        elif verb == "screenshot":
            name = [rest[0]]
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
            self.out.append(f"{dom['state']} ({dom['reason']})\n\n")
            return 0
        if verb == "qemu-agent-command":
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
            mode = rest[1]
            if dom["state"] != "running":
                self.err.append(
                    f"error: Failed to shutdown domain '{name[0]}'\n"
                    "error: Requested operation is not valid: domain is not running\n"
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
            with Path(rest[2]).open("wb") as handle:
                handle.write(
                    bytes.fromhex(self.state.get("screenshot_hex", "89504e47"))
                )
            self.out.append(
                f"Screenshot saved to {rest[2]}, with type of image/png\n\n"
            )
            return 0
        self.err.append(f"error: unknown command: '{verb}'\n")
        return 1


def main(argv: list[str]) -> int:
    """One virsh invocation: ``-c URI ARGS...`` or ``-c URI 'batch ; string'``."""
    import os

    state_path = Path(os.environ["FAKEVIRSH_STATE"])
    with Path(os.environ["FAKEVIRSH_LOG"]).open("a", encoding="utf-8") as log:
        log.write(json.dumps(argv) + "\n")
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
        while True:
            time.sleep(3600)
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
        fake = Fake(state)
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
