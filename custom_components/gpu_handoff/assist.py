"""Voice: the names Assist matches, and the GPU node's place in it.

Home Assistant's default conversation agent matches an entity by its name and
its aliases (the entity registry's), word for word: "Gaming station 1" does
not answer to "gaming station one", and the GPU node's sensors do not answer
to "the GPU node". GPU Handoff offers the spoken forms as aliases in the
entity registry, once, where the user can see, change and remove them, and
exposes the GPU node's Handoff state to Assist when it is first seen. What
the user set always wins. Exposure goes through Home Assistant's public
exposure helpers only; what GPU Handoff remembers (which aliases are its own)
lives under its own key in the entity's registry options.
"""

from __future__ import annotations

from collections.abc import Iterable
import re
from typing import Final

from homeassistant.components.homeassistant.exposed_entities import (
    async_expose_entity,
    async_get_entity_settings,
    async_should_expose,
)
from homeassistant.config_entries import ConfigEntryState
from homeassistant.const import Platform
from homeassistant.core import DOMAIN as HOMEASSISTANT_DOMAIN, HomeAssistant, callback
from homeassistant.helpers import (
    device_registry as dr,
    entity_registry as er,
    intent,
)

from .const import DOMAIN

# The assistant id of Home Assistant's own voice assistant (Assist) in the
# exposure settings.
ASSIST: Final = "conversation"
# In an entity's registry options under DOMAIN: the aliases GPU Handoff added.
# Absent: never offered; empty: never offered again (the user had aliases of
# their own, or removed GPU Handoff's).
VOICE_ALIASES: Final = "voice_aliases"
# What the README and the dashboard call the VM that lends its cards.
GPU_NODE_SPOKEN: Final = "GPU node"

_SMALL_NUMBERS: Final = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS: Final = (
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
)
_NUMBER = re.compile(r"\b\d+\b")
# "gaming-1", "gpu_node": libvirt's separators, spoken as spaces.
_SEPARATOR = re.compile(r"(?<=\w)[-_](?=\w)")


def spell_number(number: int) -> str | None:
    """``number`` in English words (0 to 99), else None."""
    if number < len(_SMALL_NUMBERS):
        return _SMALL_NUMBERS[number]
    if number >= 100:
        return None
    tens, ones = divmod(number, 10)
    word = _TENS[tens - 2]
    return f"{word}-{_SMALL_NUMBERS[ones]}" if ones else word


def is_english(hass: HomeAssistant) -> bool:
    """Whether Home Assistant speaks English (spelled numbers are English)."""
    return hass.config.language.split("-")[0].casefold() == "en"


def _folded(name: str) -> str:
    return " ".join(name.split()).casefold()


def unique_names(names: Iterable[str], *, besides: str) -> list[str]:
    """``names`` once each (case and spacing ignored), without ``besides``."""
    seen = {_folded(besides)}
    result = []
    for raw in names:
        name = " ".join(raw.split())
        if name and _folded(name) not in seen:
            seen.add(_folded(name))
            result.append(name)
    return result


def spoken_forms(name: str, *, english: bool) -> list[str]:
    """How a voice pipeline hears ``name`` where that differs from it: libvirt
    separators as spaces ("gaming-1" is heard "gaming 1"), and, in English,
    numbers as words ("Gaming station 1" is heard "gaming station one")."""
    separated = _SEPARATOR.sub(" ", name)
    forms = [separated]
    if english:
        forms.append(
            _NUMBER.sub(
                lambda match: spell_number(int(match.group())) or match.group(),
                separated,
            )
        )
    return unique_names(forms, besides=name)


@callback
def _names_taken(hass: HomeAssistant, entity_id: str) -> set[str]:
    """Every name and alias another entity answers to (folded): a spoken alias
    that one of them already has would make a sentence ambiguous."""
    registry = er.async_get(hass)
    taken: set[str] = set()
    for entry in registry.entities.values():
        if entry.entity_id != entity_id and not entry.disabled:
            taken.update(map(_folded, er.async_get_entity_aliases(hass, entry)))
    for state in hass.states.async_all():
        if state.entity_id != entity_id and registry.async_get(state.entity_id) is None:
            taken.update(
                map(_folded, intent.async_get_entity_aliases(hass, None, state=state))
            )
    return taken


