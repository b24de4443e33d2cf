"""IOMMU (VFIO) groups in the tower simulator: a group is passed through whole.

From libvirt's sources (none of this is pinned by a live run here: libvirt's
test driver has no host devices, and this machine no VFIO):

- ``src/hypervisor/virhostdev.c`` ``virHostdevPreparePCIDevicesImpl``, step 1:
  for each PCI function of the starting domain, in order, the function itself
  (``virHostdevIsPCINodeDeviceUsed``), then, for a VFIO device, every function
  of its IOMMU group (``virPCIDeviceAddressIOMMUGroupIterate``). A function
  another domain holds fails the start with
  ``PCI device %1$s is in use by driver %2$s, domain %3$s``
  (``VIR_ERR_OPERATION_INVALID``: "Requested operation is not valid: ..."),
  naming THAT function, which the starting domain's XML may not have;
- ``src/util/virpci.c``: ``virPCIDeviceAddressIOMMUGroupIterate`` lists
  ``/sys/bus/pci/devices/ADDR/iommu_group/devices``, and
  ``virPCIDeviceAddressGetIOMMUGroupNum`` takes the group's number from the
  last component of the ``iommu_group`` link;
- the qemu driver calls it from ``qemuProcessPrepareHost`` (via
  ``qemuHostdevPrepareDomainDevices``), after ``qemuProcessInit`` ran the
  ``prepare`` hook: the refused start runs the stop hooks and leaves the
  domain ``shut off (failed)``, as for a function of its own in use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import sys

import pytest

from tests.towersim import Tower, realistic_tower
from tests.towersim.conftest import FAST
from tests.towersim.helpers import sim

NODE_CARD = ["0000:01:00.0", "0000:01:00.1"]  # the GPU node's own
CARD_1 = ["0000:03:00.0", "0000:03:00.1"]  # gaming-1's
CARD_2 = ["0000:04:00.0", "0000:04:00.1"]  # gaming-2's
HOOK = "/etc/libvirt/hooks/qemu"


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[Tower]:
    """The realistic tower with every domain shut off."""
    sim_tower = realistic_tower(
        tmp_path / "tower", time_scale=FAST, gpu_node_running=False
    )
    yield sim_tower
    sim_tower.close()


def group_of(tower: Tower, address: str) -> tuple[int, list[str]]:
    """A function's group as libvirt reads it from sysfs."""
    link = tower.sysfs / "bus" / "pci" / "devices" / address / "iommu_group"
    number = int(link.readlink().name)
    return number, sorted(entry.name for entry in (link / "devices").iterdir())


def live_xml_without(tower: Tower, path: Path, cards: list[str]) -> Path:
    """The GPU node's persistent definition minus the hostdevs of ``cards``."""
    text = sim(tower, "dumpxml", "--inactive", "--domain", "gpu-node").out[:-1]
    for address in cards:
        bus = address.split(":")[1]
        func = address.rsplit(".", 1)[1]
        start = text.index(f"bus='0x{bus}' slot='0x00' function='0x{func}'")
        begin = text.rindex("    <hostdev ", 0, start)
        end = text.index("    </hostdev>\n", start) + len("    </hostdev>\n")
        text = text[:begin] + text[end:]
    path.write_text(text, encoding="utf-8")
    return path


def test_each_card_has_a_group_of_its_own_by_default(idle: Tower) -> None:
    """A board with ACS: one group per card (bus:slot), its functions in it."""
    assert idle.iommu_groups() == {11: NODE_CARD, 13: CARD_1, 14: CARD_2}
    for card in (NODE_CARD, CARD_1, CARD_2):
        for address in card:
            number, members = group_of(idle, address)
            assert members == card
            assert (
                idle.sysfs / "kernel" / "iommu_groups" / str(number) / "devices"
            ).is_dir()
    # gaming-1 plays; the GPU node starts with the other cards
    assert sim(idle, "start", "--domain", "gaming-1").rc == 0
    idle.start_live("gpu-node", NODE_CARD + CARD_2)
    assert idle.live_hostdevs("gpu-node") == NODE_CARD + CARD_2


def test_a_start_is_refused_for_a_group_mate_another_domain_holds(
    idle: Tower, tmp_path: Path
) -> None:
    """No ACS: the GPU node's own card shares a group with gaming-1's. While
    gaming-1 plays, the GPU node cannot start even without gaming-1's card:
    libvirt names gaming-1's function, which the GPU node's XML does not have."""
    idle.set_iommu_group(11, NODE_CARD + CARD_1)
    assert group_of(idle, "0000:01:00.1") == (11, sorted(NODE_CARD + CARD_1))
    assert group_of(idle, "0000:03:00.0") == (11, sorted(NODE_CARD + CARD_1))
    assert group_of(idle, "0000:04:00.0") == (14, CARD_2)
    log = tmp_path / "hook.log"
    idle.set_hook(
        [
            sys.executable,
            "-c",
            f"import sys; open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')",
        ],
        path=HOOK,
    )
    assert sim(idle, "start", "--domain", "gaming-1").rc == 0
    live = live_xml_without(idle, tmp_path / "live.xml", CARD_1)
    got = sim(idle, "create", "--file", str(live))
    assert (got.rc, got.out) == (1, "\n")
    assert got.err == (
        f"error: Failed to create domain from {live}\n"
        "error: Requested operation is not valid: PCI device 0000:03:00.0 is in use "
        "by driver QEMU, domain gaming-1\n"
    )
    # refused after the prepare hook (qemuProcessPrepareHost), then stopped
    assert log.read_text(encoding="utf-8").splitlines()[-4:] == [
        "gaming-1 started begin -",
        "gpu-node prepare begin -",
        "gpu-node stopped end -",
        "gpu-node release end failed",
    ]
    assert idle.domstate("gpu-node") == "shut off (failed)"
    # without the GPU node's card too (only gaming-2's): it starts
    idle.start_live("gpu-node", CARD_2)
    assert idle.live_hostdevs("gpu-node") == CARD_2


def test_the_starting_domains_own_function_is_checked_before_its_group(
    idle: Tower,
) -> None:
    """Function by function: the function itself, then its group."""
    idle.set_iommu_group(11, NODE_CARD + CARD_1)
    assert sim(idle, "start", "--domain", "gaming-2").rc == 0
    assert sim(idle, "start", "--domain", "gaming-1").rc == 0
    # the GPU node's first function is 0000:01:00.0: its group holds
    # gaming-1's functions, found before gaming-2's 0000:04:00.0
    got = sim(idle, "start", "--domain", "gpu-node")
    assert got.err.endswith(
        "PCI device 0000:03:00.0 is in use by driver QEMU, domain gaming-1\n"
    )


def test_two_domains_of_one_group_cannot_both_run(idle: Tower) -> None:
    """Two domains in one group cannot both run: the second start is refused,
    whichever card each has; the first's stop frees the group."""
    idle.set_iommu_group(20, CARD_1 + CARD_2)
    assert sim(idle, "start", "--domain", "gaming-2").rc == 0
    got = sim(idle, "start", "--domain", "gaming-1")
    assert got.err == (
        "error: Failed to start domain 'gaming-1'\n"
        "error: Requested operation is not valid: PCI device 0000:04:00.0 is in use "
        "by driver QEMU, domain gaming-2\n"
    )
    idle.guest_shutdown("gaming-2")
    idle.advance(1.0)
    assert sim(idle, "start", "--domain", "gaming-1").rc == 0
