"""The tower simulator: a stand-in ``virsh`` and ``systemd-run`` with state.

    tower = Tower.create(tmp_path / "tower", realistic_domains(), time_scale=0.01)
    subprocess.run([tower.virsh, "-c", tower.uri, "start", "gaming-1"])

See CONTRACT.md for the commands it reproduces, and the conformance tests in
this folder for how its output is pinned to real virsh.
"""

from __future__ import annotations

# The simulator is a process per virsh call: typing stays out of its imports
# (about 3 ms of each start); its names are for the type checker only.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from typing import Any

    from .tower import (
        Command,
        DomainSpec,
        Hostdev,
        Tower,
        Unit,
        realistic_domains,
        realistic_tower,
    )

__all__ = [
    "Command",
    "DomainSpec",
    "Hostdev",
    "Tower",
    "Unit",
    "realistic_domains",
    "realistic_tower",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that the simulated virsh (which imports this package) starts fast.
    if name in __all__:
        from . import tower

        return getattr(tower, name)
    raise AttributeError(name)
