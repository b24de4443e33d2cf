"""The simulated towers: each a tower simulator (tests/towersim) holding a GPU
node VM and two gaming VMs, behind its own real sshd that forces the real
tower agent with its own configuration.

Tower 1 is the one the README describes: "GPU node" with a GeForce GTX 960
and two RTX 3050s, "Gaming station 1" and "Gaming station 2". Further towers
are built the same way; their VMs are numbered on ("GPU node 2", "Gaming
station 3" and "4"), so that every device, entity and voice command has a
name of its own. Each VM has a screen of its own (``screens.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import getpass
import json
from pathlib import Path

from custom_components.gpu_handoff.tower.gpu_handoff import config as agent_config
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd
from tests.support.testdriver import agent_command
from tests.towersim import Tower
from tests.towersim.tower import realistic_domains

from . import screens
from .cluster import node_name

GPU_NODE_VM = "gpu-node"
GAMING_VMS = ("gaming-1", "gaming-2")
# The cards by PCI bus, as the realistic tower has them.
CARDS = {
    "01": "GeForce GTX 960 (4 GB)",
    "03": "GeForce RTX 3050 (8 GB)",
    "04": "GeForce RTX 3050 (6 GB)",
}


@dataclass
class DemoTower:
    """One running simulated tower and what Home Assistant knows it by."""

    index: int
    sim: Tower
    sshd: Sshd
    titles: dict[str, str]
    gaming: tuple[str, ...] = GAMING_VMS
    gpu_node: str = GPU_NODE_VM
    entry_id: str = ""
    named_by_agent: bool = field(default=False)
    # The GPU node's screen: working, and playing a ghost.
    console: tuple[Path, Path] | None = None

    @property
    def name(self) -> str:
        """The tower's name (its agent reports it, where the agent knows names)."""
        return f"tower-{self.index}"

    @property
    def k8s_node(self) -> str:
        """Its GPU node VM's Kubernetes node."""
        return node_name(self.index)

    def show_ghost(self, ghost: bool) -> None:
        """The GPU node's screen: the kernel's hung-task report while it plays
        a ghost, its login prompt otherwise."""
        if self.console is not None:
            self.sim.set_screen(self.gpu_node, frame=self.console[1 if ghost else 0])

    def stop(self) -> None:
        """Stop sshd and every job the tower still runs."""
        self.sshd.stop()
        self.sim.close()


def titles(index: int) -> dict[str, str]:
    """The libvirt titles of tower ``index``'s VMs (1: as in the README)."""
    first = 2 * (index - 1)
    names = {GPU_NODE_VM: "GPU node" if index == 1 else f"GPU node {index}"}
    for number, vm in enumerate(GAMING_VMS, start=first + 1):
        names[vm] = f"Gaming station {number}"
    return names


def _name_agent(config: Path, name: str) -> bool:
    """Give the agent its tower's name, where this version of the agent takes
    one (the ``name`` key, reported by ``version`` as ``host_name``)."""
    data = json.loads(config.read_text(encoding="utf-8"))
    named = data | {"name": name}
    if any(
        problem.startswith("name:") for problem in agent_config.validate_config(named)
    ):
        return False
    config.write_text(json.dumps(named), encoding="utf-8")
    return True


def start_tower(index: int, work: Path, *, fast: bool) -> DemoTower:
    """Tower ``index`` in ``work``: its simulator, the VMs' screens, agent
    configuration and sshd."""
    names = titles(index)
    specs = [
        dataclasses.replace(spec, title=names.get(spec.name, spec.title))
        for spec in realistic_domains()
    ]
    sim = Tower.create(work / "tower", specs, time_scale=0.01 if fast else 1.0)
    try:
        console = _draw_screens(sim, names, node_name(index), work / "screens")
        config = write_agent_config(
            sim,
            work / "agent",
            poll_interval=0.05 if fast else 1.0,
            agent=180.0,
            shutdown=180.0,
            start=300.0,
        )
        named = _name_agent(config, f"tower-{index}")
        sshd = Sshd(work / "sshd", agent_command(config), user=getpass.getuser())
        sshd.start()
    except BaseException:
        sim.close()
        raise
    return DemoTower(index, sim, sshd, names, named_by_agent=named, console=console)


def _draw_screens(
    sim: Tower, names: dict[str, str], host: str, where: Path
) -> tuple[Path, Path]:
    """What each VM shows while it runs: each gaming station a game, the GPU
    node its console (working, and playing a ghost: both returned)."""
    for vm in GAMING_VMS:
        frame = screens.save(screens.game(names[vm]), where / f"{vm}.png")
        sim.set_screen(vm, frame=frame)
    working = screens.save(screens.working_console(host), where / f"{host}.png")
    ghost = screens.save(screens.ghost_console(host), where / f"{host}-ghost.png")
    sim.set_screen(GPU_NODE_VM, frame=working)
    return working, ghost
