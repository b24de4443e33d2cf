"""Where a command's CPU goes, by the processes it starts: run as root.

    python3 scripts/cpu_by_process.py [--top N] -- COMMAND...

e.g. ``python3 scripts/cpu_by_process.py -- scripts/env pytest tests/chaos -n 4``.

The kernel's per-task statistics (taskstats, a generic netlink family)
send a record as each thread ends: its CPU time in nanoseconds
(``sum_exec_runtime``), its process, start and lifetime, and its name. The
proc connector (a netlink socket) tells of every exec as it happens; its
command line is read from /proc then. Joined by PID and time, the two say
what each process was: the agent and its verb, the simulated ``virsh``,
QEMU, pytest's workers. Prints JSON: the machine's CPU over the run
(/proc/stat, every process and the kernel's own work), the CPU of the
processes that ended, and the largest kinds of them; the command's own
output goes to stderr.

The record is taken as the thread begins to exit: what the kernel does for
it afterwards (unmapping its memory, closing its files: 2.5 of a bare
Python start's 8 ms) counts in the machine's CPU but not in its kind.
(The BSD process accounting of acct(2) is no use here: it keeps user and
system time in whole hundredths of a second, truncated, so a process of
8 ms is recorded as 0.)

Both are Linux features that need root (CAP_NET_ADMIN). Both see the whole
machine: every process that ends while the command runs is counted, the
command's or not (run nothing else meanwhile), and one still running when
it ends is not. Standard library only: it runs on the machine's own
Python, outside the test root.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
import json
import os
from pathlib import Path
import socket
import struct
import subprocess
import sys
import threading
import time

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_EXEC = 0x2
SO_RCVBUFFORCE = 33
NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TASKSTATS_CMD_GET = 1
TASKSTATS_CMD_ATTR_REGISTER_CPUMASK = 3
TASKSTATS_TYPE_AGGR_PID = 4
TASKSTATS_TYPE_STATS = 3
# struct taskstats (linux/taskstats.h): fields are only ever appended.
TS_VERSION_WITH_TGID = 11
TS_RUN_VIRTUAL_TOTAL = 72  # u64 ns: the task's sum_exec_runtime
TS_COMM = 80  # char[32]
TS_PID = 128  # u32: the thread's
TS_BTIME = 136  # u32 s since the epoch
TS_ETIME = 144  # u64 us
TS_TGID = 368  # u32
PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-m", "-c")


def machine_cpu() -> float:
    """Seconds of CPU the machine has used (every state but idle and iowait)."""
    with Path("/proc/stat").open(encoding="ascii") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def big_buffer(sock: socket.socket) -> None:
    """A receive buffer that holds a burst of records: the kernel drops what
    does not fit, silently. SO_RCVBUFFORCE (root) passes net.core.rmem_max."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)


def drops(sock: socket.socket) -> int:
    """What the kernel could not queue on a netlink socket (/proc/net/netlink)."""
    inode = os.fstat(sock.fileno()).st_ino
    with Path("/proc/net/netlink").open(encoding="ascii") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if int(fields[-1]) == inode:
                return int(fields[-2])
    return 0


