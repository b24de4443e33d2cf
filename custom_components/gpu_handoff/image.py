"""Images: the screen of the GPU node and of each gaming VM.

The screen is asked of the tower only when someone looks: Home Assistant
calls ``async_image`` when a dashboard, the more-info dialog or an action
fetches the image, never on a timer. One answer serves every viewer for a
few seconds, so one dashboard makes one SSH request. The image's time moves
when the VM's state changes (it started, stopped, its guest agent came up),
which tells open dashboards to fetch it again; while the VM is not running
the entity is unavailable and nothing is asked.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
import logging
from typing import Final

from homeassistant.components.image import ImageEntity, ImageEntityDescription
from homeassistant.core import HomeAssistant, callback
from homeassistant.helpers.entity_platform import AddConfigEntryEntitiesCallback
from homeassistant.util import dt as dt_util

from .const import CONF_GPU_NODE
from .data import GpuHandoffConfigEntry, GpuHandoffData
from .entity import GpuHandoffEntity, gaming_vms
from .protocol import RUNNING
from .screen import Capture, ScreenError, async_capture

_LOGGER = logging.getLogger(__name__)

# Each screen serialises its own requests; nothing is polled.
PARALLEL_UPDATES = 0

# How long one screenshot answers every fetch (a dashboard fetches an image
# several times as it opens, and each viewer fetches it).
SCREEN_FRESH_FOR: Final = timedelta(seconds=5)

SCREEN = ImageEntityDescription(key="screen", translation_key="screen")


async def async_setup_entry(
    hass: HomeAssistant,
    entry: GpuHandoffConfigEntry,
    async_add_entities: AddConfigEntryEntitiesCallback,
) -> None:
    """The GPU node's screen, and each gaming VM's on its device."""
    data = entry.runtime_data
    async_add_entities([ScreenImage(hass, data, entry.data[CONF_GPU_NODE])])
    for subentry_id, domain in gaming_vms(entry):
        async_add_entities(
            [ScreenImage(hass, data, domain)], config_subentry_id=subentry_id
        )


class ScreenImage(GpuHandoffEntity, ImageEntity):
    """A VM's screen, taken when it is looked at."""

    _attr_content_type = "image/png"

    def __init__(self, hass: HomeAssistant, data: GpuHandoffData, domain: str) -> None:
        """A screen on the VM's device."""
        super().__init__(data, SCREEN, domain)
        ImageEntity.__init__(self, hass)
        self._vm_domain = domain
        self._seen = self._screen_moment()
        self._attr_image_last_updated = dt_util.utcnow()
        self._lock = asyncio.Lock()
        # The last answer (a screen, or None after a failure) and when.
        self._last: tuple[datetime, Capture | None] | None = None
        # The kind of failure last logged, so that it is logged once.
        self._failing: str | None = None

    def _screen_moment(self) -> tuple[str | None, bool | None] | None:
        """What changes the screen for sure: the VM's state and its agent's."""
        vm = self.vm
        return (vm.state, vm.agent_ready) if vm is not None else None

    @property
    def available(self) -> bool:
        """Only a running VM has a screen to show."""
        vm = self.vm
        return super().available and vm is not None and vm.state == RUNNING

    @callback
    def _handle_coordinator_update(self) -> None:
        """A new screen when the VM's state changed: open dashboards fetch it."""
        moment = self._screen_moment()
        if moment != self._seen:
            self._seen = moment
            self._last = None
            self._attr_image_last_updated = dt_util.utcnow()
        super()._handle_coordinator_update()

    async def async_image(self) -> bytes | None:
        """The screen now (or of a few seconds ago); None if there is none."""
        if not self.available:
            return None
        async with self._lock:
            last = self._last
            if last is not None and dt_util.utcnow() - last[0] < SCREEN_FRESH_FOR:
                return last[1].content if last[1] is not None else None
            try:
                capture: Capture | None = await async_capture(
                    self.coordinator.tower, self._vm_domain
                )
            except ScreenError as err:
                self._log_failure(err)
                capture = None
            else:
                if self._failing is not None:
                    _LOGGER.info("The screen of %s is shown again", self._vm_domain)
                    self._failing = None
            self._last = (dt_util.utcnow(), capture)
            if capture is None:
                return None
            self._attr_content_type = capture.content_type
            return capture.content

    def _log_failure(self, err: ScreenError) -> None:
        """Each kind of failure once, until a screen arrives again."""
        if self._failing == err.key:
            _LOGGER.debug("No screen of %s: %s", self._vm_domain, err)
            return
        self._failing = err.key
        _LOGGER.warning("No screen of %s: %s", self._vm_domain, err)
