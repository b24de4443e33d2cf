"""Parsing what real virsh prints (fixtures captured from libvirt's test driver)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    virsh as agent_virsh,
)
from tests.tower.conftest import FIXTURES, require_tool


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_domain_xml_hostdevs_and_channel() -> None:
    gpu = agent_virsh.parse_domain_xml(fixture("dumpxml-gpu-node.xml"))
    assert gpu["name"] == "gpu-node"
    assert gpu["agent_channel"] is True
    assert gpu["hostdevs"] == [
        {"address": "0000:01:00.0", "rom_bar": "off", "managed": True},
        {"address": "0000:01:00.1", "rom_bar": "off", "managed": True},
        {"address": "0000:02:00.0", "rom_bar": "off", "managed": True},
        {"address": "0000:02:00.1", "rom_bar": None, "managed": True},
    ]
    assert gpu["title"] is None
    win1 = agent_virsh.parse_domain_xml(fixture("dumpxml-win-1.xml"))
    assert win1["title"] == "Gaming station 1"
    assert win1["hostdevs"][0]["rom_bar"] == "on"
    assert win1["hostdevs"][1]["managed"] is False
    win2 = agent_virsh.parse_domain_xml(fixture("dumpxml-win-2.xml"))
    assert win2["agent_channel"] is False


def test_domain_xml_ignores_non_pci_and_decimal_addresses() -> None:
    xml = (
        "<domain><name>x</name><devices>"
        "<hostdev mode='subsystem' type='usb'><source><vendor id='0x1'/></source></hostdev>"
        "<hostdev mode='subsystem' type='pci'><source/></hostdev>"
        "<hostdev mode='subsystem' type='pci'><source>"
        "<address domain='0' bus='10' slot='0' function='1'/></source></hostdev>"
        "<channel type='unix'><target type='virtio' name='other'/></channel>"
        "</devices></domain>"
    )
    parsed = agent_virsh.parse_domain_xml(xml)
    assert parsed["hostdevs"] == [
        {"address": "0000:0a:00.1", "rom_bar": None, "managed": False}
    ]
    assert parsed["agent_channel"] is False


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("domstate-running.txt", ("running", "unknown")),
        ("domstate-shutoff.txt", ("shut_off", "unknown")),
    ],
)
def test_domstate(name: str, expected: tuple[str, str]) -> None:
    assert agent_virsh.parse_domstate(fixture(name)) == expected


def test_domstate_variants() -> None:
    assert agent_virsh.parse_domstate("running (booted)\n\n") == ("running", "booted")
    assert agent_virsh.parse_domstate("shut off (shutdown)") == ("shut_off", "shutdown")
    assert agent_virsh.parse_domstate("in shutdown") == ("in_shutdown", None)
    assert agent_virsh.parse_domstate("") == ("no_state", None)


def test_batch_output_with_a_failed_command() -> None:
    """Real virsh goes on after a failed command; its output is just missing."""
    outs = agent_virsh.split_batch_output(fixture("batch.stdout"), "fixture", 5)
    assert outs[0].split() == ["gpu-node", "other-vm", "win-1", "win-2"]
    assert outs[1] == ""  # dumpxml of a missing domain failed
    assert outs[2] == "shut off (unknown)"
    assert outs[3] == ""  # the test driver has no guest agent
    assert outs[4] == "running (unknown)"
    assert "failed to get domain 'no-such-vm'" in fixture("batch.stderr")
    # The exit status is the last command's.
    assert fixture("batch.rc").strip() == "0"


def test_batch_needs_one_argument() -> None:
    """A separate `;` argv token is not a command separator for virsh."""
    assert "unknown command" in fixture("batch-argv-token.stderr")


def test_events_from_real_virsh() -> None:
    events = [
        agent_virsh.parse_event(line) for line in fixture("events.txt").splitlines()
    ]
    assert all(e is not None for e in events)
    kinds = [(e["action"], e["detail"]) for e in events if e]
    assert kinds == [
        ("defined", "Added"),
        ("started", "Booted"),
        ("stopped", "Shutdown"),
        ("started", "Booted"),
        ("suspended", "Paused"),
        ("resumed", "Unpaused"),
        ("stopped", "Destroyed"),
        ("undefined", "Removed"),
    ]
    first = events[0]
    assert first is not None
    assert first["domain"] == "gpu-node"
    assert first["event"] == "lifecycle"
    assert first["time"].endswith("+0000")


def test_agent_lifecycle_event() -> None:
    # The test driver has no guest agent, so this line cannot be captured here:
    # its format is virsh's virshEventAgentLifecyclePrint, as recorded from a
    # real QEMU guest (state 'connected', reason 'channel event').
    line = (
        "2026-11-29 12:05:22.665+0000: event 'agent-lifecycle' for domain "
        "'gpu-node': state: 'connected' reason: 'channel event'"
    )
    event = agent_virsh.parse_event(line)
    assert event == {
        "time": "2026-11-29 12:05:22.665+0000",
        "domain": "gpu-node",
        "event": "agent-lifecycle",
        "state": "connected",
        "reason": "channel event",
    }
    odd = agent_virsh.parse_event("event 'agent-lifecycle' for domain 'a': garbled")
    assert odd is not None
    assert odd["state"] is None
    other = agent_virsh.parse_event("event 'reboot' for domain 'a': ")
    assert other is not None
    assert other["detail"] == ""
    assert agent_virsh.parse_event("events: 3") is None


def test_error_text() -> None:
    result = agent_virsh.VirshResult(1, "", fixture("unreachable.stderr"))
    assert result.error_text().startswith("failed to connect to the hypervisor / ")
    assert (
        agent_virsh.VirshResult(3, "", "").error_text() == "virsh exited with status 3"
    )


def test_virsh_quote_round_trip_through_real_virsh(tmp_path: Path) -> None:
    """virsh's own parser reads back what virsh_quote writes."""
    require_tool("virsh")
    cfg = agent_config.Config(
        str(tmp_path / "c.json"),
        {"libvirt_uri": "test:///default", "gpu_node": "test", "gaming": ["x"]},
        dict(os.environ),
    )
    virsh = agent_virsh.Virsh(cfg)
    outs = virsh.batch(
        [["domstate", "--reason", "it's"], ["domstate", "--reason", "test"]]
    )
    assert outs == ["", "running (unknown)"]


def test_fixtures_conformance() -> None:
    """The fixtures are what real virsh prints today."""
    require_tool("virsh", "libvirtd")
    from tests.tower import capture_fixtures

    for name, text in capture_fixtures.capture_all().items():
        assert capture_fixtures.normalise(name, text) == capture_fixtures.normalise(
            name, fixture(name)
        ), name
