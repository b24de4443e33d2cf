"""Partial lending on real QEMU: a defined guest started with ``virsh create``
from a live-only definition (its persistent definition minus one device, the
same name and UUID), as the tower agent starts the GPU node without the cards
it lends.

PCI hostdevs cannot run here (no VFIO), so a second disk stands in for a lent
card: the same XML path (a device element of ``<devices>`` left out of the live
definition). The guest must boot without it (QEMU's own block list says so),
its guest agent must answer, the persistent definition must stay byte for byte
what it was, and once the guest shuts down through its agent ``dumpxml`` shows
the full persistent definition again. The events of that create are compared
with what the tower simulator prints for its own create.
"""

from __future__ import annotations

from pathlib import Path
import re
import tempfile
import time
from typing import TYPE_CHECKING

import pytest

from tests.realvm.qemu_libvirtd import EventLog, domain_xml
from tests.support.waiting import wait_until
from tests.towersim import DomainSpec, Hostdev, Tower
from tests.towersim.helpers import sim

if TYPE_CHECKING:
    from tests.realvm.build_guest import Guest
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

pytestmark = pytest.mark.system

LEND_NODE = "lend-node"
KEPT_DEV, LENT_DEV = "vdb", "vdc"
PING = '{"execute":"guest-ping"}'
BOOT_TIMEOUT = 180.0
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+\d{4}: ")
# QEMU also reports the agent going away when the guest closes its channel
# before powering off; the simulator does not (tests/towersim/CONTRACT.md).
CHANNEL_CLOSED = "state: 'disconnected' reason: 'channel event'"


def disk(image: Path, dev: str) -> str:
    return (
        "    <disk type='file' device='disk'>\n"
        "      <driver name='qemu' type='raw'/>\n"
        f"      <source file='{image}'/>\n"
        f"      <target dev='{dev}' bus='virtio'/>\n"
        "    </disk>\n"
    )


def define_with_disks(
    daemon: QemuLibvirtd, guest: Guest, images: dict[str, Path]
) -> None:
    """Define the guest with one extra raw disk per target device."""
    xml = domain_xml(
        LEND_NODE,
        kernel=guest.kernel,
        initrd=guest.initrd,
        cmdline=guest.cmdline,
        serial_log=daemon.data_dir / f"{LEND_NODE}.serial",
    )
    for image in images.values():
        with image.open("wb") as handle:
            handle.truncate(1024 * 1024)
    disks = "".join(disk(image, dev) for dev, image in images.items())
    assert "    <serial type='file'>" in xml, "the guest's devices changed"
    xml = xml.replace("    <serial type='file'>", disks + "    <serial type='file'>")
    path = daemon.data_dir / f"{LEND_NODE}.xml"
    path.write_text(xml, encoding="utf-8")
    defined = daemon.virsh("define", str(path))
    assert defined.returncode == 0, defined.stderr


def without_disk(xml: str, dev: str) -> str:
    """libvirt's XML text without the ``<disk>`` of target ``dev``, every other
    line kept as it is (what the agent does with a lent card's hostdevs)."""
    blocks = re.findall(r"    <disk [^\n]*>\n(?:      [^\n]*\n)*?    </disk>\n", xml)
    lent = [b for b in blocks if f"<target dev='{dev}'" in b]
    assert len(lent) == 1, blocks
    return xml.replace(lent[0], "")


