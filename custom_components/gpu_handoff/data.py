"""What a loaded tower entry holds: the parts its platforms and actions use.

Built in full before the platforms load. It lives apart from the coordinator,
the controller and the agent session so that dependencies point one way:
platforms and actions read this; the controller and the session use the
coordinator; the coordinator and the runner use the clients; nothing below
imports what is above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from homeassistant.config_entries import ConfigEntry

from .controller import HandoffController
from .coordinator import GpuHandoffCoordinator
from .session import AgentSession


@dataclass
class GpuHandoffData:
    """A tower's coordinator, controller, agent session and tower device."""

    coordinator: GpuHandoffCoordinator
    controller: HandoffController
    session: AgentSession
    tower_device_id: str
    # What a reload must follow (options, the set of gaming VMs) at setup.
    setup_signature: tuple[object, ...]


type GpuHandoffConfigEntry = ConfigEntry[GpuHandoffData]


def signature_of(entry: ConfigEntry) -> tuple[object, ...]:
    """What a reload must follow: the options and the set of gaming VMs."""
    return (
        tuple(sorted(entry.options.items())),
        tuple(sorted(entry.subentries)),
    )
