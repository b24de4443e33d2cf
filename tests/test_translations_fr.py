"""Tests of the French translation (translations/fr.json).

fr.json must carry exactly the keys of en.json, keep every placeholder and every
code span of the English text, and be what Home Assistant serves for this
integration when its language is French.
"""

from __future__ import annotations

from collections.abc import Iterator
import json
from pathlib import Path
import re
from typing import Any

from homeassistant.config_entries import SOURCE_USER
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
from homeassistant.helpers.translation import async_get_translations
import pytest

from custom_components.gpu_handoff.const import DOMAIN

TRANSLATIONS = (
    Path(__file__).parent.parent / "custom_components" / DOMAIN / "translations"
)
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Fenced blocks first, so their backticks are not read as inline spans.
CODE_SPAN = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)


def _load(language: str) -> dict[str, Any]:
    return json.loads((TRANSLATIONS / f"{language}.json").read_text(encoding="utf-8"))


def _paths(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key path of ``tree``, inner keys and leaves alike."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from _paths(value, f"{path}.")


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The strings of ``tree`` by dotted key path, as Home Assistant flattens them."""
    leaves: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


EN = _load("en")
FR = _load("fr")
EN_LEAVES = _leaves(EN)
FR_LEAVES = _leaves(FR)


def test_french_has_exactly_the_english_keys() -> None:
    """Same key paths, inner keys and leaves, and only strings at the leaves."""
    en_paths, fr_paths = set(_paths(EN)), set(_paths(FR))
    assert not en_paths - fr_paths, "missing in fr.json"
    assert not fr_paths - en_paths, "not in en.json"
    assert set(FR_LEAVES) == set(EN_LEAVES)
    for path, text in FR_LEAVES.items():
        assert isinstance(text, str), path
        assert text.strip(), path
        assert "[%key:" not in text, f"{path}: references must be resolved"


@pytest.mark.parametrize("path", sorted(EN_LEAVES))
def test_french_keeps_placeholders_and_code(path: str) -> None:
    """Each string has the English placeholders and code spans, unchanged."""
    english, french = EN_LEAVES[path], FR_LEAVES.get(path)
    assert french is not None, f"{path} missing in fr.json"
    assert set(PLACEHOLDER.findall(french)) == set(PLACEHOLDER.findall(english))
    assert sorted(CODE_SPAN.findall(french)) == sorted(CODE_SPAN.findall(english))
    assert french.count("\n\n") == english.count("\n\n"), "paragraphs differ"


async def test_config_flow_is_translated_from_fr_json(hass: HomeAssistant) -> None:
    """The user step's form, its errors and aborts read French from fr.json."""
    hass.config.language = "fr"
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    assert result["type"] is FlowResultType.FORM
    assert result["step_id"] == "user"

    translations = await async_get_translations(hass, "fr", "config", [DOMAIN])
    prefix = f"component.{DOMAIN}.config"
    step = f"{prefix}.step.user"
    assert translations[f"{step}.title"] == "Se connecter à la tour"
    assert translations[f"{prefix}.error.no_gaming_vm"] == (
        "Choisissez au moins une VM de jeu."
    )
    assert translations[f"{prefix}.abort.already_configured"] == (
        "L'appareil est déjà configuré"
    )
    # Every field the form shows has its French label and description.
    for marker in result["data_schema"].schema:
        field = str(marker)
        for part in ("data", "data_description"):
            key = f"{step}.{part}.{field}"
            assert translations[key] == FR["config"]["step"]["user"][part][field]
    assert translations[f"{step}.data.username"] == "Nom d'utilisateur"
    # All of fr.json's config strings, and none of English's in their place.
    expected = {f"{prefix}.{key}": text for key, text in _leaves(FR["config"]).items()}
    assert {k: v for k, v in translations.items() if k.startswith(f"{prefix}.")} == (
        expected
    )


async def test_entity_states_are_translated_from_fr_json(
    hass: HomeAssistant,
) -> None:
    """The handoff state sensor's name, states and attribute states are French."""
    hass.config.language = "fr"
    translations = await async_get_translations(hass, "fr", "entity", [DOMAIN])
    sensor = f"component.{DOMAIN}.entity.sensor.handoff_state"
    assert translations[f"{sensor}.name"] == "État du transfert"
    states = FR["entity"]["sensor"]["handoff_state"]["state"]
    assert set(states) == set(EN["entity"]["sensor"]["handoff_state"]["state"])
    for state, text in states.items():
        assert translations[f"{sensor}.state.{state}"] == text
    assert translations[f"{sensor}.state.serving"] == "Au service du cluster"
    assert translations[f"{sensor}.state.cordoned"] == "Sous cordon"
    assert translations[f"{sensor}.state.unreachable"] == "Injoignable"
    attribute = f"{sensor}.state_attributes.cordoned_by"
    assert translations[f"{attribute}.name"] == "Cordon placé par"
    assert translations[f"{attribute}.state.other"] == "Quelqu'un d'autre"


@pytest.mark.parametrize(
    "category",
    ["config_subentries", "options", "entity", "exceptions", "issues", "services"],
)
async def test_every_category_is_served_in_french(
    hass: HomeAssistant, category: str
) -> None:
    """Home Assistant serves each category exactly as fr.json has it."""
    hass.config.language = "fr"
    translations = await async_get_translations(hass, "fr", category, [DOMAIN])
    prefix = f"component.{DOMAIN}.{category}."
    served = {k: v for k, v in translations.items() if k.startswith(prefix)}
    assert served == {
        f"{prefix}{key}": text for key, text in _leaves(FR[category]).items()
    }
