"""The automation blueprints in blueprints/automation/gpu_handoff, in Home
Assistant: each is loaded by Home Assistant's own blueprint code, instantiated
as a user would (automations with ``use_blueprint``) on the entities of a
real tower (the simulator behind sshd and the real agent, the Kubernetes API
emulator), its trigger made to happen for real, and its effect asserted.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
import shutil
from typing import Any
from urllib.parse import quote

from homeassistant.components import automation
from homeassistant.components.automation import config as automation_config
from homeassistant.components.blueprint import models as blueprint_models
from homeassistant.core import HomeAssistant
from homeassistant.setup import async_setup_component
from homeassistant.util import dt as dt_util, yaml as yaml_util
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
    async_mock_service,
)

from custom_components.gpu_handoff import health
from custom_components.gpu_handoff.const import (
    EVENT_HANDOFF_FAILED,
    EVENT_RETURN_UNHEALTHY,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.stories import (
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
