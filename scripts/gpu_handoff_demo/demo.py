"""The orchestration: start the parts in order, run (interactive, scripted or
for a screenshot), and stop everything again in reverse order."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from pathlib import Path
import secrets
import shutil
import signal
import socket
import subprocess
import time
from typing import Any

import aiohttp
from homeassistant.util.package import is_docker_env, is_virtual_env
import yaml

from custom_components.gpu_handoff.const import (
    CONF_LEND_FREE_CARDS,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
)
from custom_components.gpu_handoff.health import (
    CONTAINERS_NOT_STARTING,
    NO_PROBLEM,
    STUCK_BOUND,
)
from custom_components.gpu_handoff.repair_sync import ISSUE_NODE_HEALTH
from tests.k8semu import K8sEmulator
from tests.support.box_tower import LIBVIRTD
from tests.support.kubelet import Kubelet
from tests.support.sshd import sshd_available

from . import fresh, home_assistant, screenshot
from .client import USERNAME, WAIT, HomeAssistantClient, add_tower, until
from .cluster import add_fresh_node, cordoned, gpus_requested, seed
from .dashboard import (
    URL_PATH,
    VIEW_PATH,
    TowerEntities,
    dashboard,
    find_entities,
    prepare_button,
)
from .ghost import BACKDATE, GhostSwitch, switch_name
from .home_assistant import HOST
from .output import DemoError, before_stop_lines, keep_transcript, log, say
from .packages import REQUIREMENTS_DEMO, frontend_packages
from .places import new_run_dir, reachable, shown
from .towers import CARDS, DemoTower, start_tower

# Home Assistant's notices that this installation method (Home Assistant Core
# in a Python virtual environment) is unsupported: true, and no concern of a
# demo that runs it on purpose.
INSTALLATION_NOTICES = ("deprecated_method", "deprecated_method_architecture")
# The browser window for a screenshot (width, height) by towers: one tower's
# cards side by side; with more, a column of cards per tower.
SCREEN = {1: (1400, 900), 2: (1400, 1850)}
# What goes wrong in a handoff or a return, by its event.
FAILURES = (EVENT_HANDOFF_FAILED, EVENT_RETURN_UNHEALTHY)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port any more."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


class Demo:
    """Starts the parts, runs Home Assistant, and stops it all again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.fast: bool = args.fast
        # Absolute: sshd and the agent run from other directories.
        self.work = Path(args.dir).absolute() if args.dir else new_run_dir()
        self.own_work = not args.dir
        self.towers: list[DemoTower] = []
        self.emu: K8sEmulator | None = None
        self.kubelets: list[Kubelet] = []
        self.ha_process: subprocess.Popen[bytes] | None = None
        self.ha_log = self.work / "home-assistant.out"
        self.ports: list[int] = []
        self.events: list[dict[str, Any]] = []
        self.vm_names: dict[str, str] = {}
        self.events_task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ha: HomeAssistantClient | None = None
        self.entities: list[TowerEntities] = []
        self.ghosts: list[GhostSwitch] = []
        self.password = secrets.token_urlsafe(12)
        # --guided: the fresh tower, and the kubeconfig file for its flow.
        self.fresh: fresh.DemoFreshTower | None = None
        self.kubeconfig_file = self.work / "kubeconfig.yaml"
        # The repairs its findings raise (its VMs have them on purpose).
        self.fresh_issues: set[str] = set()

    @property
    def url(self) -> str:
        """The dashboard's address."""
        base = self.ha.base if self.ha is not None else ""
        return f"{base}/{URL_PATH}/{VIEW_PATH}"

    async def start(self) -> HomeAssistantClient:
        """Everything up, onboarded, every tower added and loaded."""
        started = time.monotonic()
        if not reachable(self.work):
            raise DemoError(
                f"{self.work} is inside the environment only: give --dir a "
                "directory in the repository (relative to its top) or the cache"
            )
        self.work.mkdir(parents=True, exist_ok=True)
        if not self.own_work and any(self.work.iterdir()):
            raise DemoError(f"{self.work} is not empty: give --dir a new directory")
        keep_transcript(self.work / "demo.log")
        log(f"files (configuration, logs): {shown(self.work)}")
        if not sshd_available():
            raise DemoError("OpenSSH's sshd and ssh-keygen are needed")
        if self.args.guided and (reason := fresh.unavailable()) is not None:
            raise DemoError(f"--guided: {reason}")
        # Home Assistant falls back to recovery mode (no custom integrations)
        # when its frontend does not load: the frontend is not optional.
        packages = await asyncio.to_thread(frontend_packages)
        if packages is None:
            raise DemoError(f"cannot install {REQUIREMENTS_DEMO.name} with pip")

        count: int = self.args.towers
        self.emu = K8sEmulator(host=HOST, port=0, lease_interval=2.0)
        seed(self.emu, count)
        if self.args.guided:
            add_fresh_node(self.emu)
        await self.emu.start()
        self.ports.append(self.emu.port)
        log(f"cluster: Kubernetes API emulator at {self.emu.url}")
        for index in range(1, count + 1):
            self._start_tower(index)
        if self.args.guided:
            self.fresh = await asyncio.to_thread(fresh.start_fresh_tower)
            self.ports.append(self.fresh.port)
            log(fresh.describe(self.fresh))

        port = self.args.port or free_port()
        self.ports.append(port)
        ha_config = self.work / "home-assistant"
        home_assistant.prepare_config(ha_config, port)
        log(f"starting Home Assistant on http://{HOST}:{port}")
        log(f"Home Assistant's log: {shown(self.ha_log)}")
        self.ha_process = home_assistant.start(ha_config, packages, self.ha_log)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        ha = self.ha = HomeAssistantClient(self.session, port)
        await ha.wait_until_up(self.ha_process)
        log(f"Home Assistant answers after {time.monotonic() - started:.1f} s")
        await ha.onboard(self.password)
        version = (await ha.request("GET", "/api/config"))["version"]
        log(f"onboarded: owner user '{USERNAME}' (Home Assistant {version})")
        self.events_task = asyncio.create_task(
            ha.follow_events(self.events, self.vm_names)
        )
        kubeconfig = yaml.safe_dump(self.emu.kubeconfig(), sort_keys=False)
        if self.fresh is not None:
            self.kubeconfig_file.write_text(kubeconfig, encoding="utf-8")
        for tower in self.towers:
            tower.entry_id = await add_tower(ha, tower, kubeconfig)
            for vm, title in tower.titles.items():
                self.vm_names[f"{tower.entry_id}:{vm}"] = title
            found = await self._wait_loaded(tower)
            log(f"{tower.name}: GPU Handoff is loaded, the GPU node serves the cluster")
            if self.args.lend:
                await ha.options_flow(tower.entry_id, {CONF_LEND_FREE_CARDS: True})
                found = await self._wait_loaded(tower)
                log(
                    f'{tower.name}: options: "Keep lending the free cards while '
                    'someone plays" on; reloaded, the GPU node serves'
                )
            self.entities.append(await self._add_ghost_switch(found))
        await ha.wait_running()
        await self._ignore_installation_notice()
        await self._save_dashboard()
        log(f"ready after {time.monotonic() - started:.1f} s")
        return ha

    def _start_tower(self, index: int) -> None:
        if self.emu is None:
            raise DemoError("the cluster is not started")
        tower = start_tower(index, self.work / f"tower-{index}", fast=self.fast)
        self.towers.append(tower)
        self.ports.append(tower.sshd.port)
        titles = tower.titles
        log(
            f"{tower.name}: {titles[tower.gpu_node]} with a GeForce GTX 960 (4 GB) "
            f"and two GeForce RTX 3050s (8 GB, 6 GB); "
            + " and ".join(titles[vm] for vm in tower.gaming)
            + " each want one RTX 3050"
            + (" (guests 100x faster)" if self.fast else "")
        )
        log(
            f"{tower.name}: sshd on {HOST}:{tower.sshd.port} forcing the GPU "
            "Handoff agent"
            + ("" if tower.named_by_agent else " (this agent takes no tower name)")
        )
        # A real k3s node's pace, shortened (a hundred times with --fast,
        # as the guests): the node stays Ready a while after its VM stops,
        # then Unknown; after a boot, Ready with no GPUs, then the cards.
        self.emu.node_monitor_grace_period = 0.5 if self.fast else 20.0
        self.emu.node_monitor_period = 0.05 if self.fast else 1.0
        kubelet = Kubelet(
            tower.sim,
            self.emu,
            node=tower.k8s_node,
            vm=tower.gpu_node,
            interval=0.05 if self.fast else 0.25,
            reschedule=True,
            boot_delay=0.15 if self.fast else 5.0,
            plugin_delay=0.25 if self.fast else 10.0,
            network_delay=0.05 if self.fast else 2.0,
            sandbox_retry=0.1 if self.fast else 1.0,
            threaded=True,
        )
        kubelet.start()
        self.kubelets.append(kubelet)

    async def _add_ghost_switch(self, found: TowerEntities) -> TowerEntities:
        """The tower's "Play a ghost GPU node" switch, created as a toggle
        helper and followed from now on."""
        ha, emu, tower = self.ha, self.emu, found.tower
        if ha is None or emu is None:
            raise DemoError("the demo is not started")
        toggle = await ha.create_toggle(switch_name(tower), "mdi:ghost")
        ghost = GhostSwitch(ha, emu, tower, toggle=toggle, health=found.health)
        ghost.start()
        self.ghosts.append(ghost)
        log(f'{tower.name}: simulator switch "{switch_name(tower)}" ({toggle})')
        return dataclasses.replace(found, ghost=toggle)

    async def _wait_entry_loaded(self, entry_id: str) -> None:
        """Until the config entry is loaded; DemoError if it fails to."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")

        async def loaded() -> bool:
            entries = await ha.config_entries()
            state = next(
                (e["state"] for e in entries if e["entry_id"] == entry_id), None
            )
            if state in ("setup_error", "setup_retry", "failed_unload"):
                raise DemoError(f"the integration did not load: {state}")
            return state == "loaded"

        await until(loaded, WAIT, "the integration to load")

    async def _wait_loaded(self, tower: DemoTower) -> TowerEntities:
        """Until the tower's entry is loaded and its GPU node serves; its entities."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        await self._wait_entry_loaded(tower.entry_id)
        found = find_entities(
            tower,
            await ha.websocket({"type": "config/device_registry/list"}),
            await ha.websocket({"type": "config/entity_registry/list"}),
        )

        async def serving() -> bool:
            handoff = await ha.state(found.handoff)
            return bool(handoff and handoff["state"] == "serving")

        await until(serving, WAIT, f"{tower.name}'s GPU node to serve")
        return found

    async def _ignore_installation_notice(self) -> None:
        """Ignore Home Assistant's notice that Home Assistant Core in a virtual
        environment is an unsupported installation method, as a user would in
        its repair dialog. Home Assistant raises it once it has started, on a
        machine where it runs that way (its own test decides)."""
        ha = self.ha
        if ha is None or is_docker_env() or not is_virtual_env():
            return
        found: list[dict[str, Any]] = []

        async def raised() -> bool:
            found[:] = [
                issue
                for issue in await ha.issues()
                if issue["domain"] == "homeassistant"
                and issue["issue_id"] in INSTALLATION_NOTICES
            ]
            return bool(found)

        with contextlib.suppress(DemoError):
            await until(raised, 30, "Home Assistant's installation notice")
        for issue in found:
            await ha.ignore_issue(issue["domain"], issue["issue_id"])
            log(
                "ignored Home Assistant's notice that this installation method "
                "(Home Assistant Core in a virtual environment) is unsupported"
            )

    async def _save_dashboard(self) -> None:
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        await ha.websocket(
            {
                "type": "lovelace/dashboards/create",
                "url_path": URL_PATH,
                "title": "GPU Handoff",
                "icon": "mdi:expansion-card",
                "show_in_sidebar": True,
                "require_admin": False,
                "mode": "storage",
            }
        )
        await ha.websocket(
            {
                "type": "lovelace/config/save",
                "url_path": URL_PATH,
                "config": dashboard(self.entities),
            }
        )
        log("dashboard saved")

    async def health(self, *, ghosts: bool = False) -> list[str]:
        """What a user would see as wrong: repairs (but, with ``ghosts``, the
        GPU nodes' health repairs a ghost raises, and the repairs of the
        findings the guided install showed), integrations not loaded, the
        failure blueprint's automation not on."""
        ha = self.ha
        if ha is None:
            return ["Home Assistant is not started"]
        expected = {
            f"{ISSUE_NODE_HEALTH}_{tower.entry_id}" for tower in self.towers if ghosts
        } | self.fresh_issues
        problems = [
            f"repair {issue['domain']}.{issue['issue_id']}"
            for issue in await ha.issues()
            if not (issue["domain"] == DOMAIN and issue["issue_id"] in expected)
        ]
        problems += [
            f"integration {entry['domain']} ({entry['title']}): {entry['state']}"
            for entry in await ha.config_entries()
            if entry["state"] != "loaded"
        ]
        # The automation made from the failure blueprint loaded (a blueprint
        # Home Assistant cannot read leaves it unavailable).
        failures = await ha.state(home_assistant.FAILURE_AUTOMATION_ENTITY)
        if failures is None or failures["state"] != "on":
            problems.append(
                f"{home_assistant.FAILURE_AUTOMATION_ENTITY}: "
                f"{failures['state'] if failures else 'missing'}"
            )
        return problems

    async def scripted(self) -> list[str]:
        """Hand the first gaming VM of every tower its cards and back, all
        towers at once (with ``--ghost``, first play a ghost GPU node and heal
        it; with ``--guided``, the guided install on the fresh tower
        meanwhile); one summary line per tower."""
        towers = asyncio.gather(
            *(self._scripted_tower(found) for found in self.entities)
        )
        installed: list[str] = []
        if self.fresh is None:
            results = await towers
        else:
            results, installed = await asyncio.gather(towers, self._scripted_guided())
        problems = await self.health()
        if problems:
            raise DemoError("; ".join(problems))
        if len(results) == 1:
            lines = [f"demo: {line}" for line in results[0]]
        else:
            lines = [
                f"demo: {found.tower.name}: {line}"
                for found, tower_lines in zip(self.entities, results, strict=True)
                for line in tower_lines
            ]
        return lines + [f"demo: {line}" for line in installed]

    async def _scripted_guided(self) -> list[str]:
        """The guided install on the fresh tower, through the config flow as
        the frontend drives it; once its entry is loaded and the tower has
        the agent and the account, its summary line."""
        ha, emu, tower = self.ha, self.emu, self.fresh
        if ha is None or emu is None or tower is None:
            raise DemoError("the demo is not started")
        t0 = time.monotonic()
        kubeconfig = yaml.safe_dump(emu.kubeconfig(), sort_keys=False)
        done = await fresh.guided_install(ha, tower, kubeconfig)
        self.fresh_issues = fresh.finding_issues(done.entry_id, done.findings)
        await self._wait_entry_loaded(done.entry_id)
        await asyncio.to_thread(fresh.check_installed, tower)
        summary = (
            f"{fresh.NAME}: guided install {done.seconds:.1f} s as "
            f"{fresh.ADMIN} (sudo with its password), {fresh.PROGRAM} and "
            f"account {fresh.AGENT_USER} on the tower, {LIBVIRTD} "
            f"restarted, {len(done.findings)} findings, entry loaded "
            f"{time.monotonic() - t0:.1f} s: ok"
        )
        return [summary]

    async def _scripted_tower(self, found: TowerEntities) -> list[str]:
        lines = []
        if self.args.ghost:
            lines.append(await self._ghost_and_back(found))
        played = await self._play(found)
        back = await self._stop_playing(found)
        if found.tower.sim.destroy_attempts():
            raise DemoError(f"something asked {found.tower.name} to force a VM off")
        lines.append(f"{played}, {back}: ok")
        return lines

    async def prepare(self) -> None:
        """What ``--play`` and ``--ghost`` ask for before the dashboard is
        looked at: each tower's first gaming station playing, each GPU node
        a ghost."""
        if self.args.play:
            for line in await asyncio.gather(*map(self._play, self.entities)):
                log(line)
            if self.args.lend:
                await asyncio.gather(*map(self._workloads_back, self.entities))
        if self.args.ghost:
            await asyncio.gather(*map(self._haunt, self.entities))

    def _happened(self, tower: DemoTower, mark: int, event_type: str) -> bool:
        """Whether the tower's ``event_type`` fired since event ``mark``;
        DemoError if a handoff or return of the tower failed meanwhile."""
        mine = [
            e
            for e in self.events[mark:]
            if e["data"].get("config_entry_id") == tower.entry_id
        ]
        for event in mine:
            if event["event_type"] in FAILURES:
                raise DemoError(
                    f"{tower.name}: {event['event_type']}: {event['data'].get('error')}"
                )
        return any(e["event_type"] == event_type for e in mine)

    @staticmethod
    def _gpu_node_cards(tower: DemoTower) -> int:
        """The cards the GPU node runs with now (0 while it is off)."""
        functions = tower.sim.live_hostdevs(tower.gpu_node) or []
        return len({address.rsplit(".", 1)[0] for address in functions})

    async def _play(self, found: TowerEntities) -> str:
        """Turn the tower's first gaming station on; once it plays (and, with
        ``--lend``, once the GPU node serves the free cards), how long it took."""
        ha, emu, tower = self.ha, self.emu, found.tower
        if ha is None or emu is None:
            raise DemoError("the demo is not started")
        vm = tower.gaming[0]
        switch, handoff, title = found.switches[vm], found.handoff, tower.titles[vm]
        lend: bool = self.args.lend
        # The station plays with one card; the GPU node keeps the others.
        free = len(CARDS) - 1

        async def states() -> tuple[dict[str, Any], dict[str, Any]] | None:
            on, node = await ha.state(switch), await ha.state(handoff)
            return (on, node) if on and node else None

        async def handed_over() -> bool:
            if not self._happened(tower, mark, EVENT_HANDOFF_SUCCEEDED):
                return False
            if not (now := await states()) or not tower.sim.is_running(vm):
                return False
            on, node = now
            if lend:
                return bool(on["state"] == "on")
            return bool(
                on["state"] == "on"
                and on["attributes"].get("step") == "idle"
                and node["state"] == "off"
            )

        async def lent() -> bool:
            if not self._happened(tower, mark, EVENT_CARDS_RETURNED):
                return False
            if not (now := await states()):
                return False
            on, node = now
            lent_now = await ha.state(found.gpus_lent)
            return (
                on["state"] == "on"
                and on["attributes"].get("step") == "idle"
                and node["state"] == "serving"
                and not cordoned(emu, tower.k8s_node)
                and self._gpu_node_cards(tower) == free
                and lent_now is not None
                and lent_now["state"] == str(free)
            )

        t0 = time.monotonic()
        mark = len(self.events)
        log(f"turning {title} on")
        await ha.call("switch", "turn_on", {"entity_id": switch})
        await until(handed_over, WAIT, f"the handoff to {title}")
        handed = time.monotonic() - t0
        if not lend:
            return f"handoff {handed:.1f} s"
        log(f"{title} plays after {handed:.1f} s; the GPU node restarts with the rest")
        await until(lent, WAIT, f"{tower.name}'s GPU node to serve {free} cards")
        node = tower.titles[tower.gpu_node]
        serving = time.monotonic() - t0
        return f"handoff {handed:.1f} s, {node} serving {free} cards {serving:.1f} s"

    async def _workloads_back(self, found: TowerEntities) -> None:
        """Until the workloads the restart evicted are back on the GPU node and
        Home Assistant shows their GPUs in use (at its next look at the
        cluster: every 30 s unless something happens on the tower)."""
        ha, emu, tower = self.ha, self.emu, found.tower
        if ha is None or emu is None:
            raise DemoError("the demo is not started")

        async def shown() -> bool:
            requested = gpus_requested(emu, tower.k8s_node)
            in_use = await ha.state(found.gpus_in_use)
            return bool(requested and in_use and in_use["state"] == str(requested))

        log(f"{tower.name}: waiting for Home Assistant to see the workloads back")
        await until(shown, WAIT, f"{tower.name}'s workloads back on the GPU node")

    async def _stop_playing(self, found: TowerEntities) -> str:
        """Turn the tower's first gaming station off; once every card is back
        with the cluster, how long it took."""
        ha, emu, tower = self.ha, self.emu, found.tower
        if ha is None or emu is None:
            raise DemoError("the demo is not started")
        vm = tower.gaming[0]
        switch, handoff, title = found.switches[vm], found.handoff, tower.titles[vm]

        async def returned() -> bool:
            if not self._happened(tower, mark, EVENT_CARDS_RETURNED):
                return False
            on, node = await ha.state(switch), await ha.state(handoff)
            return bool(
                on
                and node
                and on["state"] == "off"
                and on["attributes"].get("step") == "idle"
                and node["state"] == "serving"
                and not cordoned(emu, tower.k8s_node)
                and self._gpu_node_cards(tower) == len(CARDS)
            )

        log(f"turning {title} off")
        t0 = time.monotonic()
        mark = len(self.events)
        await ha.call("switch", "turn_off", {"entity_id": switch})
        await until(returned, WAIT, f"the cards to come back to {tower.name}")
        return f"return {time.monotonic() - t0:.1f} s"

    async def _health_is(self, found: TowerEntities, problem: bool) -> bool:
        """Whether the GPU node's Health sensor, and its repair, say
        ``problem`` (the ghost's: containers do not start) or no problem."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        state = await ha.state(found.health)
        if state is None:
            return False
        reason = CONTAINERS_NOT_STARTING if problem else NO_PROBLEM
        issue = f"{ISSUE_NODE_HEALTH}_{found.tower.entry_id}"
        raised = any(
            i["domain"] == DOMAIN and i["issue_id"] == issue for i in await ha.issues()
        )
        return (
            state["state"] == ("on" if problem else "off")
            and state["attributes"].get("reason") == reason
            and raised == problem
        )

    async def _flip_ghost(self, found: TowerEntities, on: bool) -> float:
        """Flip the tower's ghost switch as the dashboard does; the seconds
        until the Health sensor (and its repair) followed."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        name = switch_name(found.tower)
        log(f'turning "{name}" {"on" if on else "off"}')
        t0 = time.monotonic()
        service = "turn_on" if on else "turn_off"
        await ha.call("input_boolean", service, {"entity_id": found.ghost})

        async def followed() -> bool:
            return await self._health_is(found, on)

        what = "the Health problem" if on else "the Health problem to clear"
        await until(followed, WAIT, f"{found.tower.name}: {what}")
        return time.monotonic() - t0

    async def _haunt(self, found: TowerEntities) -> None:
        seconds = await self._flip_ghost(found, True)
        log(f"{found.tower.name}: Health shows the problem after {seconds:.1f} s")

    async def _ghost_and_back(self, found: TowerEntities) -> str:
        raised = await self._flip_ghost(found, True)
        cleared = await self._flip_ghost(found, False)
        node = found.tower.titles[found.tower.gpu_node]
        return (
            f"ghost {node}: Health problem {raised:.1f} s, cleared {cleared:.1f} s: ok"
        )

    async def screenshot(self, output: Path) -> None:
        """The dashboard as the demo user sees it, checked, saved as PNG."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        if self.fresh is not None:
            await self._guided_screenshot(output)
            return
        ghosts: bool = self.args.ghost
        problems = await self.health(ghosts=ghosts)
        expect = ["Play", "Cards", "Health"]
        expect += [title for tower in self.towers for title in tower.titles.values()]
        expect += [switch_name(tower) for tower in self.towers]
        expect += [prepare_button(found)["name"] for found in self.entities]
        # Every screen the dashboard shows: those of the VMs that run.
        shown_screens = [
            screen
            for found in self.entities
            for screen in found.screens.values()
            if (state := await ha.state(screen)) and state["state"] != "unavailable"
        ]
        raw = sorted(
            {vm for tower in self.towers for vm in tower.titles}
            | {tower.k8s_node for tower in self.towers}
        )
        problems += await screenshot.take(
            ha,
            f"/{URL_PATH}/{VIEW_PATH}",
            output,
            login=(USERNAME, self.password),
            size=SCREEN[min(len(self.towers), 2)],
            expect=expect,
            images=len(shown_screens),
            raw=raw,
            profile=self.work / "chromium-profile",
        )
        log(f"screenshot: {output} ({len(shown_screens)} screens shown)")
        if problems:
            raise DemoError("the dashboard shows: " + "; ".join(problems))
        log(
            "screenshot: no raw codes, nothing unknown, "
            + ("no repairs but the ghosts'" if ghosts else "no repairs")
            + ", all loaded"
        )

    async def _guided_screenshot(self, output: Path) -> None:
        """The guided install's confirm step on the fresh tower, as the
        browser shows it, checked, saved as PNG; not confirmed."""
        ha, tower = self.ha, self.fresh
        if ha is None or tower is None:
            raise DemoError("the demo is not started")
        problems = await self.health()
        problems += await fresh.confirm_screenshot(
            ha,
            tower,
            output,
            login=(USERNAME, self.password),
            size=SCREEN[1],
            profile=self.work / "chromium-profile",
        )
        log(f"screenshot: {output} (the guided install's confirm step)")
        if problems:
            raise DemoError("the dialog shows: " + "; ".join(problems))
        await asyncio.to_thread(fresh.check_untouched, tower)
        log(
            "screenshot: translated, nothing unknown, no repairs, all loaded; "
            "the fresh tower unchanged (the install was not confirmed)"
        )

    async def stop(self) -> list[str]:
        """Stop everything that was started, in reverse order; what Home
        Assistant's log says went wrong."""
        for ghost in self.ghosts:
            await ghost.stop()
        if self.events_task is not None:
            self.events_task.cancel()
            await asyncio.gather(self.events_task, return_exceptions=True)
        problems: list[str] = []
        if self.ha_process is not None:
            await home_assistant.stop(self.ha_process)
            self.ha_process = None
            problems = home_assistant.log_problems(self.ha_log)
            report_log(problems)
        if self.session is not None:
            await self.session.close()
        if self.fresh is not None:
            await asyncio.to_thread(self.fresh.stop)
        for kubelet in self.kubelets:
            await kubelet.stop()
        if self.emu is not None:
            await self.emu.stop()
        for tower in self.towers:
            await asyncio.to_thread(tower.stop)
        busy = [port for port in self.ports if not port_free(port)]
        if busy:
            log(f"ports still in use after stopping: {busy}")
        if self.own_work and not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        elif self.work.exists():
            log(f"kept {shown(self.work)}")
        return problems


