"""The automation blueprints in blueprints/automation/gpu_handoff, in Home
Assistant: each is loaded by Home Assistant's own blueprint code, instantiated
as a user would (automations with ``use_blueprint``) on the entities of a
real tower (the simulator behind sshd and the real agent, the Kubernetes API
emulator), its trigger made to happen for real, and its effect asserted.
"""

from __future__ import annotations

from datetime import datetime, timedelta
import logging
from pathlib import Path
import shutil
from typing import Any
from urllib.parse import quote

from homeassistant.components import automation
from homeassistant.components.automation import config as automation_config
from homeassistant.components.blueprint import models as blueprint_models
from homeassistant.components.calendar import CalendarEntity, CalendarEvent
from homeassistant.core import HomeAssistant
from homeassistant.helpers.entity_platform import AddEntitiesCallback
from homeassistant.setup import async_setup_component
from homeassistant.util import dt as dt_util, yaml as yaml_util
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    MockPlatform,
    async_capture_events,
    async_mock_service,
    mock_platform,
)

from custom_components.gpu_handoff import health
from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.stories import (
    HANDOFF,
    SWITCH_1,
    SWITCH_2,
    cordoned,
    idle,
    play,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

REPO = Path(__file__).resolve().parents[1]
BLUEPRINTS = REPO / "blueprints" / "automation" / "gpu_handoff"
SOURCE = "https://github.com/gpu-handoff/gpu-handoff/blob/main/"
NOTIFY = "gpu_handoff/notify_on_failure.yaml"
RETURN_AT = "gpu_handoff/return_cards_at_time.yaml"
PREPARE = "gpu_handoff/prepare_on_trigger.yaml"


def _blueprint(path: Path) -> blueprint_models.Blueprint:
    return blueprint_models.Blueprint(
        yaml_util.load_yaml_dict(path),
        path=str(path),
        expected_domain=automation.DOMAIN,
        schema=automation_config.AUTOMATION_BLUEPRINT_SCHEMA,
    )


@pytest.mark.parametrize(
    "path", sorted(BLUEPRINTS.glob("*.yaml")), ids=lambda p: p.name
)
def test_each_blueprint_is_valid_and_says_where_it_lives(path: Path) -> None:
    """Home Assistant's blueprint schema takes it; its source_url (what the
    import button fetches and a re-import reads again) is its own path on
    the repository's main branch; the README links its import button."""
    blueprint = _blueprint(path)
    relative = path.relative_to(REPO).as_posix()
    assert blueprint.metadata["source_url"] == SOURCE + relative
    assert blueprint.metadata["homeassistant"]["min_version"] == _tested_version()
    assert blueprint.name.startswith("GPU Handoff: ")
    for name, spec in blueprint.inputs.items():
        assert spec, name
        assert spec.get("name"), name
        assert spec.get("selector"), name
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert quote(SOURCE + relative, safe="") in readme, "no import button"


def _tested_version() -> str:
    hacs = yaml_util.load_yaml_dict(REPO / "hacs.json")
    return str(hacs["homeassistant"])


@pytest.fixture
async def blueprints(hass: HomeAssistant, tmp_path: Path) -> None:
    """The blueprints where an import puts them: the configuration's
    blueprints/automation/gpu_handoff (a configuration of the test's own)."""
    config = tmp_path / "config"
    shutil.copytree(BLUEPRINTS, config / "blueprints" / "automation" / "gpu_handoff")
    hass.config.config_dir = str(config)


async def _automations(hass: HomeAssistant, *configs: dict[str, Any]) -> None:
    assert await async_setup_component(
        hass, automation.DOMAIN, {automation.DOMAIN: list(configs)}
    )
    await hass.async_block_till_done()
    for config in configs:
        state = hass.states.get(f"automation.{config['id']}")
        assert state is not None, config["id"]
        assert state.state == "on", config["id"]


def _use(path: str, name: str, **inputs: Any) -> dict[str, Any]:
    return {
        "id": name,
        "alias": name,
        "use_blueprint": {"path": path, "input": inputs},
    }


async def test_a_failed_handoff_is_notified_with_its_reason(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """A pod nothing recreates refuses the drain: turning Gaming station 1
    on fails, and the chosen notify action gets the VM's name and the
    reason; an instance that reports only stops stays silent."""
    phone = async_mock_service(hass, "notify", "phone")
    stops_only = async_mock_service(hass, "notify", "stops_only")
    failed = async_capture_events(hass, EVENT_HANDOFF_FAILED)
    await setup_entry(hass, entry)
    await _automations(
        hass,
        _use(NOTIFY, "tell_me", notify_action="notify.phone"),
        _use(NOTIFY, "stops", notify_action="notify.stops_only", failures=["stop"]),
    )
    cluster.add_pod("debug", node=GPU_NODE)  # no controller: the drain refuses

    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: bool(failed))
    await until(lambda: bool(phone))
    await hass.async_block_till_done()

    [call] = phone
    assert call.data["title"] == "GPU Handoff"
    message = call.data["message"]
    assert message.startswith("Turning on Gaming station 1 failed: ")
    assert failed[0].data["error"] in message
    assert "debug" in message
    assert stops_only == []


async def test_cards_back_without_their_gpus_are_notified(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    kubelet: Kubelet,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node comes back after a game without advertising its GPUs
    (the device plugin never registers them): the notification says so,
    with the numbers; a handoff that succeeded is not reported."""
    monkeypatch.setattr(health, "GPUS_BOUND", 1.5)
    phone = async_mock_service(hass, "notify", "phone")
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    await setup_entry(hass, entry)
    await _automations(hass, _use(NOTIFY, "tell_me", notify_action="notify.phone"))
    await play(hass, entry, sim, 1)
    await until(lambda: not cluster.node_is_up(GPU_NODE))
    cluster.set_node_gpus(GPU_NODE, 0)
    assert phone == []

    kubelet.plugin_delay = None  # the device plugin never registers again
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(unhealthy))
    await until(lambda: bool(phone))

    [call] = phone
    assert call.data["message"] == (
        "GPU node is back in the cluster, but not all of its GPUs: "
        + unhealthy[0].data["error"]
    )
    assert "0 allocatable GPU(s)" in call.data["message"]


def _time_of_day(moment: datetime) -> str:
    """``moment`` as the blueprint's time selector gives it."""
    return moment.strftime("%H:%M:%S")


async def test_the_cards_go_back_at_the_set_time_if_the_condition_holds(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """Gaming station 1 was left on. Two instances, "only if the TV is off":
    at the first one's time the TV is on and nothing happens; at the
    second's it is off, and Gaming station 1 is turned off (its guest shut
    down, never destroyed) and the GPU node serves the cluster again,
    uncordoned. Gaming station 2, off, is left alone."""
    tv = "input_boolean.living_room_tv"
    assert await async_setup_component(
        hass, "input_boolean", {"input_boolean": {"living_room_tv": {}}}
    )
    await _set(hass, tv, "turn_on")
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    tv_off = [{"condition": "state", "entity_id": tv, "state": "off"}]
    # Whole seconds, at least one ahead: the time trigger's resolution.
    first = dt_util.now().replace(microsecond=0) + timedelta(seconds=2)
    second = first + timedelta(seconds=4)
    await _automations(
        hass,
        *(
            _use(
                RETURN_AT,
                name,
                gaming_vms=[SWITCH_1, SWITCH_2],
                at=_time_of_day(moment),
                idle=tv_off,
            )
            for name, moment in (("bedtime", first), ("later", second))
        ),
    )
    controller = entry.runtime_data.controller

    # the first time passes with the TV on (the trigger fires at once at
    # its time; a second more is ample for its conditions to say no)
    await until(lambda: dt_util.now() >= first + timedelta(seconds=1), 10)
    await hass.async_block_till_done()
    assert not controller.requests
    assert idle(entry)
    assert hass.states.get(SWITCH_1).state == "on"
    assert sim.calls("shutdown", "gaming-1") == []

    await _set(hass, tv, "turn_off")
    assert dt_util.now() < second, "too slow to turn the TV off in time"
    await until(lambda: not sim.is_running("gaming-1"), 30)
    await until(lambda: idle(entry))
    await until(lambda: not cordoned(cluster))
    assert hass.states.get(SWITCH_1).state == "off"
    assert sim.is_running("gpu-node")
    assert [c.rc for c in sim.calls("shutdown", "gaming-1")] == [0]
    assert sim.calls("start", "gaming-2") == []
    assert hass.states.get("automation.later").attributes["last_triggered"]
    assert hass.states.get("automation.bedtime").attributes["last_triggered"] is None
    # Turned off, an automation's time trigger stops waiting for tomorrow.
    await hass.services.async_call(
        automation.DOMAIN, "turn_off", {"entity_id": "all"}, blocking=True
    )


async def _set(hass: HomeAssistant, entity_id: str, service: str) -> None:
    await hass.services.async_call(
        "input_boolean", service, {"entity_id": entity_id}, blocking=True
    )


# Prepare a gaming VM when something says someone is about to play.

TV = "media_player.living_room_tv"
ALICE = "person.alice"
DESK = "binary_sensor.desk_occupied"


def _prepare_on(
    entry: MockConfigEntry, name: str, vm: str, **inputs: Any
) -> dict[str, Any]:
    return _use(PREPARE, name, tower=entry.entry_id, vm=vm, **inputs)


async def _set_state(hass: HomeAssistant, entity_id: str, state: str) -> None:
    """The entity changes state (as its integration would write it); every
    automation run it starts is done when this returns."""
    hass.states.async_set(entity_id, state)
    await hass.async_block_till_done()


def _untouched(entry: MockConfigEntry, sim: Tower, prepared: list[Any]) -> bool:
    """Nothing was asked of the tower: no request, no hold, no prepare, the
    GPU node never shut down."""
    controller = entry.runtime_data.controller
    return (
        not controller.requests
        and controller.state.hold is None
        and not prepared
        and sim.calls("shutdown", "gpu-node") == []
        and sim.is_running("gpu-node")
    )


async def _held_for(
    hass: HomeAssistant, entry: MockConfigEntry, prepared: list[Any], count: int
) -> str:
    """The ``count``-th prepare is done: its event fired, nothing runs any
    more, the Handoff state shows the hold; the VM it is held for."""
    controller = entry.runtime_data.controller
    await until(lambda: len(prepared) == count)
    await until(lambda: idle(entry) and not controller.requests)
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    vm = str(prepared[-1].data["vm"])
    await until(lambda: hass.states.get(HANDOFF).attributes["held_for"] == vm)
    return vm


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_tv_turning_on_prepares_the_gaming_vm(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An instance for the living room TV and Gaming station 1, the hold 20
    minutes, no other trigger chosen. The TV turning off, going unavailable
    and coming back on, Alice coming home and the desk sensor turning on do
    nothing. The TV turning on prepares
    gaming-1: the GPU node is drained and shut down, gaming-1 stays off, the
    Handoff state is held for it for 20 minutes, the prepare's event fired
    for this tower. Once gaming-1 plays, the TV turning on again does
    nothing (no prepare, no error): nothing is logged as an error at all
    (the calendar trigger, with no calendar, is not set up)."""
    hass.states.async_set(TV, "on")
    hass.states.async_set(ALICE, "not_home")
    hass.states.async_set(DESK, "off")
    prepared = async_capture_events(hass, EVENT_PREPARE_SUCCEEDED)
    await setup_entry(hass, entry)
    await _automations(
        hass,
        _prepare_on(entry, "tv_on", "gaming-1", media_players=[TV], hold_minutes=20),
    )
    before = dt_util.utcnow()

    for entity_id, state in (
        (TV, "off"),
        (TV, "unavailable"),
        (TV, "on"),  # back, as when its integration reconnects
        (TV, "off"),
        (ALICE, "home"),
        (DESK, "on"),
    ):
        await _set_state(hass, entity_id, state)
    assert hass.states.get("automation.tv_on").attributes["last_triggered"] is None
    assert _untouched(entry, sim, prepared)

    await _set_state(hass, TV, "on")
    assert await _held_for(hass, entry, prepared, 1) == "gaming-1"
    assert not sim.is_running("gpu-node")
    assert [c.rc for c in sim.calls("shutdown", "gpu-node")] == [0]
    assert not sim.is_running("gaming-1")
    assert sim.calls("start", "gaming-1") == []
    assert cordoned(cluster)
    assert hass.states.get(SWITCH_1).state == "off"
    state = hass.states.get(HANDOFF)
    assert state.state == "held"
    assert state.attributes["held_for"] == "gaming-1"
    assert state.attributes["hold_minutes_left"] == 20
    ends = dt_util.parse_datetime(state.attributes["hold_ends"])
    assert ends is not None
    assert 19 * 60 < (ends - before).total_seconds() <= 20 * 60 + 30
    [event] = prepared
    assert event.data["config_entry_id"] == entry.entry_id
    assert event.data["hold_ends"] == state.attributes["hold_ends"]

    # The player turns gaming-1 on; later the TV goes off and on again.
    await switch(hass, "turn_on", SWITCH_1)
    await until(lambda: sim.is_running("gaming-1"))
    await until(lambda: idle(entry) and not entry.runtime_data.controller.requests)
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()
    await _set_state(hass, TV, "off")
    await _set_state(hass, TV, "playing")
    assert hass.states.get("automation.tv_on").attributes["last_triggered"]
    assert len(prepared) == 1
    assert not entry.runtime_data.controller.requests
    assert sim.is_running("gaming-1")
    assert _errors(caplog) == []


async def test_someone_home_or_the_desk_occupied_prepares_the_gaming_vm(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An instance for Alice and the desk sensor, Gaming station 2, the
    hold left at its default. Alice's state restored as Home Assistant
    starts (unknown to home), Alice going from home to work, the desk
    sensor coming back (unavailable to on) and turning off, and the TV
    (not chosen) turning on do nothing. Alice coming home from work
    prepares gaming-2 for 15 minutes; the desk sensor turning on while
    the cards wait holds them anew, without another shutdown."""
    hass.states.async_set(ALICE, "unknown")
    hass.states.async_set(DESK, "unavailable")
    hass.states.async_set(TV, "off")
    prepared = async_capture_events(hass, EVENT_PREPARE_SUCCEEDED)
    await setup_entry(hass, entry)
    await _automations(
        hass,
        _prepare_on(
            entry, "coming_to_play", "gaming-2", people=[ALICE], binary_sensors=[DESK]
        ),
    )

    for entity_id, state in (
        (ALICE, "home"),
        (ALICE, "work"),
        (DESK, "on"),
        (DESK, "off"),
        (TV, "on"),
    ):
        await _set_state(hass, entity_id, state)
    assert (
        hass.states.get("automation.coming_to_play").attributes["last_triggered"]
        is None
    )
    assert _untouched(entry, sim, prepared)

    await _set_state(hass, ALICE, "home")
    assert await _held_for(hass, entry, prepared, 1) == "gaming-2"
    assert not sim.is_running("gpu-node")
    assert not sim.is_running("gaming-2")
    assert hass.states.get(SWITCH_2).state == "off"
    state = hass.states.get(HANDOFF)
    assert state.state == "held"
    assert state.attributes["hold_minutes_left"] == 15
    first_end = dt_util.parse_datetime(state.attributes["hold_ends"])
    assert first_end is not None

    await _set_state(hass, DESK, "on")
    assert await _held_for(hass, entry, prepared, 2) == "gaming-2"
    await until(
        lambda: (
            hass.states.get(HANDOFF).attributes["hold_ends"]
            == prepared[-1].data["hold_ends"]
        )
    )
    second_end = dt_util.parse_datetime(prepared[-1].data["hold_ends"])
    assert second_end is not None
    assert second_end > first_end
    assert len(sim.calls("shutdown", "gpu-node")) == 1
    assert not sim.is_running("gaming-2")
    assert _errors(caplog) == []


class _Calendar(CalendarEntity):
    """A calendar with the events it is given."""

    _attr_should_poll = False

    def __init__(self, name: str, events: list[CalendarEvent]) -> None:
        self._attr_name = name
        self._attr_unique_id = name
        self._events = events

    @property
    def event(self) -> CalendarEvent | None:
        now = dt_util.now()
        coming = [e for e in self._events if e.end_datetime_local > now]
        return min(coming, key=lambda e: e.start_datetime_local, default=None)

    async def async_get_events(
        self, hass: HomeAssistant, start_date: datetime, end_date: datetime
    ) -> list[CalendarEvent]:
        return [
            e
            for e in self._events
            if e.start_datetime_local < end_date and e.end_datetime_local > start_date
        ]


async def _calendar(hass: HomeAssistant, events: list[CalendarEvent]) -> _Calendar:
    """A calendar entity (Home Assistant's calendar integration, a platform
    of the test's own) with ``events``."""
    calendar = _Calendar("Game nights", events)

    async def setup_platform(
        hass: HomeAssistant,
        config: dict[str, Any],
        add_entities: AddEntitiesCallback,
        discovery_info: Any = None,
    ) -> None:
        add_entities([calendar])

    mock_platform(
        hass, "games.calendar", MockPlatform(async_setup_platform=setup_platform)
    )
    assert await async_setup_component(
        hass, "calendar", {"calendar": [{"platform": "games"}]}
    )
    await hass.async_block_till_done()
    assert calendar.entity_id == "calendar.game_nights"
    assert hass.states.get(calendar.entity_id) is not None
    return calendar


async def test_a_game_night_about_to_start_prepares_the_gaming_vm(
    hass: HomeAssistant,
    blueprints: None,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    no_pdb: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A calendar's event starts in 10 minutes and 3 seconds; an instance
    for that calendar, 10 minutes before: nothing happens at first, and 3
    seconds later (10 minutes before the event, by Home Assistant's
    calendar trigger) gaming-1 is prepared: the GPU node is shut down,
    gaming-1 stays off, the cards are held for it."""
    start = dt_util.now().replace(microsecond=0) + timedelta(minutes=10, seconds=3)
    night = CalendarEvent(
        start=start, end=start + timedelta(hours=3), summary="Game night"
    )
    calendar = await _calendar(hass, [night])
    prepared = async_capture_events(hass, EVENT_PREPARE_SUCCEEDED)
    await setup_entry(hass, entry)
    await _automations(
        hass,
        _prepare_on(
            entry,
            "game_night",
            "gaming-1",
            calendars=[calendar.entity_id],
            minutes_before=10,
        ),
    )
    assert _untouched(entry, sim, prepared)

    assert await _held_for(hass, entry, prepared, 1) == "gaming-1"
    fired = hass.states.get("automation.game_night").attributes["last_triggered"]
    early = (start - timedelta(minutes=10) - fired).total_seconds()
    assert -1.5 < early <= 0.0, early
    assert not sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert cordoned(cluster)
    assert hass.states.get(HANDOFF).state == "held"
    assert _errors(caplog) == []
    # Turned off, an automation's calendar trigger stops waiting for events;
    # removed, the calendar stops waiting for its event's start and end.
    await hass.services.async_call(
        automation.DOMAIN, "turn_off", {"entity_id": "all"}, blocking=True
    )
    await calendar.async_remove()
