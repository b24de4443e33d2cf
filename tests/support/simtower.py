"""The agent's configuration for a simulated tower (tests/towersim).

The agent reaches libvirt through the simulator's ``virsh`` and detaches its
jobs through the simulator's ``systemd-run``, both named in its configuration,
so it runs unchanged under sshd's forced command.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.towersim import Tower


def write_agent_config(
    tower: Tower, directory: Path, *, poll_interval: float = 0.02, **timeouts: float
) -> Path:
    """Write the agent's configuration for ``tower``; return its path."""
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
            }
        ),
        encoding="utf-8",
    )
    return config
