"""A screenshot of the demo's dashboard, taken by a real browser (Debian's
headless Chromium) logged in as the demo user, and what the page says.

The browser runs with a private profile in the run's directory and is driven
over the DevTools protocol. The demo user logs in through Home Assistant's
login flow, as its login page does, and the browser opens the dashboard with
the authorization code that page would hand on (``auth_callback``): the
frontend exchanges it for its own tokens. Once the page's text has settled,
the page is captured, once the pictures it should show (the VMs' screens)
have loaded too. The visible text (shadow DOM included) is checked: no raw
codes (snake_case state or step names, libvirt domain names), nothing
"Unknown" or "Unavailable".

A config flow dialog (``FlowDialog``) is worked in the same browser: its
forms filled and submitted, its menus clicked, through the frontend's own
elements, until the step to capture shows.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
import contextlib
import itertools
import json
import os
from pathlib import Path
import re
import shutil
import signal
import subprocess
import time
from typing import Any
import urllib.parse

import aiohttp

from .client import HomeAssistantClient
from .output import DemoError

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")

# Every visible text node, shadow roots included.
VISIBLE_TEXT = """
(() => {
  const texts = [];
  const walk = (root) => {
    for (const node of root.childNodes) {
      if (node.nodeType === Node.TEXT_NODE) {
        const text = node.nodeValue.trim();
        const parent = node.parentElement;
        if (text && parent && parent.checkVisibility({visibilityProperty: true})) {
          texts.push(text);
        }
      } else if (node.nodeType === Node.ELEMENT_NODE) {
        if (node.shadowRoot) walk(node.shadowRoot);
        walk(node);
      }
    }
  };
  walk(document);
  return texts;
})()
"""
# How many pictures have loaded (shadow roots included).
LOADED_IMAGES = """
(() => {
  let loaded = 0;
  const walk = (root) => {
    for (const node of root.querySelectorAll("*")) {
      if (node.shadowRoot) walk(node.shadowRoot);
      if (node.tagName === "IMG" && node.complete && node.naturalWidth > 0) {
        loaded += 1;
      }
    }
  };
  walk(document);
  return loaded;
})()
"""
# Finds the config flow dialog's parts, shadow roots included.
FLOW_HELPERS = """
(() => {
  const all = (selector) => {
    const found = [];
    const walk = (root) => {
      for (const node of root.querySelectorAll("*")) {
        if (node.matches(selector)) found.push(node);
        if (node.shadowRoot) walk(node.shadowRoot);
      }
    };
    walk(document);
    return found;
  };
  const form = () => all("step-flow-form")[0];
  return {
    step: () => {
      for (const tag of ["step-flow-form", "step-flow-menu", "step-flow-abort",
                         "step-flow-create-entry", "step-flow-progress"]) {
        const element = all(tag)[0];
        if (element && element.step) {
          const errors = element.step.errors;
          return [tag, element.step.step_id,
                  errors && Object.keys(errors).length ? errors : null];
        }
      }
      return null;
    },
    click: (text) => {
      for (const button of all("ha-button, mwc-button, button")) {
        if (button.textContent.trim() === text && button.checkVisibility()) {
          button.click();
          return true;
        }
      }
      return false;
    },
    fill: async (values) => {
      const element = form();
      await element.updateComplete;
      const fields = element.shadowRoot.querySelector("ha-form");
      fields.dispatchEvent(new CustomEvent("value-changed", {
        detail: {value: {...(element._stepData || {}), ...values}},
      }));
      await element.updateComplete;
      return element._stepData;
    },
    submit: async () => {
      const element = form();
      await element.updateComplete;
      element.submit();
      return true;
    },
    choose: (option) => {
      const menu = all("step-flow-menu")[0];
      for (const item of menu.shadowRoot.querySelectorAll("ha-list-item")) {
        if (item.step === option) {
          item.click();
          return true;
        }
      }
      return false;
    },
  };
})()
"""
SNAKE_CASE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
NOT_KNOWN = re.compile(r"\b(unknown|unavailable)\b", re.IGNORECASE)
UNFILLED = re.compile(r"\{[a-z_]+\}")


def find_browser() -> str | None:
    """Debian's headless Chromium (or its full browser), if installed."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def text_problems(texts: list[str], raw: list[str]) -> list[str]:
    """What the page must not say: raw codes (snake_case, or one of ``raw``)
    and "Unknown" or "Unavailable"."""
    problems = []
    words = re.compile(r"\b(" + "|".join(map(re.escape, raw)) + r")\b") if raw else None
    for text in texts:
        found = SNAKE_CASE.findall(text) + NOT_KNOWN.findall(text)
        if words is not None:
            found += words.findall(text)
        problems += [f"{word!r} in {text[:80]!r}" for word in found]
    return problems


