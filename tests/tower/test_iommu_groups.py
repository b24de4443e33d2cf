"""IOMMU groups in the agent: read from sysfs as libvirt reads them, and the
unit of lending and of handoff.

libvirt (src/util/virpci.c) takes a function's group number from the last
component of its `iommu_group` link (virPCIDeviceAddressGetIOMMUGroupNum) and,
before a start, refuses one when another domain holds any function of the
group (src/hypervisor/virhostdev.c, virHostdevPreparePCIDevicesImpl). On a
board without ACS, two cards share a group: the agent then lends neither while
a player has one, and reports the group as a configuration finding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    observe as agent_observe,
    runner as agent_runner,
)

NODE = ["0000:01:00.0", "0000:01:00.1"]  # the GPU node's own card
CARD_1 = ["0000:03:00.0", "0000:03:00.1"]  # gaming-1's
CARD_2 = ["0000:04:00.0", "0000:04:00.1"]  # gaming-2's


def sysfs_tree(root: Path, groups: dict[int, list[str]]) -> Path:
    """The sysfs entries of these groups, laid out as Linux does."""
    for number, members in groups.items():
        group = root / "kernel" / "iommu_groups" / str(number) / "devices"
        group.mkdir(parents=True)
        for address in members:
            device = root / "devices" / "pci0000:00" / "0000:00:01.0" / address
            device.mkdir(parents=True)
            (device / "iommu_group").symlink_to(
                f"../../../../kernel/iommu_groups/{number}"
            )
            bus = root / "bus" / "pci" / "devices"
            bus.mkdir(parents=True, exist_ok=True)
            (bus / address).symlink_to(
                f"../../../devices/pci0000:00/0000:00:01.0/{address}"
            )
            (group / address).symlink_to(
                f"../../../../devices/pci0000:00/0000:00:01.0/{address}"
            )
    return root


def dom(name: str, addresses: list[str], *, running: bool) -> dict[str, Any]:
    return {
        "name": name,
        "exists": True,
        "state": "running" if running else "shut_off",
        "reason": None,
        "title": None,
        "hostdevs": [
            {"address": a, "rom_bar": "off", "managed": True} for a in addresses
        ],
        "agent_channel": True,
    }


def snapshot(groups: dict[str, int], *, playing: bool = True) -> agent_observe.Snapshot:
    """The GPU node (off) defined with every card; gaming-1 plays."""
    snap = agent_observe.Snapshot()
    snap.existing = ["gpu-node", "gaming-1", "gaming-2"]
    gpu = dom("gpu-node", NODE + CARD_1 + CARD_2, running=False)
    gpu["defined_hostdevs"] = gpu["hostdevs"]
    snap.domains = {
        "gpu-node": gpu,
        "gaming-1": dom("gaming-1", CARD_1, running=playing),
        "gaming-2": dom("gaming-2", CARD_2, running=False),
    }
    snap.groups = dict(groups)
    return snap


def config(tmp_path: Path, **extra: Any) -> agent_config.Config:
    data = {"gpu_node": "gpu-node", "gaming": ["gaming-1", "gaming-2"], **extra}
    assert agent_config.validate_config(data) == []
    return agent_config.Config(
        str(tmp_path / "config.json"), data, {"HOME": str(tmp_path)}
    )


def no_acs() -> dict[str, int]:
    """The GPU node's card and gaming-1's in group 11; gaming-2's alone."""
    return {**dict.fromkeys(NODE + CARD_1, 11), **dict.fromkeys(CARD_2, 14)}


def test_the_group_number_is_the_last_component_of_the_link(tmp_path: Path) -> None:
    root = sysfs_tree(tmp_path / "sys", {11: NODE + CARD_1, 14: CARD_2})
    assert [
        agent_observe.iommu_group(str(root), a) for a in NODE + CARD_1 + CARD_2
    ] == [
        11,
        11,
        11,
        11,
        14,
        14,
    ]


def test_no_group_without_an_iommu_or_for_a_strange_name(tmp_path: Path) -> None:
    """No IOMMU (no `iommu_group` link), no such device, or a name that is no
    PCI address (nothing outside the device directories is read)."""
    root = sysfs_tree(tmp_path / "sys", {14: CARD_2})
    (root / "bus" / "pci" / "devices" / "0000:05:00.0").mkdir()
    assert agent_observe.iommu_group(str(root), "0000:05:00.0") is None
    assert agent_observe.iommu_group(str(root), "0000:06:00.0") is None
    assert agent_observe.iommu_group(str(tmp_path / "none"), CARD_2[0]) is None
    assert agent_observe.iommu_group(str(root), "../../../etc") is None


def test_the_sysfs_root_is_configurable_and_defaults_to_sys(tmp_path: Path) -> None:
    assert config(tmp_path).sysfs == "/sys"
    assert config(tmp_path, sysfs="/srv/sys").as_json()["sysfs"] == "/srv/sys"
    base = {"gpu_node": "gpu-node", "gaming": ["gaming-1"]}
    for bad in ("sys", 3, None):
        assert agent_config.validate_config({**base, "sysfs": bad}) == [
            "sysfs: must be an absolute path"
        ]


