"""Partial lending on the simulator: ``virsh create`` of a defined domain from
a live-only definition, where the test driver cannot show it (PCI
exclusivity, the guest agent, the simulator's refusals) or where the
simulator's own API is concerned. Its output is pinned against real virsh in
``test_conformance_create.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import re

import pytest

from tests.towersim import Tower, realistic_domains
from tests.towersim.conftest import FAST
from tests.towersim.helpers import Result, run, sim

PING = '{"execute":"guest-ping"}'
NODE_CARD = ["0000:01:00.0", "0000:01:00.1"]
CARD_1 = ["0000:03:00.0", "0000:03:00.1"]  # gaming-1's
CARD_2 = ["0000:04:00.0", "0000:04:00.1"]  # gaming-2's
# The guests' agents come up this long after a start (30 s here): never on
# their own while a test looks, however loaded the machine; a test that
# wants them up moves the clock on.
AGENT_UP = 3000.0


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[Tower]:
    """The realistic tower with every domain shut off (and the guest agents
    slow to come up)."""
    sim_tower = Tower.create(
        tmp_path / "tower",
        realistic_domains(gpu_node_running=False, agent_delay=AGENT_UP),
        time_scale=FAST,
    )
    yield sim_tower
    sim_tower.close()


def hostdev_block(address: str) -> re.Pattern[str]:
    dom, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return re.compile(
        r"    <hostdev [^\n]*>\n      <source>\n"
        rf"        <address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' "
        rf"function='0x{int(function, 16):x}'/>\n"
        r"(?:(?!    </hostdev>\n)[^\n]*\n)*    </hostdev>\n"
    )


def live_file(
    tower: Tower, path: Path, without: list[str], name: str = "gpu-node"
) -> Path:
    """The domain's persistent definition (as the agent reads it) without the
    hostdevs of ``without``."""
    xml = sim(tower, "dumpxml", "--inactive", "--security-info", "--domain", name)
    assert xml.rc == 0
    text = xml.out[:-1]  # virsh's newline after the command
    for address in without:
        text, count = hostdev_block(address).subn("", text)
        assert count == 1, address
    path.write_text(text, encoding="utf-8")
    return path


def create(tower: Tower, path: Path) -> Result:
    return sim(tower, "create", "--file", str(path))


def addresses(xml: str) -> list[str]:
    return [
        f"{d[2:]}:{b[2:]}:{s[2:]}.{f[2:]}"
        for d, b, s, f in re.findall(
            r"<address domain='(0x\w+)' bus='(0x\w+)' slot='(0x\w+)' function='(0x\w+)'/>",
            xml,
        )
    ]


def test_create_is_refused_while_a_running_domain_holds_a_function(
    idle: Tower, tmp_path: Path
) -> None:
    assert sim(idle, "start", "gaming-1").rc == 0
    whole = live_file(idle, tmp_path / "whole.xml", without=[])
    got = create(idle, whole)
    assert (got.rc, got.out) == (1, "\n")
    assert got.err == (
        f"error: Failed to create domain from {whole}\n"
        "error: Requested operation is not valid: PCI device 0000:03:00.0 is in use "
        "by driver QEMU, domain gaming-1\n"
    )
    # refused in qemuProcessPrepareHost, after qemuProcessInit made the domain
    # active: qemuProcessStop(VIR_DOMAIN_SHUTOFF_FAILED) sets the reason
    assert idle.domstate("gpu-node") == "shut off (failed)"
    assert not idle.runs_live_definition("gpu-node")

    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    got = create(idle, lend)
    assert (got.rc, got.out, got.err) == (
        0,
        f"Domain 'gpu-node' created from {lend}\n\n",
        "",
    )
    # PCI ownership follows the live definition
    assert idle.live_hostdevs("gpu-node") == NODE_CARD + CARD_2
    assert [idle.holder(a) for a in NODE_CARD + CARD_1 + CARD_2] == [
        "gpu-node",
        "gpu-node",
        "gaming-1",
        "gaming-1",
        "gpu-node",
        "gpu-node",
    ]
    refused = sim(idle, "start", "gaming-2")
    assert refused.err.endswith(
        "PCI device 0000:04:00.0 is in use by driver QEMU, domain gpu-node\n"
    )
    assert idle.defined_hostdevs("gpu-node") == NODE_CARD + CARD_1 + CARD_2


@pytest.mark.parametrize("how", ["guest", "agent"])
def test_the_live_definition_is_gone_once_the_domain_stops(
    idle: Tower, tmp_path: Path, how: str
) -> None:
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    assert create(idle, lend).rc == 0
    assert sim(idle, "start", "gaming-1").rc == 0
    running = sim(idle, "dumpxml", "--domain", "gpu-node").out
    assert addresses(running) == NODE_CARD + CARD_2
    assert running.startswith("<domain type='kvm' id='1'>\n")
    inactive = sim(idle, "dumpxml", "--inactive", "--domain", "gpu-node").out
    assert addresses(inactive) == NODE_CARD + CARD_1 + CARD_2
    assert inactive == idle.defined_xml("gpu-node") + "\n"
    assert running == idle.live_xml("gpu-node") + "\n"

    if how == "guest":
        idle.guest_shutdown("gpu-node")
    else:
        idle.advance(AGENT_UP * FAST)  # the guest agent is up
        assert sim(idle, "shutdown", "--mode", "agent", "--domain", "gpu-node").rc == 0
    idle.advance(1.0)
    assert idle.domstate("gpu-node") == "shut off (shutdown)"
    assert idle.live_hostdevs("gpu-node") is None
    assert not idle.runs_live_definition("gpu-node")
    assert sim(idle, "dumpxml", "--domain", "gpu-node").out == inactive
    assert sim(idle, "dumpxml", "--inactive", "--domain", "gpu-node").out == inactive
    assert idle.holder("0000:04:00.0") is None
    # a plain start wants the persistent definition's cards: gaming-1 has one
    refused = sim(idle, "start", "--domain", "gpu-node")
    assert refused.err.endswith(
        "PCI device 0000:03:00.0 is in use by driver QEMU, domain gaming-1\n"
    )


def test_a_create_boots_as_a_start_does(idle: Tower, tmp_path: Path) -> None:
    """The same events as a start (QEMU's, see tests/realvm), then the guest
    agent after its delay."""
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_2)
    before = len(idle.events())
    assert create(idle, lend).rc == 0
    ping = ["qemu-agent-command", "--timeout", "2", "--domain", "gpu-node", PING]
    assert sim(idle, *ping).err.startswith("error: Guest agent is not responding")
    idle.advance(AGENT_UP * FAST)
    assert sim(idle, *ping).out == '{"return":{}}\n\n'
    texts = [line.split(": ", 1)[1] for line in idle.events()[before:]]
    channel = (
        "event 'channel-lifecycle' for domain 'gpu-node': channel name: "
        "'org.qemu.guest_agent.0' state: '{}' reason: '{}'"
    )
    assert texts == [
        (
            "event 'agent-lifecycle' for domain 'gpu-node': state: 'disconnected' "
            "reason: 'domain started'"
        ),
        channel.format("disconnected", "domain started"),
        "event 'lifecycle' for domain 'gpu-node': Resumed Unpaused",
        "event 'lifecycle' for domain 'gpu-node': Started Booted",
        (
            "event 'agent-lifecycle' for domain 'gpu-node': state: 'connected' "
            "reason: 'channel event'"
        ),
        channel.format("connected", "channel event"),
    ]


def test_the_files_hostdevs_are_read_as_libvirt_reads_them(
    idle: Tower, tmp_path: Path
) -> None:
    """Other hostdevs than the persistent ones, in other spellings: a decimal
    bus, ``managed`` absent (libvirt's default: no), no ``<rom>``."""
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1 + CARD_2)
    text = lend.read_text("utf-8").replace(
        "  </devices>",
        '    <hostdev type="pci" mode="subsystem"><source>'
        '<address domain="0" bus="9" slot="0x00" function="0x1"/>'
        "</source></hostdev>\n  </devices>",
    )
    lend.write_text(text, encoding="utf-8")
    assert create(idle, lend).rc == 0
    running = sim(idle, "dumpxml", "--domain", "gpu-node").out
    assert idle.live_hostdevs("gpu-node") == [*NODE_CARD, "0000:09:00.1"]
    assert (
        "    <hostdev mode='subsystem' type='pci' managed='no'>\n"
        "      <source>\n"
        "        <address domain='0x0000' bus='0x09' slot='0x00' function='0x1'/>\n"
        "      </source>\n"
        "    </hostdev>\n"
        "  </devices>\n"
    ) in running
    assert running.count("<rom bar='off'/>") == 2


def test_a_file_naming_no_defined_domain_is_refused(
    idle: Tower, tmp_path: Path
) -> None:
    """libvirt would make a transient domain; the simulator has none."""
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    text = lend.read_text("utf-8")
    uuid = re.search(r"<uuid>([^<]+)</uuid>", text)
    assert uuid is not None
    lend.write_text(
        text.replace("gpu-node", "stranger").replace(
            uuid[1], "0badc0de-0000-4000-8000-000000000002"
        ),
        encoding="utf-8",
    )
    got = create(idle, lend)
    assert (got.rc, got.out) == (1, "\n")
    assert got.err == (
        f"error: Failed to create domain from {lend}\n"
        "error: Operation not supported: the tower simulator has no transient "
        "domains, and no domain named 'stranger' is defined\n"
    )
    assert (
        sim(idle, "list", "--all", "--name").out == "gaming-1\ngaming-2\ngpu-node\n\n"
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            ("<vcpu placement='static'>8</vcpu>", "<vcpu placement='static'>4</vcpu>"),
            (
                "it differs from the persistent definition elsewhere than in its "
                "<hostdev> elements"
            ),
        ),
        (
            ("  </devices>", "    <watchdog model='itco'/>\n  </devices>"),
            (
                "it differs from the persistent definition elsewhere than in its "
                "<hostdev> elements"
            ),
        ),
        (
            (
                "  </devices>",
                (
                    "    <hostdev mode='subsystem' type='usb'><source>"
                    "<vendor id='0x1234'/></source></hostdev>\n  </devices>"
                ),
            ),
            "a <hostdev> that is not a PCI subsystem device",
        ),
        (
            ("<rom bar='off'/>", "<rom bar='off'/><driver name='vfio'/>"),
            "a <hostdev> with more than a PCI source address and <rom bar>",
        ),
    ],
    ids=["vcpus", "device", "usb", "driver"],
)
def test_a_live_definition_the_simulator_cannot_model_is_refused(
    idle: Tower, tmp_path: Path, change: tuple[str, str], why: str
) -> None:
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    text = lend.read_text("utf-8")
    assert change[0] in text
    lend.write_text(text.replace(change[0], change[1], 1), encoding="utf-8")
    got = create(idle, lend)
    assert got.rc == 1
    assert got.err == (
        f"error: Failed to create domain from {lend}\n"
        "error: Operation not supported: the tower simulator models a live "
        "definition only as its domain's persistent definition with other PCI "
        f"hostdevs, and {why}\n"
    )
    assert idle.domstate("gpu-node") == "shut off (unknown)"


