"""Domain definitions for the libvirt test driver: a GPU node and two gaming VMs.

The GPU node claims every card (01:00.0/.1 and 02:00.0/.1); each gaming VM claims
one card. ``gpu-node``'s 02:00.1 has no ``<rom bar='off'/>`` (a finding), and
``win-2`` has no guest-agent channel (a finding).
"""

from __future__ import annotations

from pathlib import Path

TEST_NS = "http://libvirt.org/schemas/domain/test/1.0"
AGENT_CHANNEL = "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>"


def hostdev(
    bus: int, function: int, rom: str | None = "off", managed: str = "yes"
) -> str:
    """One PCI hostdev element."""
    rom_xml = f"<rom bar='{rom}'/>" if rom else ""
    return (
        f"<hostdev mode='subsystem' type='pci' managed='{managed}'><source>"
        f"<address domain='0x0000' bus='0x{bus:02x}' slot='0x00' function='0x{function:x}'/>"
        f"</source>{rom_xml}</hostdev>"
    )


TITLES = {"win-1": "Gaming station 1"}


def domain_xml(
    name: str, devices: str, *, running: bool, test_driver_file: bool = True
) -> str:
    """A domain for the test driver (``runstate`` only inside a node file)."""
    runstate = (
        "" if running or not test_driver_file else "<test:runstate>5</test:runstate>"
    )
    ns = f" xmlns:test='{TEST_NS}'" if test_driver_file else ""
    title = f"<title>{TITLES[name]}</title>" if name in TITLES else ""
    return (
        f"<domain type='test'{ns}><name>{name}</name>{title}<memory>1048576</memory>"
        f"<vcpu>1</vcpu><os><type>hvm</type></os><devices>{devices}</devices>"
        f"{runstate}</domain>"
    )


GPU_NODE_DEVICES = (
    hostdev(1, 0)
    + hostdev(1, 1)
    + hostdev(2, 0)
    + hostdev(2, 1, rom=None)
    + AGENT_CHANNEL
)
WIN1_DEVICES = hostdev(1, 0, rom="on") + hostdev(1, 1, managed="no") + AGENT_CHANNEL
WIN2_DEVICES = hostdev(2, 0) + hostdev(2, 1)
# A domain the agent does not manage that also claims a card.
OTHER_DEVICES = hostdev(2, 0)


def domains(*, gpu_running: bool = True, other: bool = False) -> dict[str, str]:
    """Domain name -> devices XML of the standard tower."""
    out = {
        "gpu-node": GPU_NODE_DEVICES,
        "win-1": WIN1_DEVICES,
        "win-2": WIN2_DEVICES,
    }
    if other:
        out["other-vm"] = OTHER_DEVICES
    return out


def write_node_file(
    path: Path, *, running: tuple[str, ...] = ("gpu-node",), other: bool = False
) -> Path:
    """A ``test:///PATH`` node file; domains in ``running`` start running."""
    body = "".join(
        domain_xml(name, devices, running=name in running)
        for name, devices in domains(other=other).items()
    )
    path.write_text(f"<node>{body}</node>\n", encoding="utf-8")
    return path