def virsh_ok(daemon: QemuLibvirtd, *args: str) -> str:
    done = daemon.virsh(*args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def qemu_block_devices(daemon: QemuLibvirtd) -> str:
    """QEMU's own list of the guest's block devices (its monitor)."""
    return virsh_ok(daemon, "qemu-monitor-command", LEND_NODE, "--hmp", "info block")


def bare(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        assert TIMESTAMP.match(line), line
        out.append(TIMESTAMP.sub("", line))
    return out


def phase(line: str) -> int:
    """Where an event line belongs: the boot, the agent up, the power-off."""
    if "Shutdown Finished" in line or "Stopped" in line:
        return 2
    if "state: 'connected'" in line:
        return 1
    return 0


def simulated_create_events(root: Path) -> list[str]:
    """The tower simulator's events for the same story: a create from a live
    definition without one of two devices, the agent up, an agent shutdown."""
    tower = Tower.create(
        root,
        [
            DomainSpec(
                LEND_NODE,
                hostdevs=[Hostdev("0000:01:00.0"), Hostdev("0000:02:00.0")],
                agent_delay=2.0,
                shutdown_duration=1.0,
            )
        ],
    )
    try:
        inactive = sim(tower, "dumpxml", "--inactive", "--domain", LEND_NODE).out
        lent = re.compile(
            r"    <hostdev [^\n]*>\n      <source>\n        <address [^\n]*"
            r"bus='0x02'[^\n]*\n      </source>\n(?:      [^\n]*\n)*?    </hostdev>\n"
        )
        live = root / "live.xml"
        live.write_text(lent.sub("", inactive[:-1]), encoding="utf-8")
        before = len(tower.events())
        assert sim(tower, "create", "--file", str(live)).rc == 0
        assert tower.live_hostdevs(LEND_NODE) == ["0000:01:00.0"]
        tower.advance(3.0)
        assert sim(tower, "shutdown", "--mode", "agent", LEND_NODE).rc == 0
        tower.advance(2.0)
        return bare(tower.events()[before:])
    finally:
        tower.close()


def test_a_guest_created_from_a_reduced_live_definition(
    qemu_libvirtd: QemuLibvirtd,
    guest: Guest,
    tmp_path: Path,
    realvm_timings: dict[str, float],
) -> None:
    daemon = qemu_libvirtd
    images = {
        KEPT_DEV: daemon.data_dir / "lend-kept.img",
        LENT_DEV: daemon.data_dir / "lend-lent.img",
    }
    define_with_disks(daemon, guest, images)
    live_dir = Path(tempfile.mkdtemp(prefix="gpu-handoff-live-", dir=daemon.data_dir))
    live = live_dir / "live.xml"
    events = EventLog(daemon, "lend-events")
    try:
        inactive = virsh_ok(daemon, "dumpxml", "--inactive", "--domain", LEND_NODE)
        secure = virsh_ok(
            daemon, "dumpxml", "--inactive", "--security-info", "--domain", LEND_NODE
        )
        assert f"<target dev='{LENT_DEV}'" in secure
        live.write_text(without_disk(secure[:-1], LENT_DEV), encoding="utf-8")

        started = time.monotonic()
        created = daemon.virsh("create", "--file", str(live))
        assert (created.returncode, created.stdout, created.stderr) == (
            0,
            f"Domain '{LEND_NODE}' created from {live}\n\n",
            "",
        )
        wait_until(
            lambda: (
                daemon.virsh(
                    "qemu-agent-command", "--timeout", "2", "--domain", LEND_NODE, PING
                ).stdout
                == '{"return":{}}\n\n'
            ),
            timeout=BOOT_TIMEOUT,
            interval=0.5,
            what="the guest agent of the created guest",
        )
        realvm_timings["create to guest-ping"] = time.monotonic() - started

        # The guest runs without the lent device...
        running = virsh_ok(daemon, "dumpxml", "--domain", LEND_NODE)
        assert re.match(r"<domain type='qemu' id='\d+'>", running)
        assert f"<target dev='{KEPT_DEV}'" in running
        assert f"<target dev='{LENT_DEV}'" not in running
        blocks = qemu_block_devices(daemon)
        assert str(images[KEPT_DEV]) in blocks
        assert str(images[LENT_DEV]) not in blocks
        # ...and is still the persistent domain, whose definition is untouched.
        assert virsh_ok(daemon, "dumpxml", "--inactive", "--domain", LEND_NODE) == (
            inactive
        )
        assert (
            virsh_ok(
                daemon,
                "dumpxml",
                "--inactive",
                "--security-info",
                "--domain",
                LEND_NODE,
            )
            == secure
        )
        assert LEND_NODE in virsh_ok(daemon, "list", "--persistent", "--name").split()
        again = daemon.virsh("create", "--file", str(live))
        assert (again.returncode, again.stdout, again.stderr) == (
            1,
            "\n",
            (
                f"error: Failed to create domain from {live}\n"
                "error: Requested operation is not valid: "
                f"domain '{LEND_NODE}' is already active\n"
            ),
        )

        # (either of libvirt's answers for a guest that powers off)
        daemon.shutdown_by_agent(LEND_NODE)
        wait_until(
            lambda: (
                daemon.virsh("domstate", "--reason", LEND_NODE).stdout
                == "shut off (shutdown)\n\n"
            ),
            timeout=60,
            interval=0.2,
            what="the created guest to shut off",
        )
        events.wait_for(f"for domain '{LEND_NODE}': Stopped Shutdown", timeout=30)
        # The live definition is gone: the full persistent one again.
        assert virsh_ok(daemon, "dumpxml", "--domain", LEND_NODE) == inactive
        assert virsh_ok(daemon, "dumpxml", "--inactive", "--domain", LEND_NODE) == (
            inactive
        )
        real_events = [
            line
            for line in bare(events.lines())
            if f"for domain '{LEND_NODE}'" in line and CHANNEL_CLOSED not in line
        ]
    finally:
        events.stop()
        daemon.stop_guest(LEND_NODE)
        daemon.virsh("undefine", LEND_NODE)

    # A create reports what a start does, on QEMU as in the simulator.
    assert real_events[-2:] == [
        f"event 'lifecycle' for domain '{LEND_NODE}': Shutdown Finished after guest request",
        f"event 'lifecycle' for domain '{LEND_NODE}': Stopped Shutdown",
    ]
    assert f"event 'lifecycle' for domain '{LEND_NODE}': Started Booted" in real_events
    # The same lines, phase after phase; within the boot, libvirt queues
    # `Resumed` (QEMU's monitor thread) and `Started` (the API) in either order.
    phases = [phase(line) for line in real_events]
    assert phases == sorted(phases), real_events
    simulated = simulated_create_events(tmp_path / "sim")
    assert sorted(simulated) == sorted(real_events), (simulated, real_events)
