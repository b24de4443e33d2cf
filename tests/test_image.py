"""The screens: image entities and the capture_screen action, end to end.

Real parts: Home Assistant's image proxy over HTTP (what a dashboard
fetches), sshd on 127.0.0.1 forcing the real agent, and the tower simulator
behind it, whose `virsh screenshot` saves the real QEMU guest's screen
recorded by tests/realvm/test_screenshot.py as QEMU's PPM (what libvirt
before 9.0 saves): the agent converts it, and a browser gets a PNG.
Every `virsh screenshot` the agent runs is counted in the simulator.
"""

from __future__ import annotations

from datetime import timedelta
import gzip
import json
import logging
from pathlib import Path
from typing import Any

from homeassistant.const import STATE_UNAVAILABLE
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError, ServiceValidationError
from homeassistant.helpers import entity_registry as er
from homeassistant.util import dt as dt_util
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_fire_time_changed,
)
from pytest_homeassistant_custom_component.typing import ClientSessionGenerator

from custom_components.gpu_handoff import image as image_platform
from custom_components.gpu_handoff.const import DOMAIN
from custom_components.gpu_handoff.protocol import Screenshot
from custom_components.gpu_handoff.screen import (
    MAX_SCREEN_BYTES,
    Capture,
    ScreenError,
    async_capture,
)
from custom_components.gpu_handoff.tower_client import (
    AgentCommandError,
    TowerConnectionError,
)
from tests.realvm.test_screenshot import RECORDED_FRAME
from tests.support.png import decode, ppm_pixels
from tests.support.stories import play, setup_entry, until
from tests.towersim import Tower

GPU_NODE_SCREEN = "image.gpu_node_screen"
GAMING_1_SCREEN = "image.gaming_station_1_screen"
PPM = "image/x-portable-pixmap"


def screenshots(sim: Tower, domain: str = "gpu-node") -> int:
    """How many times the agent ran `virsh screenshot` of ``domain``."""
    return len(sim.calls("screenshot", domain))


def recorded_pixels() -> tuple[int, int, bytes]:
    return ppm_pixels(gzip.decompress(RECORDED_FRAME.read_bytes()))


async def fetch(
    hass_client: ClientSessionGenerator, entity_id: str
) -> tuple[int, str | None, bytes]:
    """GET the image as a dashboard does: status, content type, body."""
    client = await hass_client()
    response = await client.get(f"/api/image_proxy/{entity_id}")
    return response.status, response.content_type, await response.read()


def limit_screenshots(agent_config: Path, limit: int) -> None:
    """Set the agent's screenshot_max_bytes (read by each agent it starts)."""
    config = json.loads(agent_config.read_text(encoding="utf-8"))
    config["screenshot_max_bytes"] = limit
    agent_config.write_text(json.dumps(config), encoding="utf-8")


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The warnings and errors that mention ``text``."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING and text in record.getMessage()
    ]


@pytest.fixture
def real_screen(sim: Tower) -> None:
    """The GPU node shows the recorded real guest screen, saved as a PPM."""
    sim.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)


async def capture(hass: HomeAssistant, entry: MockConfigEntry, **data: Any) -> Any:
    return await hass.services.async_call(
        DOMAIN,
        "capture_screen",
        {"config_entry_id": entry.entry_id, **data},
        blocking=True,
        return_response=True,
    )


# --- the image entities -------------------------------------------------------


