"""The agent's `screenshot`: a PNG a browser shows, whatever virsh saved.

libvirt >= 9.0 with QEMU >= 7.1 save a PNG, which is sent as it is; older ones
save QEMU's screendump as a binary PPM, which browsers cannot show: the agent
converts it with the standard library (every row with filter type 0, zlib
level 6), never holding the whole PPM, and refuses what is not a PPM as QEMU
and Netpbm define it. What is sent is bounded by screenshot_max_bytes, and so
is the conversion's work.

The frames: the real guest's screen recorded by tests/realvm/test_screenshot.py
(QEMU's PPM of a VGA text screen), and the simulator's drawn screens.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
import gzip
import io
import json
import os
from pathlib import Path
import random
import subprocess
import tempfile
from typing import Any
import zlib

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    screenshot as agent_screenshot,
    wire,
)
from tests.realvm.test_screenshot import RECORDED_FRAME
from tests.support.agentbuild import AGENT
from tests.support.oldpython import oldest_python
from tests.support.png import chunks, decode, ppm_pixels
from tests.tower.conftest import Run, run_agent, write_config
from tests.towersim import Tower, realistic_tower

PPM = "image/x-portable-pixmap"
LIMIT = 8 << 20
# Test data (noise does not compress), not secrets.
NOISE = random.Random(1)  # noqa: S311


def recorded_frame() -> bytes:
    return gzip.decompress(RECORDED_FRAME.read_bytes())


def convert(ppm: bytes, limit: int = LIMIT) -> tuple[bytes, int, int]:
    return agent_screenshot.png_from_ppm(io.BytesIO(ppm), len(ppm), limit)


def ppm_of(width: int, height: int, pixels: bytes, maxval: int = 255) -> bytes:
    return f"P6\n{width} {height}\n{maxval}\n".encode() + pixels


def refused(ppm: bytes) -> wire.AgentError:
    with pytest.raises(wire.AgentError) as caught:
        convert(ppm)
    return caught.value


# --- the conversion ------------------------------------------------------------


def test_the_real_guest_screen_becomes_a_png_of_the_same_pixels() -> None:
    frame = recorded_frame()
    width, height, pixels = ppm_pixels(frame)
    png, got_width, got_height = convert(frame)
    assert (got_width, got_height) == (width, height) == (720, 400)
    picture = decode(png)
    assert (picture.width, picture.height) == (width, height)
    assert picture.rgb == pixels
    # A screen compresses well: a few kB instead of 864 kB.
    assert len(png) < len(frame) // 100


def test_the_png_is_plain_rgb_with_unfiltered_rows() -> None:
    pixels = bytes(NOISE.getrandbits(8) for _ in range(5 * 3 * 3))
    png, _, _ = convert(ppm_of(5, 3, pixels))
    parts = chunks(png)
    assert [kind for kind, _ in parts] == [b"IHDR", b"IDAT", b"IEND"]
    assert parts[0][1] == bytes.fromhex("00000005 00000003 08 02 00 00 00")
    rows = zlib.decompress(parts[1][1])
    assert [rows[y * 16] for y in range(3)] == [0, 0, 0]
    assert b"".join(rows[y * 16 + 1 : (y + 1) * 16] for y in range(3)) == pixels


@pytest.mark.parametrize(
    "header",
    [
        b"P6 2 1 255\n",
        b"P6\t2\r1\x0b255\x0c",
        b"P6# made by a test\n2 # width\n1\n# maxval next\r255 ",
        b"P6\n\n  2  1  255\n",
    ],
    ids=["spaces", "other-whitespace", "comments", "runs-of-whitespace"],
)
def test_headers_as_netpbm_allows_them(header: bytes) -> None:
    pixels = b"\x01\x02\x03\xfd\xfe\xff"
    picture = decode(convert(header + pixels)[0])
    assert (picture.width, picture.height, picture.rgb) == (2, 1, pixels)


def test_samples_below_255_are_scaled() -> None:
    # maxval 15: 0 is black, 15 full, 8 half; a value above maxval is invalid
    # in a PPM and shown at full intensity.
    picture = decode(convert(ppm_of(2, 1, bytes([0, 8, 15, 200, 1, 7]), maxval=15))[0])
    assert picture.rgb == bytes([0, 136, 255, 255, 17, 119])


@pytest.mark.parametrize(
    ("ppm", "code", "says"),
    [
        (b"P3\n1 1\n255\n0 0 0\n", "screenshot_failed", "not a PPM"),
        (b"\x89PNG\r\n\x1a\n", "screenshot_failed", "not a PPM"),
        (b"P6\n1 1\n255", "screenshot_failed", "not a PPM"),
        (b"P6\n1 1\n255\xff\x00\x00", "screenshot_failed", "not a PPM"),
        (b"P6\n-1 1\n255\n...", "screenshot_failed", "not a PPM"),
        (b"P6\n1x 1\n255\n...", "screenshot_failed", "not a PPM"),
        (b"P61 1 255\n...", "screenshot_failed", "not a PPM"),
        (b"P6\n1 1\n# no end of line", "screenshot_failed", "not a PPM"),
        (b"P6\n12345678 1\n255\n", "screenshot_failed", "not a PPM"),
        (b"P6\n#" + b"x" * 300 + b"\n1 1\n255\n...", "screenshot_failed", "not a PPM"),
        (b"P6\n0 1\n255\n", "screenshot_failed", "the PPM is empty (0x1)"),
        (b"P6\n16385 1\n255\n", "too_large", "at most 16384 pixels a side"),
        (b"P6\n1 16385\n255\n", "too_large", "at most 16384 pixels a side"),
        (b"P6\n1 1\n0\n...", "screenshot_failed", "maximum value is 0"),
        (b"P6\n1 1\n65535\n......", "screenshot_failed", "only 8-bit samples"),
        (b"P6\n2 1\n255\n...", "screenshot_failed", "not the 17 its 2x1 header says"),
        (b"P6\n1 1\n255\n....", "screenshot_failed", "not the 14 its 1x1 header says"),
    ],
    ids=[
        "ascii-ppm",
        "png",
        "no-pixels-separator",
        "no-whitespace-after-maxval",
        "negative",
        "not-a-number",
        "no-gap-after-magic",
        "endless-comment",
        "eight-digits",
        "header-too-long",
        "zero-width",
        "too-wide",
        "too-tall",
        "maxval-0",
        "16-bit",
        "truncated",
        "trailing-bytes",
    ],
)
def test_what_is_not_a_ppm_as_defined_is_refused(
    ppm: bytes, code: str, says: str
) -> None:
    error = refused(ppm)
    assert error.code == code
    assert says in error.message


def test_the_png_must_fit_the_limit() -> None:
    noise = NOISE.randbytes(64 * 64 * 3)
    ppm = ppm_of(64, 64, noise)
    png, _, _ = convert(ppm, limit=len(ppm) * 2)
    with pytest.raises(wire.AgentError) as caught:
        convert(ppm, limit=len(png) - 1)
    assert caught.value.code == "too_large"
    assert f"screenshot is {len(png)} bytes as PNG, more than" in caught.value.message
    assert convert(ppm, limit=len(png))[0] == png


def test_a_png_over_the_limit_stops_the_work_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Noise does not compress: the conversion gives up after the block that
    passed the limit, without reading the rest."""
    monkeypatch.setattr(
        agent_screenshot, "PPM_BLOCK_BYTES", 512 * 3 * 8
    )  # 8 rows a block
    ppm = ppm_of(512, 512, NOISE.randbytes(512 * 512 * 3))
    handle = io.BytesIO(ppm)
    with pytest.raises(wire.AgentError) as caught:
        agent_screenshot.png_from_ppm(handle, len(ppm), 100_000)
    assert caught.value.code == "too_large"
    assert "as PNG before its end" in caught.value.message
    assert handle.tell() < len(ppm) // 2