def report_log(problems: list[str]) -> None:
    """Home Assistant's errors and tracebacks, or that there were none."""
    if not problems:
        log("Home Assistant's log: no errors, no tracebacks")
        return
    log(f"Home Assistant's log: {len(problems)} errors and tracebacks:")
    for line in problems:
        say(f"demo:   {line[:300]}")


async def main_async(args: argparse.Namespace) -> int:
    """Run the demo until it is done (scripted, screenshot) or stopped
    (SIGINT, SIGTERM)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    demo = Demo(args)
    finite = bool(args.scripted or args.screenshot)

    async def run() -> list[str]:
        await demo.start()
        if args.scripted:
            return await demo.scripted()
        await demo.prepare()
        if args.screenshot:
            await demo.screenshot(Path(args.screenshot))
            return []
        if demo.fresh is not None:
            say("\n" + fresh.instructions(demo.fresh, demo.kubeconfig_file))
        say(
            "\n"
            f"  Home Assistant:  {demo.url}\n"
            f"  login:           {USERNAME} / {demo.password}\n"
            "  Toggle a gaming station, or play a ghost GPU node, on the "
            "dashboard;\n  Ctrl-C stops the demo.\n"
        )
        while not stop.is_set():
            if demo.ha_process is None or demo.ha_process.poll() is not None:
                raise DemoError("Home Assistant exited")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return []

    task = asyncio.create_task(run())
    stopper = asyncio.create_task(stop.wait())
    status = 0
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.to_thread(before_stop_lines)
            log("stopping")
            status = 130 if finite else 0
        else:
            for line in task.result():
                say(line)
            if not args.scripted:
                log("stopping")
    except (
        DemoError,
        aiohttp.ClientError,
        OSError,
        RuntimeError,
        subprocess.SubprocessError,
    ) as err:
        log(f"failed: {err}")
        if demo.ha_log.exists():
            tail = demo.ha_log.read_text("utf-8", "replace").splitlines()[-30:]
            say("\n".join(["demo: Home Assistant's last output:", *tail]))
        status = 1
    finally:
        stopper.cancel()
        problems = await demo.stop()
        if problems and finite and status == 0:
            status = 1
        log("stopped")
    return status


def towers_count(text: str) -> int:
    """``--towers``: 1 to 4."""
    value = int(text)
    if not 1 <= value <= 4:
        raise argparse.ArgumentTypeError("from 1 to 4 towers")
    return value


def check(arguments: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot go together (argparse's error: usage, exit 2)."""
    if args.play and args.scripted:
        arguments.error("--play and --scripted: --scripted plays by itself")
    if args.ghost and args.play and not args.lend:
        arguments.error(
            "--ghost with --play needs --lend: without it the GPU node is off "
            "while a station plays, and its health is not judged"
        )