async def test_one_screen_per_vm_on_its_device(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    await setup_entry(hass, entry)
    registry = er.async_get(hass)
    screens = {
        item.entity_id: item
        for item in er.async_entries_for_config_entry(registry, entry.entry_id)
        if item.domain == "image"
    }
    assert set(screens) == {
        GPU_NODE_SCREEN,
        GAMING_1_SCREEN,
        "image.gaming_station_2_screen",
    }
    for item in screens.values():
        assert item.translation_key == "screen"
        assert item.entity_category is None
    device = {
        entity_id: registry.async_get(entity_id).device_id for entity_id in screens
    }
    switch = registry.async_get("switch.gaming_station_1")
    assert switch is not None
    assert device[GAMING_1_SCREEN] == switch.device_id
    handoff = registry.async_get("sensor.gpu_node_handoff_state")
    assert handoff is not None
    assert device[GPU_NODE_SCREEN] == handoff.device_id
    assert hass.states.get(GPU_NODE_SCREEN).attributes["friendly_name"] == (
        "GPU node Screen"
    )


async def test_the_real_guest_screen_reaches_the_browser_as_a_png(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    real_screen: None,
    hass_client: ClientSessionGenerator,
) -> None:
    await setup_entry(hass, entry)
    status, content_type, body = await fetch(hass_client, GPU_NODE_SCREEN)
    assert (status, content_type) == (200, "image/png")
    picture = decode(body)
    width, height, pixels = recorded_pixels()
    assert (picture.width, picture.height) == (width, height) == (720, 400)
    assert picture.rgb == pixels
    assert screenshots(sim) == 1


async def test_nothing_is_asked_while_nobody_looks(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    real_screen: None,
    hass_client: ClientSessionGenerator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Polls, pushes and the image tokens' rotation take no screenshot; one
    dashboard opening takes one; an old one is taken again."""
    await setup_entry(hass, entry)
    coordinator = entry.runtime_data.coordinator
    await until(lambda: entry.runtime_data.session.connected)
    for minutes in (1, 6, 11):
        async_fire_time_changed(hass, dt_util.utcnow() + timedelta(minutes=minutes))
        await coordinator.async_refresh()
        await hass.async_block_till_done()
    assert hass.states.get(GPU_NODE_SCREEN).state != STATE_UNAVAILABLE
    assert screenshots(sim) == 0

    first = await fetch(hass_client, GPU_NODE_SCREEN)
    again = await fetch(hass_client, GPU_NODE_SCREEN)
    assert first[0] == again[0] == 200
    assert again[2] == first[2]
    assert screenshots(sim) == 1

    monkeypatch.setattr(image_platform, "SCREEN_FRESH_FOR", timedelta(0))
    assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 200
    assert screenshots(sim) == 2


async def test_an_off_vm_is_unavailable_until_it_runs(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    no_pdb: None,
    hass_client: ClientSessionGenerator,
) -> None:
    """Off: unavailable, and nothing is asked. Its state changing moves the
    image's time, which makes open dashboards fetch the new screen."""
    sim.set_screen("gaming-1", mime=PPM, width=320, height=200)
    await setup_entry(hass, entry)
    assert hass.states.get(GAMING_1_SCREEN).state == STATE_UNAVAILABLE
    status, _, _ = await fetch(hass_client, GAMING_1_SCREEN)
    assert status == 500
    assert screenshots(sim, "gaming-1") == 0
    before = hass.states.get(GPU_NODE_SCREEN).state
    assert before != STATE_UNAVAILABLE

    await play(hass, entry, sim, 1)
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await until(lambda: hass.states.get(GAMING_1_SCREEN).state != STATE_UNAVAILABLE)
    assert hass.states.get(GPU_NODE_SCREEN).state == STATE_UNAVAILABLE
    assert dt_util.parse_datetime(hass.states.get(GAMING_1_SCREEN).state) > (
        dt_util.parse_datetime(before)
    )
    status, content_type, body = await fetch(hass_client, GAMING_1_SCREEN)
    assert (status, content_type) == (200, "image/png")
    assert (decode(body).width, decode(body).height) == (320, 200)
    assert screenshots(sim, "gaming-1") == 1
    assert screenshots(sim) == 0  # the GPU node is off: never asked


async def test_a_screen_over_the_size_limit_is_not_shown(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    real_screen: None,
    agent_config: Path,
    hass_client: ClientSessionGenerator,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent refuses a PNG over its screenshot_max_bytes: the image fails,
    logged once."""
    limit_screenshots(agent_config, 1000)  # the recorded screen is ~2.5 kB
    await setup_entry(hass, entry)
    monkeypatch.setattr(image_platform, "SCREEN_FRESH_FOR", timedelta(0))
    for _ in range(3):
        assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 500
    assert screenshots(sim) == 3
    warnings = logged(caplog, "No screen of gpu-node")
    assert len(warnings) == 1
    assert "more than screenshot_max_bytes=1000" in warnings[0]
    assert "Traceback" not in caplog.text


async def test_a_failing_screen_is_logged_once_and_its_return_too(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    tmp_path: Path,
    hass_client: ClientSessionGenerator,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken = tmp_path / "broken.ppm"
    broken.write_bytes(b"P6\n4 4\n255\n" + bytes(10))
    sim.set_screen("gpu-node", mime=PPM, frame=broken)
    await setup_entry(hass, entry)
    # One failure answers every viewer for a few seconds too.
    assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 500
    assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 500
    assert screenshots(sim) == 1
    monkeypatch.setattr(image_platform, "SCREEN_FRESH_FOR", timedelta(0))
    assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 500
    warnings = logged(caplog, "No screen of gpu-node")
    assert len(warnings) == 1
    assert "its 4x4 header says" in warnings[0]

    sim.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)
    assert (await fetch(hass_client, GPU_NODE_SCREEN))[0] == 200
    assert "The screen of gpu-node is shown again" in caplog.text


# --- the action ----------------------------------------------------------------


async def test_capture_writes_the_screen_where_allowed(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    real_screen: None,
    tmp_path: Path,
) -> None:
    hass.config.allowlist_external_dirs = {str(tmp_path)}
    await setup_entry(hass, entry)
    target = tmp_path / "www" / "screens" / "gpu-node.png"
    response = await capture(hass, entry, vm="gpu-node", filename=str(target))
    picture = decode(target.read_bytes())
    assert picture.rgb == recorded_pixels()[2]
    assert response == {
        "vm": "gpu-node",
        "filename": str(target),
        "content_type": "image/png",
        "bytes": target.stat().st_size,
        "width": 720,
        "height": 400,
    }
    # Without asking for a response, the file is written all the same.
    target.unlink()
    assert (
        await hass.services.async_call(
            DOMAIN,
            "capture_screen",
            {
                "config_entry_id": entry.entry_id,
                "vm": "gpu-node",
                "filename": str(target),
            },
            blocking=True,
        )
        is None
    )
    assert decode(target.read_bytes()).rgb == picture.rgb
    assert screenshots(sim) == 2


@pytest.mark.parametrize(
    ("vm", "filename", "key", "placeholders"),
    [
        ("gaming-9", "{tmp}/x.png", "unknown_screen", {"vm": "gaming-9"}),
        ("gpu-node", "/etc/x.png", "path_not_allowed", {"filename": "/etc/x.png"}),
        ("gpu-node", "{tmp}/../x.png", "path_not_allowed", None),
    ],
    ids=["not-a-vm-of-the-tower", "outside-the-allowlist", "escaping-it"],
)
async def test_capture_refuses_what_it_may_not_do(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    tmp_path: Path,
    vm: str,
    filename: str,
    key: str,
    placeholders: dict[str, str] | None,
) -> None:
    hass.config.allowlist_external_dirs = {str(tmp_path / "allowed")}
    (tmp_path / "allowed").mkdir()
    await setup_entry(hass, entry)
    path = filename.format(tmp=tmp_path / "allowed")
    with pytest.raises(ServiceValidationError) as raised:
        await capture(hass, entry, vm=vm, filename=path)
    assert raised.value.translation_domain == DOMAIN
    assert raised.value.translation_key == key
    if placeholders is not None:
        assert raised.value.translation_placeholders == placeholders
    assert screenshots(sim) == 0
    assert not (tmp_path / "x.png").exists()


async def test_capture_of_an_off_vm_says_so(
    hass: HomeAssistant, entry: MockConfigEntry, sim: Tower, tmp_path: Path
) -> None:
    hass.config.allowlist_external_dirs = {str(tmp_path)}
    await setup_entry(hass, entry)
    with pytest.raises(HomeAssistantError) as raised:
        await capture(hass, entry, vm="gaming-2", filename=str(tmp_path / "x.png"))
    assert raised.value.translation_key == "vm_not_running"
    # (Home Assistant drops a translated message's final full stop.)
    assert str(raised.value) == "gaming-2 is not running: it has no screen to capture"
    assert screenshots(sim, "gaming-2") == 0


async def test_capture_over_the_limit_and_unwritable(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    real_screen: None,
    agent_config: Path,
    tmp_path: Path,
) -> None:
    hass.config.allowlist_external_dirs = {str(tmp_path)}
    (tmp_path / "a-folder.png").mkdir()
    await setup_entry(hass, entry)
    with pytest.raises(HomeAssistantError) as raised:
        await capture(
            hass, entry, vm="gpu-node", filename=str(tmp_path / "a-folder.png")
        )
    assert raised.value.translation_key == "screenshot_not_written"
    assert raised.value.translation_placeholders["filename"] == str(
        tmp_path / "a-folder.png"
    )

    limit_screenshots(agent_config, 1000)
    # The session's agent read its configuration when it started: ask one-shot.
    coordinator = entry.runtime_data.coordinator
    await until(lambda: entry.runtime_data.session.connected)
    assert coordinator.tower.session is not None
    await coordinator.tower.session.close()
    with pytest.raises(HomeAssistantError) as raised:
        await capture(hass, entry, vm="gpu-node", filename=str(tmp_path / "x.png"))
    assert raised.value.translation_key == "screenshot_too_large"
    assert "screenshot_max_bytes=1000" in str(raised.value)
    assert not (tmp_path / "x.png").exists()


# --- what a tower must not send ---------------------------------------------------


class StubTower:
    """Answers ``screenshot`` with a given reply or error (the real agent
    never sends these: they are other agents' or broken towers' answers)."""

    def __init__(self, answer: Screenshot | Exception) -> None:
        self.answer = answer

    async def screenshot(self, domain: str) -> Screenshot:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def shot(
    mime: str = "image/png", data: str = "iVBORw0KGgo=", size: int = 8
) -> Screenshot:
    return Screenshot(domain="gpu-node", mime=mime, size=size, data=data)


@pytest.mark.parametrize(
    ("answer", "key", "says"),
    [
        (shot(mime=PPM), "screenshot_failed", "browsers cannot show"),
        (shot(data="not base64!"), "screenshot_failed", "unreadable data"),
        (shot(size=9), "screenshot_failed", "not the 9 announced"),
        (shot(size=MAX_SCREEN_BYTES + 1), "screenshot_too_large", "more than"),
        (TowerConnectionError("no route"), "cannot_connect", "no route"),
        (AgentCommandError("unknown_domain", "nope"), "screenshot_failed", "nope"),
    ],
    ids=["ppm", "not-base64", "size-mismatch", "too-large", "unreachable", "refused"],
)
async def test_what_a_tower_must_not_send_is_not_shown(
    answer: Screenshot | Exception, key: str, says: str
) -> None:
    with pytest.raises(ScreenError) as raised:
        await async_capture(StubTower(answer), "gpu-node")  # type: ignore[arg-type]
    assert raised.value.key == key
    assert says in str(raised.value)


async def test_a_png_says_its_size_and_other_types_do_not() -> None:
    png = await async_capture(StubTower(shot()), "gpu-node")  # type: ignore[arg-type]
    assert png == Capture(
        vm="gpu-node", content_type="image/png", content=b"\x89PNG\r\n\x1a\n"
    )
    assert png.size is None  # a signature without its header
    assert Capture(vm="x", content_type="image/jpeg", content=b"\xff\xd8").size is None
