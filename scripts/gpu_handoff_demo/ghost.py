"""The simulator's ghost GPU node, behind a dashboard switch.

A ghost node answers pings, reports Ready and renews its Lease on time, and
cannot start a single container (a module load hung at boot: every pod
sandbox times out). GPU Handoff's Health sensor judges the GPU node by what it
does, so the demo plays one in the cluster emulator: every pod on the node
goes back to waiting for its sandbox (``PodReadyToStartContainers`` False,
its container ``ContainerCreating``) with a ``FailedCreatePodSandBox`` event
as the kubelet records it, and the GPU node's screen shows the kernel's
hung-task report.

Waiting only counts past the integration's bound (five minutes) after the
node turned Ready, so the demo plays a node that has been a ghost for longer
than that already: the pods' wait and the node's Ready transition are dated
``BACKDATE`` seconds back, and the Health problem shows at the integration's
next refresh, which the demo asks for at once (``homeassistant.update_entity``,
as a dashboard's refresh does). Pods put on the node while the switch is on
(the kubelet stand-in brings evicted workloads back) wait for their sandbox
too, from then on. Turning the switch off heals the node: every waiting pod
gets its sandbox and starts its containers.

The switch is a toggle helper (``input_boolean``) the demo creates through
Home Assistant's websocket API; ``GhostSwitch`` polls its state through the
REST API, as the rest of the demo follows states, and acts on the emulator.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import aiohttp

from custom_components.gpu_handoff.health import STUCK_BOUND
from tests.k8semu import K8sEmulator
from tests.k8semu.objects import SANDBOX_CONDITION, rfc3339_ago
from tests.k8semu.store import now_rfc3339

from .client import HomeAssistantClient
from .output import DemoError, log
from .towers import DemoTower

# How long the node has been a ghost when the switch turns on: past the
# integration's bound, by a minute.
BACKDATE: Final = STUCK_BOUND + 60
POLL: Final = 0.5  # seconds between looks at the switch
SANDBOX_TIMEOUT: Final = (
    "Failed to create pod sandbox: rpc error: code = DeadlineExceeded desc = "
    "context deadline exceeded"
)
SANDBOX_CONDITIONS: Final = (SANDBOX_CONDITION, "PodHasNetwork")
FINISHED: Final = ("Succeeded", "Failed")


def switch_name(tower: DemoTower) -> str:
    """The switch's name on the dashboard."""
    return f"Play a ghost {tower.titles[tower.gpu_node]}"


def help_text() -> str:
    """What the switch does, under it on the dashboard."""
    return (
        "On: the simulated GPU node stays Ready, its lease renewing, while "
        "every pod on it waits for its sandbox (FailedCreatePodSandBox), as "
        f"if for {BACKDATE / 60:g} minutes already, so Health shows the problem "
        "at the next refresh (the demo asks for one at once). Off: the pods "
        "start their containers."
    )


def pods_on(emu: K8sEmulator, node: str) -> list[dict[str, Any]]:
    """The pods on ``node`` that still run or wait to (not finished, not
    being deleted)."""
    return [
        pod
        for pod in emu.list_objects("Pod")
        if (pod.get("spec") or {}).get("nodeName") == node
        and not pod["metadata"].get("deletionTimestamp")
        and (pod.get("status") or {}).get("phase") not in FINISHED
    ]


def waiting(pod: dict[str, Any]) -> bool:
    """Whether the pod waits for its sandbox."""
    return any(
        condition["type"] in SANDBOX_CONDITIONS and condition["status"] != "True"
        for condition in (pod.get("status") or {}).get("conditions") or []
    )


def _make_wait(emu: K8sEmulator, pod: dict[str, Any], since: str) -> None:
    """The pod's sandbox went away at ``since`` and has not come back: the
    status its kubelet would post, and the kubelet's event for it."""

    def mutate(obj: dict[str, Any]) -> None:
        status = obj.setdefault("status", {})
        status["phase"] = "Pending"
        status.pop("podIP", None)
        status.pop("podIPs", None)
        conditions = status.setdefault("conditions", [])
        if not any(c["type"] in SANDBOX_CONDITIONS for c in conditions):
            conditions.insert(0, {"type": SANDBOX_CONDITION, "lastProbeTime": None})
        for condition in conditions:
            if condition["type"] in SANDBOX_CONDITIONS:
                condition.update(status="False", lastTransitionTime=since)
                condition.pop("reason", None)
            elif condition["type"] in ("Ready", "ContainersReady"):
                condition.update(
                    status="False",
                    reason="ContainersNotReady",
                    lastTransitionTime=since,
                )
        for container in status.get("containerStatuses") or []:
            container.update(
                ready=False,
                started=False,
                imageID="",
                state={"waiting": {"reason": "ContainerCreating"}},
            )
            container.pop("lastState", None)

    meta = pod["metadata"]
    changed = emu.modify("Pod", meta["name"], meta["namespace"], mutate=mutate)
    emu.record_event(
        changed,
        reason="FailedCreatePodSandBox",
        message=SANDBOX_TIMEOUT,
        host=pod["spec"]["nodeName"],
    )


