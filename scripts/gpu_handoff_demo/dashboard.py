"""The demo's Lovelace dashboard: for every tower, its gaming switches, its GPU
node and which VM holds each card.

Rows are the integration's own entities, so Home Assistant shows their
translated names and states; only the step a switch is at and the tower job
(state attributes, also translated) are attribute rows. Entities are found
in the entity and device registries by what they are (their device and
translation key), not by guessed entity ids.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from typing import Any

from custom_components.gpu_handoff.const import DOMAIN
from custom_components.gpu_handoff.models import domain_identifier, tower_identifier

from .output import DemoError
from .towers import CARDS, DemoTower

URL_PATH = "gpu-handoff"  # the dashboard's URL path (it must contain a hyphen)
VIEW_PATH = "tower"


@dataclass(frozen=True)
class TowerEntities:
    """One tower's entity ids, by what they show."""

    tower: DemoTower
    switches: dict[str, str]  # gaming VM -> its switch
    vm_states: dict[str, str]  # VM (gaming VMs and the GPU node) -> VM state
    handoff: str
    node_ready: str
    cordoned: str
    gpus_lent: str
    gpus_in_use: str
    pods_left: str


def find_entities(
    tower: DemoTower, devices: list[dict[str, Any]], entities: list[dict[str, Any]]
) -> TowerEntities:
    """Tower ``tower``'s entities, from the registries' listings."""
    device_ids: dict[str, str] = {}
    for listed in devices:
        for identifier in listed["identifiers"]:
            device_ids[f"{identifier[0]}:{identifier[1]}"] = listed["id"]

    def device(identifier: tuple[str, str]) -> str:
        key = f"{identifier[0]}:{identifier[1]}"
        if key not in device_ids:
            raise DemoError(f"{tower.name}: no device {identifier[1]}")
        return device_ids[key]

    def entity(device_id: str, translation_key: str) -> str:
        for item in entities:
            if (
                item["platform"] == DOMAIN
                and item["device_id"] == device_id
                and item.get("translation_key") == translation_key
            ):
                return str(item["entity_id"])
        raise DemoError(f"{tower.name}: no {translation_key} entity")

    entry = tower.entry_id
    node = device(domain_identifier(entry, tower.gpu_node))
    vms = {vm: device(domain_identifier(entry, vm)) for vm in tower.gaming}
    return TowerEntities(
        tower=tower,
        switches={vm: entity(vms[vm], "gaming_vm") for vm in tower.gaming},
        vm_states={vm: entity(d, "vm_state") for vm, d in vms.items()}
        | {tower.gpu_node: entity(node, "vm_state")},
        handoff=entity(node, "handoff_state"),
        node_ready=entity(node, "node_ready"),
        cordoned=entity(node, "cordoned"),
        gpus_lent=entity(device(tower_identifier(entry)), "gpus_lent"),
        gpus_in_use=entity(node, "gpus_in_use"),
        pods_left=entity(node, "pods_left"),
    )


def _play_card(found: TowerEntities) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for vm, switch in found.switches.items():
        rows += [
            {"entity": switch, "secondary_info": "last-changed"},
            {"entity": found.vm_states[vm]},
            {
                "type": "attribute",
                "entity": switch,
                "attribute": "step",
                "name": "Step",
            },
        ]
    # No header toggle: "all stations on" is not a thing one tower can do.
    return {
        "type": "entities",
        "title": "Play",
        "show_header_toggle": False,
        "entities": rows,
    }


def _gpu_node_card(found: TowerEntities) -> dict[str, Any]:
    tower = found.tower
    return {
        "type": "entities",
        "title": tower.titles[tower.gpu_node],
        "entities": [
            {"entity": found.handoff},
            {"entity": found.vm_states[tower.gpu_node]},
            {
                "type": "attribute",
                "entity": found.handoff,
                "attribute": "job",
                "name": "Tower job",
            },
            {"entity": found.node_ready},
            {"entity": found.cordoned},
            {"entity": found.gpus_lent},
            {"entity": found.gpus_in_use},
            {"entity": found.pods_left},
        ],
    }


def _cards_card(found: TowerEntities) -> dict[str, Any]:
    """Which VM holds each card now and which VMs want it, by their names."""
    # The template's literals are JSON, which Jinja reads as its own.
    content = (
        "{% set names = " + json.dumps(CARDS) + " %}"
        "{% set vms = " + json.dumps(found.tower.titles) + " %}"
        "| Card | Held by | Wanted by |\n|---|---|---|\n"
        "{% for c in state_attr('" + found.handoff + "', 'cards') or [] %}"
        "{% set id = c.card or c.address %}"
        "| {{ names.get(id[5:7], id) }} "
        "| {{ vms.get(c.held_by, c.held_by) if c.held_by else '—' }} "
        "| {% for d in c.claimed_by %}{{ vms.get(d, d) }}"
        "{{ ', ' if not loop.last }}{% endfor %} |\n"
        "{% endfor %}"
    )
    return {"type": "markdown", "title": "Cards", "content": content}


def dashboard(towers: list[TowerEntities]) -> dict[str, Any]:
    """The Lovelace configuration: a sections view, one section per tower (with
    one tower: one section per card)."""
    if len(towers) == 1:
        found = towers[0]
        sections = [
            {"type": "grid", "cards": [card]}
            for card in (_play_card(found), _gpu_node_card(found), _cards_card(found))
        ]
    else:
        sections = [
            {
                "type": "grid",
                "cards": [
                    {
                        "type": "heading",
                        "heading": found.tower.name,
                        "heading_style": "title",
                        "icon": "mdi:desktop-tower",
                    },
                    _play_card(found),
                    _gpu_node_card(found),
                    _cards_card(found),
                ],
            }
            for found in towers
        ]
    return {
        "title": "GPU Handoff",
        "views": [
            {
                "title": "Towers" if len(towers) > 1 else "Tower",
                "path": VIEW_PATH,
                "type": "sections",
                "max_columns": 3,
                "sections": sections,
            }
        ],
    }
