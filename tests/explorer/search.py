"""Every interleaving of up to ``depth`` events, breadth first, each state
once (the model's states are immutable and hashed whole): the steps that
happen on their own (the controller's, a tower job's, the node's) cost
nothing, so each event is followed by every order of them. The invariants
the chaos soak checks are checked after every step, and at every state
where nothing happens on its own any more; the first violation of each
invariant is kept with the shortest sequence that reaches it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import time

from custom_components.gpu_handoff.protocol import RUNNING

from .model import Ctl, InvariantError, Model, State
from .world import VMS, World


@dataclass
class Found:
    """A violation and the shortest sequence of steps that reaches it."""

    invariant: str
    detail: str
    steps: tuple[str, ...]


@dataclass
class Result:
    depth: int
    states: int = 0
    seconds: float = 0.0
    found: dict[str, Found] = field(default_factory=dict)
    explored: int = 0  # deep.py: states explored, one explored again counting again
    complete: bool = True  # deep.py: False if stopped before the end (and kept)
    progress: tuple[int, int] = (0, 0)  # deep.py: start states explored, of all
    # With a frontier asked for: each state's fewest events, and its link.
    best: dict[int, int] = field(default_factory=dict, repr=False)
    parent: dict[int, tuple[int, str] | None] = field(default_factory=dict, repr=False)

    def as_json(self) -> dict[str, object]:
        return {
            "depth": self.depth,
            "states": self.states,
            "seconds": round(self.seconds, 2),
            **({"explored": self.explored} if self.explored else {}),
            **(
                {}
                if self.complete
                else {"complete": False, "start_states": self.progress}
            ),
            "violations": [
                {"invariant": f.invariant, "detail": f.detail, "steps": list(f.steps)}
                for f in self.found.values()
            ],
        }


def settled(model: Model, state: State) -> None:
    """What must hold once nothing happens on its own any more."""
    world, ctl = state.world, state.ctl
    playing = world.playing()
    if world.gpu != RUNNING and not playing and not world.off_by_operator:
        raise InvariantError("half_state", "the GPU node is off and no gaming VM runs")
    if world.gpu == RUNNING and world.ready and world.our_cordon():
        raise InvariantError(
            "own_cordon_outlives",
            "GPU Handoff's cordon is still on the GPU node, which serves again",
        )
    for vm in VMS:
        if world.running(vm) != (vm in ctl.desired):
            raise InvariantError(
                "switch_disagrees",
                f"{vm} {'runs' if world.running(vm) else 'is off'} but GPU Handoff "
                f"{'wants' if vm in ctl.desired else 'does not want'} it to play",
            )
    if model.lend and playing and not ctl.errors:
        free = world.free()
        lent = world.lent if world.gpu == RUNNING else frozenset()
        if lent != free and not (world.gpu != RUNNING and world.off_by_operator):
            raise InvariantError(
                "cards_not_lent",
                f"the GPU node runs with {sorted(lent)}, the free cards are "
                f"{sorted(free)}, and no failure was reported",
            )


def explore(
    model: Model,
    depth: int,
    start: State | None = None,
    *,
    limit: int = 40_000_000,
    frontier: list[tuple[State, int]] | None = None,
) -> Result:
    """Every state reachable with at most ``depth`` events.

    States are kept by their hash (a 64-bit hash of the whole immutable
    state: two states that differ collide with odds of about n²/2⁶⁵, one in
    a few hundred thousand at ten million states), and those that may take
    no more events are explored depth first as soon as they are reached, so
    memory grows with the states seen, not with the last layer's frontier.
    ``frontier``, if given, receives each state (and its hash) reached with
    ``depth`` events, and the result keeps the links its paths are read from
    (``deep.py`` goes on from there).
    """
    began = time.monotonic()
    result = Result(depth=depth)
    root = start or State(World(), _ctl())
    best: dict[int, int] = {hash(root): 0}
    parent: dict[int, tuple[int, str] | None] = {hash(root): None}
    queue: deque[tuple[State, int, int]] = deque([(root, hash(root), 0)])
    last: list[tuple[State, int, int]] = []  # states with no events left
    while queue or last:
        state, key, used = last.pop() if last else queue.popleft()
        if best.get(key, depth + 1) < used:
            continue
        steps, errors = successors(model, state, used < depth)
        for err in errors:
            _keep(result, err, (*_path(parent, key), _label_of(err)))
        quiet = not errors
        for label, nxt, cost in steps:
            quiet = quiet and cost == 1
            total = used + cost
            nxt_key = hash(nxt)
            if total >= best.get(nxt_key, depth + 1):
                continue
            best[nxt_key] = total
            parent[nxt_key] = (key, label)
            if total == depth:
                last.append((nxt, nxt_key, total))
                if frontier is not None:
                    frontier.append((nxt, nxt_key))
            elif cost == 0:
                queue.appendleft((nxt, nxt_key, total))
            else:
                queue.append((nxt, nxt_key, total))
        if quiet:
            try:
                settled(model, state)
            except InvariantError as err:
                _keep(result, err, _path(parent, key))
        if len(best) > limit:
            raise RuntimeError(f"more than {limit} states at depth {depth}")
    result.states = len(best)
    result.seconds = time.monotonic() - began
    if frontier is not None:
        result.best, result.parent = best, parent
    return result


def _ctl() -> Ctl:
    return Ctl(booting=False)


def successors(
    model: Model, state: State, events: bool
) -> tuple[list[tuple[str, State, int]], list[InvariantError]]:
    """The steps from ``state`` (with its events if ``events``), each with
    its cost in events, and the invariants a step broke (the state is then
    not a settled one)."""
    errors: list[InvariantError] = []
    steps: list[tuple[str, State, int]] = []
    generators = [(model.free_steps, 0)]
    if events:
        generators.append((model.events, 1))
    for generate, cost in generators:
        try:
            for label, nxt in generate(state):
                steps.append((label, nxt, cost))
        except InvariantError as err:
            errors.append(err)
    return steps, errors


def _label_of(err: InvariantError) -> str:
    return f"<{err.invariant}>"


def _keep(result: Result, err: InvariantError, steps: tuple[str, ...]) -> None:
    if err.invariant not in result.found:
        result.found[err.invariant] = Found(err.invariant, err.detail, steps)


def _path(parent: dict[int, tuple[int, str] | None], key: int) -> tuple[str, ...]:
    steps: list[str] = []
    link = parent.get(key)
    while link is not None:
        key, label = link
        steps.append(label)
        link = parent.get(key)
    return tuple(reversed(steps))


def replay(model: Model, steps: list[str] | tuple[str, ...]) -> State:
    """Take ``steps`` (labels as ``explore`` reports them) from the start,
    then every step that may come next: raises the InvariantError one of them,
    or the state they reach, breaks."""
    state = _walk(model, steps)
    if not list(model.free_steps(state)):
        settled(model, state)
    list(model.events(state))
    return state


def run_out(model: Model, steps: list[str] | tuple[str, ...]) -> Result:
    """Take ``steps`` from the start, then every interleaving of the steps
    that happen on their own from there (no more events): a fixed race
    replayed with whatever the product does next in any order."""
    return explore(model, 0, start=_walk(model, steps))


def _walk(model: Model, steps: list[str] | tuple[str, ...]) -> State:
    """The state ``steps`` lead to from the start (each must be possible)."""
    state = State(World(), _ctl())
    for label in steps:
        options = dict(model.free_steps(state)) | dict(model.events(state))
        if label not in options:
            raise KeyError(f"{label!r} cannot happen at this point")
        state = options[label]
    return state


def as_test(found: Found, *, lend: bool) -> str:
    """The violation as a ready-to-run test (for tests/explorer/test_found.py)."""
    name = f"test_{found.invariant}{'_lending' if lend else ''}"
    steps = "".join(
        f"            {step!r},\n" for step in found.steps if not step.startswith("<")
    )
    return (
        f"def {name}() -> None:\n"
        f'    """Found by the explorer: {found.detail}."""\n'
        f"    replay(\n"
        f"        {'LENDING' if lend else 'MODEL'},\n"
        f"        [\n{steps}        ],\n"
        f"    )\n"
    )
