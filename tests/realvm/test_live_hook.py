"""The tower agent as libvirtd's live qemu hook, with real QEMU guests.

On a tower libvirtd runs the qemu hook on every start and stop of any domain,
whoever asks: `prepare begin`, `start begin`, `started begin` for a start,
`stopped end`, `release end` for a stop (libvirt's src/qemu/qemu_process.c:
qemuProcessInit runs `prepare`, qemuProcessLaunch `start`,
qemuProcessFinishStartup `started`, qemuProcessStop `stopped` and `release`,
after a start that failed too), the agent's own `virsh start` inside a job
included. Here the private libvirtd runs the agent's `hook` verb the same way
(qemu_libvirtd.py installs it), and one story is told with real guests and
real guest agents, one guest of each kind, in about 25 s:

1. a handoff: the agent's `handoff` job stops the GPU node through its guest
   agent and starts the gaming guest; libvirtd runs the hook for both, and
   the job's own start is no request;
2. a return: the agent's `release` job stops the gaming guest and starts the
   GPU node; no request either;
3. a start by hand: `virsh start` of the gaming guest while the GPU node runs
   with its card: the hook records a request and fires the stop of the GPU
   node, and libvirt then refuses the start (the card is busy), as a tower
   does.

Cards: real guests cannot carry PCI hostdevs here (no VFIO), so each card is
named in the domains' metadata and shown to the agent as PCI hostdevs in the
XML virsh prints to it and in the XML libvirtd writes to the hook (cards.py).
So that a card can still belong to one running domain at a time, for real,
each card is also a raw disk image that every domain claiming the card
attaches: QEMU locks an image it writes to, so a second domain with the card
fails to start after the hook ran, like a start refused for a PCI device that
another domain holds (a test asserts it). Not real: that failure's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.realvm.cards import metadata
from tests.realvm.qemu_libvirtd import define_guest
from tests.realvm.towers import iso_epoch, make_tower, wait_job
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import HookCall, QemuLibvirtd
    from tests.realvm.towers import Tower

pytestmark = pytest.mark.system

NODE = "hook-node"
GAME = "hook-game"
# Two cards of two functions each (GPU and HDMI audio): the GPU node claims
# both, the gaming guest one.
GAME_CARD = ("0000:0a:00.0", "0000:0a:00.1")
NODE_CARD = ("0000:0b:00.0", "0000:0b:00.1")
SETTLE_TIMEOUT = 60.0
START = ["prepare begin", "start begin", "started begin"]
STOP = ["stopped end", "release end"]


def card_disk(image: Path, dev: str) -> str:
    return (
        "    <disk type='file' device='disk'>\n"
        "      <driver name='qemu' type='raw'/>\n"
        f"      <source file='{image}'/>\n"
        f"      <target dev='{dev}' bus='virtio'/>\n"
        "    </disk>\n"
    )


@dataclass
class Rig:
    daemon: QemuLibvirtd
    tower: Tower


@dataclass
class Phase:
    """What one step of the story left: the job (if any), the hook's calls
    and the requests it recorded meanwhile, and the status afterwards."""

    job: dict[str, Any] | None
    calls: list[HookCall]
    requests: list[dict[str, Any]]
    hook_jobs: list[dict[str, Any]]
    status: dict[str, Any]
    seconds: float
    extra: dict[str, Any]


def status(tower: Tower) -> dict[str, Any]:
    reply = tower.agent("status")
    assert reply["ok"], reply
    return reply


def state(daemon: QemuLibvirtd, name: str) -> str:
    return daemon.virsh("domstate", "--reason", name).stdout.strip()


def held_by(reply: dict[str, Any], address: str) -> str | None:
    card = next(c for c in reply["cards"] if c["address"] == address)
    held: str | None = card["held_by"]
    return held


def settle(tower: Tower) -> dict[str, Any]:
    """The status once no job is queued or running (a job the hook fired
    runs after the one that holds the tower)."""

    def idle() -> dict[str, Any] | None:
        reply = status(tower)
        return None if reply["active_jobs"] else reply

    return wait_until(
        idle, timeout=SETTLE_TIMEOUT, interval=0.5, what="the tower's jobs to end"
    )


def hook_jobs(tower: Tower, before: set[str]) -> list[dict[str, Any]]:
    reply = tower.agent("jobs")
    assert reply["ok"], reply
    return [
        job
        for job in reply["jobs"]
        if job["requested_by"] == "hook" and job["id"] not in before
    ]


def job_ids(tower: Tower) -> set[str]:
    return {job["id"] for job in tower.agent("jobs")["jobs"]}


def run_job(
    rig: Rig, verb: str, last: tuple[str, str], timings: dict[str, float]
) -> Phase:
    """Submit one job and wait until it and whatever the hook fired are over,
    and until the hook ran for `last` (domain, event)."""
    d, tower = rig.daemon, rig.tower
    since = len(d.hook_calls())
    requests_before = len(status(tower)["hook_requests"])
    jobs_before = job_ids(tower)
    started = time.monotonic()
    submitted = tower.agent(verb, GAME)
    assert submitted["ok"], submitted
    job = wait_job(tower, submitted["job"]["id"])
    seconds = time.monotonic() - started
    timings[f"live hook: {verb} job"] = iso_epoch(job["finished"]) - iso_epoch(
        job["created"]
    )
    if job["state"] == "succeeded":
        d.wait_hook(*last, since=since)
    after = settle(tower)
    return Phase(
        job=job,
        calls=d.hook_calls()[since:],
        requests=after["hook_requests"][requests_before:],
        hook_jobs=hook_jobs(tower, jobs_before),
        status=after,
        seconds=seconds,
        extra={},
    )


@pytest.fixture(scope="module")
def rig(
    qemu_libvirtd: QemuLibvirtd, guest: Guest, realvm_timings: dict[str, float]
) -> Iterator[Rig]:
    d = qemu_libvirtd
    images = {
        card: d.data_dir / f"hook-card-{card[5:7]}.img"
        for card in (GAME_CARD[0], NODE_CARD[0])
    }
    for image in images.values():
        with image.open("wb") as handle:
            handle.truncate(1024 * 1024)
    define_guest(
        d,
        guest,
        NODE,
        metadata=metadata([*GAME_CARD, *NODE_CARD]),
        devices=card_disk(images[GAME_CARD[0]], "vdb")
        + card_disk(images[NODE_CARD[0]], "vdc"),
    )
    define_guest(
        d,
        guest,
        GAME,
        metadata=metadata(GAME_CARD),
        devices=card_disk(images[GAME_CARD[0]], "vdb"),
    )
    tower = make_tower(
        d,
        "hook",
        NODE,
        {"agent": 120.0, "shutdown": 60.0, "start": 60.0},
        gaming=[GAME],
        poll_interval=0.25,
    )
    d.set_hook_config(tower.config)
    try:
        started = time.monotonic()
        # The GPU node runs with every card, as when nobody plays.
        begun = d.virsh("start", NODE)
        assert begun.returncode == 0, begun.stderr
        first = status(tower)
        realvm_timings["live hook: GPU node start and status"] = (
            time.monotonic() - started
        )
        # The agent sees the cards (the stand-ins) and who holds them.
        assert held_by(first, GAME_CARD[0]) == NODE, first["cards"]
        assert held_by(first, NODE_CARD[1]) == NODE, first["cards"]
        yield Rig(daemon=d, tower=tower)
    finally:
        d.set_hook_config(None)
        for name in (GAME, NODE):
            d.stop_guest(name)
            d.virsh("undefine", name)


@pytest.fixture(scope="module")
def handoff(rig: Rig, realvm_timings: dict[str, float]) -> Phase:
    return run_job(rig, "handoff", (GAME, "started begin"), realvm_timings)


@pytest.fixture(scope="module")
def release(rig: Rig, handoff: Phase, realvm_timings: dict[str, float]) -> Phase:
    return run_job(rig, "release", (NODE, "started begin"), realvm_timings)


@pytest.fixture(scope="module")
def by_hand(rig: Rig, release: Phase, realvm_timings: dict[str, float]) -> Phase:
    d, tower = rig.daemon, rig.tower
    assert release.job is not None
    assert release.job["state"] == "succeeded", release.job
    before = status(tower)  # as Home Assistant asks, now and then
    assert held_by(before, GAME_CARD[0]) == NODE, before["cards"]
    since = len(d.hook_calls())
    jobs_before = job_ids(tower)
    started = time.monotonic()
    result = d.virsh("start", GAME)
    calls = d.wait_hook(GAME, "release end", since=since)
    fired = wait_until(
        lambda: hook_jobs(tower, jobs_before),
        timeout=SETTLE_TIMEOUT,
        interval=0.5,
        what="the job the hook fired",
    )
    job = wait_job(tower, fired[0]["id"])
    seconds = time.monotonic() - started
    realvm_timings["live hook: start by hand, then the hook's stop job"] = seconds
    after = settle(tower)
    return Phase(
        job=job,
        calls=calls,
        requests=after["hook_requests"][len(before["hook_requests"]) :],
        hook_jobs=hook_jobs(tower, jobs_before),
        status=after,
        seconds=seconds,
        extra={
            "start": (result.returncode, result.stderr),
            "states": {name: state(d, name) for name in (NODE, GAME)},
        },
    )


def events(calls: list[HookCall], *domains: str) -> list[tuple[str, str]]:
    return [(c.domain, c.event) for c in calls if c.domain in domains]


def test_handoff_runs_the_hook_for_the_stop_and_the_start(handoff: Phase) -> None:
    job = handoff.job
    assert job is not None
    assert job["state"] == "succeeded", job
    assert [s["result"] for s in job["steps"]] == ["ok"] * 5, job["steps"]
    # libvirtd ran the hook for the GPU node's stop, then for the start the
    # job itself made (the card was free by then).
    assert events(handoff.calls, NODE, GAME) == [
        *((NODE, e) for e in STOP),
        *((GAME, e) for e in START),
    ]
    assert [c.rc for c in handoff.calls] == [0] * len(handoff.calls)
    domains = {dom["name"]: dom for dom in handoff.status["domains"]}
    assert (domains[NODE]["state"], domains[NODE]["reason"]) == ("shut_off", "shutdown")
    assert domains[GAME]["state"] == "running"
    assert held_by(handoff.status, GAME_CARD[0]) == GAME


def test_the_handoffs_own_start_is_no_hook_request(
    handoff: Phase, qemu_libvirtd: QemuLibvirtd
) -> None:
    assert handoff.requests == []
    assert handoff.hook_jobs == []
    assert qemu_libvirtd.hook_errors() == ""


def test_release_runs_the_hook_for_the_stop_and_the_start(release: Phase) -> None:
    job = release.job
    assert job is not None
    assert job["state"] == "succeeded", job
    assert [s["result"] for s in job["steps"]] == ["ok"] * 5, job["steps"]
    assert events(release.calls, NODE, GAME) == [
        *((GAME, e) for e in STOP),
        *((NODE, e) for e in START),
    ]
    assert [c.rc for c in release.calls] == [0] * len(release.calls)
    domains = {dom["name"]: dom for dom in release.status["domains"]}
    assert (domains[GAME]["state"], domains[GAME]["reason"]) == ("shut_off", "shutdown")
    assert domains[NODE]["state"] == "running"
    assert held_by(release.status, GAME_CARD[0]) == NODE


def test_the_releases_own_start_is_no_hook_request(release: Phase) -> None:
    assert release.requests == []
    assert release.hook_jobs == []


def test_a_start_by_hand_is_a_hook_request_that_stops_the_gpu_node(
    by_hand: Phase, qemu_libvirtd: QemuLibvirtd
) -> None:
    # libvirt ran the hook, then refused the start: the card was busy (its
    # image locked by the GPU node's QEMU); the failed start's cleanup ran the
    # stop hooks. A start can fail after the hook ran.
    rc, stderr = by_hand.extra["start"]
    assert rc == 1, stderr
    assert 'Failed to get "write" lock' in stderr, stderr
    assert events(by_hand.calls, NODE, GAME) == [
        (GAME, "prepare begin"),
        (GAME, "start begin"),
        *((GAME, e) for e in STOP),
    ]
    assert [c.rc for c in by_hand.calls] == [0] * len(by_hand.calls)
    # One request, for the gaming guest's card, and the stop it fired.
    assert len(by_hand.requests) == 1, by_hand.requests
    request = by_hand.requests[0]
    assert request["domain"] == GAME
    assert request["operation"] == "prepare begin"
    assert request["addresses"] == list(GAME_CARD)
    assert [job["id"] for job in by_hand.hook_jobs] == [request["job"]]
    job = by_hand.job
    assert job is not None
    assert job["id"] == request["job"]
    assert (job["kind"], job["args"], job["state"]) == (
        "stop",
        {"domain": NODE},
        "succeeded",
    ), job
    assert by_hand.extra["states"] == {
        NODE: "shut off (shutdown)",
        GAME: "shut off (failed)",
    }
    assert qemu_libvirtd.hook_errors() == ""
