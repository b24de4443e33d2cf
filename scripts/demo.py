"""GPU Handoff, running: Home Assistant with the integration against a simulated tower.

Everything listens on 127.0.0.1 only:

- the tower simulator (tests/towersim): a GPU node VM holding a GTX 960 and two
  RTX 3050s, and two gaming VMs, each wanting one RTX 3050;
- OpenSSH's sshd whose authorized_keys forces the real tower agent;
- the Kubernetes API emulator (tests/k8semu) with a GPU node, its workloads and
  a PodDisruptionBudget, plus a small "kubelet" that keeps the node Ready
  exactly while the simulated GPU node VM runs (and a "scheduler" that puts the
  evicted workloads back once the node serves again);
- Home Assistant, onboarded through its onboarding API, with the integration
  added through its real config flow and a dashboard.

    scripts/demo               # interactive: prints the URL and the login
    scripts/demo --fast        # guests 100x faster
    scripts/demo --scripted    # one handoff and return through the REST API, then exit

Ctrl-C (or SIGTERM) stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
import contextlib
import getpass
import hashlib
import json
import os
from pathlib import Path
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.k8semu import GPU_NODE, K8sEmulator, seed_demo  # noqa: E402
from tests.support.simtower import write_agent_config  # noqa: E402
from tests.support.sshd import Sshd, sshd_available  # noqa: E402
from tests.support.testdriver import agent_command  # noqa: E402
from tests.towersim import Tower, realistic_tower  # noqa: E402

HOST = "127.0.0.1"
DOMAIN = "gpu_handoff"
SWITCH_1 = "switch.gaming_station_1"
SWITCH_2 = "switch.gaming_station_2"
HANDOFF = "sensor.gpu_node_handoff_state"
USERNAME = "demo"
DASHBOARD = "gpu-handoff"  # the dashboard's URL path (it must contain a hyphen)
CARDS = {
    "01": "GeForce GTX 960 (4 GB)",
    "03": "GeForce RTX 3050 (8 GB)",
    "04": "GeForce RTX 3050 (6 GB)",
}
REQUIREMENTS_DEMO = REPO / "requirements_demo.txt"
EVENTS = (
    "gpu_handoff_handoff_started",
    "gpu_handoff_handoff_step",
    "gpu_handoff_handoff_succeeded",
    "gpu_handoff_stop_succeeded",
    "gpu_handoff_return_succeeded",
    "gpu_handoff_handoff_failed",
    "gpu_handoff_cards_returned",
)
WAIT = 300.0  # seconds any single wait may take at most


class DemoError(Exception):
    """A step of the demo failed; the message says which and why."""


def log(message: str) -> None:
    """One progress line."""
    print(f"demo: {message}", flush=True)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def cache_dir() -> Path:
    """Where the demo keeps what it downloads (the frontend)."""
    base = os.environ.get("GPU_HANDOFF_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "gpu-handoff"
    return root / "demo"


def frontend_packages() -> Path | None:
    """requirements_demo.txt installed into a cached --target directory (once per
    file content); None when pip cannot install it."""
    stamp = hashlib.sha256(REQUIREMENTS_DEMO.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"packages-{stamp}"
    if (target / ".complete").exists():
        return target
    log(f"installing the Home Assistant frontend into {target} (once)")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(partial),
            "-r",
            str(REQUIREMENTS_DEMO),
        ],
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        return None
    (partial / ".complete").write_text(stamp, encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


# --- the cluster --------------------------------------------------------------------


def label_cards(emu: K8sEmulator) -> None:
    """The node's GPU product label as NVIDIA's feature discovery would set it
    for this tower (it names the most common card)."""

    def mutate(node: dict[str, Any]) -> None:
        node["metadata"].setdefault("labels", {})["nvidia.com/gpu.product"] = (
            "NVIDIA-GeForce-RTX-3050"
        )

    emu.modify("Node", GPU_NODE, "", mutate=mutate)


def relax_pdb(emu: K8sEmulator) -> None:
    """The seeded trainer PDB refuses every eviction; the demo's allows one
    disruption, so the drain shows it respected and still finishes."""
    pdb = emu.get("PodDisruptionBudget", "trainer", "ai")
    if pdb is None:
        return
    labels = pdb["spec"]["selector"]["matchLabels"]
    emu.delete("PodDisruptionBudget", "trainer", "ai")
    emu.add_pdb("trainer", "ai", match_labels=labels, max_unavailable=1)


class Kubelet:
    """Plays the k3s agent in the GPU node VM and a scheduler: the node is Ready
    exactly while the simulated VM runs, and the workloads the drain evicted
    come back once the node serves again (so the demo can be repeated)."""

    def __init__(self, tower: Tower, emu: K8sEmulator, interval: float) -> None:
        self.tower = tower
        self.emu = emu
        self.interval = interval
        self.workloads = self._workloads()

    def _workloads(self) -> list[dict[str, Any]]:
        found = []
        for pod in self.emu.list_objects("Pod", "ai"):
            spec = pod["spec"]
            owner = (pod["metadata"].get("ownerReferences") or [{}])[0]
            found.append(
                {
                    "owner": owner.get("name", ""),
                    "labels": dict(pod["metadata"].get("labels", {})),
                    "image": spec["containers"][0]["image"],
                }
            )
        return found

    def _schedule(self) -> None:
        node = self.emu.get("Node", GPU_NODE, "")
        if node is None or node["spec"].get("unschedulable"):
            return
        present = {
            (p["metadata"].get("ownerReferences") or [{}])[0].get("name")
            for p in self.emu.list_objects("Pod", "ai")
        }
        for workload in self.workloads:
            if workload["owner"] in present:
                continue
            owner = self.emu.get("ReplicaSet", workload["owner"], "ai")
            if owner is None:
                continue
            self.emu.add_pod(
                f"{workload['owner']}-{secrets.token_hex(3)}",
                "ai",
                node=GPU_NODE,
                labels=workload["labels"],
                owner=self.emu.owner_ref(owner),
                image=workload["image"],
                gpu_request=1,
            )

    async def run(self) -> None:
        up = True
        while True:
            running = await asyncio.to_thread(self.tower.is_running, "gpu-node")
            if running != up:
                self.emu.set_node_up(GPU_NODE, running)
                up = running
            if up:
                self._schedule()
            await asyncio.sleep(self.interval)


def cordoned(emu: K8sEmulator) -> bool:
    """Whether the GPU node's Kubernetes node is cordoned."""
    node = emu.get("Node", GPU_NODE, "")
    return bool(node and node["spec"].get("unschedulable"))


