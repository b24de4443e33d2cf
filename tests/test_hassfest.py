"""Home Assistant's own checks of the integration's files, as its hassfest
checker runs them for a custom integration (tests/support/hassfest.py), and
proof that each check can fail: test_each_check_catches_its_fault mutates a
copy of the files and expects the validator to report it."""

from __future__ import annotations

from collections.abc import Callable
import json
from pathlib import Path
import shutil
from typing import Any

import homeassistant
import pytest
import yaml

from custom_components.gpu_handoff.const import DOMAIN
from tests.support.hassfest import (
    COMPONENT,
    FILES,
    FLOW_SECTIONS,
    QUALITY_RULES,
    QUALITY_SCALE_SCHEMA,
    YAML_LOADER,
    Key,
    code_facts,
    get_in,
    schema_errors,
    validate,
)

# --- the tests -------------------------------------------------------------------


def test_the_integration_passes_home_assistants_checks() -> None:
    """No finding on the files as they are."""
    assert validate(COMPONENT) == []


def test_the_code_is_read_completely() -> None:
    """Every translation key and flow the code has is followed (none left to
    chance), and what is read is what the code does."""
    facts = code_facts()
    assert facts.unresolved == []
    assert {flow.name for flow in facts.flows} == set(FLOW_SECTIONS)
    config = next(flow for flow in facts.flows if flow.name == "GpuHandoffConfigFlow")
    assert config.forms["user"] == {"host", "port", "username"}
    assert config.forms["reconfigure"] == {"host", "port", "username", "kubeconfig"}
    assert config.forms["install_done"] == set()
    assert config.menus["credentials"] == {"install_agent", "generate_key", "paste_key"}
    assert {"invalid_host", "cannot_connect", "cluster_auth", "no_gaming_vm"} <= {
        key.name for key in config.errors
    }
    assert Key("admin_no_sudo", "InstallError") in config.errors
    assert {"already_configured", "reconfigure_successful", "agent_missing"} <= {
        key.name for key in config.aborts
    }
    assert {"entry_not_loaded", "invalid_kubeconfig", "agent_error"} <= {
        key.name for key in facts.exceptions
    }
    assert Key("screenshot_too_large", "ScreenError") in facts.exceptions
    assert {"node_gpus_missing", "rom_bar_not_off", "duplicate_tower"} <= {
        key.name for key in facts.issues
    }
    assert ("sensor", "handoff_state") in facts.entities
    assert ("switch", "gaming_vm") in facts.entities
    assert facts.actions == {
        "return_cards": {"config_entry_id"},
        "start_handoff": {"config_entry_id", "vm", "wait"},
        "prepare": {"config_entry_id", "vm", "hold_minutes"},
        "capture_screen": {"config_entry_id", "vm", "filename"},
    }


def test_the_rules_are_home_assistants() -> None:
    """The rules restated from quality_scale.py are the ones Home Assistant's
    own integrations grade themselves by (their quality_scale.yaml files,
    shipped with the installed Home Assistant), and their statuses pass."""
    components = Path(homeassistant.__file__).parent / "components"
    used: set[str] = set()
    for path in sorted(components.glob("*/quality_scale.yaml")):
        text = path.read_text(encoding="utf-8")
        scale = yaml.load(text, Loader=YAML_LOADER)  # noqa: S506 - a safe loader
        used |= set(scale["rules"])
        errors: list[str] = []
        schema_errors(path.parent.name, QUALITY_SCALE_SCHEMA, scale, errors)
        assert errors == []
    assert used == QUALITY_RULES


def _json(
    name: str, change: Callable[[dict[str, Any]], object]
) -> Callable[[Path], None]:
    def mutate(component: Path) -> None:
        path = component / name
        data = json.loads(path.read_text(encoding="utf-8"))
        change(data)
        path.write_text(json.dumps(data), encoding="utf-8")

    return mutate


def _yaml(
    name: str, change: Callable[[dict[str, Any]], object]
) -> Callable[[Path], None]:
    def mutate(component: Path) -> None:
        path = component / name
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        change(data)
        path.write_text(yaml.safe_dump(data), encoding="utf-8")

    return mutate