def test_with_a_group_per_card_only_the_players_card_is_busy() -> None:
    snap = snapshot({**dict.fromkeys(NODE, 11), **dict.fromkeys(CARD_1, 13)})
    assert agent_runner.busy_cards(snap, "gpu-node") == ["0000:03:00"]
    # and without any group (no IOMMU): the card is the unit
    assert agent_runner.busy_cards(snapshot({}), "gpu-node") == ["0000:03:00"]


def test_a_players_group_mate_is_busy_too() -> None:
    """gaming-1 holds its card; the GPU node's own card shares its group:
    libvirt would refuse the GPU node with it, so it is left out too."""
    snap = snapshot(no_acs())
    assert agent_runner.busy_cards(snap, "gpu-node") == ["0000:01:00", "0000:03:00"]
    # nobody plays: nothing is busy
    assert agent_runner.busy_cards(snapshot(no_acs(), playing=False), "gpu-node") == []


def test_the_live_definition_leaves_the_whole_group_out() -> None:
    xml = (
        "<domain type='kvm'><name>gpu-node</name><devices>"
        + "".join(
            "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
            f"<address domain='0x0000' bus='0x{a[5:7]}' slot='0x00' "
            f"function='0x{a[-1]}'/></source></hostdev>"
            for a in NODE + CARD_1 + CARD_2
        )
        + "</devices></domain>"
    )
    busy = agent_runner.busy_cards(snapshot(no_acs()), "gpu-node")
    live, kept, left = agent_runner.live_definition(xml, busy)
    assert (kept, left) == (["0000:04:00"], ["0000:01:00", "0000:03:00"])
    assert "bus='0x01'" not in live
    assert "bus='0x03'" not in live
    assert live.count("<hostdev ") == 2


def test_the_card_table_tells_each_functions_group(tmp_path: Path) -> None:
    snap = snapshot(no_acs())
    cards = agent_observe.card_table(config(tmp_path), snap)
    assert {c["address"]: c["iommu_group"] for c in cards} == no_acs()
    assert {c["address"]: c["held_by"] for c in cards if c["held_by"]} == dict.fromkeys(
        CARD_1, "gaming-1"
    )
    assert (
        agent_observe.card_table(config(tmp_path), snapshot({}))[0]["iommu_group"]
        is None
    )


def test_a_group_mixing_two_vms_cards_is_a_finding(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    snap = snapshot(no_acs())
    found = agent_observe.findings_for(cfg, snap, agent_observe.card_table(cfg, snap))
    assert [f for f in found if f["code"] == "shared_iommu_group"] == [
        {
            "code": "shared_iommu_group",
            "domain": "gaming-1",
            "detail": "IOMMU group 11 holds 0000:03:00.0, 0000:03:00.1 (gaming-1) "
            "and 0000:01:00.0, 0000:01:00.1 (gpu-node): these cards can only be "
            "passed through together",
        }
    ]
    # two gaming VMs' cards in one group: named after the first
    both = {**dict.fromkeys(NODE, 11), **dict.fromkeys(CARD_1 + CARD_2, 20)}
    snap = snapshot(both)
    found = agent_observe.findings_for(cfg, snap, agent_observe.card_table(cfg, snap))
    assert [(f["domain"], f["detail"]) for f in found] == [
        (
            "gaming-1",
            (
                "IOMMU group 20 holds 0000:03:00.0, 0000:03:00.1 (gaming-1) and "
                "0000:04:00.0, 0000:04:00.1 (gaming-2): these cards can only be "
                "passed through together"
            ),
        )
    ]
    # a group per card: no finding
    per_card = {
        **dict.fromkeys(NODE, 11),
        **dict.fromkeys(CARD_1, 13),
        **dict.fromkeys(CARD_2, 14),
    }
    snap = snapshot(per_card)
    assert (
        agent_observe.findings_for(cfg, snap, agent_observe.card_table(cfg, snap)) == []
    )


def test_the_finding_stays_while_the_gpu_node_runs_without_its_card(
    tmp_path: Path,
) -> None:
    """Lending: the GPU node runs with gaming-2's card alone (its own shares
    gaming-1's group); its own card is still its own."""
    cfg = config(tmp_path)
    snap = snapshot(no_acs())
    gpu = snap.domains["gpu-node"]
    snap.domains["gpu-node"] = {
        **dom("gpu-node", CARD_2, running=True),
        "defined_hostdevs": gpu["defined_hostdevs"],
    }
    found = agent_observe.findings_for(cfg, snap, agent_observe.card_table(cfg, snap))
    assert [(f["code"], f["domain"]) for f in found] == [
        ("shared_iommu_group", "gaming-1")
    ]