# --- Home Assistant -----------------------------------------------------------------


def write_ha_config(config: Path, port: int) -> None:
    """A configuration.yaml with as few integrations as the demo needs."""
    config.mkdir(parents=True, exist_ok=True)
    custom = config / "custom_components"
    custom.mkdir(exist_ok=True)
    link = custom / DOMAIN
    if not link.exists():
        link.symlink_to(REPO / "custom_components" / DOMAIN)
    core: dict[str, Any] = {
        "homeassistant": {
            "name": "GPU Handoff demo",
            "unit_system": "metric",
            "time_zone": "UTC",
            "currency": "EUR",
            "country": "DE",
            "latitude": 52.52,
            "longitude": 13.40,
            "elevation": 34,
        },
        "http": {"server_host": HOST, "server_port": port},
        "api": {},
        "auth": {},
        "config": {},
        "onboarding": {},
        "websocket_api": {},
        "lovelace": {},
        "logger": {
            "default": "warning",
            "logs": {f"custom_components.{DOMAIN}": "info"},
        },
    }
    core |= {"frontend": {}, "recorder": {}, "history": {}, "logbook": {}}
    (config / "configuration.yaml").write_text(
        yaml.safe_dump(core, sort_keys=False), encoding="utf-8"
    )


def start_home_assistant(
    config: Path, packages: Path, output: Path
) -> subprocess.Popen[bytes]:
    """``python -m homeassistant`` in its own session (stopped by us, in order),
    with the demo's extra packages on its path only."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(packages), env.get("PYTHONPATH", "")) if p
    )
    with output.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "homeassistant",
                "--config",
                str(config),
                "--skip-pip",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


class HomeAssistantClient:
    """Talks to Home Assistant as its frontend does: REST and websocket."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session = session
        self.base = f"http://{HOST}:{port}"
        self.client_id = f"{self.base}/"
        self.token = ""

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def request(
        self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200,)
    ) -> Any:
        """JSON in, JSON out; anything but an ``ok`` status is a DemoError."""
        async with self.session.request(
            method, self.base + path, json=body, headers=self._headers()
        ) as response:
            text = await response.text()
            if response.status not in ok:
                raise DemoError(f"{method} {path}: HTTP {response.status}: {text}")
            return json.loads(text) if text else None

    async def wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        """Until the onboarding API answers (Home Assistant's http is up)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise DemoError(f"Home Assistant exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, DemoError):
                await self.request("GET", "/api/onboarding")
                return
            await asyncio.sleep(0.2)
        raise DemoError("Home Assistant did not start in time")

    async def onboard(self, password: str) -> None:
        """The owner user, then the core config, analytics and integration steps."""
        reply = await self.request(
            "POST",
            "/api/onboarding/users",
            {
                "client_id": self.client_id,
                "name": "Demo",
                "username": USERNAME,
                "password": password,
                "language": "en",
            },
        )
        async with self.session.post(
            f"{self.base}/auth/token",
            data={
                "grant_type": "authorization_code",
                "code": reply["auth_code"],
                "client_id": self.client_id,
            },
        ) as response:
            if response.status != 200:
                raise DemoError(f"/auth/token: HTTP {response.status}")
            self.token = (await response.json())["access_token"]
        await self.request("POST", "/api/onboarding/core_config", {})
        await self.request("POST", "/api/onboarding/analytics", {})
        await self.request(
            "POST",
            "/api/onboarding/integration",
            {
                "client_id": self.client_id,
                "redirect_uri": f"{self.base}/?auth_callback=1",
            },
        )

    async def flow_step(self, flow_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """Submit one step of a config flow."""
        result: dict[str, Any] = await self.request(
            "POST", f"/api/config/config_entries/flow/{flow_id}", data
        )
        if result.get("errors"):
            raise DemoError(
                f"config flow step {result.get('step_id')}: {result['errors']}"
            )
        if result["type"] == "abort":
            raise DemoError(f"config flow aborted: {result.get('reason')}")
        return result

    async def state(self, entity_id: str) -> dict[str, Any] | None:
        """An entity's state object, or None."""
        result: dict[str, Any] | None = await self.request(
            "GET", f"/api/states/{entity_id}", ok=(200, 404)
        )
        return result if result and "state" in result else None

    async def states(self) -> list[dict[str, Any]]:
        """Every state."""
        result: list[dict[str, Any]] = await self.request("GET", "/api/states")
        return result

    async def call(self, domain: str, service: str, data: dict[str, Any]) -> None:
        """Call an action."""
        await self.request("POST", f"/api/services/{domain}/{service}", data)

    async def websocket(self, message: dict[str, Any]) -> Any:
        """One command over the websocket API; its result."""
        async with self.session.ws_connect(f"{self.base}/api/websocket") as ws:
            await ws.receive_json()  # auth_required
            await ws.send_json({"type": "auth", "access_token": self.token})
            reply = await ws.receive_json()
            if reply.get("type") != "auth_ok":
                raise DemoError(f"websocket auth: {reply}")
            await ws.send_json({"id": 1, **message})
            reply = await ws.receive_json()
            if not reply.get("success"):
                raise DemoError(f"websocket {message['type']}: {reply.get('error')}")
            return reply.get("result")

    async def follow_events(self, seen: list[dict[str, Any]]) -> None:
        """Append every GPU Handoff event to ``seen`` and print it, until cancelled."""
        async with self.session.ws_connect(
            f"{self.base}/api/websocket", timeout=aiohttp.ClientWSTimeout(ws_close=5)
        ) as ws:
            await ws.receive_json()
            await ws.send_json({"type": "auth", "access_token": self.token})
            if (await ws.receive_json()).get("type") != "auth_ok":
                raise DemoError("websocket auth failed")
            for number, event_type in enumerate(EVENTS, start=1):
                await ws.send_json(
                    {"id": number, "type": "subscribe_events", "event_type": event_type}
                )
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                data = json.loads(message.data)
                if data.get("type") != "event":
                    continue
                event = data["event"]
                seen.append(event)
                details = event["data"]
                extra = details.get("step") or details.get("error") or ""
                log(
                    f"event {event['event_type']}: {details.get('vm')}"
                    + (f" {extra}" if extra else "")
                )


