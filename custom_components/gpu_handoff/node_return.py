"""The end of every return: the GPU node's Kubernetes node back, and our cordon
lifted; no Home Assistant imports.

Ready is not enough: after a restart the kubelet advertises no GPU device
(``nvidia.com/gpu``, ``nvidia.com/gpu.shared``, ``nvidia.com/mig-*``) until the
device plugin registers the cards (``cluster_client.gpus_short``). That wait is
bounded (health.GPUS_BOUND); a node still short then is given back all the same
(it runs other pods), and ``unhealthy`` says the cluster did not get its cards
back.

After a job that started the GPU node, only a Ready from a later boot counts:
the node keeps the Ready its old kubelet posted until kube-controller-manager's
node monitor grace period ends (the kubelet of a VM shut down posts nothing),
and so do its GPUs.

The cards are back only if the GPU node still runs when the wait is over, with
no tower job acting on it: a start by hand meanwhile (the hook stops the GPU
node for that player) has taken them again, and the node's Ready and GPUs are
only what its kubelet last posted. Then our cordon stays (the handoff that
follows needs it) and the return ends without them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Final, Protocol

from . import health
from .cluster_client import ClusterClient, ClusterError, gpus_short
from .cluster_events import NodeEvents
from .cluster_model import NodeView
from .const import PHASE_RETURNING
from .core import gpu_node_disturbed
from .health import UnhealthyReturn
from .jobs import DoneJob, TowerJobs, first_of
from .tower_client import AgentCommandError, TowerClient, TowerConnectionError

_LOGGER = logging.getLogger(__name__)

NODE_READY_TIMEOUT: Final = 900.0


class NodeBackError(Exception):
    """The node did not become Ready in time."""

    def __init__(self, node: str) -> None:
        super().__init__(
            f"{node} did not become Ready within {NODE_READY_TIMEOUT:.0f} s"
        )


class ReturnHost(Protocol):
    """What the node's return tells its host."""

    def step(self, step: str) -> None:
        """The operation is at ``step``."""

    def phase(self, phase: str) -> None:
        """The GPU node is at ``phase`` (PHASE_*) of the operation."""

    def show_node(self, view: NodeView) -> None:
        """The node as just seen."""

    def show_cordon(self, owner: str | None) -> None:
        """The cordon as just left."""


class NodeReturn:
    """Waits for the GPU node's Kubernetes node and lifts our own cordon (a
    drain's cordon survives the node's reboot); an operator's stays."""

    # Set by the last return whose GPU node came back short of its GPUs.
    unhealthy: UnhealthyReturn | None = None

    def __init__(
        self,
        tower: TowerClient,
        cluster: ClusterClient,
        jobs: TowerJobs,
        *,
        gpu_node: str,
        k8s_node: str,
        host: ReturnHost,
        events: NodeEvents | None = None,
    ) -> None:
        """Nothing is waited for until ``wait`` is called; ``events`` tells
        the cluster the node is back (cluster_events)."""
        self.events = events
        self.tower = tower
        self.cluster = cluster
        self.jobs = jobs
        self.gpu_node = gpu_node
        self.k8s_node = k8s_node
        self._host = host

    async def wait(self, done: DoneJob | None) -> bool:
        """Wait until the node is Ready (from a boot after ``done``'s start
        of the GPU node) and advertises the GPUs the GPU node holds, then
        lift our own cordon. True when the cards are back; False when a tower
        job stops the GPU node again meanwhile (our cordon stays)."""
        self.unhealthy = None
        self._host.phase(PHASE_RETURNING)
        self._host.step("waiting_for_node")
        old_boot = done.booted(self.gpu_node) if done is not None else None
        try:
            view = await self.cluster.wait_ready(
                self.k8s_node, NODE_READY_TIMEOUT, not_boot=old_boot
            )
        except TimeoutError as err:
            raise NodeBackError(self.k8s_node) from err
        self._host.show_node(view)
        expected = await self._gpus_held()
        if gpus_short(view, expected):
            self._host.step("waiting_for_gpus")
            found = await self._gpus(view, expected, old_boot)
            if found is None:
                return self._overtaken()
            self._host.show_node(found)
            view = found
        if await self._disturbed():
            return self._overtaken()
        self._host.step("uncordoning")
        lifted = await self.cluster.uncordon(self.k8s_node)
        if lifted:
            self._host.show_cordon(None)
        if self.events is not None:
            back = f"The GPU node is back, {view.gpu_allocatable} GPU(s) allocatable"
            if lifted:
                self.events.normal(
                    "Uncordoned", "Uncordon", f"{back}; GPU Handoff lifted its cordon"
                )
            elif view.unschedulable:
                self.events.normal(
                    "Returned", "Return", f"{back}; a cordon not GPU Handoff's stays"
                )
            else:
                self.events.normal("Returned", "Return", back)
        return True

    async def _gpus_held(self) -> int:
        """How many cards the GPU node runs with (0 when the tower cannot
        say: then no GPU is waited for)."""
        try:
            return (await self.tower.status()).gpus_held_by(self.gpu_node)
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning(
                "Not waiting for the GPUs: the tower did not answer: %s", err
            )
            return 0

    async def _gpus(
        self, view: NodeView, cards: int, old_boot: str | None
    ) -> NodeView | None:
        """The node once it advertises ``cards`` cards, or as it is past
        health.GPUS_BOUND (``unhealthy`` says so when still short); None as
        soon as a tower job acts on the GPU node: its GPUs cannot come then,
        and the start by hand that stops it must not wait for the bound."""
        try:
            return await first_of(
                self.cluster.wait_gpus(
                    self.k8s_node, cards, health.GPUS_BOUND, not_boot=old_boot
                ),
                self.jobs.until_tower(gpu_node_disturbed),
            )
        except TimeoutError:
            with contextlib.suppress(ClusterError):
                view = await self.cluster.node_view(self.k8s_node)
        if gpus_short(view, cards):
            self.unhealthy = UnhealthyReturn(
                reason=health.GPUS_MISSING,
                expected=cards,
                allocatable=view.gpu_allocatable,
                capacity=view.gpu_capacity,
            )
            _LOGGER.warning("%s: %s", self.k8s_node, self.unhealthy.message)
        return view

    async def _disturbed(self) -> bool:
        """Whether a tower job acts on the GPU node now, or it is off (a
        tower that cannot say: not disturbed)."""
        try:
            return gpu_node_disturbed(await self.tower.status())
        except (TowerConnectionError, AgentCommandError) as err:
            _LOGGER.warning("Could not read the tower before the uncordon: %s", err)
            return False

    def _overtaken(self) -> bool:
        """The return ends without the cards: a tower job stops the GPU node
        again (a start by hand on the tower); our cordon stays for the
        handoff that follows."""
        _LOGGER.info(
            "The cards did not go back: the GPU node is stopping again "
            "(a start by hand on the tower); %s stays cordoned",
            self.k8s_node,
        )
        self.unhealthy = None
        return False