def test_a_ppm_larger_than_any_screen_is_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_screenshot, "PPM_MAX_BYTES", 1000)
    ppm = ppm_of(20, 20, bytes(1200))
    handle = io.BytesIO(ppm)
    with pytest.raises(wire.AgentError) as caught:
        agent_screenshot.png_from_ppm(handle, len(ppm), LIMIT)
    assert caught.value.code == "too_large"
    assert "at most 1000 are converted" in caught.value.message
    assert handle.tell() == 0


def test_a_ppm_that_shrinks_while_read_is_refused() -> None:
    ppm = ppm_of(4, 4, bytes(48))
    with pytest.raises(wire.AgentError) as caught:
        agent_screenshot.png_from_ppm(io.BytesIO(ppm[:-3]), len(ppm), LIMIT)
    assert caught.value.code == "screenshot_failed"
    assert "ended early" in caught.value.message


def desktop_1280x800() -> bytes:
    """A desktop-like screen: a gradient, and a window of text-like noise."""
    rnd = NOISE
    rows = []
    for y in range(800):
        if 200 <= y < 600:
            text = rnd.randbytes(700 * 3) if y % 16 < 10 else b"\xfa" * (700 * 3)
            rows.append(bytes(300 * 3) + text + bytes(280 * 3))
        else:
            rows.append(
                bytes(
                    value
                    for x in range(1280)
                    for value in (x * 255 // 1279, y * 255 // 799, 128)
                )
            )
    return ppm_of(1280, 800, b"".join(rows))


def test_a_1280x800_desktop_converts_pixel_for_pixel() -> None:
    """A desktop-sized screen of text-like content (the conversion's time is
    measured by scripts/bench, not asserted here)."""
    ppm = desktop_1280x800()
    png, width, height = convert(ppm)
    assert (width, height) == (1280, 800)
    assert decode(png).rgb == ppm[-1280 * 800 * 3 :]
    assert len(png) < len(ppm)


# --- the verb, through the simulated tower ----------------------------------------


class ShotTower:
    """The agent configured for a simulated tower; screenshots only."""

    def __init__(self, tower: Tower, directory: Path) -> None:
        self.tower = tower
        self.directory = directory
        self.configure()

    def configure(self, **overrides: Any) -> None:
        self.config = write_config(
            self.directory / "config.json",
            libvirt_uri=self.tower.uri,
            gpu_node="gpu-node",
            gaming=["gaming-1", "gaming-2"],
            state_dir=str(self.directory / "agent-state"),
            commands={"virsh": str(self.tower.virsh)},
            detach="process",
            **overrides,
        )

    def shot(self, domain: str = "gpu-node") -> Run:
        return run_agent(["--config", str(self.config), "screenshot", domain])


@pytest.fixture
def shots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ShotTower]:
    # The agent's temporary files land here, to show it leaves none.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    tower = realistic_tower(tmp_path / "tower", time_scale=0.01)
    yield ShotTower(tower, tmp_path)
    tower.close()
    assert list((tmp_path / "tmp").iterdir()) == []


