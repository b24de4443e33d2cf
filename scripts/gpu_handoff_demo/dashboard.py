"""The demo's Lovelace dashboard: for every tower, its gaming switches, a
button that gets its first gaming station ready (``gpu_handoff.prepare``),
its GPU node with its health, which VM holds each card, the VMs' screens,
and the simulator's ghost switch.

Rows are the integration's own entities, so Home Assistant shows their
translated names and states; only the step a switch is at, the tower job and
the reason of a health problem (state attributes, also translated) are
attribute rows. A VM's screen shows while the VM runs (an off VM has none:
its Screen entity is unavailable then). Entities are found in the entity and
device registries by what they are (their device and translation key), not
by guessed entity ids. The ghost switch is the demo's own (a toggle helper,
``ghost.py``), in a card of its own under the cards.
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from typing import Any

from custom_components.gpu_handoff.const import (
    ATTR_CONFIG_ENTRY_ID,
    ATTR_VM,
    DOMAIN,
    SERVICE_PREPARE,
)
from custom_components.gpu_handoff.models import domain_identifier, tower_identifier

from .ghost import help_text
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
    health: str
    screens: dict[str, str]  # VM (the GPU node first) -> its Screen
    ghost: str = ""  # the simulator's ghost switch (a toggle helper)


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
        health=entity(node, "node_health"),
        screens={tower.gpu_node: entity(node, "screen")}
        | {vm: entity(d, "screen") for vm, d in vms.items()},
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


def prepare_button(found: TowerEntities) -> dict[str, Any]:
    """A button that gets the tower's first gaming station ready: its tap
    calls ``gpu_handoff.prepare`` for it with the tower's config entry (the
    GPU node is drained and shut down, the station's cards held for it;
    its switch then only starts it)."""
    tower = found.tower
    vm = tower.gaming[0]
    title = tower.titles[vm]
    return {
        "type": "button",
        "name": f"Get {title[:1].lower()}{title[1:]} ready",
        "icon": "mdi:gamepad-variant",
        "show_state": False,
        "tap_action": {
            "action": "perform-action",
            "perform_action": f"{DOMAIN}.{SERVICE_PREPARE}",
            "data": {ATTR_CONFIG_ENTRY_ID: tower.entry_id, ATTR_VM: vm},
        },
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
            {"entity": found.health},
            # Why, while there is a problem.
            {
                "type": "conditional",
                "conditions": [
                    {"condition": "state", "entity": found.health, "state": "on"}
                ],
                "row": {
                    "type": "attribute",
                    "entity": found.health,
                    "attribute": "reason",
                    "name": "Reason",
                },
            },
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


def _screen_card(found: TowerEntities, vm: str) -> dict[str, Any]:
    """The VM's screen, while it runs (the picture is fetched from the tower
    when the card shows it)."""
    screen = found.screens[vm]
    return {
        "type": "conditional",
        "conditions": [
            {"condition": "state", "entity": screen, "state_not": "unavailable"}
        ],
        "card": {
            "type": "picture-entity",
            "entity": screen,
            "show_name": True,
            "show_state": False,
        },
    }


def _simulator_card(found: TowerEntities) -> dict[str, Any]:
    """The demo's ghost switch, and what it does."""
    return {
        "type": "entities",
        "title": "Simulator",
        "show_header_toggle": False,
        "entities": [{"entity": found.ghost}],
    }


def _simulator_help() -> dict[str, Any]:
    return {"type": "markdown", "content": help_text()}


def _columns(found: TowerEntities) -> list[list[dict[str, Any]]]:
    """The tower's cards in three columns: the players with the button that
    gets the first one ready and their screens, the GPU node with its screen,
    the cards and the simulator."""
    tower = found.tower
    return [
        [
            _play_card(found),
            prepare_button(found),
            *(_screen_card(found, vm) for vm in tower.gaming),
        ],
        [_gpu_node_card(found), _screen_card(found, tower.gpu_node)],
        [_cards_card(found), _simulator_card(found), _simulator_help()],
    ]


def dashboard(towers: list[TowerEntities]) -> dict[str, Any]:
    """The Lovelace configuration: a sections view, one section per tower (with
    one tower: one section per column of cards)."""
    if len(towers) == 1:
        sections = [{"type": "grid", "cards": cards} for cards in _columns(towers[0])]
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
                    *(card for cards in _columns(found) for card in cards),
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
