"""Voice: the sentences of docs/voice.md, typed to Home Assistant's default agent.

Each sentence goes through the conversation agent as Assist hands it text
(hassil with home-assistant-intents, the gazetteer fallback behind it) to the
real integration: sshd forcing the real agent on the simulated tower, and the
Kubernetes API emulator. Every phrase that page quotes is said here, and the
answer and the effect are checked.
"""

from __future__ import annotations

from homeassistant.components import conversation
from homeassistant.components.homeassistant.const import DATA_EXPOSED_ENTITIES
from homeassistant.components.homeassistant.exposed_entities import (
    async_expose_entity,
    async_should_expose,
)
from homeassistant.core import Context, HomeAssistant
from homeassistant.helpers import entity_registry as er, intent, issue_registry as ir
from homeassistant.setup import async_setup_component
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff.assist import (
    VOICE_ALIASES,
    spell_number,
    spoken_forms,
)
from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    setup_entry,
    until,
)
from tests.towersim import Tower

COMPUTED = er.COMPUTED_NAME


async def voice_ready(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    """Home Assistant as a user runs it (its core integration, Assist), then
    the tower."""
    assert await async_setup_component(hass, "homeassistant", {})
    assert await async_setup_component(hass, "conversation", {})
    assert await async_setup_component(hass, "intent", {})
    await setup_entry(hass, entry)


async def say(hass: HomeAssistant, text: str) -> intent.IntentResponse:
    """``text`` to the default conversation agent, in English."""
    result = await conversation.async_converse(
        hass, text, None, Context(), language="en"
    )
    return result.response


def speech(response: intent.IntentResponse) -> str:
    return str(response.speech["plain"]["speech"]).strip()


def state_of(hass: HomeAssistant, entity_id: str) -> str:
    state = hass.states.get(entity_id)
    assert state is not None
    return state.state


def answered_about(response: intent.IntentResponse) -> list[str]:
    """The entities an answer was about."""
    return [
        state.entity_id
        for state in (*response.matched_states, *response.unmatched_states)
    ]


def aliases(hass: HomeAssistant, entity_id: str) -> list[er.AliasEntry]:
    entry = er.async_get(hass).async_get(entity_id)
    assert entry is not None
    return list(entry.aliases)


async def reload(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()


# --- the sentences of docs/voice.md -------------------------------------------


@pytest.mark.parametrize(
    ("name", "number"),
    [
        ("gaming station one", 1),
        ("gaming station 1", 1),
        ("gaming station two", 2),
        ("gaming station 2", 2),
    ],
)
async def test_turn_a_gaming_vm_on_and_off_by_voice(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    name: str,
    number: int,
) -> None:
    """Said to Assist, "turn on gaming station one" hands the cards over, "is
    gaming station one on" says yes, "turn off gaming station one" gives them
    back. The number works as a word and as a digit, for each gaming VM."""
    vm, switch = f"gaming-{number}", f"switch.gaming_station_{number}"
    returned = async_capture_events(hass, EVENT_CARDS_RETURNED)
    await voice_ready(hass, entry)
    assert speech(await say(hass, f"is {name} on")) == f"No, {state_of(hass, switch)}"

    response = await say(hass, f"turn on {name}")
    assert response.response_type is intent.IntentResponseType.ACTION_DONE
    assert [target.id for target in response.success_results] == [switch]
    assert speech(response) == "Turned on the switch"
    await until(lambda: sim.is_running(vm))
    await until(lambda: idle(entry))
    assert not sim.is_running("gpu-node")
    assert speech(await say(hass, f"is {name} on")) == "Yes"
    assert speech(await say(hass, f"is {name} off")) == f"No, {state_of(hass, switch)}"

    response = await say(hass, f"turn off {name}")
    assert [target.id for target in response.success_results] == [switch]
    assert speech(response) == "Turned off the switch"
    await until(lambda: bool(returned))
    await until(lambda: idle(entry))
    assert not sim.is_running(vm)
    assert sim.is_running("gpu-node")
    assert not cordoned(cluster)
    await entry.runtime_data.coordinator.async_refresh()
    assert speech(await say(hass, f"is {name} off")) == "Yes"


@pytest.mark.parametrize(
    "sentence",
    [
        "what is the state of the GPU node",
        "what's the state of the GPU node",
        "what is the GPU node doing",
    ],
)
async def test_ask_what_the_gpu_node_is_doing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    no_pdb: None,
    sentence: str,
) -> None:
    """The GPU node answers with its Handoff state: serving while it serves
    the cluster, off while a gaming VM holds its cards."""
    await voice_ready(hass, entry)
    serving = hass.states.get(HANDOFF)
    assert serving is not None
    assert serving.state == "serving"
    response = await say(hass, sentence)
    assert response.response_type is intent.IntentResponseType.QUERY_ANSWER
    assert [state.entity_id for state in response.matched_states] == [HANDOFF]
    assert speech(response).endswith(f" is {serving.state}")
    if "state of" in sentence:
        # hassil's answer names what it matched: the alias "GPU node".
        assert speech(response) == f"Gpu node is {serving.state}"

    await say(hass, "turn on gaming station one")
    await until(lambda: sim.is_running("gaming-1"))
    await until(lambda: idle(entry))
    now = hass.states.get(HANDOFF)
    assert now is not None
    assert now.state == "off"
    assert speech(await say(hass, sentence)).endswith(" is off")


async def test_the_sentences_need_what_gpu_handoff_adds(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """Without the spoken aliases and the exposed Handoff state, the default
    agent knows neither "gaming station one" nor "the GPU node": the aliases
    and the exposure are what the sentences above stand on."""
    await voice_ready(hass, entry)
    registry = er.async_get(hass)
    for entity_id in (SWITCH_1, HANDOFF):
        registry.async_update_entity(entity_id, aliases=[COMPUTED])
    async_expose_entity(hass, "conversation", HANDOFF, False)
    response = await say(hass, "is gaming station one on")
    assert response.response_type is intent.IntentResponseType.ERROR
    response = await say(hass, "what is the state of the GPU node")
    assert HANDOFF not in [state.entity_id for state in response.matched_states]


# --- what the user set wins ---------------------------------------------------


def _preregister(
    hass: HomeAssistant, entry: MockConfigEntry, domain: str, key: str, object_id: str
) -> str:
    """The registry entry of one of the tower's entities before it first loads
    (an entity the user already named, or gave aliases)."""
    return (
        er.async_get(hass)
        .async_get_or_create(
            domain,
            DOMAIN,
            f"{entry.entry_id}_{key}",
            config_entry=entry,
            suggested_object_id=object_id,
        )
        .entity_id
    )


async def test_aliases_are_offered_once(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """The spoken alias sits beside Home Assistant's own name, remembered as
    GPU Handoff's; a reload adds nothing twice."""
    await voice_ready(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED, "Gaming station one"]
    assert aliases(hass, SWITCH_2) == [COMPUTED, "Gaming station two"]
    assert aliases(hass, HANDOFF) == [COMPUTED, "GPU node"]
    switch = er.async_get(hass).async_get(SWITCH_1)
    assert switch is not None
    assert switch.options[DOMAIN] == {VOICE_ALIASES: ["Gaming station one"]}
    assert async_should_expose(hass, "conversation", HANDOFF)

    await reload(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED, "Gaming station one"]
    assert aliases(hass, HANDOFF) == [COMPUTED, "GPU node"]


async def test_a_users_own_aliases_win(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A switch whose user already gave it aliases gets none from GPU Handoff,
    then or later: the user's alias answers, the spoken one does not."""
    switch = _preregister(
        hass, entry, "switch", "gaming-1_gaming_vm", "gaming_station_1"
    )
    er.async_get(hass).async_update_entity(switch, aliases=[COMPUTED, "Kids PC"])
    await voice_ready(hass, entry)
    assert aliases(hass, switch) == [COMPUTED, "Kids PC"]
    assert speech(await say(hass, "is kids pc on")) == f"No, {state_of(hass, switch)}"
    response = await say(hass, "is gaming station one on")
    assert response.response_type is intent.IntentResponseType.ERROR

    # The user empties the list later: GPU Handoff still adds nothing.
    er.async_get(hass).async_update_entity(switch, aliases=[COMPUTED])
    await reload(hass, entry)
    assert aliases(hass, switch) == [COMPUTED]


async def test_a_removed_alias_is_never_added_again(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """The user removes "Gaming station one" and "GPU node": after a reload
    (and a restart is one) they stay removed."""
    await voice_ready(hass, entry)
    registry = er.async_get(hass)
    registry.async_update_entity(SWITCH_1, aliases=[COMPUTED])
    registry.async_update_entity(HANDOFF, aliases=[COMPUTED])
    await reload(hass, entry)
    await reload(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED]
    assert aliases(hass, HANDOFF) == [COMPUTED]
    assert aliases(hass, SWITCH_2) == [COMPUTED, "Gaming station two"]
    response = await say(hass, "is gaming station one on")
    assert response.response_type is intent.IntentResponseType.ERROR
    assert (
        speech(await say(hass, "is gaming station 1 on"))
        == f"No, {state_of(hass, SWITCH_1)}"
    )


async def test_a_users_own_name_is_the_one_spoken(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A user who renames the switch gets the spoken form of their name in
    place of GPU Handoff's old alias, as long as the aliases are GPU
    Handoff's alone; once the user adds one of their own, GPU Handoff leaves
    the list as it is."""
    await voice_ready(hass, entry)
    registry = er.async_get(hass)
    registry.async_update_entity(SWITCH_1, name="Racing rig 3")
    await reload(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED, "Racing rig three"]
    assert (
        speech(await say(hass, "is racing rig three on"))
        == f"No, {state_of(hass, SWITCH_1)}"
    )
    # The old alias is gone. (Assist's fallback matcher may still read the
    # missing name as the nearest one it knows, Gaming station 2.)
    assert SWITCH_1 not in answered_about(await say(hass, "is gaming station one on"))

    registry.async_update_entity(
        SWITCH_1, aliases=[COMPUTED, "Racing rig three", "The rig"]
    )
    registry.async_update_entity(SWITCH_1, name="Sim rig 4")
    await reload(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED, "Racing rig three", "The rig"]

    # A name with no number to spell: nothing to add, nothing left behind.
    registry.async_update_entity(SWITCH_2, name="Couch")
    await reload(hass, entry)
    assert aliases(hass, SWITCH_2) == [COMPUTED]
    switch_2 = registry.async_get(SWITCH_2)
    assert switch_2 is not None
    assert VOICE_ALIASES not in switch_2.options.get(DOMAIN, {})


async def test_a_name_another_entity_answers_to_is_left_out(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A light the user called "Gaming station one" keeps that name to itself:
    the switch gets no alias that would make the sentence mean both."""
    hass.states.async_set(
        "light.desk_lamp", "off", {"friendly_name": "Gaming station one"}
    )
    await voice_ready(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED]
    assert aliases(hass, SWITCH_2) == [COMPUTED, "Gaming station two"]


async def test_numbers_are_spelled_in_english_only(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """Home Assistant set to French: "Gaming station 1" gets no English
    "one" (a French speaker adds their own alias); the GPU node still
    answers to its device's name."""
    hass.config.language = "fr"
    await voice_ready(hass, entry)
    assert aliases(hass, SWITCH_1) == [COMPUTED]
    # Its entity id follows the French name.
    handoff = er.async_get(hass).async_get_entity_id(
        "sensor", DOMAIN, f"{entry.entry_id}_gpu-node_handoff_state"
    )
    assert handoff is not None
    assert handoff != HANDOFF
    assert aliases(hass, handoff) == [COMPUTED, "GPU node"]


async def test_the_users_exposure_choice_wins(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """The Handoff state is exposed to Assist when first seen, as switches
    are; a user who unexposes it keeps it unexposed across reloads."""
    await voice_ready(hass, entry)
    assert async_should_expose(hass, "conversation", HANDOFF)
    async_expose_entity(hass, "conversation", HANDOFF, False)
    await reload(hass, entry)
    assert not async_should_expose(hass, "conversation", HANDOFF)


async def test_no_exposure_when_new_entities_are_not_exposed(
    hass: HomeAssistant, entry: MockConfigEntry
) -> None:
    """A user who turned off "Expose new entities" for Assist gets no
    exposed Handoff state either."""
    assert await async_setup_component(hass, "homeassistant", {})
    hass.data[DATA_EXPOSED_ENTITIES].async_set_expose_new_entities(
        "conversation", False
    )
    await voice_ready(hass, entry)
    assert not async_should_expose(hass, "conversation", HANDOFF)
    assert not async_should_expose(hass, "conversation", SWITCH_1)


# --- a handoff started by voice that fails later ------------------------------


@pytest.mark.parametrize(
    ("failure", "reason"),
    [("pdb_refuses", "PodDisruptionBudget"), ("cordon_forbidden", "403")],
)
async def test_a_voice_handoff_that_fails_later_says_why(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    failure: str,
    reason: str,
) -> None:
    """Assist answers at once ("Turned on the switch"); the handoff fails
    afterwards. The user learns why without the dashboard: a repair issue
    names the gaming VM and the reason, and the switch's last_error says it
    too. The GPU node keeps serving, uncordoned."""
    if failure == "cordon_forbidden":
        # The ServiceAccount lost "patch nodes": the cordon is refused.
        cluster.delete("PodDisruptionBudget", "trainer", "ai")
        cluster.fail_next(1, 403, verb="patch", resource="nodes")
    # Else the trainer's PodDisruptionBudget refuses until the drain timeout.
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await voice_ready(hass, entry)
    response = await say(hass, "turn on gaming station one")
    assert speech(response) == "Turned on the switch"
    await until(lambda: bool(failed))
    await until(lambda: idle(entry))

    error = failed[0].data["error"]
    assert reason in error
    issue = ir.async_get(hass).async_get_issue(
        DOMAIN, f"handoff_failed_{entry.entry_id}_gaming-1"
    )
    assert issue is not None
    assert issue.severity is ir.IssueSeverity.ERROR
    assert issue.translation_placeholders is not None
    assert issue.translation_placeholders["error"] == error
    assert issue.translation_placeholders["vm"] == "Gaming station 1"
    switch = hass.states.get(SWITCH_1)
    assert switch is not None
    assert switch.state == "off"
    assert switch.attributes["last_error"] == error
    assert sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    await until(lambda: not cordoned(cluster))
    assert (
        speech(await say(hass, "is gaming station one on"))
        == f"No, {state_of(hass, SWITCH_1)}"
    )


async def test_a_voice_request_refused_at_once_changes_nothing(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Someone else cordoned the GPU node: the handoff is refused before it
    starts. Assist answers with an error (Home Assistant's own words for a
    failed action; the reason is in the log), and nothing changes."""
    started = async_capture_events(hass, EVENT_HANDOFF_STARTED)
    await voice_ready(hass, entry)
    cluster.modify(
        "Node",
        GPU_NODE,
        "",
        mutate=lambda node: node["spec"].update(unschedulable=True),
    )
    await entry.runtime_data.coordinator.async_refresh()
    response = await say(hass, "turn on gaming station one")
    assert response.response_type is intent.IntentResponseType.ERROR
    assert response.error_code is intent.IntentResponseErrorCode.FAILED_TO_HANDLE
    assert "cordoned by someone else" in caplog.text
    await hass.async_block_till_done()
    assert started == []
    assert state_of(hass, SWITCH_1) == "off"
    assert not sim.is_running("gaming-1")
    assert sim.is_running("gpu-node")


# --- spoken forms ----------------------------------------------------------------


def test_spoken_forms() -> None:
    """libvirt separators become spaces; numbers become English words."""
    assert spoken_forms("Gaming station 1", english=True) == ["Gaming station one"]
    assert spoken_forms("gaming-12", english=True) == ["gaming 12", "gaming twelve"]
    assert spoken_forms("win_2", english=False) == ["win 2"]
    assert spoken_forms("Gaming station 1", english=False) == []
    assert spoken_forms("GPU node", english=True) == []
    assert spoken_forms("Rig 100", english=True) == []
    assert spoken_forms("k3s-gpu", english=True) == ["k3s gpu"]
    assert [spell_number(n) for n in (0, 19, 20, 21, 99, 100)] == [
        "zero",
        "nineteen",
        "twenty",
        "twenty-one",
        "ninety-nine",
        None,
    ]