def png_of(run: Run) -> bytes:
    reply = run.reply
    assert reply["ok"] is True, reply
    assert reply["mime"] == "image/png"
    data = base64.b64decode(reply["data"], validate=True)
    assert reply["size"] == len(data)
    return data


def test_a_recorded_real_ppm_is_sent_as_png(shots: ShotTower) -> None:
    shots.tower.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)
    picture = decode(png_of(shots.shot()))
    assert (picture.width, picture.height) == (720, 400)
    assert picture.rgb == ppm_pixels(recorded_frame())[2]


def test_a_drawn_ppm_of_any_size_keeps_its_size(shots: ShotTower) -> None:
    shots.tower.set_screen("gpu-node", mime=PPM, width=321, height=123)
    picture = decode(png_of(shots.shot()))
    assert (picture.width, picture.height) == (321, 123)
    assert any(picture.rgb)


def test_a_png_from_virsh_is_sent_as_it_is(shots: ShotTower, tmp_path: Path) -> None:
    run = shots.shot()
    saved = tmp_path / "by-virsh.png"
    subprocess.run(
        [
            str(shots.tower.virsh),
            "-c",
            shots.tower.uri,
            "screenshot",
            "gpu-node",
            str(saved),
        ],
        check=True,
        capture_output=True,
    )
    assert png_of(run) == saved.read_bytes()


def test_a_ppm_whose_png_is_over_the_limit_is_refused(shots: ShotTower) -> None:
    shots.tower.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)
    size = len(png_of(shots.shot()))
    shots.configure(screenshot_max_bytes=size - 1)
    error = shots.shot().reply["error"]
    assert error["code"] == "too_large"
    assert f"screenshot is {size} bytes as PNG, more than" in error["message"]
    shots.configure(screenshot_max_bytes=size)
    assert len(png_of(shots.shot())) == size


def test_a_png_over_the_limit_is_refused(shots: ShotTower) -> None:
    size = len(png_of(shots.shot()))
    shots.configure(screenshot_max_bytes=size - 1)
    error = shots.shot().reply["error"]
    assert error["code"] == "too_large"
    assert error["message"] == (
        f"screenshot is {size} bytes, more than screenshot_max_bytes={size - 1}"
    )


def test_a_shut_off_vm_has_no_screen(shots: ShotTower) -> None:
    error = shots.shot("gaming-1").reply["error"]
    assert error == {
        "code": "screenshot_failed",
        "message": "could not take a screenshot of gaming-1 / "
        "Requested operation is not valid: domain is not running",
    }


def test_a_malformed_ppm_from_virsh_is_refused(
    shots: ShotTower, tmp_path: Path
) -> None:
    frame = tmp_path / "bad.ppm"
    frame.write_bytes(b"P6\n4 4\n255\n" + bytes(10))
    shots.tower.set_screen("gpu-node", mime=PPM, frame=frame)
    error = shots.shot().reply["error"]
    assert error["code"] == "screenshot_failed"
    assert "its 4x4 header says" in error["message"]


def test_python39_converts_the_real_frame(shots: ShotTower) -> None:
    """The tower may run Python 3.9: the agent converts there as well."""
    python, extra = oldest_python()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(shots.directory), **extra}
    shots.tower.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)
    proc = subprocess.run(
        [
            python,
            str(AGENT),
            "--config",
            str(shots.config),
            "screenshot",
            "gpu-node",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    run = Run(proc.returncode, [json.loads(proc.stdout)], proc.stderr)
    assert decode(png_of(run)).rgb == ppm_pixels(recorded_frame())[2]