def parser(description: str) -> argparse.ArgumentParser:
    """The command line."""
    arguments = argparse.ArgumentParser(prog="scripts/demo", description=description)
    arguments.add_argument("--fast", action="store_true", help="guests 100x faster")
    arguments.add_argument(
        "--towers",
        type=towers_count,
        default=1,
        help="simulated towers side by side, each with its own sshd and agent, "
        "on one cluster (default 1)",
    )
    mode = arguments.add_mutually_exclusive_group()
    mode.add_argument(
        "--scripted",
        action="store_true",
        help="hand each tower's first gaming station the cards and back, "
        "print one line per tower, exit",
    )
    mode.add_argument(
        "--screenshot",
        metavar="PNG",
        help="save the dashboard as a logged-in browser shows it, check its "
        "text, exit (needs Debian's headless Chromium); with --guided, the "
        "guided install's confirm step instead, not confirmed",
    )
    arguments.add_argument(
        "--lend",
        action="store_true",
        help='turn on "Keep lending the free cards while someone plays" for '
        "every tower, through its options flow: after a handoff the GPU node "
        "serves the cards no player uses",
    )
    arguments.add_argument(
        "--play",
        action="store_true",
        help="once started, turn each tower's first gaming station on and wait "
        "until it plays (with --lend: until the GPU node serves the free "
        "cards); not with --scripted",
    )
    arguments.add_argument(
        "--ghost",
        action="store_true",
        help='once started, turn "Play a ghost GPU node" on (a dashboard switch '
        "of the simulator): the GPU node stays Ready with its lease renewing "
        "while every pod on it waits for its sandbox (FailedCreatePodSandBox) "
        f"since {BACKDATE / 60:g} minutes, past the integration's "
        f"{STUCK_BOUND / 60:g}-minute bound, so its Health problem shows at the "
        "next refresh (which the demo asks for at once); with --scripted, turn "
        "it on and off again (the problem clears)",
    )
    arguments.add_argument(
        "--guided",
        action="store_true",
        help="also start a fresh tower (a Debian root booted under its own "
        "systemd: real sshd, sudo and accounts, a real libvirtd.service serving "
        "libvirt's test driver; nothing of GPU Handoff on it) to try the config "
        'flow\'s "Install the agent for me" on: the demo prints what to type; '
        "with --scripted it does the guided install itself, libvirtd.service "
        "restarted for real (needs root)",
    )
    arguments.add_argument(
        "--port",
        type=int,
        default=0,
        help="Home Assistant's port (default: a free one)",
    )
    arguments.add_argument(
        "--dir",
        help="working directory, new or empty, kept; relative to the "
        "repository's top directory (default: a new one in the cache, removed "
        "at the end unless --keep)",
    )
    arguments.add_argument(
        "--keep",
        action="store_true",
        help="keep the working directory (logs, Home Assistant's configuration)",
    )
    return arguments
