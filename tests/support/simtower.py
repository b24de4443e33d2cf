"""The agent's configuration for a simulated tower (tests/towersim).

The agent reaches libvirt through the simulator's ``virsh`` and detaches its
jobs through the simulator's ``systemd-run``, both named in its configuration,
so it runs unchanged under sshd's forced command. As the agent's ``install``
does, the configuration comes with the agent installed as libvirt's qemu hook
(the very script ``install`` writes, calling the agent through a launcher
where ``install`` puts the program): the simulator runs it at every step of
every start and stop, the agent's own included.
"""

from __future__ import annotations

import json
from pathlib import Path
import shlex
import sys

from custom_components.gpu_handoff.tower.gpu_handoff.install import hook_script
from tests.support.testdriver import AGENT
from tests.towersim import Tower

# Where the agent's install puts its hook (the agent's HOOK_PATH).
HOOK_PATH = "/etc/libvirt/hooks/qemu.d/gpu-handoff"


def write_agent_config(
    tower: Tower, directory: Path, *, poll_interval: float = 0.02, **timeouts: float
) -> Path:
    """Write the agent's configuration for ``tower`` and install the agent as
    the tower's qemu hook (the script ``install`` writes, which runs
    ``gpu-handoff --config PATH hook`` for "prepare begin"); return the
    configuration's path."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "agent.json"
    config.write_text(
        json.dumps(
            {
                "libvirt_uri": tower.uri,
                "gpu_node": "gpu-node",
                "gaming": ["gaming-1", "gaming-2"],
                "timeouts": {
                    "agent": 20.0,
                    "shutdown": 20.0,
                    "start": 30.0,
                    **timeouts,
                },
                "shutdown_modes": ["agent"],
                "state_dir": str(directory / "agent-state"),
                "commands": {
                    "virsh": str(tower.virsh),
                    "systemd_run": str(tower.systemd_run),
                },
                "detach": "systemd",
                "poll_interval": poll_interval,
                "sysfs": str(tower.sysfs),
            }
        ),
        encoding="utf-8",
    )
    install_hook(tower, directory, AGENT, config)
    return config


def install_hook(tower: Tower, directory: Path, agent: Path, config: Path) -> None:
    """Install the hook script the agent's ``install`` writes, for the agent
    at ``agent`` (reached through a launcher, where ``install`` puts the
    program) with ``config``, as the tower's qemu hook."""
    program = directory / "gpu-handoff"
    program.write_text(
        f'#!/bin/sh\nexec {shlex.join([sys.executable, "-S", str(agent)])} "$@"\n',
        encoding="utf-8",
    )
    program.chmod(0o755)
    hook = directory / "qemu-hook"
    hook.write_text(hook_script(str(program), str(config)), encoding="utf-8")
    hook.chmod(0o755)
    tower.set_hook([str(hook)], path=HOOK_PATH)
