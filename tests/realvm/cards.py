"""Stand-in GPUs for real QEMU guests: the cards a domain's ``<metadata>``
names become PCI ``<hostdev>`` elements in the XML the tower agent reads.

Real guests here cannot carry PCI hostdevs (no VFIO: libvirt refuses to start
them). So a test domain names its cards in its metadata::

    <metadata>
      <cards:cards xmlns:cards="https://gpu-handoff.invalid/realvm-cards">
        <cards:card address="0000:0a:00.0"/>
      </cards:cards>
    </metadata>

libvirt keeps that element in every XML it hands out, and this filter adds one
``<hostdev mode='subsystem' type='pci'>`` per card right after ``<devices>``,
line by line, to:

- the domain XML libvirtd writes to the qemu hook's stdin (the hook script
  pipes it through ``cards.py filter`` before the agent's ``hook`` verb);
- what ``virsh`` prints to the agent (its configured virsh is a wrapper that
  runs ``cards.py virsh ARGS...``).

Standalone and stdlib only: libvirtd runs it from the hook.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import re
import subprocess
import sys

NAMESPACE = "https://gpu-handoff.invalid/realvm-cards"
DOMAIN_START = re.compile(r"^\s*<domain[\s>]")
CARD = re.compile(
    r"""<(?:\w+:)?card\s+address=["']([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])["']"""
)
DEVICES = re.compile(r"^(\s*)<devices>\s*$")


def metadata(addresses: Iterable[str]) -> str:
    """The ``<metadata>`` element naming these PCI functions as the domain's."""
    cards = "".join(f'      <cards:card address="{a}"/>\n' for a in addresses)
    return (
        "  <metadata>\n"
        f'    <cards:cards xmlns:cards="{NAMESPACE}">\n'
        f"{cards}"
        "    </cards:cards>\n"
        "  </metadata>\n"
    )


def hostdev(address: str, indent: str) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    inner = indent + "  "
    return (
        f"{indent}<hostdev mode='subsystem' type='pci' managed='yes'>\n"
        f"{inner}<source>\n"
        f"{inner}  <address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}'"
        f" function='0x{function}'/>\n"
        f"{inner}</source>\n"
        f"{inner}<rom bar='off'/>\n"
        f"{indent}</hostdev>\n"
    )


def with_cards(lines: Iterable[str]) -> Iterator[str]:
    """The lines, with each domain's cards as hostdevs after its ``<devices>``."""
    cards: list[str] = []
    for line in lines:
        if DOMAIN_START.match(line):
            cards = []
        cards.extend(CARD.findall(line))
        yield line
        devices = DEVICES.match(line)
        if devices and cards:
            indent = devices.group(1) + "  "
            yield "".join(hostdev(address, indent) for address in cards)
            cards = []


def _copy(source: Iterable[str]) -> None:
    for chunk in with_cards(source):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    if argv[:1] == ["filter"]:
        _copy(sys.stdin)
        return 0
    if argv[:1] == ["virsh"]:
        with subprocess.Popen(
            ["virsh", *argv[1:]], stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None
            _copy(proc.stdout)
        return proc.returncode
    sys.stderr.write("usage: cards.py filter | cards.py virsh ARGS...\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
