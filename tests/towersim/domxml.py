"""Domain XML of simulated domains, as libvirt formats it back (``dumpxml``),
and as ``virsh create`` reads it.

The layout is what libvirt's test driver prints for the same definition, so
the conformance tests can compare the two texts; the simulator only changes
the domain ``type`` (``kvm`` on a simulated tower).

A live definition given to ``create`` is read for what libvirt checks first
(the root element, the name, the UUID) and then compared with the domain's
persistent definition: the simulator models a live definition that differs
from it only in its PCI ``<hostdev>`` elements (the partial lending's file),
and refuses any other difference rather than pretend to run it.
"""

from __future__ import annotations

# The simulator is a process per virsh call: typing stays out of its imports
# (about 3 ms of each start); its names are for the type checker only.
TYPE_CHECKING = False

if TYPE_CHECKING:  # imported lazily: only ``create`` parses XML
    from typing import Any
    from xml.etree.ElementTree import Element

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


# --- reading a definition (``virsh create``) -----------------------------------


class DefinitionError(Exception):
    """libvirt refuses the XML; the argument is libvirt's error text."""


class UnmodelledError(Exception):
    """Valid XML that the simulator cannot run faithfully; the argument says why."""


class Definition:
    """A parsed domain definition: what libvirt looks up before it starts it."""

    def __init__(self, root: Element, name: str, uuid: str | None) -> None:
        self.root = root
        self.name = name
        self.uuid = uuid


def read_definition(text: str) -> Definition:
    """Parse a domain's XML as libvirt does first, with libvirt's errors.

    libxml2's messages for malformed XML are not reproduced beyond the empty
    document (the line number is, the wording says it is the simulator's).
    """
    from xml.etree import ElementTree as ET  # lazy: only create parses XML

    if not text:
        raise DefinitionError("at line 1: Document is empty\n")
    try:
        root = ET.fromstring(text)  # noqa: S314 - the caller's own file
    except ET.ParseError as err:
        line = err.position[0] if err.position else 1
        raise DefinitionError(
            f"at line {line}: the tower simulator cannot parse this XML ({err})"
        ) from None
    if root.tag != "domain":
        raise DefinitionError(
            f"XML error: expecting root element of 'domain', not '{root.tag}'"
        )
    name = root.findtext("name") or ""
    if not name:
        raise DefinitionError("missing name information")
    uuid_text = root.findtext("uuid")
    uuid = None if uuid_text is None else parse_uuid(uuid_text)
    if uuid_text is not None and uuid is None:
        raise DefinitionError("internal error: malformed uuid element")
    return Definition(root, name, uuid)


def parse_uuid(text: str) -> str | None:
    """libvirt's UUID syntax (32 hex digits, ``-`` anywhere, spaces around),
    in its canonical form; None if malformed."""
    digits = text.strip(" ").replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return None
    d = digits.lower()
    return f"{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def live_hostdevs(definition: Definition, spec: JsonObj) -> list[JsonObj]:
    """The PCI hostdevs of a live definition of the domain ``spec`` describes.

    Raises ``UnmodelledError`` unless the definition is the persistent one
    (as ``dumpxml --inactive`` prints it, in any XML spelling) with other
    PCI hostdevs of the kind the simulator models.
    """
    from xml.etree import ElementTree as ET  # lazy: only create parses XML

    persistent = ET.fromstring(dump_xml(spec, None))  # noqa: S314 - our own text
    if _shape(definition.root) != _shape(persistent):
        raise UnmodelledError(
            "it differs from the persistent definition elsewhere than in "
            "its <hostdev> elements"
        )
    devices = definition.root.find("devices")
    if devices is None:
        return []
    return [_read_hostdev(dev) for dev in devices.findall("hostdev")]


def _shape(elem: Element, parent: str = "") -> tuple[Any, ...]:
    """An element without formatting: tag, attributes, text, children; the
    domain's name, UUID and ``id`` and its devices' ``<hostdev>`` left out."""
    top = parent == ""
    attrs = sorted((k, v) for k, v in elem.attrib.items() if not (top and k == "id"))
    children = tuple(
        _shape(child, elem.tag)
        for child in elem
        if not (top and child.tag in ("name", "uuid"))
        and not (elem.tag == "devices" and child.tag == "hostdev")
    )
    return (elem.tag, tuple(attrs), (elem.text or "").strip(), children)


def _read_hostdev(dev: Element) -> JsonObj:
    """A ``<hostdev>`` as the simulator's hostdev, if it is one it models."""
    if (dev.get("mode"), dev.get("type")) != ("subsystem", "pci") or set(dev.attrib) - {
        "mode",
        "type",
        "managed",
    }:
        raise UnmodelledError("a <hostdev> that is not a PCI subsystem device")
    source = dev.find("source")
    rom = dev.find("rom")
    address = None
    if source is not None and len(source) == 1 and not source.attrib:
        address = source.find("address")
    if (
        address is None
        or set(address.attrib) != {"domain", "bus", "slot", "function"}
        or len(address) > 0
        or len(dev) != (1 if rom is None else 2)
        or (rom is not None and (set(rom.attrib) != {"bar"} or len(rom) > 0))
    ):
        raise UnmodelledError(
            "a <hostdev> with more than a PCI source address and <rom bar>"
        )
    try:
        parts = [
            _number(address.get(k, "")) for k in ("domain", "bus", "slot", "function")
        ]
    except ValueError:
        raise UnmodelledError("a <hostdev> PCI address it cannot read") from None
    dom, bus, slot, function = parts
    return {
        "address": f"{dom:04x}:{bus:02x}:{slot:02x}.{function:x}",
        "managed": dev.get("managed") == "yes",
        "rom_bar": None if rom is None else rom.get("bar"),
    }


def _number(text: str) -> int:
    """A number as libvirt's ``strtol(.., 0)`` reads it (0x hex, 0 octal)."""
    if text.lower().startswith("0x"):
        return int(text[2:], 16)
    if len(text) > 1 and text.startswith("0"):
        return int(text[1:], 8)
    return int(text, 10)
