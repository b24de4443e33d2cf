"""A VM's screen, asked of the tower's agent: for the image entities and the
``capture_screen`` action.

The agent runs ``virsh screenshot`` and sends a PNG (it converts the PPM that
older libvirt and QEMU save), at most its ``screenshot_max_bytes``. What
arrives is checked here before anyone shows or saves it.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Final

from .const import CONF_GPU_NODE
from .data import GpuHandoffConfigEntry
from .entity import gaming_vms
from .errors import tower_error_key
from .tower.gpu_handoff import wire
from .tower_client import AgentCommandError, TowerClient, TowerError

# What browsers show (a current agent always sends PNG).
SHOWN_TYPES: Final = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
# More than any agent sends by default (8 MiB): a screen is kept in memory.
MAX_SCREEN_BYTES: Final = 32 << 20
PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"


class ScreenError(Exception):
    """No screen: why, as a translation key and its placeholders."""

    def __init__(self, key: str, placeholders: dict[str, str]) -> None:
        """Keep the key and placeholders; the message is for the log."""
        super().__init__(placeholders.get("error", key))
        self.key = key
        self.placeholders = placeholders


@dataclass(frozen=True, kw_only=True)
class Capture:
    """A screen as it arrived: what it is and its bytes."""

    vm: str
    content_type: str
    content: bytes = field(repr=False)

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of a PNG, from its header; None for other types."""
        data = self.content
        if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
            return None
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def screen_vms(entry: GpuHandoffConfigEntry) -> list[str]:
    """The VMs whose screens an entry shows: its GPU node and gaming VMs."""
    return [entry.data[CONF_GPU_NODE], *(domain for _, domain in gaming_vms(entry))]


async def async_capture(tower: TowerClient, vm: str) -> Capture:
    """The screen of ``vm`` now; ScreenError if there is none to show."""
    try:
        shot = await tower.screenshot(vm)
    except AgentCommandError as err:
        key = (
            "screenshot_too_large"
            if err.code == wire.ERR_TOO_LARGE
            else "screenshot_failed"
        )
        raise ScreenError(key, {"vm": vm, "error": err.message}) from err
    except TowerError as err:
        raise ScreenError(tower_error_key(err), {"error": str(err)}) from err
    if shot.mime not in SHOWN_TYPES:
        raise ScreenError(
            "screenshot_failed",
            {
                "vm": vm,
                "error": f"the tower sent {shot.mime[:40]}, which browsers cannot "
                "show; install the agent that comes with this version",
            },
        )
    size = max(shot.size, len(shot.data) // 4 * 3)
    if size > MAX_SCREEN_BYTES:
        raise ScreenError(
            "screenshot_too_large",
            {"vm": vm, "error": f"{size} bytes, more than {MAX_SCREEN_BYTES}"},
        )
    try:
        content = base64.b64decode(shot.data, validate=True)
    except binascii.Error as err:
        raise ScreenError(
            "screenshot_failed", {"vm": vm, "error": f"unreadable data: {err}"}
        ) from err
    if len(content) != shot.size:
        raise ScreenError(
            "screenshot_failed",
            {"vm": vm, "error": f"{len(content)} bytes, not the {shot.size} announced"},
        )
    return Capture(vm=vm, content_type=shot.mime, content=content)
