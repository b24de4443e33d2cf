"""Conformance of partial lending's commands: ``virsh create`` of a defined
domain from a live-only definition (its persistent definition without some
``<hostdev>`` elements, same name and UUID) and ``dumpxml --inactive``, on real
virsh (libvirt's test driver in a private libvirtd) and on the simulator.

libvirt starts the persistent domain with the file as its live definition;
``dumpxml`` shows the live one, ``dumpxml --inactive`` the persistent one, and
the live one is gone once the domain stops. What the test driver cannot show
(PCI exclusivity, a QEMU guest started this way) is in ``test_lending.py`` and
tests/realvm/test_live_definition.py.
"""

from __future__ import annotations

from pathlib import Path
import re
from xml.etree import ElementTree as ET

import pytest

from tests.towersim import test_conformance as base

pytestmark = pytest.mark.system

# the same daemon and simulator set-up as the other conformance tests (a
# module-scoped fixture: this module gets its own daemon and tower)
pair = base.pair

GAMING_1_BUS = 0x03  # the card the GPU node lends to gaming-1
TIMESTAMP = re.compile(base.TIMESTAMP)


def without_bus(xml: str, bus: int) -> str:
    """libvirt's dumpxml text without the hostdevs of one PCI bus, as text (the
    layout of every other line kept byte for byte)."""
    block = re.compile(
        r"    <hostdev mode='subsystem' type='pci' managed='(?:yes|no)'>\n"
        r"      <source>\n"
        rf"        <address domain='0x0000' bus='0x{bus:02x}' [^\n]*\n"
        r"(?:(?!    </hostdev>\n)[^\n]*\n)*"
        r"    </hostdev>\n"
    )
    return block.sub("", xml)


def without_bus_etree(xml: str, bus: int) -> str:
    """The same through ElementTree: double quotes, other whitespace."""
    root = ET.fromstring(xml)  # noqa: S314 - libvirt's own output
    devices = root.find("devices")
    assert devices is not None
    for dev in devices.findall("hostdev"):
        address = dev.find("source/address")
        if address is not None and int(address.get("bus", "0"), 16) == bus:
            devices.remove(dev)
    return ET.tostring(root, encoding="unicode")


def hostdev_buses(xml: str) -> list[int]:
    return [
        int(b, 16) for b in re.findall(r"<address domain='0x0000' bus='(0x..)'", xml)
    ]


def test_create_of_a_defined_domain_matches_real_virsh(
    pair: base.Pair, tmp_path: Path
) -> None:
    inactive = pair.same(
        "dumpxml", "--inactive", "--security-info", "--domain", "gpu-node"
    )
    pair.check()
    persistent_buses = hostdev_buses(inactive.out)
    assert persistent_buses == [0x01, 0x01, 0x03, 0x03, 0x04, 0x04]
    live = tmp_path / "live.xml"
    live.write_text(without_bus(inactive.out, GAMING_1_BUS), encoding="utf-8")
    assert hostdev_buses(live.read_text("utf-8")) == [0x01, 0x01, 0x04, 0x04]
    spelled = tmp_path / "live-etree.xml"
    spelled.write_text(without_bus_etree(inactive.out, GAMING_1_BUS), encoding="utf-8")
    status_batch = (
        "echo @@gpu-handoff-0a1b2c-0 ; list '--all' '--name' ; "
        "echo @@gpu-handoff-0a1b2c-1 ; domstate '--reason' '--domain' 'gpu-node' ; "
        "echo @@gpu-handoff-0a1b2c-2 ; dumpxml '--domain' 'gpu-node' ; "
        "echo @@gpu-handoff-0a1b2c-3 ; dumpxml '--inactive' '--domain' 'gpu-node'"
    )

    created = pair.same("create", "--file", str(live))
    running_xml = pair.same("dumpxml", "--domain", "gpu-node").out
    steps: list[list[str]] = [
        ["create", "--file", str(live)],  # already active
        ["-q", "create", str(live)],
        ["create", f"--file={live}"],
        ["domstate", "--reason", "--domain", "gpu-node"],
        ["dumpxml", "--inactive", "--domain", "gpu-node"],
        ["dumpxml", "--inactive", "--security-info", "--domain", "gpu-node"],
        ["list", "--all"],
        [status_batch],
        # the lent card is free: its gaming VM starts beside the GPU node
        ["start", "--domain", "gaming-1"],
        ["list", "--all"],
        ["shutdown", "--domain", "gaming-1"],
    ]
    for args in steps:
        pair.same(*args)
    lent_live = pair.tower.live_hostdevs("gpu-node")
    assert pair.tower.runs_live_definition("gpu-node")
    pair.same("shutdown", "--domain", "gpu-node")
    after = pair.same("dumpxml", "--domain", "gpu-node").out
    steps = [
        ["domstate", "--reason", "--domain", "gpu-node"],
        ["dumpxml", "--inactive", "--domain", "gpu-node"],
        ["list", "--all", "--name"],
        # quiet, positional, and a file ElementTree wrote
        ["-q", "create", "--file", str(live)],
        ["shutdown", "gpu-node"],
        ["create", str(spelled)],
        ["dumpxml", "gpu-node"],
        ["shutdown", "gpu-node"],
        # in a batch, after a create that fails
        [
            (
                f"echo a; create --file {live}; echo b; create {live}; "
                "dumpxml --inactive --domain gpu-node; shutdown gpu-node"
            )
        ],
        # a plain start after a live run: the persistent definition again
        ["start", "--domain", "gpu-node"],
        ["dumpxml", "--domain", "gpu-node"],
        ["shutdown", "--domain", "gpu-node"],
    ]
    for args in steps:
        pair.same(*args)
    pair.check()

    assert created.out == f"Domain 'gpu-node' created from {live}\n\n"
    assert hostdev_buses(running_xml) == [0x01, 0x01, 0x04, 0x04]
    assert re.match(r"<domain type='test' id='\d+'>", running_xml)
    assert lent_live == ["0000:01:00.0", "0000:01:00.1", "0000:04:00.0", "0000:04:00.1"]
    assert hostdev_buses(after) == persistent_buses
    assert not pair.tower.runs_live_definition("gpu-node")
    assert pair.tower.live_hostdevs("gpu-node") is None


