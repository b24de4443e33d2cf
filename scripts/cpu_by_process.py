"""Where a command's CPU goes, by the processes it starts: run as root.

    python3 scripts/cpu_by_process.py [--top N] -- COMMAND...

e.g. ``python3 scripts/cpu_by_process.py -- scripts/env pytest tests/chaos -n 4``.

The kernel's process accounting (acct(2)) writes a record as each process
ends: its CPU, start and lifetime, but only its name (15 characters: a
Python program's is ``python3.14``, or the name of its last thread). The
proc connector (a netlink socket) tells of every exec as it happens; its
command line is read from /proc then. Joined by PID and time, the two say
what each process was: the agent and its verb, the simulated ``virsh``,
QEMU, pytest's workers. Prints JSON: the machine's CPU over the run
(/proc/stat, every process and the kernel's own work), the CPU of the
processes that ended, and the largest kinds of them; the command's own
output goes to stderr.

Both are Linux features that need root (CAP_SYS_PACCT, CAP_NET_ADMIN).
Both see the whole machine: every process that ends while the command runs
is counted, the command's or not (run nothing else meanwhile), and one
still running when it ends is not. Standard library only: it runs on the
machine's own Python, outside the test root.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
import ctypes
from dataclasses import dataclass
import json
import os
from pathlib import Path
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_EXEC = 0x2
ACCT_V3 = 3
AHZ = 100  # acct's comp_t unit: 1/100 s
PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-m", "-c")


def machine_cpu() -> float:
    """Seconds of CPU the machine has used (every state but idle and iowait)."""
    with Path("/proc/stat").open(encoding="ascii") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def comp_t(value: int) -> int:
    """acct's 16-bit float: 13 bits of mantissa, 3 of base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


class ExecLog(threading.Thread):
    """Every exec on the machine, with its command line, while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.execs: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)
        self.sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR
        )
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((0, CN_IDX_PROC))
        op = struct.pack("=I", PROC_CN_MCAST_LISTEN)
        cn_msg = struct.pack("=IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
        # nlmsghdr: length, type NLMSG_DONE, flags, sequence, port
        self.sock.send(struct.pack("=IHHII", 16 + len(cn_msg), 3, 0, 0, 0) + cn_msg)
        self.sock.settimeout(0.2)
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:  # a timeout too
                continue
            offset = 0
            while offset + 16 <= len(data):
                (length,) = struct.unpack_from("=I", data, offset)
                event = data[offset + 16 + 20 : offset + length]  # after cn_msg
                offset += (length + 3) & ~3
                if len(event) < 24:
                    continue
                (what,) = struct.unpack_from("=I", event, 0)
                if what != PROC_EVENT_EXEC:
                    continue
                _pid, tgid = struct.unpack_from("=II", event, 16)
                try:
                    raw = Path(f"/proc/{tgid}/cmdline").read_bytes()
                except OSError:
                    continue
                argv = [part.decode("utf-8", "replace") for part in raw.split(b"\0")]
                self.execs[tgid].append((time.time(), [a for a in argv if a]))

    def stop(self) -> None:
        self.stopping = True
        self.join()
        self.sock.close()


def kind(argv: list[str] | None, comm: str) -> str:
    """What a process was, in a few words."""
    if not argv:
        return f"{comm} (no exec seen)"
    program = argv[0].rsplit("/", 1)[-1]
    if not program.startswith("python"):
        return program
    rest = iter(argv[1:])
    for arg in rest:
        if arg in PYTHON_OPTIONS_WITH_VALUE:
            value = next(rest, "")
            if arg == "-c" and "exec(eval(sys.stdin.readline()))" in value:
                return "pytest worker"
            if arg in ("-m", "-c"):
                return f"python -{arg[1]} {value.split()[0] if value else ''}".strip()
            continue
        if arg.startswith("-"):
            continue
        script = arg.rsplit("/", 1)[-1]
        if script.startswith("gpu-handoff"):
            words = [a for a in rest if not a.startswith("-") and not a.startswith("/")]
            verb = next((w for w in words if not w.endswith(".json")), "")
            return f"agent {verb}".strip()
        if script.startswith(".") and script.endswith(".py"):
            return f"simulated {script[1:-3]}"
        return f"python {script}"
    return "python"


@dataclass
class Ended:
    """One process's accounting record."""

    pid: int
    start: float  # seconds since the epoch (whole seconds)
    end: float
    cpu: float
    comm: str


def records(path: Path) -> list[Ended]:
    data = path.read_bytes()
    found = []
    for offset in range(0, len(data) - 63, 64):
        record = data[offset : offset + 64]
        if record[1] != ACCT_V3:
            continue
        fields = struct.unpack("<HIIIIIIfHH", record[2:36])
        pid, btime, etime, utime, stime = (
            fields[4],
            fields[6],
            fields[7],
            fields[8],
            fields[9],
        )
        found.append(
            Ended(
                pid=pid,
                start=float(btime),
                end=btime + etime / AHZ,
                cpu=(comp_t(utime) + comp_t(stime)) / AHZ,
                comm=record[48:64].split(b"\0")[0].decode("latin-1"),
            )
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="kinds to list")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    libc = ctypes.CDLL(None, use_errno=True)
    with tempfile.TemporaryDirectory() as tmp:
        accounting = Path(tmp) / "acct"
        accounting.touch()
        if libc.acct(str(accounting).encode()) != 0:
            print(f"acct: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
        execs = ExecLog()
        execs.start()
        began, cpu_before = time.monotonic(), machine_cpu()
        try:
            # its output to stderr: stdout is this script's JSON alone
            returncode = subprocess.run(
                command, check=False, stdout=sys.stderr
            ).returncode
        finally:
            cpu_after, wall = machine_cpu(), time.monotonic() - began
            libc.acct(None)
            execs.stop()
        ended = records(accounting)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for record in ended:
        seen = [
            argv
            for at, argv in execs.execs.get(record.pid, [])
            if record.start - 1 <= at <= record.end + 1
        ]
        entry = by_kind[kind(seen[-1] if seen else None, record.comm)]
        entry[0] += 1
        entry[1] += record.cpu
    ranked = sorted(by_kind.items(), key=lambda item: -item[1][1])
    print(
        json.dumps(
            {
                "command": command,
                "returncode": returncode,
                "wall_s": round(wall, 1),
                "machine_cpu_s": round(cpu_after - cpu_before, 1),
                "ended_processes": len(ended),
                "ended_processes_cpu_s": round(sum(r.cpu for r in ended), 1),
                "by_kind": [
                    {
                        "kind": name,
                        "processes": int(count),
                        "cpu_s": round(cpu, 1),
                        "ms_each": round(1000 * cpu / count, 1),
                    }
                    for name, (count, cpu) in ranked[: args.top]
                ],
            },
            indent=1,
        )
    )
    return returncode


if __name__ == "__main__":
    sys.exit(main())
