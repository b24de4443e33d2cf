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
from dataclasses import dataclass
import mmap
import multiprocessing
from multiprocessing.connection import Connection
import sys
import time

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


def deep(model: Model, depth: int, *, jobs: int = 2, bits: int | None = None) -> Result:
    """Every state reachable with at most ``depth`` events (see the module)."""
    began = time.monotonic()
    front = max(depth - 2, 0)
    frontier: list[tuple[State, int]] = []
    result = explore(model, front, frontier=frontier)
    starts = [
        (state, key, _path(result.parent, key))
        for state, key in frontier
        if result.best[key] == front
    ]
    table = Table(bits or table_bits(depth))
    try:
        for key, used in result.best.items():
            table.claim(key, used)
        result.best, result.parent = {}, {}
        shares = _run(model, table, depth, front, starts, jobs)
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


def _run(
    model: Model,
    table: Table,
    depth: int,
    front: int,
    starts: list[tuple[State, int, tuple[str, ...]]],
    jobs: int,
) -> list[_Share]:
    if jobs <= 1:
        return [_work(model, table, depth, front, iter(starts))]
    context = multiprocessing.get_context("fork")
    taken = context.Value("q", 0)
    pipes: list[Connection] = []
    workers = []
    for _ in range(jobs):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(
            target=_worker, args=(model, table, depth, front, starts, taken, send)
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
    return shares


def _progress(taken: object, total: int, pipes: list[Connection]) -> None:
    """Say on stderr, once a minute, how far the workers are."""
    began = time.monotonic()
    while not all(pipe.poll(60) for pipe in pipes):
        done = min(taken.value, total)  # type: ignore[attr-defined]
        print(
            f"explorer: {done}/{total} start states dealt out, "
            f"{time.monotonic() - began:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def _worker(
    model: Model,
    table: Table,
    depth: int,
    front: int,
    starts: list[tuple[State, int, tuple[str, ...]]],
    taken: object,
    send: Connection,
) -> None:
    chunk = max(1, min(_CHUNK, len(starts) // 64))

    def dealt() -> Iterator[tuple[State, int, tuple[str, ...]]]:
        while True:
            with taken.get_lock():  # type: ignore[attr-defined]
                first = taken.value  # type: ignore[attr-defined]
                taken.value = first + chunk  # type: ignore[attr-defined]
            if first >= len(starts):
                return
            yield from starts[first : first + chunk]

    send.send(_work(model, table, depth, front, dealt()))
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