@callback
def async_offer_voice_aliases(
    hass: HomeAssistant, entity_id: str, wanted: list[str]
) -> None:
    """Add ``wanted`` to the entity's aliases, once, and only where it is
    GPU Handoff's to add.

    Added only while the aliases are Home Assistant's default (the entity's
    own name alone): aliases of the user's own win, and then none is ever
    added. Aliases removed by the user are never added again. While the list
    is still exactly what GPU Handoff made, it follows a changed name (a
    renamed gaming VM gets the spoken form of its new name). A name another
    entity already answers to is left out.
    """
    registry = er.async_get(hass)
    if (entry := registry.async_get(entity_id)) is None:
        return
    options = entry.options.get(DOMAIN)
    ours: list[str] | None = options.get(VOICE_ALIASES) if options is not None else None
    if ours == []:
        return  # never again
    taken = _names_taken(hass, entity_id)
    wanted = [name for name in wanted if _folded(name) not in taken]
    aliases = list(entry.aliases)
    default: list[er.AliasEntry] = [er.COMPUTED_NAME]
    if ours is None:
        if not wanted:
            return
        if aliases != default:
            _remember(registry, entry, [])
            return
        registry.async_update_entity(entity_id, aliases=[*default, *wanted])
        _remember(registry, entry, wanted)
        return
    if any(name not in aliases for name in ours):
        # The user removed GPU Handoff's alias: theirs from now on.
        _remember(registry, entry, [])
        return
    if aliases != [*default, *ours] or wanted == ours:
        return
    registry.async_update_entity(entity_id, aliases=[*default, *wanted])
    _remember(registry, entry, wanted or None)


def _remember(
    registry: er.EntityRegistry, entry: er.RegistryEntry, aliases: list[str] | None
) -> None:
    options = dict(entry.options.get(DOMAIN, {}))
    if aliases is None:
        options.pop(VOICE_ALIASES, None)
    else:
        options[VOICE_ALIASES] = aliases
    registry.async_update_entity_options(entry.entity_id, DOMAIN, options or None)


@callback
def async_expose_to_assist_once(hass: HomeAssistant, entity_id: str) -> None:
    """Expose the entity to Assist the first time it is seen, when Assist is
    given the tower's gaming VM switches; once a choice is stored it is the
    user's (un-exposing it sticks).

    Home Assistant exposes a new switch unless the user turned off "Expose
    new entities" for Assist, and that setting has no public reader: its
    verdict on the tower's own switches stands for it. The switches come
    from another platform, maybe after this entity, so the verdict is taken
    once the tower's entry has loaded.
    """
    if HOMEASSISTANT_DOMAIN not in hass.config.components:
        return  # no exposure settings to write to
    entry = er.async_get(hass).async_get(entity_id)
    if entry is None or entry.config_entry_id is None:
        return
    if "should_expose" in async_get_entity_settings(hass, entity_id).get(ASSIST, {}):
        return  # seen before: the choice stored then stands
    config_entry = hass.config_entries.async_get_known_entry(entry.config_entry_id)

    @callback
    def expose_with_the_switches() -> None:
        # Asking about a switch stores Home Assistant's verdict on it, the
        # one it stores itself when the switch first appears.
        if config_entry.state is ConfigEntryState.LOADED and any(
            async_should_expose(hass, ASSIST, switch.entity_id)
            for switch in er.async_entries_for_config_entry(
                er.async_get(hass), config_entry.entry_id
            )
            if switch.domain == Platform.SWITCH
        ):
            async_expose_entity(hass, ASSIST, entity_id, True)

    if config_entry.state is ConfigEntryState.LOADED:
        expose_with_the_switches()
    else:
        config_entry.async_on_unload(
            config_entry.async_on_state_change(expose_with_the_switches)
        )


@callback
def device_name(hass: HomeAssistant, entry: er.RegistryEntry) -> str | None:
    """The name the user sees for the entity's device (theirs if renamed)."""
    if entry.device_id is None or not (
        device := dr.async_get(hass).async_get(entry.device_id)
    ):
        return None
    return device.name_by_user or device.name
