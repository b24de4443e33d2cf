"""The tower agent's `screenshot` of a real QEMU guest, as a browser gets it.

A guest with a VGA card boots under the private libvirtd (its screen: SeaBIOS
in text mode, 720x400). The agent takes its screenshot twice:

- through today's `virsh screenshot` (libvirt >= 9.0 with QEMU >= 7.1 save a
  PNG, which the agent sends as it is);
- through `virsh screenshot` as libvirt before 9.0 ran it: QEMU's screendump
  in its default format, a PPM (`image/x-portable-pixmap`), which browsers
  cannot show and the agent converts to PNG. That virsh is a wrapper that asks
  the same QEMU for the same screendump through its monitor.

Both must be PNGs of the guest's real size whose pixels are exactly the ones
QEMU's own screendump holds. A shut-off guest's screenshot fails with libvirt's
own words, which the tower simulator repeats.

    python -m tests.realvm.test_screenshot   # rewrites recorded/screen.ppm.gz

The recording is the real frame the Home Assistant tests serve through the
simulator (tests/test_image.py); the live test checks it still has the real
guest's size.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
import gzip
import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

from tests.realvm.qemu_libvirtd import domain_xml
from tests.support.agentbuild import AGENT
from tests.support.png import decode, ppm_pixels
from tests.support.waiting import wait_until
from tests.towersim import DomainSpec, Tower
from tests.towersim.helpers import sim

if TYPE_CHECKING:
    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

pytestmark = pytest.mark.system

RECORDED_FRAME = Path(__file__).parent / "recorded" / "screen.ppm.gz"
SCREEN_NODE = "screen-node"
OFF_NODE = "screen-off"
NO_VIDEO = "<video><model type='none'/></video>"
VGA = "<video><model type='vga'/></video>"
BOOT_TIMEOUT = 180.0
# What QEMU's VGA shows in text mode (80x25 cells of 9x16 pixels): SeaBIOS's
# screen, which stays once the guest's kernel logs to its serial port only.
VGA_TEXT_SIZE = (720, 400)
FRAME_SAMPLES = 10

# `virsh screenshot DOMAIN FILE` as libvirt < 9.0 runs it: QEMU writes its
# screendump (a PPM) and virsh names its type. Everything else is real virsh.
OLD_VIRSH = """#!/bin/sh
printf '%s\\n' "$*" >>"{log}"
if [ "$3" = screenshot ] && [ "$4" = --domain ] && [ "$6" = --file ]; then
  virsh -c "$2" qemu-monitor-command "$5" --hmp "screendump $7" >/dev/null || exit 1
  echo "Screenshot saved to $7, with type of image/x-portable-pixmap"
  exit 0
fi
exec virsh "$@"
"""


@dataclass
class ScreenTower:
    config: Path
    env: dict[str, str]

    def agent(self, *args: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, str(AGENT), "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
            check=False,
        )
        try:
            reply: dict[str, Any] = json.loads(proc.stdout)
        except ValueError:
            pytest.fail(f"agent said {proc.stdout!r} / {proc.stderr!r}")
        return reply


def make_screen_tower(daemon: QemuLibvirtd, base: Path, virsh: str) -> ScreenTower:
    base.mkdir()
    config = base / "config.json"
    config.write_text(
        json.dumps(
            {
                "libvirt_uri": daemon.uri,
                "gpu_node": SCREEN_NODE,
                "gaming": [OFF_NODE],
                "state_dir": str(base / "state"),
                "commands": {"virsh": virsh},
                "detach": "process",
            }
        )
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base)}
    return ScreenTower(config=config, env=env)


def define_vga_guest(daemon: QemuLibvirtd, guest: Guest, name: str) -> Path:
    """Define ``name`` with a VGA card; returns its serial log."""
    serial = daemon.data_dir / f"{name}.serial"
    xml = domain_xml(
        name,
        kernel=guest.kernel,
        initrd=guest.initrd,
        cmdline=guest.cmdline,
        serial_log=serial,
    )
    assert NO_VIDEO in xml, "the guest's video element changed"
    path = daemon.data_dir / f"{name}.xml"
    path.write_text(xml.replace(NO_VIDEO, VGA), encoding="utf-8")
    defined = daemon.virsh("define", str(path))
    assert defined.returncode == 0, defined.stderr
    return serial


def boot(daemon: QemuLibvirtd, guest: Guest, name: str) -> None:
    """Start ``name`` and wait until its /init is up (its screen then stays)."""
    serial = define_vga_guest(daemon, guest, name)
    started = daemon.virsh("start", name)
    assert started.returncode == 0, started.stderr
    wait_until(
        lambda: (
            serial.exists() and "gh-guest: up" in serial.read_text(errors="replace")
        ),
        timeout=BOOT_TIMEOUT,
        interval=0.2,
        what=f"{name} to boot",
    )


def stop(daemon: QemuLibvirtd, name: str) -> None:
    """Shut ``name`` down through its guest agent and forget it (the daemon's
    teardown destroys what does not stop)."""
    daemon.stop_guest(name)
    daemon.virsh("undefine", name)


def screendump(daemon: QemuLibvirtd, name: str, path: Path) -> bytes:
    """QEMU's own screendump of the guest, in its default format (PPM)."""
    dumped = daemon.virsh("qemu-monitor-command", name, "--hmp", f"screendump {path}")
    assert dumped.returncode == 0, dumped.stderr
    return path.read_bytes()


