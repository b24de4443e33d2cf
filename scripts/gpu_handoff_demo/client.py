"""Talks to Home Assistant as its frontend does: REST and websocket. Also the
config flow, clicked through as a user would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import contextlib
import json
import subprocess
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from custom_components.gpu_handoff.const import DOMAIN, EVENTS

from .home_assistant import CORE_CONFIG, HOST
from .output import DemoError, log

if TYPE_CHECKING:
    from .towers import DemoTower

USERNAME = "demo"
WAIT = 300.0  # seconds any single wait may take at most


async def until(
    what: Callable[[], Awaitable[bool]], bound: float, description: str
) -> None:
    """Poll ``what`` until it holds; DemoError after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while not await what():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {bound:.0f} s waiting for {description}")
        await asyncio.sleep(0.1)


class HomeAssistantClient:
    """One logged-in user's view of Home Assistant."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session = session
        self.base = f"http://{HOST}:{port}"
        self.client_id = f"{self.base}/"
        self.tokens: dict[str, Any] = {}

    @property
    def token(self) -> str:
        """The access token (empty before login)."""
        return str(self.tokens.get("access_token", ""))

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

    async def wait_running(self) -> None:
        """Until Home Assistant has finished starting (its state RUNNING)."""

        async def running() -> bool:
            config = await self.request("GET", "/api/config")
            return bool(config.get("state") == "RUNNING")

        await until(running, WAIT, "Home Assistant to finish starting")

    async def onboard(self, password: str) -> None:
        """The owner user, the general settings, analytics, and the login."""
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
            self.tokens = await response.json()
        # What the onboarding page's general settings step sends, before it
        # marks the step done (see home_assistant.py for why that is done).
        await self.websocket({"type": "config/core/update", **CORE_CONFIG})
        await self.request("POST", "/api/onboarding/analytics", {})
        await self.request(
            "POST",
            "/api/onboarding/integration",
            {
                "client_id": self.client_id,
                "redirect_uri": f"{self.base}/?auth_callback=1",
            },
        )

    async def login_code(self, username: str, password: str) -> str:
        """Log in as the login page does; the authorization code it hands the
        frontend (which exchanges it for the browser's own tokens)."""
        flow = await self.request(
            "POST",
            "/auth/login_flow",
            {
                "client_id": self.client_id,
                "handler": ["homeassistant", None],
                "redirect_uri": f"{self.base}/?auth_callback=1",
            },
        )
        result = await self.request(
            "POST",
            f"/auth/login_flow/{flow['flow_id']}",
            {"client_id": self.client_id, "username": username, "password": password},
        )
        if result.get("type") != "create_entry":
            raise DemoError(f"login as {username}: {result.get('errors')}")
        return str(result["result"])

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

    async def options_flow(self, entry_id: str, changes: dict[str, Any]) -> None:
        """Change an entry's options through its options flow, as the
        integration's Configure dialog does (the form opens with the current
        values filled in, the user changes some and submits); return once
        the entry has been reloaded with them."""
        async with self.session.ws_connect(f"{self.base}/api/websocket") as ws:
            await self._authenticate(ws)
            await ws.send_json({"id": 1, "type": "config_entries/subscribe"})
            form = await self.request(
                "POST",
                "/api/config/config_entries/options/flow",
                {"handler": entry_id, "show_advanced_options": False},
            )
            if form.get("type") != "form":
                raise DemoError(f"the options flow did not open a form: {form}")
            fields = {field["name"]: field for field in form["data_schema"]}
            unknown = set(changes) - set(fields)
            if unknown:
                raise DemoError(f"the options form has no {sorted(unknown)}")
            values: dict[str, Any] = {}
            for name, field in fields.items():
                shown = (field.get("description") or {}).get("suggested_value")
                if shown is None:
                    shown = field.get("default")
                if shown is not None:
                    values[name] = shown
            result = await self.request(
                "POST",
                f"/api/config/config_entries/options/flow/{form['flow_id']}",
                values | changes,
            )
            if result.get("type") != "create_entry":
                raise DemoError(f"the options flow did not finish: {result}")
            async with asyncio.timeout(WAIT):
                await _reloaded(ws, entry_id)

    async def create_toggle(self, name: str, icon: str) -> str:
        """A toggle helper (``input_boolean``), created as Settings > Helpers
        creates one; its entity id, as the entity registry has it."""
        item = await self.websocket(
            {"type": "input_boolean/create", "name": name, "icon": icon}
        )
        found: list[str] = []

        async def registered() -> bool:
            found[:] = [
                str(entity["entity_id"])
                for entity in await self.websocket(
                    {"type": "config/entity_registry/list"}
                )
                if entity["platform"] == "input_boolean"
                and entity.get("unique_id") == item["id"]
            ]
            return bool(found)

        await until(registered, 30, f"the toggle {name!r} to have an entity")
        return found[0]

    async def state(self, entity_id: str) -> dict[str, Any] | None:
        """An entity's state object, or None."""
        result: dict[str, Any] | None = await self.request(
            "GET", f"/api/states/{entity_id}", ok=(200, 404)
        )
        return result if result and "state" in result else None

    async def call(self, domain: str, service: str, data: dict[str, Any]) -> None:
        """Call an action."""
        await self.request("POST", f"/api/services/{domain}/{service}", data)

    async def config_entries(self) -> list[dict[str, Any]]:
        """Every config entry, with its state."""
        result: list[dict[str, Any]] = await self.request(
            "GET", "/api/config/config_entries/entry"
        )
        return result

    async def issues(self) -> list[dict[str, Any]]:
        """The repairs the user sees (active and not ignored)."""
        result = await self.websocket({"type": "repairs/list_issues"})
        return [issue for issue in result["issues"] if not issue["ignored"]]

    async def ignore_issue(self, domain: str, issue_id: str) -> None:
        """Ignore a repair, as its dialog's "Ignore" does."""
        await self.websocket(
            {
                "type": "repairs/ignore_issue",
                "domain": domain,
                "issue_id": issue_id,
                "ignore": True,
            }
        )

    async def websocket(self, message: dict[str, Any]) -> Any:
        """One command over the websocket API; its result."""
        async with self.session.ws_connect(f"{self.base}/api/websocket") as ws:
            await self._authenticate(ws)
            await ws.send_json({"id": 1, **message})
            reply = await ws.receive_json()
            if not reply.get("success"):
                raise DemoError(f"websocket {message['type']}: {reply.get('error')}")
            return reply.get("result")

    async def _authenticate(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.receive_json()  # auth_required
        await ws.send_json({"type": "auth", "access_token": self.token})
        reply = await ws.receive_json()
        if reply.get("type") != "auth_ok":
            raise DemoError(f"websocket auth: {reply}")

    async def follow_events(
        self, seen: list[dict[str, Any]], names: dict[str, str]
    ) -> None:
        """Append every GPU Handoff event to ``seen`` and print it, until
        cancelled; ``names`` names a VM by ``"<config entry id>:<domain>"``."""
        async with self.session.ws_connect(
            f"{self.base}/api/websocket", timeout=aiohttp.ClientWSTimeout(ws_close=5)
        ) as ws:
            await self._authenticate(ws)
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
                vm = details.get("vm")
                name = names.get(f"{details.get('config_entry_id')}:{vm}", vm)
                log(
                    f"event {event['event_type']}: {name}"
                    + (f" {extra}" if extra else "")
                )


async def _reloaded(ws: aiohttp.ClientWebSocketResponse, entry_id: str) -> None:
    """Follow ``config_entries/subscribe`` until the entry has left the loaded
    state and is loaded again."""
    left = False
    async for message in ws:
        if message.type != aiohttp.WSMsgType.TEXT:
            break
        data = json.loads(message.data)
        if data.get("type") == "result" and not data.get("success"):
            raise DemoError(f"config_entries/subscribe: {data.get('error')}")
        if data.get("type") != "event":
            continue
        for change in data["event"]:
            entry = change["entry"]
            if entry["entry_id"] != entry_id:
                continue
            state = entry["state"]
            if state in ("setup_error", "setup_retry", "failed_unload"):
                raise DemoError(f"the integration did not load again: {state}")
            if state != "loaded":
                left = True
            elif left:
                return
    raise DemoError("Home Assistant closed the websocket")


async def add_tower(ha: HomeAssistantClient, tower: DemoTower, kubeconfig: str) -> str:
    """The real config flow, step by step, as a user clicks through it; the
    new entry's id."""
    result = await ha.request(
        "POST",
        "/api/config/config_entries/flow",
        {"handler": DOMAIN, "show_advanced_options": False},
    )
    flow_id = result["flow_id"]
    sshd = tower.sshd
    log(f"{tower.name}: config flow: the tower's address")
    result = await ha.flow_step(
        flow_id, {"host": HOST, "port": sshd.port, "username": sshd.user}
    )
    fingerprint = result["description_placeholders"]["fingerprint"]
    if fingerprint != sshd.host_fingerprint:
        raise DemoError(f"host key {fingerprint} is not the tower's")
    log(f"{tower.name}: config flow: host key {fingerprint} matches, pinning it")
    result = await ha.flow_step(flow_id, {})
    if result["type"] != "menu":
        raise DemoError(f"expected the credentials menu, got {result}")
    result = await ha.flow_step(flow_id, {"next_step_id": "generate_key"})
    public_key = result["description_placeholders"]["public_key"]
    # As a user would: put the shown public key into the tower's authorized_keys,
    # forced to run the agent (the only key the tower accepts).
    sshd.authorized_keys.write_text("", encoding="utf-8")
    sshd.authorize(public_key)
    log(f"{tower.name}: config flow: generated a key pair, its public key authorized")
    result = await ha.flow_step(flow_id, {})
    result = await ha.flow_step(flow_id, {"gaming_vms": list(tower.gaming)})
    log(f"{tower.name}: config flow: both gaming VMs get a switch; the kubeconfig")
    result = await ha.flow_step(flow_id, {"kubeconfig": kubeconfig})
    result = await ha.flow_step(flow_id, {"k8s_node": tower.k8s_node})
    if result["type"] != "create_entry":
        raise DemoError(f"config flow did not finish: {result}")
    entry_id: str = result["result"]["entry_id"]
    return entry_id
