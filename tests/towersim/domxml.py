"""Domain XML of simulated domains, as libvirt formats it back (``dumpxml``).

The layout is what libvirt's test driver prints for the same definition, so
the conformance tests can compare the two texts; the simulator only changes
the domain ``type`` (``kvm`` on a simulated tower).
"""

from __future__ import annotations

from typing import Any

JsonObj = dict[str, Any]


def escape(text: str) -> str:
    """XML text escaping (xml.sax.saxutils is slow to import)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def quote(value: str) -> str:
    """An attribute value in libvirt's single quotes."""
    return "'" + escape(value).replace("'", "&apos;") + "'"


def _address_attrs(address: str) -> str:
    dom, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return (
        f"domain='0x{int(dom, 16):04x}' bus='0x{int(bus, 16):02x}' "
        f"slot='0x{int(slot, 16):02x}' function='0x{int(function, 16):x}'"
    )


def _hostdev(dev: JsonObj, indent: str) -> str:
    managed = "yes" if dev.get("managed", True) else "no"
    lines = [
        f"{indent}<hostdev mode='subsystem' type='pci' managed='{managed}'>",
        f"{indent}  <source>",
        f"{indent}    <address {_address_attrs(dev['address'])}/>",
        f"{indent}  </source>",
    ]
    if dev.get("rom_bar") is not None:
        lines.append(f"{indent}  <rom bar='{dev['rom_bar']}'/>")
    lines.append(f"{indent}</hostdev>")
    return "\n".join(lines)


def define_xml(spec: JsonObj, domain_type: str | None = None) -> str:
    """The XML a user would give ``virsh define`` for this spec."""
    kind = domain_type or spec.get("domain_type", "kvm")
    parts = [f"<domain type='{kind}'>", f"  <name>{escape(spec['name'])}</name>"]
    parts.append(f"  <uuid>{spec['uuid']}</uuid>")
    if spec.get("title"):
        parts.append(f"  <title>{escape(spec['title'])}</title>")
    parts.append(f"  <memory unit='KiB'>{int(spec['memory_mib']) * 1024}</memory>")
    parts.append(f"  <vcpu>{int(spec['vcpus'])}</vcpu>")
    parts.append(
        f"  <os><type arch='x86_64' machine={quote(spec['machine'])}>hvm</type></os>"
    )
    parts.append("  <devices>")
    if spec.get("agent_channel", True):
        parts.append(
            "    <channel type='unix'><target type='virtio' "
            "name='org.qemu.guest_agent.0'/></channel>"
        )
    parts.extend(_hostdev(dev, "    ") for dev in spec.get("hostdevs", []))
    parts.append("  </devices>")
    parts.append("</domain>")
    return "\n".join(parts) + "\n"


def dump_xml(
    spec: JsonObj, domain_id: int | None, domain_type: str | None = None
) -> str:
    """``virsh dumpxml`` of the domain (without virsh's trailing newline)."""
    kind = domain_type or spec.get("domain_type", "kvm")
    head = f"<domain type='{kind}'" + (f" id='{domain_id}'" if domain_id else "") + ">"
    kib = int(spec["memory_mib"]) * 1024
    lines = [
        head,
        f"  <name>{escape(spec['name'])}</name>",
        f"  <uuid>{spec['uuid']}</uuid>",
    ]
    if spec.get("title"):
        lines.append(f"  <title>{escape(spec['title'])}</title>")
    lines += [
        f"  <memory unit='KiB'>{kib}</memory>",
        f"  <currentMemory unit='KiB'>{kib}</currentMemory>",
        f"  <vcpu placement='static'>{int(spec['vcpus'])}</vcpu>",
        "  <os>",
        f"    <type arch='x86_64' machine={quote(spec['machine'])}>hvm</type>",
        "    <boot dev='hd'/>",
        "  </os>",
        "  <clock offset='utc'/>",
        "  <on_poweroff>destroy</on_poweroff>",
        "  <on_reboot>restart</on_reboot>",
        "  <on_crash>destroy</on_crash>",
        "  <devices>",
    ]
    if spec.get("agent_channel", True):
        lines += [
            "    <controller type='virtio-serial' index='0'/>",
            "    <channel type='unix'>",
            "      <target type='virtio' name='org.qemu.guest_agent.0'/>",
            "    </channel>",
        ]
    lines.extend(_hostdev(dev, "    ") for dev in spec.get("hostdevs", []))
    lines += ["  </devices>", "</domain>"]
    return "\n".join(lines) + "\n"