def test_create_errors_match_real_virsh(pair: base.Pair, tmp_path: Path) -> None:
    inactive = pair.same("dumpxml", "--inactive", "--domain", "gpu-node").out
    pair.check()
    uuid = re.search(r"<uuid>([^<]+)</uuid>", inactive)
    assert uuid is not None
    live = without_bus(inactive, GAMING_1_BUS)
    files = {
        "live.xml": live,
        "other-uuid.xml": live.replace(uuid[1], "0badc0de-0000-4000-8000-000000000001"),
        "other-name.xml": live.replace(
            "<name>gpu-node</name>", "<name>gaming-1</name>"
        ),
        "no-uuid.xml": live.replace(f"  <uuid>{uuid[1]}</uuid>\n", ""),
        "upper-uuid.xml": live.replace(uuid[1], uuid[1].upper()),
        "bad-uuid.xml": live.replace(uuid[1], "not-a-uuid"),
        "no-name.xml": live.replace("  <name>gpu-node</name>\n", ""),
        "other-root.xml": "<network><name>gpu-node</name></network>\n",
        "empty.xml": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "a-directory").mkdir()

    def path(name: str) -> str:
        return str(tmp_path / name)

    steps: list[list[str]] = [
        ["create", "--file", path("other-uuid.xml")],
        ["create", "--file", path("other-name.xml")],
        ["create", "--file", path("no-uuid.xml")],
        ["create", "--file", path("bad-uuid.xml")],
        ["create", "--file", path("no-name.xml")],
        ["create", "--file", path("other-root.xml")],
        ["create", "--file", path("empty.xml")],
        ["create", "--file", path("missing.xml")],
        ["-q", "create", "--file", path("missing.xml")],
        ["create", "--file", path("a-directory")],
        ["create"],
        ["create", "--file"],
        ["create", path("live.xml"), "extra"],
        ["create", "--file", path("live.xml"), "--bogus"],
        # started from its persistent definition: already active
        ["start", "--domain", "gpu-node"],
        ["create", "--file", path("live.xml")],
        ["create", "--file", path("other-uuid.xml")],
        ["shutdown", "--domain", "gpu-node"],
        # libvirt reads any spelling of the UUID
        ["create", "--file", path("upper-uuid.xml")],
        ["shutdown", "--domain", "gpu-node"],
        ["list", "--all"],
    ]
    for args in steps:
        pair.same(*args)
    pair.check()


def test_create_events_match_real_virsh(pair: base.Pair, tmp_path: Path) -> None:
    """A create reports what a start does: the test driver's `Started Booted`
    (and `Stopped Shutdown` at the end) are among the simulator's lines."""
    inactive = pair.same("dumpxml", "--inactive", "--domain", "gpu-node").out
    live = tmp_path / "live.xml"
    live.write_text(without_bus(inactive, GAMING_1_BUS), encoding="utf-8")
    pair.same("create", "--file", str(live))
    pair.same("shutdown", "--domain", "gpu-node")
    pair.check()
    pair.daemon.await_last_event(
        "event 'lifecycle' for domain 'gpu-node': Stopped Shutdown"
    )

    def strip(line: str) -> str:
        assert TIMESTAMP.match(line), line
        return line.split(": ", 1)[1]

    want = [strip(line) for line in pair.daemon.new_event_lines()]
    assert want[-2:] == [
        "event 'lifecycle' for domain 'gpu-node': Started Booted",
        "event 'lifecycle' for domain 'gpu-node': Stopped Shutdown",
    ]

    pair.sim_events_include(want, strip, timeout=30)
