"""The orchestration: start the parts in order, run (interactive, scripted or
for a screenshot), and stop everything again in reverse order."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
)
from tests.k8semu import K8sEmulator
from tests.support.kubelet import Kubelet
from tests.support.sshd import sshd_available

from . import home_assistant, screenshot
from .client import USERNAME, WAIT, HomeAssistantClient, add_tower, until
from .cluster import cordoned, seed
from .dashboard import URL_PATH, VIEW_PATH, TowerEntities, dashboard, find_entities
from .home_assistant import HOST
from .output import DemoError, before_stop_lines, keep_transcript, log, say
from .packages import REQUIREMENTS_DEMO, frontend_packages
from .places import new_run_dir, reachable, shown
from .towers import DemoTower, start_tower

# Home Assistant's notices that this installation method (Home Assistant Core
# in a Python virtual environment) is unsupported: true, and no concern of a
# demo that runs it on purpose.
INSTALLATION_NOTICES = ("deprecated_method", "deprecated_method_architecture")
# The browser window for a screenshot (width, height) by towers: one tower's
# cards side by side; with more, a column of cards per tower.
SCREEN = {1: (1400, 620), 2: (1400, 1220)}


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
        self.password = secrets.token_urlsafe(12)

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
        # Home Assistant falls back to recovery mode (no custom integrations)
        # when its frontend does not load: the frontend is not optional.
        packages = await asyncio.to_thread(frontend_packages)
        if packages is None:
            raise DemoError(f"cannot install {REQUIREMENTS_DEMO.name} with pip")

        count: int = self.args.towers
        self.emu = K8sEmulator(host=HOST, port=0, lease_interval=2.0)
        seed(self.emu, count)
        await self.emu.start()
        self.ports.append(self.emu.port)
        log(f"cluster: Kubernetes API emulator at {self.emu.url}")
        for index in range(1, count + 1):
            self._start_tower(index)

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
        log(f"onboarded: owner user '{USERNAME}'")
        self.events_task = asyncio.create_task(
            ha.follow_events(self.events, self.vm_names)
        )
        kubeconfig = yaml.safe_dump(self.emu.kubeconfig(), sort_keys=False)
        for tower in self.towers:
            tower.entry_id = await add_tower(ha, tower, kubeconfig)
            for vm, title in tower.titles.items():
                self.vm_names[f"{tower.entry_id}:{vm}"] = title
            self.entities.append(await self._wait_loaded(tower))
            log(f"{tower.name}: GPU Handoff is loaded, the GPU node serves the cluster")
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
        kubelet = Kubelet(
            tower.sim,
            self.emu,
            node=tower.k8s_node,
            vm=tower.gpu_node,
            interval=0.05 if self.fast else 0.25,
            reschedule=True,
        )
        kubelet.start()
        self.kubelets.append(kubelet)

    async def _wait_loaded(self, tower: DemoTower) -> TowerEntities:
        """Until the tower's entry is loaded and its GPU node serves; its entities."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")

        async def loaded() -> bool:
            entries = await ha.config_entries()
            state = next(
                (e["state"] for e in entries if e["entry_id"] == tower.entry_id), None
            )
            if state in ("setup_error", "setup_retry", "failed_unload"):
                raise DemoError(f"the integration did not load: {state}")
            return state == "loaded"

        await until(loaded, WAIT, "the integration to load")
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

    async def health(self) -> list[str]:
        """What a user would see as wrong: repairs, integrations not loaded."""
        ha = self.ha
        if ha is None:
            return ["Home Assistant is not started"]
        problems = [
            f"repair {issue['domain']}.{issue['issue_id']}"
            for issue in await ha.issues()
        ]
        problems += [
            f"integration {entry['domain']} ({entry['title']}): {entry['state']}"
            for entry in await ha.config_entries()
            if entry["state"] != "loaded"
        ]
        return problems

    async def scripted(self) -> list[str]:
        """Hand the first gaming VM of every tower its cards and back, all
        towers at once; one summary line per tower."""
        results = await asyncio.gather(
            *(self._hand_over_and_back(found) for found in self.entities)
        )
        problems = await self.health()
        if problems:
            raise DemoError("; ".join(problems))
        if len(results) == 1:
            return [f"demo: {results[0]}"]
        return [
            f"demo: {found.tower.name}: {result}"
            for found, result in zip(self.entities, results, strict=True)
        ]

    async def _hand_over_and_back(self, found: TowerEntities) -> str:
        ha, emu, tower = self.ha, self.emu, found.tower
        if ha is None or emu is None:
            raise DemoError("the demo is not started")
        vm = tower.gaming[0]
        switch, handoff = found.switches[vm], found.handoff
        title = tower.titles[vm]
        mark = 0

        def happened(event_type: str) -> bool:
            mine = [
                e
                for e in self.events[mark:]
                if e["data"].get("config_entry_id") == tower.entry_id
            ]
            for event in mine:
                if event["event_type"] == EVENT_HANDOFF_FAILED:
                    raise DemoError(f"the handoff failed: {event['data'].get('error')}")
            return any(e["event_type"] == event_type for e in mine)

        async def states() -> tuple[dict[str, Any], dict[str, Any]] | None:
            on, node = await ha.state(switch), await ha.state(handoff)
            return (on, node) if on and node else None

        async def handed_over() -> bool:
            if not happened(EVENT_HANDOFF_SUCCEEDED) or not (now := await states()):
                return False
            on, node = now
            return (
                on["state"] == "on"
                and on["attributes"].get("step") == "idle"
                and node["state"] == "off"
                and tower.sim.is_running(vm)
            )

        async def returned() -> bool:
            if not happened(EVENT_CARDS_RETURNED) or not (now := await states()):
                return False
            on, node = now
            return (
                on["state"] == "off"
                and on["attributes"].get("step") == "idle"
                and node["state"] == "serving"
                and not cordoned(emu, tower.k8s_node)
                and tower.sim.is_running(tower.gpu_node)
            )

        t0 = time.monotonic()
        mark = len(self.events)
        log(f"turning {title} on")
        await ha.call("switch", "turn_on", {"entity_id": switch})
        await until(handed_over, WAIT, f"the handoff to {title}")
        handed = time.monotonic() - t0
        log(f"{title} plays after {handed:.1f} s; turning it off")
        t1 = time.monotonic()
        mark = len(self.events)
        await ha.call("switch", "turn_off", {"entity_id": switch})
        await until(returned, WAIT, f"the cards to come back to {tower.name}")
        back = time.monotonic() - t1
        if tower.sim.destroy_attempts():
            raise DemoError(f"something asked {tower.name} to force a VM off")
        return f"handoff {handed:.1f} s, return {back:.1f} s: ok"

    async def screenshot(self, output: Path) -> None:
        """The dashboard as the demo user sees it, checked, saved as PNG."""
        ha = self.ha
        if ha is None:
            raise DemoError("Home Assistant is not started")
        problems = await self.health()
        expect = ["Play", "Cards"] + [
            title for tower in self.towers for title in tower.titles.values()
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
            raw=raw,
            profile=self.work / "chromium-profile",
        )
        log(f"screenshot: {output}")
        if problems:
            raise DemoError("the dashboard shows: " + "; ".join(problems))
        log("screenshot: no raw codes, nothing unknown, no repairs, all loaded")

    async def stop(self) -> list[str]:
        """Stop everything that was started, in reverse order; what Home
        Assistant's log says went wrong."""
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
        if args.screenshot:
            await demo.screenshot(Path(args.screenshot))
            return []
        say(
            "\n"
            f"  Home Assistant:  {demo.url}\n"
            f"  login:           {USERNAME} / {demo.password}\n"
            "  Toggle a gaming station on the dashboard; Ctrl-C stops the demo.\n"
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
        "text, exit (needs Debian's headless Chromium)",
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
