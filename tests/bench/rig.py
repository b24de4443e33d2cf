"""The benchmark's tower, kubelet and loop-lag meter.

The tower is the simulator (real time: ``time_scale`` 1.0, durations set
explicitly) behind a real sshd whose forced command is a tiny wrapper: it
appends the request (``SSH_ORIGINAL_COMMAND``) to a file, then ``exec``s the
real agent, so every agent process the tower starts is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
import datetime as dt
import functools
import json
from pathlib import Path
import shlex
import statistics
import time
from typing import Any
import uuid

from homeassistant.core import HomeAssistant
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_DRAIN_TIMEOUT,
    CONF_KUBECONFIG,
    CONF_SCAN_INTERVAL,
    DOMAIN,
)
from custom_components.gpu_handoff.tower.gpu_handoff.config import POLL_INTERVAL_DEFAULT
from custom_components.gpu_handoff.tower.gpu_handoff.virsh import parse_event
from tests.conftest import gaming_subentries, kubeconfig_text, tower_entry_data
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd
from tests.support.testdriver import agent_command
from tests.towersim import Tower, realistic_domains

# The agent's own default (what a tower runs unless its config says otherwise);
# the tests' 0.02 s would hide what polling costs a handoff.
AGENT_POLL_INTERVAL = POLL_INTERVAL_DEFAULT


def agent_config(sim: Tower, directory: Path, gaming: int) -> Path:
    """The tests' agent configuration, for gaming-1..gaming-N."""
    path = write_agent_config(sim, directory, poll_interval=AGENT_POLL_INTERVAL)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["gaming"] = [f"gaming-{n}" for n in range(1, gaming + 1)]
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def real_time_tower(
    root: Path,
    *,
    gaming: int = 2,
    gpu_node_running: bool = True,
    shutdown: float = 10.0,
    agent_delay: float | None = 30.0,
) -> Tower:
    """The realistic tower at real time (``time_scale`` 1.0)."""
    return Tower.create(
        root,
        realistic_domains(
            gaming=gaming,
            gpu_node_running=gpu_node_running,
            agent_delay=agent_delay,
            shutdown_duration=shutdown,
        ),
        time_scale=1.0,
    )


@dataclass
class Rig:
    """A simulated tower behind sshd, every agent process counted."""

    sim: Tower
    sshd: Sshd
    config: Path
    counter: Path

    def agent_starts(self) -> list[str]:
        """The request of every agent process started so far, in order."""
        if not self.counter.exists():
            return []
        return self.counter.read_text(encoding="utf-8").splitlines()


def build_rig(directory: Path, stack: ExitStack, **tower: Any) -> Rig:
    """Tower, agent config, counting wrapper and sshd; torn down by ``stack``."""
    sim = real_time_tower(directory / "sim", **tower)
    stack.callback(sim.close)
    config = agent_config(sim, directory / "agent", tower.get("gaming", 2))
    counter = directory / "agent-starts"
    wrapper = directory / "forced-command"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# Counts agent processes: one line per start, then the real agent.\n"
        f'printf "%s\\n" "${{SSH_ORIGINAL_COMMAND:-}}" >> {shlex.quote(str(counter))}\n'
        f"exec {shlex.join(agent_command(config))}\n",
        encoding="utf-8",
    )
    wrapper.chmod(0o755)
    sshd = Sshd(directory / "sshd", [str(wrapper)]).start()
    stack.callback(sshd.stop)
    return Rig(sim=sim, sshd=sshd, config=config, counter=counter)


def add_entry(
    hass: HomeAssistant,
    rig: Rig,
    cluster: K8sEmulator,
    *,
    vms: tuple[int, ...] = (1, 2),
    scan_interval: int = 30,
) -> MockConfigEntry:
    """The tower's config entry (as tests.conftest.add_tower_entry, with the
    poll interval chosen)."""
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="tower",
        unique_id=f"127.0.0.1:{rig.sshd.port}",
        data=tower_entry_data(rig.sshd) | {CONF_KUBECONFIG: kubeconfig_text(cluster)},
        options={
            CONF_SCAN_INTERVAL: scan_interval,
            CONF_DRAIN_TIMEOUT: 300,
            CONF_AUTO_RETURN: True,
        },
        subentries_data=gaming_subentries(*vms),
    )
    entry.add_to_hass(hass)
    return entry


def event_epoch(stamp: str) -> float:
    """A virsh event timestamp (``2026-12-01 00:58:51.011+0000``) as epoch seconds."""
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f%z").timestamp()


async def until(what: Callable[[], object], bound: float, poll: float = 0.005) -> None:
    """Poll an in-memory condition (no I/O) until it holds; TimeoutError after ``bound``."""
    async with asyncio.timeout(bound):
        while not what():  # noqa: ASYNC110 - polls state the bench cannot await
            await asyncio.sleep(poll)


class Kubelet:
    """Event-driven stand-in for the GPU node's kubelet.

    It follows ``virsh event --loop`` of the simulator: the node turns Ready
    with a new bootID exactly ``ready_after`` seconds after the event time of
    the GPU node's start (scheduled on the event's own timestamp, so the
    event stream's delivery delay adds no error), and Unknown as soon as its
    stop is read (the node monitor grace period is not what the bench
    measures).
    """

    def __init__(
        self, sim: Tower, cluster: K8sEmulator, ready_after: float = 1.0
    ) -> None:
        self.sim = sim
        self.cluster = cluster
        self.ready_after = ready_after
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            str(self.sim.virsh),
            "-c",
            self.sim.uri,
            "event",
            "--loop",
            "--all",
            "--timestamp",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self._reader = asyncio.create_task(self._read(), name="bench kubelet")
        # The stream listens from when it has read the state once.
        await asyncio.sleep(1.0)

    async def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        loop = asyncio.get_running_loop()
        async for raw in self._proc.stdout:
            event = parse_event(raw.decode(errors="replace"))
            if (
                event is None
                or event["domain"] != "gpu-node"
                or event["event"] != "lifecycle"
            ):
                continue
            if event["action"] == "started":
                delay = event_epoch(event["time"]) + self.ready_after - time.time()
                self._cancel_pending()
                # Each boot's kubelet posts a new bootID (what tells GPU
                # Handoff the node is back from this boot, not the last).
                self._pending = loop.call_later(
                    max(0.0, delay),
                    functools.partial(
                        self.cluster.set_node_up,
                        GPU_NODE,
                        True,
                        boot_id=str(uuid.uuid4()),
                    ),
                )
            elif event["action"] == "stopped":
                self._cancel_pending()
                self.cluster.set_node_up(GPU_NODE, False)

    def _cancel_pending(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    async def close(self) -> None:
        self._cancel_pending()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


class LoopLag:
    """How late a task sleeping 10 ms at a time wakes, while ``active``."""

    PERIOD = 0.01

    def __init__(self) -> None:
        self.active = False
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="bench loop lag")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.PERIOD)
            late = loop.time() - before - self.PERIOD
            if self.active:
                self.samples.append(max(0.0, late))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def p50(values: Sequence[float]) -> float:
    return statistics.median(values)


def p95(values: Sequence[float]) -> float:
    """The 95th percentile (linear interpolation between samples)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
