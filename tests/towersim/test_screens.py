"""The simulator's screens (``Tower.set_screen``): what `virsh screenshot`
saves and says, for current libvirt (PNG) and older libvirt or QEMU (QEMU's
PPM), drawn or a recorded real frame.

The PNG form is pinned against libvirt's test driver (test_conformance.py);
the recorded frame and a shut-off domain's error against real QEMU guests
(tests/realvm/test_screenshot.py).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tests.realvm.test_screenshot import RECORDED_FRAME
from tests.support.png import decode, ppm_pixels
from tests.towersim import Tower
from tests.towersim.helpers import png_size, sim

PPM = "image/x-portable-pixmap"


def test_a_drawn_ppm_of_the_asked_size(tower: Tower, tmp_path: Path) -> None:
    tower.set_screen("gpu-node", mime=PPM, width=33, height=7)
    path = tmp_path / "shot"
    got = sim(tower, "screenshot", "--domain", "gpu-node", "--file", str(path))
    assert (got.rc, got.err) == (0, "")
    assert got.out == f"Screenshot saved to {path}, with type of {PPM}\n"
    width, height, pixels = ppm_pixels(path.read_bytes())
    assert (width, height) == (33, 7)
    assert any(pixels)
    assert sim(tower, "-q", "screenshot", "gpu-node", str(path)).out == ""


def test_the_recorded_frame_is_saved_as_it_is(tower: Tower, tmp_path: Path) -> None:
    tower.set_screen("gpu-node", mime=PPM, frame=RECORDED_FRAME)
    path = tmp_path / "shot"
    assert sim(tower, "screenshot", "gpu-node", "--file", str(path)).rc == 0
    assert path.read_bytes() == gzip.decompress(RECORDED_FRAME.read_bytes())


def test_a_drawn_png_of_the_asked_size(tower: Tower, tmp_path: Path) -> None:
    tower.set_screen("gpu-node", width=64, height=48)
    path = tmp_path / "shot.png"
    got = sim(tower, "screenshot", "gpu-node", "--file", str(path))
    assert got.out == f"Screenshot saved to {path}, with type of image/png\n"
    assert png_size(path) == (64, 48)
    assert len(decode(path.read_bytes()).rgb) == 64 * 48 * 3


def test_without_a_file_the_name_ends_as_its_type(
    tower: Tower, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    tower.set_screen("gpu-node", mime=PPM, width=2, height=2)
    got = sim(tower, "screenshot", "gpu-node")
    (saved,) = (path.name for path in here.iterdir())
    assert saved.startswith("gpu-node-")
    assert saved.endswith(".ppm")
    assert got.out == f"Screenshot saved to {saved}, with type of {PPM}\n"


def test_a_shut_off_domain_has_no_screen_whatever_it_would_show(
    tower: Tower, tmp_path: Path
) -> None:
    tower.set_screen("gaming-1", mime=PPM, frame=RECORDED_FRAME)
    got = sim(tower, "screenshot", "gaming-1", "--file", str(tmp_path / "x"))
    assert got.rc == 1
    assert got.err == (
        "error: could not take a screenshot of gaming-1\n"
        "error: Requested operation is not valid: domain is not running\n"
    )
    assert not (tmp_path / "x").exists()


def test_only_the_types_virsh_saves(tower: Tower) -> None:
    with pytest.raises(ValueError, match="image/jpeg"):
        tower.set_screen("gpu-node", mime="image/jpeg")
    with pytest.raises(KeyError):
        tower.set_screen("no-such-domain")