def screen_frames(daemon: QemuLibvirtd, name: str, directory: Path) -> set[bytes]:
    """The distinct pixels of QEMU's screendumps over a second or so: the
    screen is still but for the blinking text cursor, so one or two frames."""
    frames = set()
    for i in range(FRAME_SAMPLES):
        size = ppm_pixels(screendump(daemon, name, directory / f"qemu-{i}.ppm"))
        assert size[:2] == VGA_TEXT_SIZE
        frames.add(size[2])
        time.sleep(0.1)
    assert len(frames) <= 2, "the screen is not still: nothing can be compared"
    assert all(any(frame) for frame in frames), "the screen is blank"
    return frames


def png_of(reply: dict[str, Any]) -> bytes:
    assert reply["ok"], reply
    assert reply["mime"] == "image/png"
    png = base64.b64decode(reply["data"], validate=True)
    assert len(png) == reply["size"]
    return png


def test_a_real_guest_screen_arrives_as_a_png_of_its_size(
    qemu_libvirtd: QemuLibvirtd,
    guest: Guest,
    tmp_path: Path,
    realvm_timings: dict[str, float],
) -> None:
    daemon = qemu_libvirtd
    boot(daemon, guest, SCREEN_NODE)
    define_vga_guest(daemon, guest, OFF_NODE)
    try:
        frames = screen_frames(daemon, SCREEN_NODE, tmp_path)

        real_virsh = shutil.which("virsh")
        assert real_virsh is not None
        today = make_screen_tower(daemon, tmp_path / "today", real_virsh)
        started = time.monotonic()
        picture = decode(png_of(today.agent("screenshot", SCREEN_NODE)))
        realvm_timings["agent screenshot, PNG"] = time.monotonic() - started
        assert (picture.width, picture.height) == VGA_TEXT_SIZE
        assert picture.rgb in frames

        log = tmp_path / "old-virsh.log"
        wrapper = tmp_path / "old-virsh"
        wrapper.write_text(OLD_VIRSH.format(log=log), encoding="utf-8")
        wrapper.chmod(0o755)
        before = make_screen_tower(daemon, tmp_path / "before-9", str(wrapper))
        started = time.monotonic()
        png = png_of(before.agent("screenshot", SCREEN_NODE))
        realvm_timings["agent screenshot, PPM to PNG"] = time.monotonic() - started
        assert "screenshot --domain screen-node --file" in log.read_text()
        converted = decode(png)
        assert (converted.width, converted.height) == VGA_TEXT_SIZE
        assert converted.rgb in frames | screen_frames(daemon, SCREEN_NODE, tmp_path)

        # The Home Assistant tests' recorded frame is this guest's screen.
        recorded = ppm_pixels(gzip.decompress(RECORDED_FRAME.read_bytes()))
        assert recorded[:2] == VGA_TEXT_SIZE

        # A shut-off guest: libvirt's words, and the simulator's.
        off = today.agent("screenshot", OFF_NODE)
        assert off["ok"] is False
        assert off["error"]["code"] == "screenshot_failed"
        tower = Tower.create(tmp_path / "sim", [DomainSpec(name=OFF_NODE)])
        said = sim(tower, "screenshot", "--domain", OFF_NODE, "--file", "x.png")
        real = daemon.virsh("screenshot", "--domain", OFF_NODE, "--file", "x.png")
        assert (said.rc, said.err) == (real.returncode, real.stderr)
        tower.close()
    finally:
        daemon.virsh("undefine", OFF_NODE)
        stop(daemon, SCREEN_NODE)


def record() -> None:
    """Boot the guest and record its screen (QEMU's PPM, gzip-compressed)."""
    from tests.realvm.build_guest import build_guest, cache_dir
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

    guest = build_guest(log=True)
    with QemuLibvirtd(cache_dir=cache_dir() / "libvirt-cache") as daemon:
        boot(daemon, guest, SCREEN_NODE)
        frame = screendump(daemon, SCREEN_NODE, daemon.data_dir / "frame.ppm")
        stop(daemon, SCREEN_NODE)
    RECORDED_FRAME.write_bytes(gzip.compress(frame, mtime=0))
    width, height, _ = ppm_pixels(frame)
    print(f"{RECORDED_FRAME}: {width}x{height}")


if __name__ == "__main__":
    record()