def _strings(change: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    """The same change to strings.json and every translation."""

    def mutate(component: Path) -> None:
        _json("strings.json", change)(component)
        for path in (component / "translations").glob("*.json"):
            _json(f"translations/{path.name}", change)(component)

    return mutate


def _pop(*path: str) -> Callable[[dict[str, Any]], object]:
    def change(data: dict[str, Any]) -> object:
        return get_in(data, path[:-1]).pop(path[-1])

    return change


def _put(value: Any, *path: str) -> Callable[[dict[str, Any]], object]:
    def change(data: dict[str, Any]) -> None:
        get_in(data, path[:-1])[path[-1]] = value

    return change


def _nest_data(data: dict[str, Any]) -> None:
    """The user step's fields one level too deep."""
    step = data["config"]["step"]["user"]
    step["fields"] = {"data": step.pop("data")}


def _rename_placeholder(data: dict[str, Any]) -> None:
    step = data["config"]["step"]["install_agent"]
    step["title"] = step["title"].replace("{host}", "{hote}")


def _move_keys(data: dict[str, Any]) -> None:
    """The version right after the name."""
    version = data.pop("version")
    items = list(data.items())
    data.clear()
    data.update([*items[:2], ("version", version), *items[2:]])


FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    # manifest.json
    "manifest_unknown_key": (
        _json("manifest.json", _put("2026.10.4", "homeassistant")),
        "manifest.json: not a valid option",
    ),
    "manifest_without_version": (
        _json("manifest.json", _pop("version")),
        "required key not provided at 'version'",
    ),
    "manifest_unreadable_version": (
        _json("manifest.json", _put("soon", "version")),
        "loader refuses it",
    ),
    "manifest_without_codeowners": (
        _json("manifest.json", _pop("codeowners")),
        "required key not provided at 'codeowners'",
    ),
    "manifest_unsorted": (
        _json("manifest.json", _move_keys),
        "keys are not domain, name, then alphabetical",
    ),
    "manifest_other_domain": (
        _json("manifest.json", _put("gpu_handover", "domain")),
        "the domain is not the directory's name",
    ),
    # keys the code uses
    "no_step_string": (
        _strings(_pop("config", "step", "node")),
        "config.step.node is missing",
    ),
    "no_field_string": (
        _strings(_pop("config", "step", "paste_key", "data", "passphrase")),
        "config.step.paste_key.data.passphrase is missing",
    ),
    "no_menu_option_string": (
        _strings(_pop("config", "step", "credentials", "menu_options", "paste_key")),
        "config.step.credentials.menu_options: paste_key",
    ),
    "no_error_string": (
        _strings(_pop("config", "error", "invalid_key")),
        "config.error.invalid_key is missing",
    ),
    "no_error_string_of_a_key_function": (
        _strings(_pop("config", "error", "cluster_auth")),
        "config.error.cluster_auth is missing",
    ),
    "no_string_for_an_exceptions_key": (
        _strings(_pop("config", "error", "invalid_uri")),
        "InstallError key invalid_uri is in none of",
    ),
    "no_abort_string": (
        _strings(_pop("config", "abort", "other_tower_configured")),
        "config.abort.other_tower_configured is missing",
    ),
    "no_implied_abort_string": (
        _strings(_pop("config", "abort", "reconfigure_successful")),
        "config.abort.reconfigure_successful is missing",
    ),
    "no_options_string": (
        _strings(_pop("options", "step", "init", "data", "lend_free_cards")),
        "options.step.init.data.lend_free_cards is missing",
    ),
    "no_subentry_step_string": (
        _strings(_pop("config_subentries", "gaming_vm", "step", "user")),
        "config_subentries.gaming_vm.step.user is missing",
    ),
    "no_fix_flow_string": (
        _strings(_pop("issues", "new_gaming_vm", "fix_flow", "abort", "vm_gone")),
        "issues.new_gaming_vm.fix_flow.abort.vm_gone is missing",
    ),
    "no_exception_string": (
        _strings(_pop("exceptions", "entry_not_loaded")),
        "exceptions.entry_not_loaded is missing",
    ),
    "no_issue_string": (
        _strings(_pop("issues", "duplicate_tower")),
        "issues.duplicate_tower is missing",
    ),
    "no_string_for_a_named_issue": (
        _strings(_pop("issues", "node_gpus_missing")),
        "issues.node_gpus_missing is missing",
    ),
    "no_entity_string": (
        _strings(_pop("entity", "sensor", "lease_age")),
        "entity.sensor.lease_age is missing",
    ),
    "string_of_no_step": (
        _strings(_put({"title": "Old"}, "config", "step", "forgotten")),
        "config.step.forgotten is no step the flow shows",
    ),
    "string_of_no_field": (
        _strings(_put("Name", "config", "step", "node", "data", "name")),
        "config.step.node.data.name is no field of the form",
    ),
    # data_description
    "no_data_description": (
        _strings(_pop("config", "step", "user", "data_description", "port")),
        "config.step.user.data.port has no data_description",
    ),
    "no_data_description_in_a_repair": (
        _strings(
            _pop(
                "issues",
                "agent_older",
                "fix_flow",
                "step",
                "update_login",
                "data_description",
                "sudo_password",
            )
        ),
        "issues.agent_older.fix_flow.step.update_login.data.sudo_password has no data_description",
    ),
    "data_description_of_no_data": (
        _strings(_put("Why", "config", "step", "node", "data_description", "nothing")),
        "data_description nothing is not in data",
    ),
    # strings.json's structure
    "wrong_nesting": (_strings(_nest_data), "strings.json: not a valid option"),
    "string_where_a_section_belongs": (
        _strings(_put("Errors", "config", "error")),
        "strings.json: expected a mapping at 'config.error'",
    ),
    "html_in_a_string": (
        _strings(
            _put("Connect to <b>the tower</b>", "config", "step", "user", "title")
        ),
        "strings.json: the string should not contain HTML",
    ),
    "placeholder_in_single_quotes": (
        _strings(
            _put("Install on '{host}'", "config", "step", "install_agent", "title")
        ),
        "a placeholder in single quotes",
    ),
    "trailing_space": (
        _strings(_put("Gaming VM ", "config_subentries", "gaming_vm", "entry_type")),
        "leading or trailing spaces",
    ),
    "bad_translation_key": (
        _strings(_put({"name": "X"}, "entity", "sensor", "Lease__Age")),
        "invalid translation key",
    ),
    "issue_with_text_and_fix_flow": (
        _strings(_put("Text", "issues", "host_key_mismatch", "description")),
        "two or more values in the same group of exclusion",
    ),
    "subentry_without_its_button": (
        _strings(_pop("config_subentries", "gaming_vm", "initiate_flow")),
        "required key not provided",
    ),
    "reference_to_nothing": (
        _json(
            "strings.json",
            _put(
                "[%key:common::config_flow::data::nothing%]",
                "config",
                "step",
                "user",
                "data",
                "host",
            ),
        ),
        "config.step.user.data.host refers to no string",
    ),
    # translations/*.json
    "translation_placeholder_differs": (
        _json("translations/fr.json", _rename_placeholder),
        "translations/fr.json: config.step.install_agent.title has other placeholders",
    ),
    "translation_lacks_a_key": (
        _json("translations/fr.json", _pop("exceptions", "unknown_vm")),
        "translations/fr.json: exceptions.unknown_vm.message is missing",
    ),
    "translation_has_an_extra_key": (
        _json("translations/fr.json", _put("Bonjour", "config", "abort", "hello")),
        "translations/fr.json: config.abort.hello is not in strings.json",
    ),
    "english_is_not_strings": (
        _json(
            "translations/en.json", _put("Connect", "config", "step", "user", "title")
        ),
        "translations/en.json: is not strings.json with its references resolved",
    ),
    # services.yaml and the actions
    "action_not_described": (
        _yaml("services.yaml", _pop("capture_screen")),
        "services.yaml: the action capture_screen is missing",
    ),
    "described_action_not_registered": (
        _yaml("services.yaml", _put(None, "lend_cards")),
        "services.yaml: lend_cards is no action the integration registers",
    ),
    "field_not_described": (
        _yaml("services.yaml", _pop("start_handoff", "fields", "wait")),
        "services.yaml: start_handoff.fields.wait is missing",
    ),
    "described_field_not_in_the_schema": (
        _yaml(
            "services.yaml",
            _put({"selector": {"boolean": None}}, "return_cards", "fields", "force"),
        ),
        "return_cards: field force is not in the action's schema",
    ),
    "unknown_selector": (
        _yaml(
            "services.yaml",
            _put({"not_a_selector": None}, "start_handoff", "fields", "vm", "selector"),
        ),
        "services.yaml: Unknown selector type not_a_selector found",
    ),
    "unknown_key_in_services_yaml": (
        _yaml("services.yaml", _put(True, "start_handoff", "fields", "vm", "hidden")),
        "services.yaml: not a valid option",
    ),
    "action_without_strings": (
        _strings(_pop("services", "return_cards")),
        "strings.json: services.return_cards is missing",
    ),
    "action_without_a_name": (
        _strings(_pop("services", "return_cards", "name")),
        "required key not provided at 'services.return_cards.name'",
    ),
    "field_without_a_description": (
        _strings(_pop("services", "start_handoff", "fields", "wait", "description")),
        "services.start_handoff.fields.wait.description",
    ),
    "strings_of_no_action": (
        _strings(
            _put({"name": "Lend", "description": "Lends."}, "services", "lend_cards")
        ),
        "strings.json services: lend_cards is no action the integration registers",
    ),
    # icons.json
    "icon_of_no_entity": (
        _json(
            "icons.json",
            _put({"default": "mdi:chip"}, "entity", "sensor", "gpu_temperature"),
        ),
        "icons.json: entity.sensor.gpu_temperature is no entity of the integration",
    ),
    "icon_of_no_state": (
        _json(
            "icons.json",
            _put("mdi:fire", "entity", "sensor", "vm_state", "state", "exploded"),
        ),
        "icons.json: entity.sensor.vm_state.state.exploded is no state of it",
    ),
    "icon_of_no_action": (
        _json("icons.json", _put({"service": "mdi:cards"}, "services", "lend_cards")),
        "icons.json: services.lend_cards is no action the integration registers",
    ),
    "action_without_an_icon": (
        _json("icons.json", _pop("services", "return_cards")),
        "icons.json: the action return_cards has no icon",
    ),
    "icon_not_from_mdi": (
        _json(
            "icons.json", _put("fa:chip", "entity", "sensor", "gpus_in_use", "default")
        ),
        "is not an mdi: icon",
    ),
    "state_icon_same_as_default": (
        _json(
            "icons.json",
            _put("mdi:monitor", "entity", "sensor", "vm_state", "state", "paused"),
        ),
        "the icon of state paused is the default icon",
    ),
    # quality_scale.yaml
    "unknown_rule": (
        _yaml("quality_scale.yaml", _put("done", "rules", "made-up-rule")),
        "quality_scale.yaml: not a valid option",
    ),
    "invalid_status": (
        _yaml("quality_scale.yaml", _put("partial", "rules", "brands")),
        "quality_scale.yaml",
    ),
    "exempt_without_comment": (
        _yaml("quality_scale.yaml", _put({"status": "exempt"}, "rules", "discovery")),
        "quality_scale.yaml",
    ),
    "bare_exempt": (
        _yaml("quality_scale.yaml", _put("exempt", "rules", "discovery")),
        "quality_scale.yaml",
    ),
}


@pytest.fixture
def component(tmp_path: Path) -> Path:
    """A copy of the integration's files, to change."""
    copy = tmp_path / DOMAIN
    copy.mkdir()
    for name in FILES:
        source = COMPONENT / name
        if source.is_dir():
            shutil.copytree(source, copy / name)
        else:
            shutil.copy2(source, copy / name)
    return copy


def test_an_unchanged_copy_passes(component: Path) -> None:
    """The copy the faults are made in is clean to begin with."""
    assert validate(component) == []


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_check_catches_its_fault(component: Path, fault: str) -> None:
    """Each check reports the fault made for it in a copy of the files."""
    mutate, expected = FAULTS[fault]
    mutate(component)
    errors = validate(component)
    assert any(expected in error for error in errors), errors
