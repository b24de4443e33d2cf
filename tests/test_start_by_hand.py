"""What a gaming VM started by hand asks of GPU Handoff: every case of the
decision (``start_by_hand_asks``), from the first status that shows the
hook's record. The stories around it: tests/test_faithful_world.py,
tests/test_handoff.py::test_started_by_hand_on_the_tower and
tests/test_failed_handoff.py."""

from __future__ import annotations

import pytest

from custom_components.gpu_handoff.core import StartByHand, start_by_hand_asks
from custom_components.gpu_handoff.protocol import DomainState

HAND_OFF, FOLLOW, ENDED = StartByHand.HAND_OFF, StartByHand.FOLLOW, StartByHand.ENDED


def domain(
    state: str | None, reason: str | None = None, *, exists: bool = True
) -> DomainState:
    return DomainState(
        name="vm",
        title="",
        role="gaming",
        exists=exists,
        state=state,
        reason=reason,
        agent_channel=True,
        agent_ready=None,
        hostdevs=(),
    )


ON = domain("running", "booted")
OFF = domain("shut_off", "shutdown")


@pytest.mark.parametrize(
    ("vm", "gpu_node", "hook_job_running", "asks"),
    [
        # The start failed: the GPU node held the cards.
        (domain("shut_off", "failed"), ON, True, HAND_OFF),
        (domain("shut_off", "failed"), OFF, False, HAND_OFF),
        # It ran and ended before Home Assistant looked (scripts/bench -k push).
        (domain("shut_off", "shutdown"), OFF, False, ENDED),
        (domain("shut_off", "destroyed"), OFF, True, ENDED),
        (domain("shut_off", "crashed"), ON, False, ENDED),
        (domain("shut_off", None), OFF, False, ENDED),
        # Gone from the tower, or undefined.
        (None, ON, True, ENDED),
        (domain(None, exists=False), OFF, False, ENDED),
        # It runs with its cards: nothing to hand over, its session followed.
        (ON, OFF, False, FOLLOW),
        (ON, OFF, True, FOLLOW),  # the hook's stop of an off GPU node: a no-op
        (ON, None, True, FOLLOW),
        (domain("paused", "starting up"), OFF, False, FOLLOW),
        (domain("in_shutdown", "unknown"), OFF, False, FOLLOW),
        (ON, ON, False, FOLLOW),  # the GPU node lends: it does not hold them
        # It runs while the hook's stop takes the GPU node down: drain it.
        (ON, ON, True, HAND_OFF),
        (ON, domain("in_shutdown", "unknown"), True, HAND_OFF),
    ],
)
def test_what_a_start_by_hand_asks(
    vm: DomainState | None,
    gpu_node: DomainState | None,
    hook_job_running: bool,
    asks: StartByHand,
) -> None:
    assert start_by_hand_asks(vm, gpu_node, hook_job_running=hook_job_running) is asks