def _date_ready(emu: K8sEmulator, node: str, since: str) -> None:
    """The node has been Ready since ``since`` (if it is Ready now)."""

    def mutate(obj: dict[str, Any]) -> None:
        for condition in obj["status"]["conditions"]:
            if condition["type"] == "Ready" and condition["status"] == "True":
                condition["lastTransitionTime"] = since

    emu.modify("Node", node, "", mutate=mutate)


def haunt(emu: K8sEmulator, node: str) -> int:
    """Make ``node`` a ghost for ``BACKDATE`` seconds already: every pod on
    it waits for its sandbox since then; how many pods."""
    since = rfc3339_ago(BACKDATE)
    if emu.node_is_up(node):
        _date_ready(emu, node, since)
    pods = pods_on(emu, node)
    for pod in pods:
        _make_wait(emu, pod, since)
    return len(pods)


def keep_haunted(emu: K8sEmulator, node: str) -> int:
    """While the node is a ghost, pods that arrive on it wait for their
    sandbox from now on; how many did."""
    arrived = [pod for pod in pods_on(emu, node) if not waiting(pod)]
    now = now_rfc3339()
    for pod in arrived:
        _make_wait(emu, pod, now)
    return len(arrived)


def heal(emu: K8sEmulator, node: str) -> int:
    """Every pod on ``node`` that waits for its sandbox gets it and starts its
    containers; how many did."""
    healed = [pod for pod in pods_on(emu, node) if waiting(pod)]
    for pod in healed:
        meta = pod["metadata"]
        emu.start_pod_containers(meta["name"], meta["namespace"])
    return len(healed)


class GhostSwitch:
    """Follows one tower's ghost switch and plays (or heals) its GPU node."""

    def __init__(
        self,
        ha: HomeAssistantClient,
        emu: K8sEmulator,
        tower: DemoTower,
        *,
        toggle: str,
        health: str,
    ) -> None:
        self.ha = ha
        self.emu = emu
        self.tower = tower
        self.toggle = toggle
        self.health = health
        self.on = False
        self._task: asyncio.Task[None] | None = None

    @property
    def node(self) -> str:
        """The tower's GPU node in the cluster."""
        return self.tower.k8s_node

    def start(self) -> None:
        """Follow the switch in a task of the running loop (``stop`` ends it)."""
        self._task = asyncio.create_task(
            self.run(), name=f"ghost switch {self.tower.name}"
        )

    async def stop(self) -> None:
        """End the task ``start`` started."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def run(self) -> None:
        """Look at the switch every ``POLL`` seconds until cancelled."""
        while True:
            try:
                await self.look()
            except (aiohttp.ClientError, DemoError, TimeoutError) as err:
                log(f"{self.tower.name}: the ghost switch could not be read: {err}")
            await asyncio.sleep(POLL)

    async def look(self) -> None:
        """Act on a change of the switch; keep a ghost a ghost."""
        state = await self.ha.state(self.toggle)
        on = bool(state and state["state"] == "on")
        was, self.on = self.on, on
        name = self.tower.titles[self.tower.gpu_node]
        if on and not was:
            count = haunt(self.emu, self.node)
            self.tower.show_ghost(True)
            log(
                f"{self.tower.name}: {name} plays a ghost: Ready, its lease "
                f"renewing, {count} pods waiting for their sandbox for "
                f"{BACKDATE:.0f} s"
            )
            await self._refresh()
        elif on:
            if arrived := keep_haunted(self.emu, self.node):
                log(f"{self.tower.name}: {arrived} new pods wait for their sandbox")
        elif was:
            count = heal(self.emu, self.node)
            self.tower.show_ghost(False)
            log(f"{self.tower.name}: {name} healed: {count} pods started")
            await self._refresh()

    async def _refresh(self) -> None:
        """Ask Home Assistant to refresh the Health sensor now."""
        await self.ha.call("homeassistant", "update_entity", {"entity_id": self.health})