class Browser:
    """Headless Chromium with one page, spoken to over the DevTools protocol."""

    def __init__(
        self,
        binary: str,
        profile: Path,
        session: aiohttp.ClientSession,
        size: tuple[int, int],
    ) -> None:
        self.binary = binary
        self.size = size
        self.profile = profile
        self.session = session
        self.process: subprocess.Popen[bytes] | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    def _launch(self, port_file: Path) -> subprocess.Popen[bytes]:
        self.profile.mkdir(parents=True, exist_ok=True)
        port_file.unlink(missing_ok=True)
        with (self.profile.parent / "chromium.log").open("wb") as log:
            return subprocess.Popen(
                [
                    self.binary,
                    "--headless",
                    # The demo runs as root inside its environment, where
                    # Chromium's sandbox cannot work; the page is our own.
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--hide-scrollbars",
                    f"--user-data-dir={self.profile}",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",
                    f"--window-size={self.size[0]},{self.size[1]}",
                    "about:blank",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def start(self) -> None:
        """Start the browser and connect to its page."""
        port_file = self.profile / "DevToolsActivePort"
        self.process = self._launch(port_file)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise DemoError(f"{self.binary} did not start (see chromium.log)")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as reply:
            targets = await reply.json()
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = await self.session.ws_connect(
            page["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024
        )

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result."""
        if self.ws is None:
            raise DemoError("the browser is not started")
        number = next(self._ids)
        await self.ws.send_json({"id": number, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") != number:
                continue  # an event
            if "error" in message:
                raise DemoError(f"{method}: {message['error']}")
            result: dict[str, Any] = message.get("result", {})
            return result

    async def evaluate(self, expression: str) -> Any:
        """A JavaScript expression's value in the page."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True
        )
        return result.get("result", {}).get("value")

    async def close(self) -> None:
        """Close the connection and stop the browser."""
        if self.ws is not None:
            await self.ws.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await asyncio.to_thread(self.process.wait)
        if self.process is not None:
            # Its helper processes (same session) would write to the profile
            # after it is removed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.profile, ignore_errors=True)


@contextlib.asynccontextmanager
async def logged_in(
    ha: HomeAssistantClient,
    path: str,
    *,
    login: tuple[str, str],
    size: tuple[int, int],
    profile: Path,
) -> AsyncIterator[Browser]:
    """The browser with ``path`` opened, logged in as ``login`` (user name,
    password), in a window of ``size`` (width, height); stopped afterwards."""
    binary = find_browser()
    if binary is None:
        raise DemoError(
            "no headless Chromium: install Debian's chromium-headless-shell "
            "(or chromium)"
        )
    code = await ha.login_code(*login)
    state = base64.b64encode(
        json.dumps({"hassUrl": ha.base, "clientId": ha.client_id}).encode()
    ).decode()
    query = urllib.parse.urlencode({"auth_callback": "1", "code": code, "state": state})
    browser = Browser(binary, profile, ha.session, size)
    try:
        await browser.start()
        await browser.send(
            "Emulation.setDeviceMetricsOverride",
            width=size[0],
            height=size[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        joiner = "&" if "?" in path else "?"
        await browser.send("Page.navigate", url=f"{ha.base}{path}{joiner}{query}")
        yield browser
    finally:
        with contextlib.suppress(Exception):
            await browser.close()


async def capture(browser: Browser, output: Path) -> None:
    """The page as it is now, saved as PNG to ``output``."""
    shot = await browser.send("Page.captureScreenshot", format="png")
    await asyncio.to_thread(_save, output, base64.b64decode(shot["data"]))


async def take(
    ha: HomeAssistantClient,
    path: str,
    output: Path,
    *,
    login: tuple[str, str],
    size: tuple[int, int],
    expect: list[str],
    images: int = 0,
    raw: list[str],
    profile: Path,
) -> list[str]:
    """Open ``path`` logged in as ``login`` (user name, password) in a window
    of ``size`` (width, height), wait until the page shows every text in
    ``expect`` and at least ``images`` loaded pictures and has settled, save a
    PNG to ``output``; what is wrong with the page's text (see
    ``text_problems``)."""
    async with logged_in(ha, path, login=login, size=size, profile=profile) as browser:
        texts = await settled(browser, expect, images)
        await capture(browser, output)
        return text_problems(texts, raw)


def _save(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def settled(browser: Browser, expect: list[str], images: int = 0) -> list[str]:
    """The page's visible text once it shows ``expect`` and ``images`` loaded
    pictures and stays the same for a second and a half (numbers aside: "40
    seconds ago" counts on)."""
    deadline = time.monotonic() + 90
    texts: list[str] = []
    loaded = 0
    last = ""
    same = 0
    while time.monotonic() < deadline:
        texts = await browser.evaluate(VISIBLE_TEXT) or []
        loaded = int(await browser.evaluate(LOADED_IMAGES) or 0)
        joined = "\n".join(texts)
        if all(word in joined for word in expect) and loaded >= images:
            shape = re.sub(r"\d+", "#", joined)
            same = same + 1 if shape == last else 0
            last = shape
            if same >= 3:
                return list(texts)
        await asyncio.sleep(0.5)
    missing = [word for word in expect if word not in "\n".join(texts)]
    if loaded < images:
        missing.append(f"{images} pictures ({loaded} loaded)")
    raise DemoError(f"the page did not show {missing} in time: {texts[:40]}")


def dialog_problems(texts: list[str]) -> list[str]:
    """What a config flow dialog must not say: a translation key instead of
    its text, a placeholder left unfilled, "Unknown" or "Unavailable". (Its
    descriptions name paths and accounts, such as ``authorized_keys``: no
    snake_case check here.)"""
    problems = []
    for text in texts:
        found = NOT_KNOWN.findall(text) + UNFILLED.findall(text)
        if "component." in text:
            found.append("component.")
        problems += [f"{word!r} in {text[:80]!r}" for word in found]
    return problems


class FlowDialog:
    """The config flow dialog in the page, worked as the frontend's own
    elements work it: a form's values go in through its ``ha-form``'s
    ``value-changed`` event (what the form's fields send) and are submitted
    by ``step-flow-form``'s ``submit()``; a menu option is clicked."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser

    async def _call(self, method: str, *args: Any) -> Any:
        """One of FLOW_HELPERS' functions, awaited in the page; its value."""
        arguments = ", ".join(json.dumps(arg) for arg in args)
        result = await self.browser.send(
            "Runtime.evaluate",
            expression=f"({FLOW_HELPERS}).{method}({arguments})",
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            thrown = details.get("exception", {}).get("description")
            raise DemoError(f"in the page: {thrown or details.get('text')}")
        return result.get("result", {}).get("value")

    async def click(self, text: str, bound: float = 60) -> None:
        """Click the visible button that says ``text``, once there is one."""
        deadline = time.monotonic() + bound
        while not await self._call("click", text):
            if time.monotonic() > deadline:
                raise DemoError(f"no button {text!r} in time")
            await asyncio.sleep(0.2)

    async def wait(self, step_id: str, bound: float = 60) -> None:
        """Until the dialog shows step ``step_id``; DemoError if it shows
        errors, another outcome, or nothing in time."""
        deadline = time.monotonic() + bound
        while True:
            shown = await self._call("step")
            if shown is not None:
                kind, shown_id, errors = shown
                if errors:
                    raise DemoError(f"the dialog's {shown_id} step shows {errors}")
                if shown_id == step_id:
                    return
                if kind not in ("step-flow-form", "step-flow-menu"):
                    raise DemoError(f"the dialog ended in {kind} {shown_id}")
            if time.monotonic() > deadline:
                raise DemoError(f"the dialog did not reach {step_id}: {shown}")
            await asyncio.sleep(0.2)

    async def fill(self, values: dict[str, Any]) -> None:
        """Put ``values`` into the form (the others keep what it shows)."""
        taken = await self._call("fill", values)
        if not isinstance(taken, dict) or any(
            taken.get(key) != value for key, value in values.items()
        ):
            raise DemoError(f"the form did not take {sorted(values)}")

    async def submit(self) -> None:
        """Submit the form, as its Submit button does."""
        await self._call("submit")

    async def choose(self, option: str) -> None:
        """Click a menu's option."""
        if not await self._call("choose", option):
            raise DemoError(f"the menu has no option {option!r}")
