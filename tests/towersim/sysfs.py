# ruff: noqa: PTH101, PTH103, PTH104, PTH112, PTH118, PTH120, PTH211, S103
"""The part of the tower's sysfs that tells IOMMU groups, as Linux lays it out.

For each PCI function ``ADDR`` of the tower (see ``model.pci_functions``):

- ``devices/pci0000:00/ADDR/``, the device's directory, with
  ``iommu_group -> ../../../kernel/iommu_groups/N``;
- ``bus/pci/devices/ADDR -> ../../../devices/pci0000:00/ADDR``;
- ``kernel/iommu_groups/N/devices/ADDR -> ../../../../devices/pci0000:00/ADDR``.

So ``bus/pci/devices/ADDR/iommu_group`` resolves to the group (its last
component is the number: libvirt's ``virPCIDeviceAddressGetIOMMUGroupNum``)
and ``bus/pci/devices/ADDR/iommu_group/devices`` lists the group's functions
(``virPCIDeviceAddressIOMMUGroupIterate``), both in src/util/virpci.c. Every
entry is readable by anyone, as on Linux. Real devices sit below their bridges
(``pci0000:00/0000:00:01.0/ADDR``); the simulator keeps them flat, which
changes no path the agent or libvirt reads.

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from . import model


def write_tree(root: str, data: dict[str, Any]) -> None:
    """(Re)write the tree at ``root`` for the tower's state ``data``; the new
    tree replaces the old one in one rename, so a reader sees one or the other."""
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".sys-")
    for number, members in sorted(model.iommu_groups(data).items()):
        group = os.path.join(tmp, "kernel", "iommu_groups", str(number), "devices")
        os.makedirs(group, exist_ok=True)
        for address in members:
            device = os.path.join(tmp, "devices", "pci0000:00", address)
            os.makedirs(device, exist_ok=True)
            os.symlink(
                f"../../../kernel/iommu_groups/{number}",
                os.path.join(device, "iommu_group"),
            )
            bus = os.path.join(tmp, "bus", "pci", "devices")
            os.makedirs(bus, exist_ok=True)
            os.symlink(
                f"../../../devices/pci0000:00/{address}", os.path.join(bus, address)
            )
            os.symlink(
                f"../../../../devices/pci0000:00/{address}",
                os.path.join(group, address),
            )
    for path, dirs, _files in os.walk(tmp):
        os.chmod(path, 0o755)
        for name in dirs:
            os.chmod(os.path.join(path, name), 0o755)
    old = None
    if os.path.isdir(root):
        old = tempfile.mkdtemp(dir=parent, prefix=".sys-old-")
        os.rename(root, os.path.join(old, "sys"))
    os.rename(tmp, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