def nl_attr(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * (-length % 4)


def length_type_values(data: bytes, fmt: str, header: int) -> list[tuple[int, bytes]]:
    """(type, payload) of each item: netlink messages (a 16-byte header,
    length and type first) or their attributes (a 4-byte one)."""
    found, offset = [], 0
    while offset + header <= len(data):
        length, kind = struct.unpack_from(fmt, data, offset)
        if length < header:
            break
        found.append((kind, data[offset + header : offset + length]))
        offset += (length + 3) & ~3
    return found


def nl_attrs(data: bytes) -> list[tuple[int, bytes]]:
    return [
        (kind & 0x3FFF, value) for kind, value in length_type_values(data, "=HH", 4)
    ]


def nl_messages(data: bytes) -> list[tuple[int, bytes]]:
    return length_type_values(data, "=IH", 16)


@dataclass
class Ended:
    """One ended thread's record."""

    pid: int
    tgid: int
    start: float  # seconds since the epoch (whole seconds)
    end: float
    cpu: float
    comm: str


class TaskStats(threading.Thread):
    """A record of every thread that ends on the machine, while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ended: list[Ended] = []
        self.dropped = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        big_buffer(self.sock)
        self.sock.bind((0, 0))
        self.family = self._family()
        cpus = f"0-{(os.cpu_count() or 1) - 1}".encode() + b"\0"
        self._request(
            self.family,
            TASKSTATS_CMD_GET,
            nl_attr(TASKSTATS_CMD_ATTR_REGISTER_CPUMASK, cpus),
        )
        self.sock.settimeout(0.2)
        self.stopping = False

    def _request(self, family: int, command: int, payload: bytes) -> None:
        body = struct.pack("=BBH", command, 1, 0) + payload
        header = struct.pack("=IHHII", 16 + len(body), family, NLM_F_REQUEST, 0, 0)
        self.sock.send(header + body)

    def _family(self) -> int:
        self._request(
            GENL_ID_CTRL,
            CTRL_CMD_GETFAMILY,
            nl_attr(CTRL_ATTR_FAMILY_NAME, b"TASKSTATS\0"),
        )
        for kind, payload in nl_messages(self.sock.recv(1 << 16)):
            if kind == NLMSG_ERROR:
                break
            for attr, value in nl_attrs(payload[4:]):
                if attr == CTRL_ATTR_FAMILY_ID:
                    return int(struct.unpack_from("=H", value)[0])
        raise OSError("the kernel has no taskstats (CONFIG_TASKSTATS)")

    def run(self) -> None:
        while not self.stopping:
            try:
                data = self.sock.recv(1 << 20)
            except OSError:  # a timeout, or ENOBUFS: counted in drops()
                continue
            for kind, payload in nl_messages(data):
                if kind != self.family:
                    continue
                for attr, value in nl_attrs(payload[4:]):
                    if attr != TASKSTATS_TYPE_AGGR_PID:
                        continue
                    for inner, stats in nl_attrs(value):
                        if inner == TASKSTATS_TYPE_STATS:
                            self._add(stats)

    def _add(self, stats: bytes) -> None:
        (version,) = struct.unpack_from("=H", stats, 0)
        if version < TS_VERSION_WITH_TGID or len(stats) < TS_TGID + 4:
            return
        (cpu_ns,) = struct.unpack_from("=Q", stats, TS_RUN_VIRTUAL_TOTAL)
        (begin,) = struct.unpack_from("=I", stats, TS_BTIME)
        (elapsed_us,) = struct.unpack_from("=Q", stats, TS_ETIME)
        (pid,) = struct.unpack_from("=I", stats, TS_PID)
        (tgid,) = struct.unpack_from("=I", stats, TS_TGID)
        comm = stats[TS_COMM : TS_COMM + 32].split(b"\0")[0].decode("latin-1")
        self.ended.append(
            Ended(pid, tgid, float(begin), begin + elapsed_us / 1e6, cpu_ns / 1e9, comm)
        )

    def stop(self) -> None:
        time.sleep(0.5)  # the last records on their way
        self.stopping = True
        self.join()
        self.dropped = drops(self.sock)
        self.sock.close()


class ExecLog(threading.Thread):
    """Every exec on the machine, with its command line, while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.execs: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)
        self.sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR
        )
        big_buffer(self.sock)
        self.sock.bind((0, CN_IDX_PROC))
        op = struct.pack("=I", PROC_CN_MCAST_LISTEN)
        cn_msg = struct.pack("=IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
        # nlmsghdr: length, type NLMSG_DONE, flags, sequence, port
        self.sock.send(struct.pack("=IHHII", 16 + len(cn_msg), 3, 0, 0, 0) + cn_msg)
        self.sock.settimeout(0.2)
        self.stopping = False
        self.dropped = 0

    def run(self) -> None:
        while not self.stopping:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:  # a timeout too
                continue
            for _kind, payload in nl_messages(data):
                event = payload[20:]  # after cn_msg
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
        self.dropped = drops(self.sock)
        self.sock.close()


def kind(argv: list[str] | None, comm: str) -> str:
    """What a process was, in a few words."""
    if not argv:
        return f"{comm} (no exec seen)"
    program = argv[0].rsplit("/", 1)[-1]
    if program == "virsh" and argv[0].endswith("/bin/virsh") and "/usr/" not in argv[0]:
        return "simulated virsh's client"  # a tower simulator's bin/virsh
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="kinds to list")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    try:
        tasks = TaskStats()
        execs = ExecLog()
    except OSError as err:
        print(f"cannot listen to the kernel: {err}", file=sys.stderr)
        return 1
    tasks.start()
    execs.start()
    began, cpu_before = time.monotonic(), machine_cpu()
    try:
        # its output to stderr: stdout is this script's JSON alone
        returncode = subprocess.run(command, check=False, stdout=sys.stderr).returncode
    finally:
        cpu_after, wall = machine_cpu(), time.monotonic() - began
        tasks.stop()
        execs.stop()
    # A process is its threads' records: the leader's says when it ran and
    # its name, and its CPU is theirs summed.
    threads: dict[int, list[Ended]] = defaultdict(list)
    for record in tasks.ended:
        threads[record.tgid].append(record)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for tgid, records in threads.items():
        leader = next((r for r in records if r.pid == tgid), records[0])
        seen = [
            argv
            for at, argv in execs.execs.get(tgid, [])
            if leader.start - 1 <= at <= leader.end + 1
        ]
        entry = by_kind[kind(seen[-1] if seen else None, leader.comm)]
        entry[0] += 1
        entry[1] += sum(r.cpu for r in records)
    ranked = sorted(by_kind.items(), key=lambda item: -item[1][1])
    print(
        json.dumps(
            {
                "command": command,
                "returncode": returncode,
                "wall_s": round(wall, 1),
                "machine_cpu_s": round(cpu_after - cpu_before, 1),
                "ended_processes": len(threads),
                "ended_processes_cpu_s": round(sum(r.cpu for r in tasks.ended), 1),
                # records the kernel could not queue (then the figures
                # above miss them)
                "records_dropped": tasks.dropped,
                "execs_dropped": execs.dropped,
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
