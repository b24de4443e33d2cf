"""The tower as the agent sees it: domains, cards, their owners, findings.

``observe`` reads every managed domain in one batch of virsh calls (with the
guest agents' pings when asked), and the PCI cards each holds; the findings
(``FINDING_*``) are what would make a handoff fail, found before it does.
"""

from __future__ import annotations

import contextlib
import os
import re
import xml.etree.ElementTree as ET

from .config import Config
from .virsh import (
    AGENT_CHANNEL,
    VIRSH_TIMEOUT,
    Virsh,
    VirshTimeoutError,
    cmd_domstate,
    cmd_dumpxml,
    cmd_inactive_xml,
    cmd_ping,
    parse_domain_xml,
    parse_domstate,
)
from .wire import (
    ERR_VIRSH_FAILED,
    FINDING_CLAIMED_BY_UNMANAGED,
    FINDING_DOMAIN_MISSING,
    FINDING_NO_AGENT_CHANNEL,
    FINDING_ROM_BAR,
    FINDING_SHARED_IOMMU_GROUP,
    AgentError,
    JsonObj,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Set

# The status batch with pings: libvirt makes a ping wait for the domain's
# agent job (virDomainObjBeginAgentJob, up to 30 s whatever its --timeout)
# while another call holds it (a `shutdown --mode agent` waits up to 60 s for
# the power-off); past this the status is read again without pings.
STATUS_BATCH_TIMEOUT = 10.0


class Snapshot:
    """What libvirt says about the managed domains (and who else claims cards)."""

    def __init__(self) -> None:
        self.existing: List[str] = []
        self.domains: Dict[str, JsonObj] = {}
        self.others: Dict[str, JsonObj] = {}
        # The IOMMU group of each PCI function any domain claims (none: the
        # tower has no IOMMU groups, or not for that function).
        self.groups: Dict[str, int] = {}
        self.virsh_calls = 0

    def all_domains(self) -> Dict[str, JsonObj]:
        merged = dict(self.others)
        merged.update(self.domains)
        return merged

    @staticmethod
    def holds(dom: JsonObj) -> bool:
        return bool(dom.get("exists")) and dom.get("state") not in ("shut_off", None)

    def addresses(self) -> List[str]:
        """Every PCI function a domain claims (the GPU node's whole definition
        included, while it runs with a live one)."""
        found = {
            dev["address"]
            for dom in self.all_domains().values()
            for dev in [*dom["hostdevs"], *dom.get("defined_hostdevs", [])]
        }
        return sorted(found)

    def units(self, address: str) -> List[str]:
        """What a PCI function moves with: its card (one card's functions go
        to one domain), and its IOMMU group (libvirt passes a group through
        whole: see busy_cards)."""
        units = ["card " + card_of(address)]
        if address in self.groups:
            units.append(f"group {self.groups[address]}")
        return units


def _domain_record(name: str, xml_text: str, state_text: str, exists: bool) -> JsonObj:
    record: JsonObj = {
        "name": name,
        "exists": exists,
        "state": None,
        "reason": None,
        "title": None,
        "hostdevs": [],
        "agent_channel": False,
    }
    if exists and state_text:
        record["state"], record["reason"] = parse_domstate(state_text)
    if exists and xml_text:
        try:
            parsed = parse_domain_xml(xml_text)
        except ET.ParseError:
            parsed = {"hostdevs": [], "agent_channel": False, "title": None}
        record["title"] = parsed["title"]
        record["hostdevs"] = parsed["hostdevs"]
        record["agent_channel"] = parsed["agent_channel"]
    return record


def _observe_commands(cfg: Config, pinged: List[str]) -> List[List[str]]:
    cmds: List[List[str]] = [["list", "--all", "--name"]]
    for name in cfg.managed:
        cmds.append(cmd_dumpxml(name))
        cmds.append(cmd_domstate(name))
    cmds.extend(cmd_ping(name) for name in pinged)
    # The GPU node's persistent definition: while it runs with a live-only
    # one (some cards lent to players), its own cards are still these.
    cmds.append(cmd_inactive_xml(cfg.gpu_node))
    return cmds


def observe(
    cfg: Config, virsh: Virsh, ping: bool, busy: Optional[Set[str]] = None
) -> Snapshot:
    """One virsh call for the managed domains (+ pings), one more for others.

    No domain in `busy` is pinged (a job of ours stops it through its guest
    agent: libvirt would make the ping wait for that), and a batch whose
    pings wait anyway is read again without pings: the status never waits
    on a guest agent; an unpinged running domain's agent_ready is None.
    """
    snap = Snapshot()
    managed = cfg.managed
    pinged = [name for name in managed if name not in (busy or set())] if ping else []
    before = virsh.calls
    try:
        outs = virsh.batch(
            _observe_commands(cfg, pinged),
            STATUS_BATCH_TIMEOUT if pinged else VIRSH_TIMEOUT,
        )
    except VirshTimeoutError:
        if not pinged:
            raise
        pinged = []
        outs = virsh.batch(_observe_commands(cfg, pinged))
    if not outs[0] and not any(outs[1:]):
        # Not even `list` answered: ask again alone for its error.
        listing = virsh.run(["list", "--all", "--name"])
        if listing.rc != 0:
            raise AgentError(ERR_VIRSH_FAILED, listing.error_text())
        outs[0] = listing.out.strip()
    snap.existing = [ln.strip() for ln in outs[0].splitlines() if ln.strip()]
    for i, name in enumerate(managed):
        record = _domain_record(
            name, outs[1 + 2 * i], outs[2 + 2 * i], name in snap.existing
        )
        if ping:
            answer = (
                outs[1 + 2 * len(managed) + pinged.index(name)]
                if name in pinged
                else None
            )
            record["agent_ready"] = (
                ('"return"' in answer)
                if record["state"] == "running" and answer is not None
                else None
            )
        snap.domains[name] = record
    gpu = snap.domains[cfg.gpu_node]
    gpu["defined_hostdevs"] = gpu["hostdevs"]
    if gpu["exists"] and outs[-1]:
        with contextlib.suppress(ET.ParseError):
            gpu["defined_hostdevs"] = parse_domain_xml(outs[-1])["hostdevs"]
    others = [name for name in snap.existing if name not in managed]
    if others:
        cmds = []
        for name in others:
            cmds.append(cmd_dumpxml(name))
            cmds.append(cmd_domstate(name))
        outs = virsh.batch(cmds)
        for i, name in enumerate(others):
            snap.others[name] = _domain_record(name, outs[2 * i], outs[2 * i + 1], True)
    snap.virsh_calls = virsh.calls - before
    for address in snap.addresses():
        group = iommu_group(cfg.sysfs, address)
        if group is not None:
            snap.groups[address] = group
    return snap


PCI_NAME_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def iommu_group(sysfs: str, address: str) -> Optional[int]:
    """The IOMMU (VFIO) group of a PCI function, read as libvirt reads it
    (src/util/virpci.c, virPCIDeviceAddressGetIOMMUGroupNum): the last
    component of the `iommu_group` link in the device's sysfs directory.
    Readable by anyone, so the agent needs no root for it. None when there
    is none: no IOMMU, or no such function on this machine."""
    if not PCI_NAME_RE.match(address):
        return None
    link = os.path.join(sysfs, "bus", "pci", "devices", address, "iommu_group")
    try:
        target = os.readlink(link)
    except OSError:
        return None
    number = os.path.basename(target.rstrip("/"))
    return int(number) if number.isdigit() else None


def card_table(cfg: Config, snap: Snapshot) -> List[JsonObj]:
    """For each PCI function a managed domain claims: holder and claimants."""
    everything = snap.all_domains()
    addresses: List[str] = []
    gpu = snap.domains[cfg.gpu_node]
    for devs in [gpu.get("defined_hostdevs", [])] + [
        snap.domains[name]["hostdevs"] for name in cfg.managed
    ]:
        for dev in devs:
            if dev["address"] not in addresses:
                addresses.append(dev["address"])
    cards = []
    for address in sorted(addresses):
        claimed = sorted(
            name
            for name, dom in everything.items()
            if any(d["address"] == address for d in dom["hostdevs"])
        )
        held = [name for name in claimed if Snapshot.holds(everything[name])]
        cards.append(
            {
                "address": address,
                "held_by": held[0] if held else None,
                "claimed_by": claimed,
                "iommu_group": snap.groups.get(address),
            }
        )
    return cards


def card_owner(cfg: Config, card: JsonObj, own: List[str]) -> str:
    """Whose card a PCI function is: the gaming VMs that claim it (the GPU
    node only borrows theirs), else the GPU node if its persistent definition
    (`own`) has it, even while it runs without it."""
    gaming = [name for name in card["claimed_by"] if name in cfg.gaming]
    if gaming:
        return ", ".join(gaming)
    return cfg.gpu_node if card["address"] in own else ""


def shared_group_findings(
    cfg: Config, snap: Snapshot, cards: List[JsonObj]
) -> List[JsonObj]:
    """IOMMU groups that hold the cards of different VMs (a board without
    ACS): libvirt passes a group through whole, so those cards can only move
    together; the group is lent and handed off as one."""
    gpu = snap.domains[cfg.gpu_node]
    defined: List[JsonObj] = gpu.get("defined_hostdevs") or gpu["hostdevs"]
    own = [dev["address"] for dev in defined]
    groups: Dict[int, Dict[str, List[str]]] = {}
    for card in cards:
        owner = card_owner(cfg, card, own)
        if card.get("iommu_group") is None or not owner:
            continue
        by_owner = groups.setdefault(card["iommu_group"], {})
        by_owner.setdefault(owner, []).append(card["address"])
    found = []
    for number, by_owner in sorted(groups.items()):
        if len(by_owner) < 2:
            continue
        owners = sorted(by_owner, key=lambda owner: (owner == cfg.gpu_node, owner))
        held = " and ".join(
            f"{', '.join(by_owner[owner])} ({owner})" for owner in owners
        )
        found.append(
            {
                "code": FINDING_SHARED_IOMMU_GROUP,
                "domain": owners[0].split(", ")[0],
                "detail": f"IOMMU group {number} holds {held}: these cards can "
                "only be passed through together",
            }
        )
    return found


def findings_for(cfg: Config, snap: Snapshot, cards: List[JsonObj]) -> List[JsonObj]:
    found: List[JsonObj] = []
    for name in cfg.managed:
        dom = snap.domains[name]
        if not dom["exists"]:
            found.append(
                {
                    "code": FINDING_DOMAIN_MISSING,
                    "domain": name,
                    "detail": f"configured domain {name!r} is not defined in libvirt",
                }
            )
            continue
        if not dom["agent_channel"]:
            found.append(
                {
                    "code": FINDING_NO_AGENT_CHANNEL,
                    "domain": name,
                    "detail": f"no <channel> with target name {AGENT_CHANNEL}: graceful stops cannot work",
                }
            )
    found.extend(
        {
            "code": FINDING_ROM_BAR,
            "domain": cfg.gpu_node,
            "detail": f"hostdev {dev['address']} has no <rom bar='off'/>",
        }
        for dev in snap.domains[cfg.gpu_node]["hostdevs"]
        if dev["rom_bar"] != "off"
    )
    found.extend(
        {
            "code": FINDING_CLAIMED_BY_UNMANAGED,
            "domain": name,
            "detail": f"{card['address']} is also claimed by unmanaged domain {name!r}",
        }
        for card in cards
        for name in card["claimed_by"]
        if name not in cfg.managed
    )
    found.extend(shared_group_findings(cfg, snap, cards))
    return found


def card_of(address: str) -> str:
    """The card a PCI function belongs to (`0000:03:00.1` -> `0000:03:00`):
    the functions of one card go to one domain together."""
    return address.rsplit(".", 1)[0]
