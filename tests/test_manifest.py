"""Checks of the files HACS and Home Assistant read besides the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import homeassistant
import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import wire

ROOT = Path(__file__).resolve().parent.parent
COMPONENT = ROOT / "custom_components" / "gpu_handoff"
REQUIREMENTS = ROOT / "requirements_test.txt"

# The shared strings HA core resolves for its own integrations, as the
# installed Home Assistant words them; a custom integration must ship them
# resolved in translations/en.json.
HA_STRINGS = Path(homeassistant.__file__).parent / "strings.json"


def _common(key: str) -> str:
    tree: Any = json.loads(HA_STRINGS.read_text(encoding="utf-8"))
    for part in key.split("::"):
        tree = tree[part]
    assert isinstance(tree, str), key
    return tree


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def test_manifest_keys_are_ordered_and_pinned() -> None:
    """domain and name first, then sorted keys; requirements pinned to the test pins."""
    manifest = _load(COMPONENT / "manifest.json")
    keys = list(manifest)
    assert keys[:2] == ["domain", "name"]
    assert keys[2:] == sorted(keys[2:])
    assert manifest["domain"] == COMPONENT.name
    assert manifest["config_flow"] is True
    assert manifest["integration_type"] == "hub"
    pins = {
        line.split("==")[0].lower(): line.strip()
        for line in REQUIREMENTS.read_text(encoding="utf-8").splitlines()
        if "==" in line and not line.startswith("#")
    }
    for requirement in manifest["requirements"]:
        name, _, version = requirement.partition("==")
        assert version, f"{requirement} is not pinned"
        assert pins[name.lower()] == requirement


def test_hacs_names_the_tested_home_assistant() -> None:
    """hacs.json's minimum version is the release the test harness pins."""
    hacs = _load(ROOT / "hacs.json")
    assert hacs["name"] == _load(COMPONENT / "manifest.json")["name"]
    from homeassistant.const import __version__

    assert hacs["homeassistant"] == __version__


def _resolve(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _resolve(item) for key, item in value.items()}
    if isinstance(value, str) and value.startswith("[%key:"):
        return _common(value.removeprefix("[%key:").removesuffix("%]"))
    return value


@pytest.mark.parametrize("language", ["en"])
def test_translations_match_strings(language: str) -> None:
    """translations/en.json is strings.json with every reference resolved."""
    strings = _resolve(_load(COMPONENT / "strings.json"))
    assert _load(COMPONENT / "translations" / f"{language}.json") == strings


def test_the_integration_ships_the_agent_of_its_version() -> None:
    """The manifest's version is the bundled agent's: Home Assistant knows
    which agent it ships (and so which one a tower should run)."""
    manifest = json.loads((COMPONENT / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["version"] == wire.VERSION


def test_every_step_a_switch_can_show_is_translated() -> None:
    """The switch's ``step`` attribute shows translated words, never a code:
    every step the controller and the runner can name has a translation."""
    from custom_components.gpu_handoff.jobs import AGENT_STEPS
    from custom_components.gpu_handoff.operations import STEP_RETRYING
    from custom_components.gpu_handoff.switch import STEP_IDLE

    strings = _load(COMPONENT / "strings.json")
    shown = strings["entity"]["switch"]["gaming_vm"]["state_attributes"]["step"]
    steps = {
        f"{name}_{role}" for name in AGENT_STEPS.values() for role in ("gpu_node", "vm")
    } | {
        STEP_IDLE,
        "preparing",
        "draining",
        "waiting_for_node",
        "waiting_for_gpus",
        "uncordoning",
        STEP_RETRYING,
    }
    assert steps == set(shown["state"])


def test_every_attribute_value_the_handoff_state_can_show_is_translated() -> None:
    """Words on the screen, not codes: each value the Handoff state's
    enumerated attributes can take has a translation."""
    from custom_components.gpu_handoff.protocol import JobKind, StepName
    from custom_components.gpu_handoff.sensor import VM_STATES

    attrs = _load(COMPONENT / "strings.json")["entity"]["sensor"]["handoff_state"][
        "state_attributes"
    ]
    assert set(attrs["job"]["state"]) == {"none", *(kind.value for kind in JobKind)}
    assert set(attrs["job_step"]["state"]) == {"none", *(s.value for s in StepName)}
    assert set(attrs["vm_state"]["state"]) == set(VM_STATES) - {"missing"}
    assert set(attrs["cordoned_by"]["state"]) == {"gpu_handoff", "other"}
    assert set(attrs["cluster_error"]["state"]) == {
        "cluster_unreachable",
        "cluster_auth",
        "node_not_found",
        "invalid_kubeconfig",
    }
    for key in ("guest_agent_ready", "cordoned", "node_ready"):
        assert set(attrs[key]["state"]) == {"true", "false"}
