"""A tower on libvirt's test driver, and the agent configuration for it.

``test:///PATH/node.xml`` starts every virsh call from the file again, so this
tower is stateless: right for reading status, card ownership and findings.
"""

from __future__ import annotations

import json
from pathlib import Path
import sys

# The agent's program; many tests import it from here.
from tests.support.agentbuild import AGENT

NODE_XML = """<node>
{domains}
</node>
"""
DOMAIN_XML = """<domain type='test' xmlns:test='http://libvirt.org/schemas/domain/test/1.0'>
  <name>{name}</name>
  <title>{title}</title>
  <memory unit='MiB'>256</memory>
  <os><type arch='x86_64'>hvm</type></os>
  <devices>
    <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
    {hostdevs}
  </devices>
  {runstate}
</domain>"""
HOSTDEV_XML = """<hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0x{bus:02x}' slot='0x00' function='0x{function}'/></source>
      {rom}
    </hostdev>"""
SHUT_OFF = "<test:runstate>5</test:runstate>"


def _hostdevs(*buses: int, rom_bar_off: bool = True) -> str:
    rom = "<rom bar='off'/>" if rom_bar_off else ""
    return "\n    ".join(
        HOSTDEV_XML.format(bus=bus, function=function, rom=rom)
        for bus in buses
        for function in (0, 1)
    )


def write_tower(
    directory: Path,
    *,
    gpu_node_running: bool = True,
    gpu_node_rom_bar_off: bool = True,
    gaming_running: tuple[str, ...] = (),
) -> Path:
    """A test-driver tower: by default the GPU node running with all three cards
    and both gaming VMs off. Rewriting it changes what the next virsh call sees.
    Returns the agent's configuration file."""
    directory.mkdir(parents=True, exist_ok=True)
    domains = [
        DOMAIN_XML.format(
            name="gpu-node",
            title="GPU node",
            hostdevs=_hostdevs(1, 2, 3, rom_bar_off=gpu_node_rom_bar_off),
            runstate="" if gpu_node_running else SHUT_OFF,
        ),
        *(
            DOMAIN_XML.format(
                name=f"gaming-{n}",
                title=f"Gaming station {n}",
                hostdevs=_hostdevs(n + 1),
                runstate="" if f"gaming-{n}" in gaming_running else SHUT_OFF,
            )
            for n in (1, 2)
        ),
    ]
    node = directory / "node.xml"
    node.write_text(NODE_XML.format(domains="\n".join(domains)), encoding="utf-8")
    config = directory / "config.json"
    config.write_text(
        json.dumps(
            {
                "libvirt_uri": f"test://{node}",
                "gpu_node": "gpu-node",
                "gaming": ["gaming-1", "gaming-2"],
                "state_dir": str(directory / "state"),
                "detach": "process",
                # the test driver's PCI functions have no IOMMU groups (this
                # machine's own are not theirs)
                "sysfs": str(directory / "sys"),
            }
        ),
        encoding="utf-8",
    )
    return config


def agent_command(config: Path) -> list[str]:
    """The forced command of the tower's authorized_keys line (-S: the agent
    is the standard library alone; the test environment's site-packages
    would cost a fifth of each of its many starts)."""
    return [sys.executable, "-S", str(AGENT), "--config", str(config), "serve"]