async def add_integration(ha: HomeAssistantClient, sshd: Sshd, kubeconfig: str) -> str:
    """The real config flow, step by step, as a user clicks through it."""
    result = await ha.request(
        "POST",
        "/api/config/config_entries/flow",
        {"handler": DOMAIN, "show_advanced_options": False},
    )
    flow_id = result["flow_id"]
    log("config flow: the tower's address")
    result = await ha.flow_step(
        flow_id, {"host": HOST, "port": sshd.port, "username": sshd.user}
    )
    fingerprint = result["description_placeholders"]["fingerprint"]
    if fingerprint != sshd.host_fingerprint:
        raise DemoError(f"host key {fingerprint} is not the tower's")
    log(f"config flow: host key {fingerprint} matches the tower's, pinning it")
    result = await ha.flow_step(flow_id, {})
    if result["type"] != "menu":
        raise DemoError(f"expected the credentials menu, got {result}")
    result = await ha.flow_step(flow_id, {"next_step_id": "generate_key"})
    public_key = result["description_placeholders"]["public_key"]
    # As a user would: put the shown public key into the tower's authorized_keys,
    # forced to run the agent (the only key the tower accepts).
    sshd.authorized_keys.write_text("", encoding="utf-8")
    sshd.authorize(public_key)
    log("config flow: generated a key pair; its public key is now authorized")
    result = await ha.flow_step(flow_id, {})
    log("config flow: both gaming VMs get a switch")
    result = await ha.flow_step(flow_id, {"gaming_vms": ["gaming-1", "gaming-2"]})
    log("config flow: the cluster's kubeconfig")
    result = await ha.flow_step(flow_id, {"kubeconfig": kubeconfig})
    result = await ha.flow_step(flow_id, {"k8s_node": GPU_NODE})
    if result["type"] != "create_entry":
        raise DemoError(f"config flow did not finish: {result}")
    entry_id: str = result["result"]["entry_id"]
    return entry_id


