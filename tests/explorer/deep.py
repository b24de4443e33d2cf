"""The explorer's search made to reach depth 6 on a 2-core machine: the same
states as ``search.explore`` (every state reachable with at most ``depth``
events, each explored with its fewest events, the same invariants after
every step and at every settled state), kept and shared differently.

- **The states seen** are kept as 60 bits of their hash and their fewest
  events (4 bits) in one open-addressing table of 8-byte slots, in memory
  the worker processes share: about 4 GB for 200 million states, where
  ``explore``'s dictionaries take some 190 bytes a state.
- **Breadth first, then depth first.** ``explore`` runs up to ``depth - 2``
  events in this process; the states it reaches with ``depth - 2`` events
  are then dealt out to the workers in chunks, and each explores what
  follows them depth first, keeping only its own stack. A state reached
  later with fewer events than it was first is explored again, as in
  ``explore``, so each is explored with its fewest.
- **Paths.** The steps that lead to a state are carried on the stack, so a
  violation found below the breadth-first part is reported with a sequence
  that reaches it: the shortest found, not always the shortest there is
  (``explore`` at a smaller depth gives that).

Two workers may fill the same empty slot at the same moment. One of the two
states is then missing from the table and is explored again when it is
reached again: work is repeated, none is skipped. The count of states is
the number of filled slots; two states whose 60 bits agree count once and
only the first is explored (odds of any such pair about n²/2⁶¹: about one
in a hundred at 150 million states).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
import hashlib
import json
import mmap
import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path
import sys
import time
from typing import Any, BinaryIO

from .model import InvariantError, Model, State
from .search import (
    Found,
    Result,
    _label_of,
    _path,
    explore,
    settled,
    successors,
)

_MASK = (1 << 64) - 1
_DEPTH_BITS = 0xF
_IO_CHUNK = 1 << 28  # bytes a kept table is written and read by
_CHUNK = 256  # start states a worker takes at a time (fewer if there are few)


class Table:
    """States seen, by hash, with the fewest events each was reached with."""

    def __init__(self, bits: int) -> None:
        self.size = 1 << bits
        self._shift = 64 - bits
        self._memory = mmap.mmap(-1, self.size * 8)  # shared with forked workers
        self._slots = memoryview(self._memory).cast("Q")

    def close(self) -> None:
        self._slots.release()
        self._memory.close()

    def claim(self, key: int, used: int) -> bool:
        """Record that the state ``key`` is reached with ``used`` events:
        False if it was reached with as few already (nothing to do)."""
        key &= _MASK
        tag = key & ~_DEPTH_BITS & _MASK
        slots, mask = self._slots, self.size - 1
        index = key >> self._shift
        while True:
            value = slots[index]
            if value == 0 or value & ~_DEPTH_BITS == tag:
                if value and (value & _DEPTH_BITS) - 1 <= used:
                    return False
                slots[index] = tag | (used + 1)
                return True
            index = (index + 1) & mask

    def fewest(self, key: int) -> int | None:
        """The fewest events ``key`` was recorded with, if it was."""
        key &= _MASK
        tag = key & ~_DEPTH_BITS & _MASK
        slots, mask = self._slots, self.size - 1
        index = key >> self._shift
        while value := slots[index]:
            if value & ~_DEPTH_BITS == tag:
                return (value & _DEPTH_BITS) - 1
            index = (index + 1) & mask
        return None

    def write_to(self, handle: BinaryIO) -> None:
        view = memoryview(self._memory)
        for start in range(0, len(view), _IO_CHUNK):
            handle.write(view[start : start + _IO_CHUNK])
        view.release()

    def read_from(self, handle: BinaryIO) -> None:
        view = memoryview(self._memory)
        for start in range(0, len(view), _IO_CHUNK):
            part = view[start : start + _IO_CHUNK]
            data = handle.read(len(part))
            if len(data) != len(part):
                raise RuntimeError(f"{handle.name} is not a table of {self.size} slots")
            part[:] = data
        view.release()

    def filled(self) -> int:
        step = 1 << 20
        chunks = (
            self._slots[start : start + step].tolist()
            for start in range(0, self.size, step)
        )
        return sum(len(chunk) - chunk.count(0) for chunk in chunks)


def table_bits(depth: int) -> int:
    """Slots enough for the states of ``depth`` (about twelve times more a
    level: 75 thousand at 3, 12 to 19 million at 5) at under half full."""
    return max(16, min(29, 13 + 3 * depth))


@dataclass
class _Share:
    """What a worker reports: states it explored (a state explored again
    with fewer events counts again) and the violations it found."""

    explored: int
    found: dict[str, Found]


def deep(
    model: Model,
    depth: int,
    *,
    jobs: int = 2,
    bits: int | None = None,
    keep: str | None = None,
    stop_after: float | None = None,
    until: int | None = None,
) -> Result:
    """Every state reachable with at most ``depth`` events (see the module).

    With ``stop_after`` (seconds), the workers take no more start states
    after that long; with ``keep`` (a path), a run that stopped so is kept
    there (its table, and how far it came) and a later call with the same
    ``keep`` goes on from there, if the model, the decisions and the search
    are those it began with, and Python hashes as it did (another process
    must run with the same PYTHONHASHSEED). ``until`` stops once that many
    start states are explored (of all, kept ones included). The result says
    whether it is complete."""
    began = time.monotonic()
    front = max(depth - 2, 0)
    frontier: list[tuple[State, int]] = []
    result = explore(model, front, frontier=frontier)
    starts = [
        (state, key, _path(result.parent, key))
        for state, key in frontier
        if result.best[key] == front
    ]
    bits = bits or table_bits(depth)
    table = Table(bits)
    try:
        kept = _Kept(keep, fingerprint(model, depth, bits)) if keep else None
        done, shares = kept.load(table) if kept else (0, [])
        for key, used in result.best.items():
            table.claim(key, used)
        result.best, result.parent = {}, {}
        deadline = None if stop_after is None else time.monotonic() + stop_after
        end = len(starts) if until is None else min(until, len(starts))
        todo = starts[done:end]
        taken, more = _run(model, table, depth, front, todo, jobs, deadline)
        done, shares = done + taken, shares + more
        result.complete = done >= len(starts)
        result.progress = (done, len(starts))
        if kept:
            kept.save(table, done, shares, result.complete)
        result.states = table.filled()
    finally:
        table.close()
    for share in shares:
        for found in share.found.values():
            _keep_shortest(result.found, found)
    result.depth = depth
    result.explored = sum(share.explored for share in shares)
    result.seconds = time.monotonic() - began
    return result


# What a kept run's table is only good for: these sources, unchanged.
_SOURCES = (
    "custom_components/gpu_handoff/core.py",
    "custom_components/gpu_handoff/cluster_model.py",
    "custom_components/gpu_handoff/protocol.py",
    "tests/explorer/model.py",
    "tests/explorer/world.py",
    "tests/explorer/search.py",
    "tests/explorer/deep.py",
)


# How this process hashes strings (PYTHONHASHSEED): a kept table holds
# states' hashes, good only in a process that hashes them alike.
_HASHES = hash("gpu-handoff explorer")


def fingerprint(model: Model, depth: int, bits: int) -> str:
    """The run a kept table belongs to: the model's options, the depth, the
    table's size, and the sources of the decisions, the model and the
    search."""
    top = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(f"{model.settings!r} {depth} {bits}".encode())
    for name in _SOURCES:
        digest.update((top / name).read_bytes())
    return digest.hexdigest()


class _Kept:
    """A run kept to go on later: its table (PATH.table) and how far it
    came (PATH.json)."""

    def __init__(self, path: str, fingerprint: str) -> None:
        self.table, self.record = Path(f"{path}.table"), Path(f"{path}.json")
        self.fingerprint = fingerprint

    def load(self, table: Table) -> tuple[int, list[_Share]]:
        if not self.record.exists():
            return 0, []
        saved = json.loads(self.record.read_text(encoding="utf-8"))
        if saved["hashes"] != _HASHES:
            raise RuntimeError(
                f"{self.record} was kept by a Python that hashes otherwise: run with "
                "PYTHONHASHSEED=0 (scripts/explore --keep does)"
            )
        if saved["fingerprint"] != self.fingerprint:
            raise RuntimeError(
                f"{self.record} was kept by another run (other sources, depth or "
                "options): remove it to begin again"
            )
        if saved["complete"]:
            raise RuntimeError(
                f"{self.record} is a complete run: remove it to run again"
            )
        with self.table.open("rb") as handle:
            table.read_from(handle)
        found = {
            f["invariant"]: Found(f["invariant"], f["detail"], tuple(f["steps"]))
            for f in saved["found"]
        }
        return saved["done"], [_Share(explored=saved["explored"], found=found)]

    def save(
        self, table: Table, done: int, shares: list[_Share], complete: bool
    ) -> None:
        # The table first, each file whole or not at all: a table newer than
        # its record only has start states explored again.
        if not complete:
            part = self.table.with_name(self.table.name + ".new")
            with part.open("wb") as handle:
                table.write_to(handle)
            part.replace(self.table)
        else:
            self.table.unlink(missing_ok=True)
        found = [asdict(f) for share in shares for f in share.found.values()]
        record = {
            "fingerprint": self.fingerprint,
            "hashes": _HASHES,
            "done": done,
            "complete": complete,
            "explored": sum(share.explored for share in shares),
            "found": found,
        }
        part = self.record.with_name(self.record.name + ".new")
        part.write_text(json.dumps(record, indent=1), encoding="utf-8")
        part.replace(self.record)


def _run(
    model: Model,
    table: Table,
    depth: int,
    front: int,
    starts: list[tuple[State, int, tuple[str, ...]]],
    jobs: int,
    deadline: float | None,
) -> tuple[int, list[_Share]]:
    """The start states' explorations, by ``jobs`` processes: how many of the
    start states were explored (all, unless the deadline came first), and
    what each process found."""
    context = multiprocessing.get_context("fork")
    taken = context.Value("q", 0)
    if jobs <= 1:
        shares = [_work(model, table, depth, front, _dealt(starts, taken, deadline))]
        return min(taken.value, len(starts)), shares
    pipes: list[Connection] = []
    workers = []
    for _ in range(jobs):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(
            target=_worker,
            args=(model, table, depth, front, starts, taken, deadline, send),
        )
        worker.start()
        send.close()
        pipes.append(receive)
        workers.append(worker)
    _progress(taken, len(starts), pipes)
    shares = [pipe.recv() for pipe in pipes]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"an explorer worker exited with {worker.exitcode}")
    return min(taken.value, len(starts)), shares


def _progress(taken: Any, total: int, pipes: list[Connection]) -> None:
    """Say on stderr, once a minute, how far the workers are."""
    began = time.monotonic()
    while not all(pipe.poll(60) for pipe in pipes):
        print(
            f"explorer: {min(taken.value, total)}/{total} start states dealt out, "
            f"{time.monotonic() - began:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def _dealt(
    starts: list[tuple[State, int, tuple[str, ...]]], taken: Any, deadline: float | None
) -> Iterator[tuple[State, int, tuple[str, ...]]]:
    """Start states, a chunk at a time, for as long as there are any and the
    deadline has not come (``taken`` counts those dealt, all processes')."""
    chunk = max(1, min(_CHUNK, len(starts) // 64))
    while deadline is None or time.monotonic() < deadline:
        with taken.get_lock():
            first = taken.value
            if first >= len(starts):
                return
            taken.value = first + chunk
        yield from starts[first : first + chunk]


def _worker(
    model: Model,
    table: Table,
    depth: int,
    front: int,
    starts: list[tuple[State, int, tuple[str, ...]]],
    taken: Any,
    deadline: float | None,
    send: Connection,
) -> None:
    send.send(_work(model, table, depth, front, _dealt(starts, taken, deadline)))
    send.close()


def _work(
    model: Model,
    table: Table,
    depth: int,
    front: int,
    starts: Iterator[tuple[State, int, tuple[str, ...]]],
) -> _Share:
    share = _Share(explored=0, found={})
    for state, key, prefix in starts:
        _dive(model, table, depth, share, (state, key, front, prefix, None))
    return share


type _Link = tuple[str, _Link | None] | None


def _dive(
    model: Model,
    table: Table,
    depth: int,
    share: _Share,
    start: tuple[State, int, int, tuple[str, ...], _Link],
) -> None:
    """Everything that follows ``start`` within ``depth`` events, depth first."""
    prefix = start[3]
    stack = [(start[0], start[1], start[2], start[4])]
    while stack:
        state, key, used, link = stack.pop()
        seen = table.fewest(key)
        if seen is not None and seen < used:
            continue  # reached with fewer events since, and explored so
        share.explored += 1
        steps, errors = successors(model, state, used < depth)
        for err in errors:
            _keep_error(share, err, prefix, link, (_label_of(err),))
        quiet = not errors
        for label, nxt, cost in steps:
            quiet = quiet and cost == 1
            nxt_key = hash(nxt)
            if table.claim(nxt_key, used + cost):
                stack.append((nxt, nxt_key, used + cost, (label, link)))
        if quiet:
            try:
                settled(model, state)
            except InvariantError as err:
                _keep_error(share, err, prefix, link, ())


def _keep_error(
    share: _Share,
    err: InvariantError,
    prefix: tuple[str, ...],
    link: _Link,
    tail: tuple[str, ...],
) -> None:
    labels: list[str] = []
    while link is not None:
        label, link = link
        labels.append(label)
    steps = (*prefix, *reversed(labels), *tail)
    _keep_shortest(share.found, Found(err.invariant, err.detail, steps))


def _keep_shortest(found: dict[str, Found], new: Found) -> None:
    old = found.get(new.invariant)
    if old is None or len(new.steps) < len(old.steps):
        found[new.invariant] = new