@pytest.mark.parametrize(
    "flag", ["--paused", "--console", "--autodestroy", "--validate", "--reset-nvram"]
)
def test_create_flags_are_refused(idle: Tower, tmp_path: Path, flag: str) -> None:
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    got = sim(idle, "create", "--file", str(lend), flag)
    assert (got.rc, got.err) == (
        1,
        (
            f"error: Failed to create domain from {lend}\n"
            f"error: Operation not supported: the tower simulator has no create {flag}\n"
        ),
    )
    assert not idle.is_running("gpu-node")


def test_malformed_xml_is_refused_with_its_line(idle: Tower, tmp_path: Path) -> None:
    broken = tmp_path / "broken.xml"
    broken.write_text("<domain type='kvm'>\n  <name>gpu-node</name>\n", "utf-8")
    got = create(idle, broken)
    assert got.rc == 1
    assert got.err.startswith(
        f"error: Failed to create domain from {broken}\n"
        "error: at line 3: the tower simulator cannot parse this XML ("
    )


def test_start_live_and_the_tower_api(idle: Tower) -> None:
    idle.start_live("gpu-node", CARD_2 + NODE_CARD)
    assert idle.runs_live_definition("gpu-node")
    assert idle.live_hostdevs("gpu-node") == NODE_CARD + CARD_2
    assert addresses(sim(idle, "dumpxml", "gpu-node").out) == NODE_CARD + CARD_2
    assert idle.events()[-1].endswith(
        "event 'lifecycle' for domain 'gpu-node': Started Booted"
    )
    with pytest.raises(RuntimeError, match="already running"):
        idle.start_live("gpu-node", NODE_CARD)
    with pytest.raises(ValueError, match="does not have"):
        idle.start_live("gaming-1", NODE_CARD)
    with pytest.raises(RuntimeError, match=r"0000:04:00\.0 is held by gpu-node"):
        idle.start_live("gaming-2", CARD_2)
    assert idle.live_hostdevs("gaming-1") is None
    assert sim(idle, "start", "gaming-1").rc == 0
    assert idle.live_hostdevs("gaming-1") == CARD_1
    assert not idle.runs_live_definition("gaming-1")


def test_destroy_attempts_are_still_recorded_beside_creates(
    idle: Tower, tmp_path: Path
) -> None:
    lend = live_file(idle, tmp_path / "live.xml", without=CARD_1)
    got = run(
        [
            str(idle.virsh),
            "-c",
            idle.uri,
            f"create --file {lend}; destroy --domain gpu-node",
        ]
    )
    assert got.rc == 1
    assert "error: Failed to destroy domain 'gpu-node'\n" in got.err
    assert idle.is_running("gpu-node")
    assert len(idle.destroy_attempts()) == 1
    assert len(idle.calls("create")) == 1