async def until(
    what: Callable[[], Awaitable[bool]], bound: float, description: str
) -> None:
    """Poll ``what`` until it holds; DemoError after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while not await what():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {bound:.0f} s waiting for {description}")
        await asyncio.sleep(0.1)


async def wait_loaded(ha: HomeAssistantClient, entry_id: str) -> None:
    """Until the entry is loaded and its entities have states."""

    async def loaded() -> bool:
        entries = await ha.request("GET", "/api/config/config_entries/entry")
        state = next((e["state"] for e in entries if e["entry_id"] == entry_id), None)
        if state in ("setup_error", "setup_retry", "failed_unload"):
            raise DemoError(f"the integration did not load: {state}")
        if state != "loaded":
            return False
        handoff = await ha.state(HANDOFF)
        switch = await ha.state(SWITCH_1)
        return bool(handoff and switch and handoff["state"] == "serving")

    await until(loaded, WAIT, "the integration to load")


def dashboard(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The Lovelace configuration: both switches, the GPU node's handoff state
    with its cards, GPUs lent and pods left."""

    def find(prefix: str, suffix: str) -> str:
        return next(
            (
                s["entity_id"]
                for s in states
                if s["entity_id"].startswith(prefix) and s["entity_id"].endswith(suffix)
            ),
            f"{prefix}{suffix}",
        )

    lent = find("sensor.", "gpus_lent_to_the_cluster")
    pods = find("sensor.", "pods_left_to_evict")
    in_use = find("sensor.", "gpus_in_use")
    names = ", ".join(f"'{bus}': '{name}'" for bus, name in CARDS.items())
    cards_table = (
        "{% set names = {" + names + "} %}"
        "| card | function | held by | claimed by |\n|---|---|---|---|\n"
        "{% for c in state_attr('" + HANDOFF + "', 'cards') or [] %}"
        "| {{ names.get(c.address[5:7], c.address) }} | {{ c.address }} "
        "| {{ c.held_by or '—' }} | {{ c.claimed_by | join(', ') }} |\n"
        "{% endfor %}"
    )
    return {
        "title": "GPU Handoff",
        "views": [
            {
                "title": "Tower",
                "path": "tower",
                "cards": [
                    {
                        "type": "entities",
                        "title": "Play",
                        "entities": [
                            {"entity": SWITCH_1, "secondary_info": "last-changed"},
                            {
                                "type": "attribute",
                                "entity": SWITCH_1,
                                "attribute": "step",
                                "name": "Station 1 step",
                            },
                            {"entity": SWITCH_2, "secondary_info": "last-changed"},
                            {
                                "type": "attribute",
                                "entity": SWITCH_2,
                                "attribute": "step",
                                "name": "Station 2 step",
                            },
                        ],
                    },
                    {
                        "type": "entities",
                        "title": "GPU node",
                        "entities": [
                            {"entity": HANDOFF},
                            {
                                "type": "attribute",
                                "entity": HANDOFF,
                                "attribute": "vm_state",
                                "name": "VM",
                            },
                            {
                                "type": "attribute",
                                "entity": HANDOFF,
                                "attribute": "job",
                                "name": "Tower job",
                            },
                            {
                                "type": "attribute",
                                "entity": HANDOFF,
                                "attribute": "node_ready",
                                "name": "Node Ready",
                            },
                            {
                                "type": "attribute",
                                "entity": HANDOFF,
                                "attribute": "cordoned",
                                "name": "Cordoned",
                            },
                            {"entity": lent, "name": "GPUs lent to the cluster"},
                            {"entity": in_use, "name": "GPUs in use"},
                            {"entity": pods, "name": "Pods left to evict"},
                        ],
                    },
                    {"type": "markdown", "title": "Cards", "content": cards_table},
                ],
            }
        ],
    }


