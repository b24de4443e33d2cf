"""Home Assistant as its own process: its configuration directory, set up the
way a current installation keeps it, its start and stop, and what its log
says.

A current installation keeps its HTTP settings and its general settings
(name, location, units) in ``.storage``, not in ``configuration.yaml``: YAML
``http:`` is deprecated (a repair says so) and the general settings belong to
the settings page. So ``configuration.yaml`` names only the integrations the
demo needs, all of which work offline; the HTTP settings (127.0.0.1 and the
demo's port, from the first start on) are written to storage before Home
Assistant starts, in the format of Home Assistant's own HTTP settings store;
and the general settings are set after onboarding, as the onboarding page
does.

The onboarding step that takes those general settings would also set up
Met.no, Radio Browser, Google Translate and the shopping list: online
services the demo neither needs nor can reach, which fail with tracebacks.
The demo records that step as done (in the onboarding store, before the
start) and does the rest of onboarding through its API.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
import json
import os
from pathlib import Path
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

from homeassistant.components.http import config as http_config
from homeassistant.components.onboarding import (
    STORAGE_KEY as ONBOARDING_KEY,
    STORAGE_VERSION as ONBOARDING_VERSION,
)
from homeassistant.components.onboarding.const import STEP_CORE_CONFIG
import yaml

from custom_components.gpu_handoff.const import DOMAIN

from .places import REPO

HOST = "127.0.0.1"

BLUEPRINTS = REPO / "blueprints" / "automation" / DOMAIN
# The automation the demo makes from the failure blueprint: a failed
# handoff or return shows in Home Assistant's notifications.
FAILURE_AUTOMATION: dict[str, Any] = {
    "id": "gpu_handoff_failures",
    "alias": "Tell me when a handoff or a return fails",
    "use_blueprint": {
        "path": f"{DOMAIN}/notify_on_failure.yaml",
        "input": {"notify_action": "notify.persistent_notification"},
    },
}
FAILURE_AUTOMATION_ENTITY = "automation.tell_me_when_a_handoff_or_a_return_fails"

# What the onboarding page sends for its general settings step.
CORE_CONFIG: dict[str, Any] = {
    "location_name": "GPU Handoff demo",
    "unit_system": "metric",
    "time_zone": "UTC",
    "currency": "EUR",
    "country": "DE",
    "language": "en",
    "latitude": 52.52,
    "longitude": 13.40,
    "elevation": 34,
}

LOG_RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ (?P<level>[A-Z]+) \((?P<thread>[^)]*)\) "
    r"\[(?P<logger>[^\]]+)\] (?P<message>.*)$"
)


def _write_store(storage: Path, key: str, version: int, minor: int, data: Any) -> None:
    """One file of Home Assistant's ``.storage`` (its own file layout)."""
    storage.mkdir(parents=True, exist_ok=True)
    path = storage / key
    path.write_text(
        json.dumps(
            {"version": version, "minor_version": minor, "key": key, "data": data},
            indent=2,
        ),
        encoding="utf-8",
    )
    path.chmod(0o600)


def prepare_config(config: Path, port: int) -> None:
    """A configuration directory for a first start on 127.0.0.1:``port``."""
    config.mkdir(parents=True, exist_ok=True)
    custom = config / "custom_components"
    custom.mkdir(exist_ok=True)
    link = custom / DOMAIN
    if not link.exists():
        link.symlink_to(REPO / "custom_components" / DOMAIN)
    integrations: dict[str, Any] = {
        "frontend": {},
        "recorder": {},
        "history": {},
        "logbook": {},
        # The toggle helpers the demo creates (its simulator's own switches).
        "input_boolean": {},
        "logger": {
            "default": "warning",
            "logs": {f"custom_components.{DOMAIN}": "info"},
        },
    }
    # Automations as the automation editor keeps them (automations.yaml,
    # included): one made from GPU Handoff's failure blueprint, imported
    # into the configuration's blueprints as the import dialog puts it.
    (config / "configuration.yaml").write_text(
        yaml.safe_dump(integrations, sort_keys=False)
        + "automation: !include automations.yaml\n",
        encoding="utf-8",
    )
    imported = config / "blueprints" / "automation" / DOMAIN
    shutil.copytree(BLUEPRINTS, imported, dirs_exist_ok=True)
    (config / "automations.yaml").write_text(
        yaml.safe_dump([FAILURE_AUTOMATION], sort_keys=False), encoding="utf-8"
    )
    storage = config / ".storage"
    stable = http_config.HTTP_STORAGE_SCHEMA(
        {"server_host": [HOST], "server_port": port}
    ) | {
        http_config.HTTP_CONFIG_CREATED_AT: datetime.now(UTC).isoformat(),
        http_config.HTTP_CONFIG_ERROR: None,
        http_config.HTTP_CONFIG_ERROR_MESSAGE: None,
    }
    _write_store(
        storage,
        http_config.STORAGE_KEY,
        http_config.STORAGE_VERSION,
        http_config.STORAGE_MINOR_VERSION,
        {
            http_config.KEY_STABLE: stable,
            http_config.KEY_PENDING: None,
            http_config.KEY_YAML_MIGRATION_DONE: True,
        },
    )
    _write_store(
        storage, ONBOARDING_KEY, ONBOARDING_VERSION, 1, {"done": [STEP_CORE_CONFIG]}
    )


# A directory holding another Home Assistant release and the packages it
# pins (scripts/newest-home-assistant), put first on Home Assistant's path:
# the demo then runs that release instead of the tool chain's.
OTHER_RELEASE = "GPU_HANDOFF_DEMO_HOME_ASSISTANT"


def start(config: Path, packages: Path, output: Path) -> subprocess.Popen[bytes]:
    """``python -m homeassistant`` in its own session (stopped by us, in order),
    with the demo's extra packages on its path only (and another release
    before them, when OTHER_RELEASE names one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (env.get(OTHER_RELEASE, ""), str(packages), env.get("PYTHONPATH", ""))
        if p
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


async def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, up to a minute for a clean stop, then SIGKILL for whatever is
    left in its session."""
    if process.poll() is None:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.to_thread(process.wait)
    # Anything Home Assistant started in its session goes with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def log_problems(output: Path) -> list[str]:
    """Every ERROR or CRITICAL record, every traceback and every blocking
    call Home Assistant detected in its event loop (a WARNING with a stack
    but no exception) in its output, one line each (a traceback by its
    exception's line)."""
    if not output.exists():
        return []
    lines = output.read_text("utf-8", "replace").splitlines()
    problems: list[str] = []
    in_traceback = False
    for line in lines:
        record = LOG_RECORD.match(line)
        if record:
            in_traceback = False
            if (
                record["level"] in ("ERROR", "CRITICAL")
                or record["message"].startswith("Detected blocking call")
                or _deprecation_of_ours(line)
            ):
                problems.append(
                    f"{record['level']} [{record['logger']}] {record['message']}"
                )
        elif line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line.startswith((" ", "\t")):
            # The exception's own line ends the traceback.
            problems.append(f"traceback: {line}")
            in_traceback = False
    return problems


def _deprecation_of_ours(line: str) -> bool:
    """A warning that something GPU Handoff uses is deprecated (Home
    Assistant's report of a deprecated call, or Python's DeprecationWarning
    through py.warnings): it names the integration."""
    lowered = line.lower()
    return "gpu_handoff" in lowered and "deprecat" in lowered
