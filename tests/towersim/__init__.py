"""The tower simulator: a stand-in ``virsh`` and ``systemd-run`` with state.

    tower = Tower.create(tmp_path / "tower", realistic_domains(), time_scale=0.01)
    subprocess.run([tower.virsh, "-c", tower.uri, "start", "gaming-1"])

See CONTRACT.md for the commands it reproduces, and the conformance tests in
this folder for how its output is pinned to real virsh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