# --- the demo -------------------------------------------------------------------------


class Demo:
    """Starts the parts, runs Home Assistant, and stops it all again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scale = 0.01 if args.fast else 1.0
        self.work = (
            Path(args.dir)
            if args.dir
            else Path(tempfile.mkdtemp(prefix="gpu-handoff-demo-"))
        )
        self.own_work = not args.dir
        self.tower: Tower | None = None
        self.sshd: Sshd | None = None
        self.emu: K8sEmulator | None = None
        self.kubelet_task: asyncio.Task[None] | None = None
        self.ha_process: subprocess.Popen[bytes] | None = None
        self.ha_log = self.work / "home-assistant.out"
        self.ports: list[int] = []
        self.events: list[dict[str, Any]] = []
        self.events_task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.password = secrets.token_urlsafe(12)

    async def start(self) -> HomeAssistantClient:
        """Everything up, onboarded, the integration added and loaded."""
        started = time.monotonic()
        self.work.mkdir(parents=True, exist_ok=True)
        if not self.own_work and any(self.work.iterdir()):
            raise DemoError(f"{self.work} is not empty: give --dir a new directory")
        if not sshd_available():
            raise DemoError("OpenSSH's sshd and ssh-keygen are needed")
        # Home Assistant falls back to recovery mode (no custom integrations)
        # when its frontend does not load: the frontend is not optional.
        packages = await asyncio.to_thread(frontend_packages)
        if packages is None:
            raise DemoError(f"cannot install {REQUIREMENTS_DEMO.name} with pip")
        log(
            "tower: GPU node with a GeForce GTX 960 (4 GB) and two GeForce RTX 3050s "
            "(8 GB, 6 GB); Gaming station 1 and 2 each want one RTX 3050"
            + (" (guests 100x faster)" if self.args.fast else "")
        )
        self.tower = realistic_tower(self.work / "tower", time_scale=self.scale)
        config = write_agent_config(
            self.tower,
            self.work / "agent",
            poll_interval=0.05 if self.args.fast else 1.0,
            agent=180.0,
            shutdown=180.0,
            start=300.0,
        )
        self.sshd = Sshd(
            self.work / "sshd", agent_command(config), user=getpass.getuser()
        ).start()
        self.ports.append(self.sshd.port)
        log(f"tower: sshd on {HOST}:{self.sshd.port} forcing the GPU Handoff agent")

        self.emu = K8sEmulator(host=HOST, port=0, lease_interval=2.0)
        seed_demo(self.emu)
        label_cards(self.emu)
        relax_pdb(self.emu)
        await self.emu.start()
        self.ports.append(self.emu.port)
        kubelet = Kubelet(self.tower, self.emu, 0.05 if self.args.fast else 0.25)
        self.kubelet_task = asyncio.create_task(kubelet.run())
        kubeconfig = yaml.safe_dump(self.emu.kubeconfig(), sort_keys=False)
        log(f"cluster: Kubernetes API emulator at {self.emu.url}")

        port = self.args.port or free_port()
        self.ports.append(port)
        ha_config = self.work / "home-assistant"
        write_ha_config(ha_config, port)
        log(f"starting Home Assistant on http://{HOST}:{port} (log: {self.ha_log})")
        self.ha_process = start_home_assistant(ha_config, packages, self.ha_log)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        ha = HomeAssistantClient(self.session, port)
        await ha.wait_until_up(self.ha_process)
        log(f"Home Assistant answers after {time.monotonic() - started:.1f} s")
        await ha.onboard(self.password)
        log(f"onboarded: owner user '{USERNAME}'")
        # Home Assistant moves the YAML http settings into storage as a trial
        # that reverts after five minutes unless confirmed: confirm it, as the
        # user would in the dialog the frontend shows.
        await ha.websocket({"type": "http/config/promote"})
        self.events_task = asyncio.create_task(ha.follow_events(self.events))
        entry_id = await add_integration(ha, self.sshd, kubeconfig)
        await wait_loaded(ha, entry_id)
        log("GPU Handoff is loaded: the GPU node serves the cluster")
        try:
            await ha.websocket(
                {
                    "type": "lovelace/dashboards/create",
                    "url_path": DASHBOARD,
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
                    "url_path": DASHBOARD,
                    "config": dashboard(await ha.states()),
                }
            )
            log("dashboard saved")
        except DemoError as err:
            log(f"no dashboard: {err}")
        log(f"ready after {time.monotonic() - started:.1f} s")
        return ha

    async def scripted(self, ha: HomeAssistantClient) -> str:
        """Hand the cards to Gaming station 1 and back; the summary line."""
        tower, emu = self.tower, self.emu
        if tower is None or emu is None:
            raise DemoError("the demo is not started")

        def happened(event_type: str, since: int) -> bool:
            for event in self.events[since:]:
                if event["event_type"] == "gpu_handoff_handoff_failed":
                    raise DemoError(f"the handoff failed: {event['data'].get('error')}")
            return any(e["event_type"] == event_type for e in self.events[since:])

        async def handed_over() -> bool:
            if not happened("gpu_handoff_handoff_succeeded", mark):
                return False
            switch, handoff = await ha.state(SWITCH_1), await ha.state(HANDOFF)
            return bool(
                switch
                and handoff
                and switch["state"] == "on"
                and switch["attributes"].get("step") == "idle"
                and handoff["state"] == "off"
                and await asyncio.to_thread(tower.is_running, "gaming-1")
            )

        async def returned() -> bool:
            if not happened("gpu_handoff_cards_returned", mark):
                return False
            switch, handoff = await ha.state(SWITCH_1), await ha.state(HANDOFF)
            return bool(
                switch
                and handoff
                and switch["state"] == "off"
                and switch["attributes"].get("step") == "idle"
                and handoff["state"] == "serving"
                and not cordoned(emu)
                and await asyncio.to_thread(tower.is_running, "gpu-node")
            )

        t0 = time.monotonic()
        mark = len(self.events)
        log("turning Gaming station 1 on")
        await ha.call("switch", "turn_on", {"entity_id": SWITCH_1})
        await until(handed_over, WAIT, "the handoff to Gaming station 1")
        handoff = time.monotonic() - t0
        log(f"Gaming station 1 plays after {handoff:.1f} s; turning it off")
        t1 = time.monotonic()
        mark = len(self.events)
        await ha.call("switch", "turn_off", {"entity_id": SWITCH_1})
        await until(returned, WAIT, "the cards to come back to the GPU node")
        back = time.monotonic() - t1
        if tower.destroy_attempts():
            raise DemoError("something asked the tower to force a VM off")
        return f"demo: handoff {handoff:.1f} s, return {back:.1f} s: ok"

    async def stop(self) -> None:
        """Stop everything that was started, in reverse order."""
        if self.events_task is not None:
            self.events_task.cancel()
            await asyncio.gather(self.events_task, return_exceptions=True)
        if self.ha_process is not None:
            if self.ha_process.poll() is None:
                self.ha_process.terminate()
                try:
                    await asyncio.to_thread(self.ha_process.wait, 60)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.ha_process.pid, signal.SIGKILL)
                    self.ha_process.wait()
            # Anything Home Assistant started in its session goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.ha_process.pid, signal.SIGKILL)
            self.ha_process = None
        if self.session is not None:
            await self.session.close()
        if self.kubelet_task is not None:
            self.kubelet_task.cancel()
            await asyncio.gather(self.kubelet_task, return_exceptions=True)
        if self.emu is not None:
            await self.emu.stop()
        if self.sshd is not None:
            self.sshd.stop()
        if self.tower is not None:
            await asyncio.to_thread(self.tower.close)
        busy = [port for port in self.ports if not port_free(port)]
        if busy:
            log(f"ports still in use after stopping: {busy}")
        if self.own_work and not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port any more."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


async def main_async(args: argparse.Namespace) -> int:
    """Run the demo until it is done (scripted) or stopped (SIGINT/SIGTERM)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    demo = Demo(args)

    async def run() -> str | None:
        ha = await demo.start()
        if args.scripted:
            return await demo.scripted(ha)
        print(
            "\n"
            f"  Home Assistant:  {ha.base}/{DASHBOARD}/tower\n"
            f"  login:           {USERNAME} / {demo.password}\n"
            "  Toggle 'Gaming station 1' or '2' on the dashboard; Ctrl-C stops the demo.\n",
            flush=True,
        )
        while not stop.is_set():
            if demo.ha_process is None or demo.ha_process.poll() is not None:
                raise DemoError("Home Assistant exited")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return None

    task = asyncio.create_task(run())
    stopper = asyncio.create_task(stop.wait())
    status = 0
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            summary = task.result()
            if summary:
                print(summary, flush=True)
            else:
                log("stopping")
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            log("stopping")
            status = 130 if args.scripted else 0
    except (
        DemoError,
        aiohttp.ClientError,
        OSError,
        RuntimeError,
        subprocess.SubprocessError,
    ) as err:
        print(f"demo: failed: {err}", flush=True)
        if demo.ha_log.exists():
            tail = demo.ha_log.read_text("utf-8", "replace").splitlines()[-30:]
            print("\n".join(["demo: Home Assistant's last output:", *tail]), flush=True)
        status = 1
    finally:
        stopper.cancel()
        await demo.stop()
        log("stopped")
    return status


def parser() -> argparse.ArgumentParser:
    """The command line."""
    arguments = argparse.ArgumentParser(
        prog="scripts/demo", description=__doc__.split("\n\n")[0]
    )
    arguments.add_argument("--fast", action="store_true", help="guests 100x faster")
    arguments.add_argument(
        "--scripted",
        action="store_true",
        help="hand Gaming station 1 the cards and back, print one line, exit",
    )
    arguments.add_argument(
        "--port",
        type=int,
        default=0,
        help="Home Assistant's port (default: a free one)",
    )
    arguments.add_argument(
        "--dir", help="working directory (default: a new temporary one)"
    )
    arguments.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary directory (logs, Home Assistant's configuration)",
    )
    return arguments


def main() -> int:
    """Entry point."""
    return asyncio.run(main_async(parser().parse_args()))


if __name__ == "__main__":
    sys.exit(main())
