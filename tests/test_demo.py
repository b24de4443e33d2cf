"""The demo, end to end: Home Assistant as its own process, onboarded and set
up through its REST API, hands the cards over and back (guests 100x faster);
with the lending option set through the options flow, the GPU node serves the
free cards while a station plays; the simulator's ghost switch raises the GPU
node's Health problem and heals it; two towers side by side; Ctrl-C with its
output piped into a reader that Ctrl-C stops too; a browser screenshot. And
the demo's parts that decide what a user sees: the kubelet stand-in, the
ghost it plays in the cluster emulator (judged by the integration with its
real bound), the log check, the page text check."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
import re
import select
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from typing import Any

from homeassistant.core import HomeAssistant
from homeassistant.helpers import device_registry as dr, entity_registry as er
from homeassistant.util.yaml import load_yaml_dict
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import DOMAIN, SERVICE_PREPARE
from custom_components.gpu_handoff.health import CONTAINERS_NOT_STARTING, NO_PROBLEM
from custom_components.gpu_handoff.tower.gpu_handoff import config as agent_config, wire
from scripts.gpu_handoff_demo import ghost
from scripts.gpu_handoff_demo.cluster import seed
from scripts.gpu_handoff_demo.dashboard import dashboard, find_entities
from scripts.gpu_handoff_demo.demo import SCREEN
from scripts.gpu_handoff_demo.home_assistant import log_problems
from scripts.gpu_handoff_demo.screenshot import find_browser, text_problems
from scripts.gpu_handoff_demo.towers import DemoTower, titles
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.box_tower import box_tower_unavailable
from tests.support.kubelet import FAST, Kubelet
from tests.support.sshd import Sshd, sshd_available
from tests.support.stories import HANDOFF, SWITCH_1, cordoned, idle, setup_entry, until
from tests.towersim import Tower

REPO = Path(__file__).resolve().parent.parent
DEMO = [sys.executable, "-m", "scripts.gpu_handoff_demo"]
SUMMARY = re.compile(r"^demo: handoff \d+\.\d s, return \d+\.\d s: ok$", re.MULTILINE)
LENDING = re.compile(
    r"^demo: handoff \d+\.\d s, GPU node serving 2 cards \d+\.\d s, "
    r"return \d+\.\d s: ok$",
    re.MULTILINE,
)
GHOST = re.compile(
    r"^demo: ghost GPU node: Health problem \d+\.\d s, cleared \d+\.\d s: ok$",
    re.MULTILINE,
)
GUIDED = re.compile(
    r"^demo: fresh tower: guided install \d+\.\d s as gh-admin-pw \(sudo with its "
    r"password\), /usr/local/bin/gpu-handoff and account gpu-handoff on the tower, "
    r"libvirtd\.service restarted, 2 findings, entry loaded \d+\.\d s: ok$",
    re.MULTILINE,
)
# The tower's systemd, asked as the demo stops: the install's restart.
GUIDED_RESTARTS = (
    "demo: fresh tower: libvirtd.service was restarted 1 time(s) while the demo "
    "ran (the tower's journal)"
)
CLEAN_LOG = "demo: Home Assistant's log: no errors, no tracebacks"
STRINGS = json.loads(
    (REPO / "custom_components" / "gpu_handoff" / "strings.json").read_text("utf-8")
)


def _require(available: bool, what: str) -> None:
    if available:
        return
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail(f"{what} is required here")
    pytest.skip(f"needs {what}")


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    _require(sshd_available(), "OpenSSH's sshd")
    return subprocess.run(
        [*DEMO, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _work_dir(stdout: str) -> Path:
    found = re.search(r"^demo: files \(configuration, logs\): (.+)$", stdout, re.M)
    assert found, stdout
    return Path(found[1])


def _store(config: Path, key: str) -> Any:
    return json.loads((config / ".storage" / key).read_text("utf-8"))["data"]


def _entity_id(config: Path, platform: str, translation_key: str | None) -> str:
    """The one entity of ``platform`` with ``translation_key``, from the
    kept entity registry."""
    (found,) = [
        e["entity_id"]
        for e in _store(config, "core.entity_registry")["entities"]
        if e["platform"] == platform and e.get("translation_key") == translation_key
    ]
    return str(found)


def _history(config: Path, entity_id: str) -> list[tuple[str, dict[str, Any], float]]:
    """What Home Assistant's recorder kept of ``entity_id``: each state with
    its attributes and when, in order."""
    with contextlib.closing(
        sqlite3.connect(config / "home-assistant_v2.db")
    ) as database:
        rows = database.execute(
            "SELECT states.state, state_attributes.shared_attrs, "
            "states.last_updated_ts FROM states "
            "JOIN states_meta ON states.metadata_id = states_meta.metadata_id "
            "LEFT JOIN state_attributes "
            "ON states.attributes_id = state_attributes.attributes_id "
            "WHERE states_meta.entity_id = ? ORDER BY states.state_id",
            (entity_id,),
        ).fetchall()
    return [(state, json.loads(attrs or "{}"), moment) for state, attrs, moment in rows]


def _changes(history: list[tuple[str, dict[str, Any], float]]) -> list[str]:
    """The states one after the other, repeats left out."""
    states = [state for state, _, _ in history]
    return [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]


def test_scripted_demo() -> None:
    """``--scripted --fast`` exits 0 with its summary line, after a run in which
    Home Assistant logged no error and no traceback, showed no repair and
    loaded every integration; its directory is gone afterwards."""
    result = _demo("--scripted", "--fast")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert SUMMARY.search(result.stdout), output
    assert CLEAN_LOG in result.stdout, output
    assert result.stdout.rstrip().endswith("demo: stopped"), output
    assert not _work_dir(result.stdout).exists()


def test_lending_demo() -> None:
    """``--lend``: the option is turned on through the options flow; Gaming
    station 1's handoff ends with the GPU node serving the two cards nobody
    plays with (Home Assistant recorded it lending 2), and turning the
    station off brings all three back."""
    result = _demo("--scripted", "--fast", "--lend", "--keep")
    output = result.stdout + result.stderr
    work = _work_dir(result.stdout)
    try:
        assert result.returncode == 0, output
        assert LENDING.search(result.stdout), output
        assert CLEAN_LOG in result.stdout, output
        config = work / "home-assistant"
        (entry,) = [
            e
            for e in _store(config, "core.config_entries")["entries"]
            if e["domain"] == DOMAIN
        ]
        assert entry["options"]["lend_free_cards"] is True
        # The flow kept what the user did not change.
        assert entry["options"]["drain_timeout"] == 300
        lent = _changes(_history(config, _entity_id(config, DOMAIN, "gpus_lent")))
        assert lent[0] == "3"
        assert lent[-1] == "3"
        # While the station played, the GPU node came back with two cards.
        assert "2" in lent, lent
        handoff = _changes(
            _history(config, _entity_id(config, DOMAIN, "handoff_state"))
        )
        assert handoff.count("serving") >= 3, handoff
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_ghost_switch_demo() -> None:
    """``--scripted --ghost``: the simulator's "Play a ghost GPU node" switch,
    a toggle helper on the dashboard, turned on and off through Home
    Assistant: the GPU node's Health shows the problem (containers do not
    start) while it is on, with its Kubernetes node Ready throughout, and
    clears once it is off; the handoff and return work afterwards."""
    result = _demo("--scripted", "--fast", "--ghost", "--keep")
    output = result.stdout + result.stderr
    work = _work_dir(result.stdout)
    try:
        assert result.returncode == 0, output
        assert GHOST.search(result.stdout), output
        assert SUMMARY.search(result.stdout), output
        assert CLEAN_LOG in result.stdout, output
        config = work / "home-assistant"
        (toggle,) = _store(config, "input_boolean")["items"]
        assert toggle["name"] == "Play a ghost GPU node"
        switch = _changes(_history(config, _entity_id(config, "input_boolean", None)))
        assert switch == ["off", "on", "off"]
        health = _history(config, _entity_id(config, DOMAIN, "node_health"))
        assert _changes(health) == ["off", "on", "off"]
        on = [state for state, _, _ in health].index("on")
        _, problem, raised = health[on]
        assert problem["reason"] == CONTAINERS_NOT_STARTING
        assert set(problem["pods_not_starting"]) == _seeded_pods()
        assert health[-1][1]["reason"] == NO_PROBLEM
        # A ghost is Ready: the Kubernetes node was Ready when the problem
        # showed (it went off only with the handoff that followed).
        ready = _history(config, _entity_id(config, DOMAIN, "node_ready"))
        assert [state for state, _, moment in ready if moment <= raised][-1] == "on"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_two_towers_side_by_side() -> None:
    """``--towers 2``: two simulated towers, each behind its own sshd with its
    own agent configuration, on one cluster; both hand over and back at once.
    The kept directory shows a Home Assistant configured as a current
    installation is, and a dashboard of translated entities."""
    result = _demo("--scripted", "--fast", "--towers", "2", "--keep")
    output = result.stdout + result.stderr
    work = _work_dir(result.stdout)
    try:
        assert result.returncode == 0, output
        for tower in ("tower-1", "tower-2"):
            assert re.search(
                rf"^demo: {tower}: handoff \d+\.\d s, return \d+\.\d s: ok$",
                result.stdout,
                re.M,
            ), output
        assert CLEAN_LOG in result.stdout, output
        assert f"demo: kept {work}" in result.stdout, output
        _check_kept(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_guided_install_demo() -> None:
    """``--scripted --guided``: beside the simulated tower, a fresh tower (a
    box: the Debian root under its own systemd, its real ssh.service, sudo,
    accounts and libvirtd.service serving libvirt's test driver) gets the
    agent through the config flow's guided install, one screen after the
    other through Home Assistant's REST API as the frontend sends them, with
    "Restart libvirtd now" ticked; libvirtd.service restarts for real (a new
    main process, once: the demo checks systemd's word and says it again from
    the journal as it stops); the install shows the tower's findings, the
    entry loads, the tower has the agent and the account; the simulated
    tower's handoff works meanwhile, and Home Assistant's log stays clean."""
    _require(
        box_tower_unavailable() is None,
        "a fresh tower in a box (root, systemd, overlayfs, cgroup2, namespaces)",
    )
    result = _demo("--scripted", "--fast", "--guided")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert GUIDED.search(result.stdout), output
    assert GUIDED_RESTARTS in result.stdout, output
    assert SUMMARY.search(result.stdout), output
    assert CLEAN_LOG in result.stdout, output
    assert "ports still in use" not in result.stdout, output
    screens = re.findall(
        r"^demo: fresh tower: config flow: (.*)$", result.stdout, re.MULTILINE
    )
    expected = [
        "the tower's address, account gpu-handoff",
        "host key SHA256:",
        '"Install the agent for me"',
        "administrator gh-admin-pw with its password",
        "GPU node gpu-node, gaming VMs win-1, win-2 (as proposed)",
        f'confirmed with "Restart libvirtd now"; agent {wire.VERSION} installed',
        "the restricted key logs in; the kubeconfig",
        "Kubernetes node fresh-gpu-node",
    ]
    assert len(screens) == len(expected), output
    for screen, start in zip(screens, expected, strict=True):
        assert screen.startswith(start), (screen, start)
    assert re.search(
        r"libvirtd\.service restarted \(main process (\d+) -> (?!\1\))\d+\)", screens[5]
    ), screens[5]
    # The findings of the tower's check, as the install_done step shows
    # them (the fresh tower's VMs have these on purpose).
    findings = re.findall(
        r"^demo: fresh tower:   - (\S+ \(\S+\)):", result.stdout, re.M
    )
    assert findings == ["no_agent_channel (win-2)", "rom_bar_not_off (gpu-node)"]
    assert not _work_dir(result.stdout).exists()


def _seeded_pods() -> set[str]:
    """The pods the demo's cluster has on tower 1's GPU node."""
    emu = K8sEmulator()
    seed(emu, 1)
    return {
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        for pod in ghost.pods_on(emu, GPU_NODE)
    }


def _check_kept(work: Path) -> None:
    assert (work / "demo.log").read_text("utf-8").rstrip().endswith("demo: stopped")
    agents = [
        json.loads((work / tower / "agent" / "agent.json").read_text("utf-8"))
        for tower in ("tower-1", "tower-2")
    ]
    assert agents[0]["state_dir"] != agents[1]["state_dir"]
    sshd_configs = {
        (work / tower / "sshd" / "sshd_config").read_text("utf-8")
        for tower in ("tower-1", "tower-2")
    }
    assert len({re.findall(r"^Port \d+$", c, re.M)[0] for c in sshd_configs}) == 2

    config = work / "home-assistant"
    # No YAML Home Assistant deprecates or keeps in storage: http and the
    # general settings are in .storage, as a current installation has them.
    configuration = load_yaml_dict(config / "configuration.yaml")
    assert not {"http", "homeassistant"} & set(configuration)
    # The automation made from the failure blueprint, where the automation
    # editor keeps a user's (automations.yaml, included), and the blueprint
    # where its import puts it.
    [failures] = configuration["automation"]
    assert failures["use_blueprint"]["path"] == "gpu_handoff/notify_on_failure.yaml"
    assert (
        config / "blueprints" / "automation" / failures["use_blueprint"]["path"]
    ).is_file()
    http = _store(config, "http")
    assert http["stable"]["server_host"] == ["127.0.0.1"]
    assert http["pending"] is None
    assert _store(config, "core.config")["country"] == "DE"

    entries = [
        e
        for e in _store(config, "core.config_entries")["entries"]
        if e["domain"] == "gpu_handoff"
    ]
    assert len(entries) == 2
    # The agent reports the tower's name where it takes one ("name").
    if not any(
        p.startswith("name:")
        for p in agent_config.validate_config(agents[0] | {"name": "x"})
    ):
        assert {e["title"] for e in entries} == {"tower-1", "tower-2"}
    registry = _store(config, "core.entity_registry")["entities"]
    ours = [e["entity_id"] for e in registry if e["platform"] == "gpu_handoff"]
    # Every VM has a name of its own: no entity id needed a "_2" to be unique.
    assert {i for i in ours if i.startswith("switch.")} == {
        f"switch.gaming_station_{n}" for n in range(1, 5)
    }
    assert [
        i for i in ours if not i.startswith("switch.") and re.search(r"_\d+$", i)
    ] == []
    by_id = {e["entity_id"]: e for e in registry}
    board = _store(config, "lovelace.gpu_handoff")["config"]
    _check_dashboard(board, by_id)
    _check_prepare_buttons(board, entries)


def _cards(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every card, those a conditional card holds too."""
    found = []
    for view in dashboard["views"]:
        for section in view["sections"]:
            for card in section["cards"]:
                found.append(card)
                if card["type"] == "conditional":
                    found.append(card["card"])
    return found


def _check_dashboard(
    dashboard: dict[str, Any], registry: dict[str, dict[str, Any]]
) -> None:
    """Every row is one of the integration's entities or the simulator's ghost
    switch; an attribute row only shows an attribute whose values the
    integration translates; every GPU node card shows its Health; every VM's
    screen is shown, while it is not unavailable."""
    cards = _cards(dashboard)
    rows = [
        row.get("row", row)  # a conditional row holds the row it shows
        for card in cards
        for row in card.get("entities", [])
    ]
    assert rows
    switches, ghosts, health = set(), set(), set()
    for row in rows:
        entity = registry[row["entity"]]
        platform = row["entity"].split(".")[0]
        if entity["platform"] == "input_boolean":
            ghosts.add(row["entity"])
            continue
        assert entity["platform"] == "gpu_handoff"
        if platform == "switch":
            switches.add(row["entity"])
        if entity["translation_key"] == "node_health":
            health.add(row["entity"])
        if row.get("type") == "attribute":
            translations = STRINGS["entity"][platform][entity["translation_key"]]
            assert translations["state_attributes"][row["attribute"]]["state"]
    assert len(switches) == 4
    assert len(ghosts) == 2
    assert len(health) == 2
    screens = [card["entity"] for card in cards if card["type"] == "picture-entity"]
    assert {registry[s]["translation_key"] for s in screens} == {"screen"}
    assert len(set(screens)) == 6  # three VMs a tower
    shown_while = {
        card["card"]["entity"]: card["conditions"]
        for card in cards
        if card["type"] == "conditional"
    }
    for screen in screens:
        assert shown_while[screen] == [
            {"condition": "state", "entity": screen, "state_not": "unavailable"}
        ]


def _buttons(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [card for card in _cards(dashboard) if card["type"] == "button"]


def _check_prepare_buttons(
    dashboard: dict[str, Any], entries: list[dict[str, Any]]
) -> None:
    """One "Get ... ready" button a tower: its tap calls gpu_handoff.prepare
    for the tower's first gaming station with the tower's own config entry
    (as Home Assistant stored it)."""
    buttons = _buttons(dashboard)
    assert {b["name"] for b in buttons} == {
        "Get gaming station 1 ready",
        "Get gaming station 3 ready",
    }
    taps = [b["tap_action"] for b in buttons]
    assert {t["action"] for t in taps} == {"perform-action"}
    assert {t["perform_action"] for t in taps} == {f"{DOMAIN}.{SERVICE_PREPARE}"}
    assert {t["data"]["vm"] for t in taps} == {"gaming-1"}
    assert sorted(t["data"]["config_entry_id"] for t in taps) == sorted(
        e["entry_id"] for e in entries
    )


def test_ctrl_c_with_the_reader_of_its_output_gone() -> None:
    """``scripts/demo | tee log`` and Ctrl-C: the interrupt stops ``tee`` too,
    before the demo prints its stop lines; those reach the terminal."""
    _require(sshd_available(), "OpenSSH's sshd")
    reader, writer = os.pipe()
    demo = subprocess.Popen(
        [*DEMO, "--fast"], cwd=REPO, stdout=writer, stderr=subprocess.PIPE
    )
    os.close(writer)
    seen = b""
    try:
        deadline = time.monotonic() + 300
        while b"Ctrl-C stops the demo" not in seen:
            assert time.monotonic() < deadline, seen
            if select.select([reader], [], [], 1.0)[0]:
                chunk = os.read(reader, 65536)
                assert chunk, seen  # the demo ended early
                seen += chunk
    finally:
        os.close(reader)  # the reader is gone, as tee is after Ctrl-C
    demo.send_signal(signal.SIGINT)
    _, stderr = demo.communicate(timeout=300)
    text = stderr.decode()
    assert demo.returncode == 0, seen.decode() + text
    lines = text.splitlines()
    assert "demo: stopping" in lines, text
    assert CLEAN_LOG in lines, text
    assert lines[-1] == "demo: stopped", text
    assert "BrokenPipeError" not in text


def test_screenshot(tmp_path: Path) -> None:
    """``--screenshot``: Debian's headless Chromium, logged in as the demo
    user, sees the dashboard without raw codes, "Unknown", repairs or failed
    integrations (the demo checks the page's text and exits 1 otherwise), and
    the PNG is the browser's."""
    _require(find_browser() is not None, "Debian's headless Chromium")
    shot = tmp_path / "dashboard.png"
    result = _demo("--fast", "--screenshot", str(shot))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "screenshot: no raw codes, nothing unknown" in result.stdout, output
    assert CLEAN_LOG in result.stdout, output
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == SCREEN[1]


def test_page_text_check() -> None:
    """What the screenshot refuses: snake_case codes, libvirt names, unknown."""
    good = ["Serving the cluster", "Shut off", "GPU node", "Gaming station 1", "Idle"]
    assert text_problems(good, ["gpu-node", "gaming-1"]) == []
    bad = ["shut_off", "Tower job Unknown", "held by gpu-node", "unavailable"]
    problems = text_problems(bad, ["gpu-node", "gaming-1"])
    assert [p.split(" in ")[0] for p in problems] == [
        "'shut_off'",
        "'Unknown'",
        "'gpu-node'",
        "'unavailable'",
    ]


def test_log_check(tmp_path: Path) -> None:
    """Errors, tracebacks, blocking calls in the event loop and deprecations
    naming gpu_handoff are found, one line each; other warnings are not."""
    log = tmp_path / "home-assistant.out"
    log.write_text(
        "2026-12-01 03:20:24.094 WARNING (MainThread) [homeassistant.bootstrap] "
        "Skipping pip installation\n"
        "2026-12-01 03:20:24.250 ERROR (MainThread) [haffmpeg.core] FFmpeg fails\n"
        "Traceback (most recent call last):\n"
        '  File "core.py", line 130, in open\n'
        "    self._proc = await create()\n"
        "FileNotFoundError: [Errno 2] No such file or directory: 'ffmpeg'\n"
        "2026-12-01 03:20:25.000 CRITICAL (MainThread) [homeassistant] Boom\n"
        "2026-12-01 03:20:26.000 INFO (MainThread) [custom_components.x] fine\n"
        # Home Assistant's own check of its event loop: a warning with a
        # stack and no exception, still a problem of the integration.
        "2026-12-01 03:20:27.000 WARNING (MainThread) "
        "[homeassistant.util.loop] Detected blocking call to read_bytes with "
        "args (...) inside the event loop by custom integration 'gpu_handoff'\n"
        '  File "installer.py", line 333, in _uploaded_agent\n'
        # A deprecation naming the integration (Home Assistant's report, or
        # Python's through py.warnings); one naming another is not ours.
        "2026-12-01 03:20:28.000 WARNING (MainThread) [homeassistant.helpers.frame] "
        "Detected that custom integration 'gpu_handoff' uses a deprecated call\n"
        "2026-12-01 03:20:29.000 WARNING (MainThread) [py.warnings] "
        "/x/custom_components/other/a.py:1: DeprecationWarning: old\n",
        encoding="utf-8",
    )
    assert log_problems(log) == [
        "ERROR [haffmpeg.core] FFmpeg fails",
        "traceback: FileNotFoundError: [Errno 2] No such file or directory: 'ffmpeg'",
        "CRITICAL [homeassistant] Boom",
        (
            "WARNING [homeassistant.util.loop] Detected blocking call to read_bytes "
            "with args (...) inside the event loop by custom integration 'gpu_handoff'"
        ),
        (
            "WARNING [homeassistant.helpers.frame] Detected that custom integration "
            "'gpu_handoff' uses a deprecated call"
        ),
    ]
    assert log_problems(tmp_path / "missing") == []


async def test_kubelet_follows_the_vm_and_brings_workloads_back(
    sim: Tower, cluster: K8sEmulator
) -> None:
    """The stand-in shared by the tests and the demo: the node is Ready while
    the VM runs; an evicted workload comes back once the node is schedulable
    again, not while it is cordoned."""
    kubelet = Kubelet(sim, cluster, reschedule=True, **FAST)

    def llm_pods() -> list[dict[str, Any]]:
        return [
            p
            for p in cluster.list_objects("Pod", "ai")
            if p["metadata"]["name"].startswith("llm-inference-")
        ]

    def cordon(on: bool) -> None:
        cluster.modify(
            "Node",
            GPU_NODE,
            "",
            mutate=lambda node: node["spec"].update(unschedulable=on),
        )

    (evicted,) = llm_pods()
    cordon(True)
    cluster.remove_pod(evicted["metadata"]["name"], "ai")
    kubelet.step()
    assert llm_pods() == []
    cordon(False)
    kubelet.step()
    (back,) = llm_pods()
    assert back["spec"]["nodeName"] == GPU_NODE
    assert back["metadata"]["ownerReferences"] == evicted["metadata"]["ownerReferences"]
    limits = back["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    kubelet.step()
    assert len(llm_pods()) == 1

    assert cluster.node_is_up(GPU_NODE)
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    kubelet.step()
    assert not cluster.node_is_up(GPU_NODE)


def _health(hass: HomeAssistant) -> tuple[str, str, list[str]]:
    state = hass.states.get("binary_sensor.gpu_node_health")
    assert state is not None
    return (
        state.state,
        state.attributes["reason"],
        state.attributes["pods_not_starting"],
    )


async def _refresh(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


async def test_the_ghost_is_seen_at_the_next_refresh(
    hass: HomeAssistant, entry: MockConfigEntry, cluster: K8sEmulator
) -> None:
    """What the ghost switch does to the cluster, judged by the integration
    with its real five-minute bound: one refresh after the node turns ghost,
    its Health shows the problem with every pod on it, while the node stays
    Ready; a pod that arrives meanwhile waits too (too recent to be named);
    healed, the problem clears at the next refresh."""
    await setup_entry(hass, entry)
    assert _health(hass)[:2] == ("off", NO_PROBLEM)
    pods = {
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        for pod in ghost.pods_on(cluster, GPU_NODE)
    }
    assert ghost.haunt(cluster, GPU_NODE) == len(pods)
    await _refresh(hass, entry)
    state, reason, stuck = _health(hass)
    assert (state, reason) == ("on", CONTAINERS_NOT_STARTING)
    assert set(stuck) == pods
    assert hass.states.get("binary_sensor.gpu_node_kubernetes_node").state == "on"
    assert cluster.node_is_up(GPU_NODE)

    cluster.add_pod("late", "ai", node=GPU_NODE)
    assert ghost.keep_haunted(cluster, GPU_NODE) == 1
    assert ghost.keep_haunted(cluster, GPU_NODE) == 0
    late = cluster.get("Pod", "late", "ai")
    assert ghost.waiting(late)
    assert late["status"]["containerStatuses"][0]["state"] == {
        "waiting": {"reason": "ContainerCreating"}
    }
    await _refresh(hass, entry)
    assert _health(hass)[0] == "on"
    assert set(_health(hass)[2]) == pods

    assert ghost.heal(cluster, GPU_NODE) == len(pods) + 1
    assert not any(ghost.waiting(pod) for pod in ghost.pods_on(cluster, GPU_NODE))
    await _refresh(hass, entry)
    assert _health(hass) == ("off", NO_PROBLEM, [])


async def test_the_get_ready_button_prepares_gaming_station_1(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    no_pdb: None,
) -> None:
    """The dashboard the demo builds for a tower (from Home Assistant's
    device and entity registries, as the demo reads them) has a "Get gaming
    station 1 ready" button; doing what its tap does (the action it names,
    with its data) drains the GPU node and shuts it down while gaming-1
    stays off, and the Handoff state shows the cards held for gaming-1."""
    await setup_entry(hass, entry)
    tower = DemoTower(1, sim, sim_sshd, titles(1), entry_id=entry.entry_id)
    found = find_entities(
        tower,
        [
            device.dict_repr
            for device in dr.async_entries_for_config_entry(
                dr.async_get(hass), entry.entry_id
            )
        ],
        [
            item.as_partial_dict
            for item in er.async_entries_for_config_entry(
                er.async_get(hass), entry.entry_id
            )
        ],
    )
    (button,) = _buttons(dashboard([found]))
    assert button["name"] == "Get gaming station 1 ready"
    tap = button["tap_action"]
    assert tap["action"] == "perform-action"
    domain, service = tap["perform_action"].split(".")

    await hass.services.async_call(domain, service, tap["data"], blocking=True)
    controller = entry.runtime_data.controller
    await until(lambda: controller.state.hold is not None)
    await until(lambda: idle(entry) and not controller.requests)
    await _refresh(hass, entry)
    state = hass.states.get(HANDOFF)
    assert state.state == "held"
    assert state.attributes["held_for"] == "gaming-1"
    assert not sim.is_running("gpu-node")
    assert not sim.is_running("gaming-1")
    assert cordoned(cluster)
    assert hass.states.get(SWITCH_1).state == "off"
