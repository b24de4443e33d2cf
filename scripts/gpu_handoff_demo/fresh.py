"""The fresh tower of ``--guided``: a tower with nothing of GPU Handoff on it,
to try the config flow's guided install ("Install the agent for me") on.

It is the tests' box tower (tests/support/box_tower.py): the Debian root
booted under its own systemd in private namespaces, on an overlay thrown
away when the demo stops; its sshd is its ``ssh.service`` (password logins),
its accounts and sudo are real, and libvirt is its real ``libvirtd.service``
serving libvirt's test driver with ``gpu-node``, ``win-1`` and ``win-2`` from
a file (so they survive a restart of the daemon). The install, the restart
of libvirtd.service it does when asked (systemd's, for real) and the status
Home Assistant reads afterwards are real; the test driver's VMs have no guest
agent, so this tower's switches cannot hand a card off.

Interactive, the demo prints what to type in the browser; with
``--scripted`` it clicks through the same screens through Home Assistant's
REST API, as the frontend does (``guided_install``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import json
import os
from pathlib import Path
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

import custom_components.gpu_handoff
from custom_components.gpu_handoff.const import (
    CONF_ADMIN_PASSWORD,
    CONF_ADMIN_USERNAME,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_LIBVIRT_URI,
    CONF_RESTART_LIBVIRT,
    DOMAIN,
)
from custom_components.gpu_handoff.tower.gpu_handoff import wire
from tests.support.agentbuild import agent_bytes
from tests.support.box import BoxError
from tests.support.box_tower import (
    LIBVIRTD,
    BoxFreshTower,
    BoxTowerError,
    box_tower_unavailable,
)
from tests.support.fresh_tower import ADMIN_PW, ROOT

from . import screenshot
from .client import HomeAssistantClient
from .cluster import FRESH_NODE
from .home_assistant import HOST
from .output import DemoError, log
from .places import shown

NAME = "fresh tower"
# The administrator the scripted install logs in as: a sudo user whose sudo
# asks for the login's password.
ADMIN = ADMIN_PW
# The account Home Assistant logs in as; the install creates it.
AGENT_USER = "gpu-handoff"
# Where the install puts the agent.
PROGRAM = "/usr/local/bin/gpu-handoff"
# The tower's box takes a plain path (its overlay's options name it), and
# the run's directory may be anywhere: the tower's goes to /tmp.
TEMP_PREFIX = "gpu-handoff-fresh-tower-"
# What the tower's errors can be (a step that failed, a box that did not
# boot or go away, a program that could not run).
TOWER_ERRORS = (BoxTowerError, BoxError, OSError, subprocess.SubprocessError)


def unavailable() -> str | None:
    """Why no fresh tower can run here, or None."""
    if os.geteuid() != 0:
        return "a fresh tower needs root (it boots a box under its own systemd)"
    reason = box_tower_unavailable()
    if reason is not None:
        return f"a fresh tower boots a box: {reason}"
    if not shutil.which("libvirtd") or not shutil.which("virsh"):
        return "a fresh tower needs libvirtd and virsh"
    return None


@dataclass
class DemoFreshTower:
    """The running fresh tower and the temporary directory it lives in."""

    tower: BoxFreshTower
    parent: Path

    @property
    def port(self) -> int:
        """sshd's port."""
        return self.tower.port

    def libvirtd(self) -> tuple[int, int]:
        """libvirtd.service as the tower's systemd tells it: (its main
        process id, how many times it started); DemoError if it cannot."""
        try:
            pid = self.tower.main_pid(LIBVIRTD)
            starts = self.tower.journal(LIBVIRTD).count("Started libvirtd.service")
        except TOWER_ERRORS as err:
            raise DemoError(
                f"{NAME}: cannot ask systemd about {LIBVIRTD}: {err}"
            ) from err
        return pid, starts

    def stop(self) -> None:
        """Power the tower off (sshd, libvirtd and every session go with
        it); remove what it wrote (what went wrong is said, and the demo's
        other parts still stop). A libvirtd.service restarted meanwhile (a
        guided install asked for it) is said first."""
        try:
            if self.tower.box is not None:
                _pid, starts = self.libvirtd()
                if starts > 1:
                    log(
                        f"{NAME}: {LIBVIRTD} was restarted {starts - 1} time(s) "
                        "while the demo ran (the tower's journal)"
                    )
        except DemoError as err:
            log(str(err))
        try:
            self.tower.stop()
        except TOWER_ERRORS as err:
            log(f"{NAME}: stopping: {err}")
        finally:
            shutil.rmtree(self.parent, ignore_errors=True)


def start_fresh_tower() -> DemoFreshTower:
    """A fresh tower in a new directory under /tmp; DemoError when it cannot
    run here or does not start."""
    reason = unavailable()
    if reason is not None:
        raise DemoError(f"--guided: {reason}")
    parent = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp"))
    tower = BoxFreshTower(parent / "tower")
    try:
        tower.start()
    except (*TOWER_ERRORS, ValueError) as err:
        shutil.rmtree(parent, ignore_errors=True)
        raise DemoError(f"the fresh tower did not start: {err}") from err
    return DemoFreshTower(tower, parent)


def describe(fresh: DemoFreshTower) -> str:
    """What the fresh tower is, for the start's progress line."""
    tower = fresh.tower
    return (
        f"{NAME}: a Debian root booted under its own systemd, ssh.service on "
        f"{HOST}:{tower.port} with password logins, sudo, {LIBVIRTD} serving "
        "libvirt's test driver (gpu-node, win-1, win-2); nothing of GPU Handoff "
        f"installed (started in {tower.startup_seconds or 0.0:.1f} s)"
    )


def instructions(fresh: DemoFreshTower, kubeconfig: Path) -> str:
    """How to try the guided install in the browser, step by step."""
    tower = fresh.tower
    admin, root = tower.admins[ADMIN], tower.admins[ROOT]
    return "\n".join(
        [
            "  Try the guided install on the fresh tower (nothing of GPU Handoff on it):",
            "    1. Settings > Devices & services > Add integration > GPU Handoff",
            f"    2. host {HOST}, port {tower.port}, username {AGENT_USER}",
            f"    3. the host key must be {tower.host_fingerprint}",
            '    4. pick "Install the agent for me"',
            f"    5. administrator user {admin.name}, password {admin.password}",
            "       (sudo asks for the same password: leave the sudo password empty),",
            f"       or administrator user {root.name}, password {root.password};",
            f"       libvirt URI {tower.uri}",
            "    6. keep the GPU node gpu-node and the gaming VMs win-1 and win-2;",
            '       confirm the install; "Restart libvirtd now" restarts the tower\'s',
            f"       real {LIBVIRTD} (its VMs stay; the demo says so as it stops)",
            "    7. the kubeconfig: paste the whole text of",
            f"       {shown(kubeconfig)}",
            f"    8. the Kubernetes node {FRESH_NODE} (the form proposes gpu-node,",
            "       tower-1's, as the fresh tower's GPU node VM has that name)",
            "  Its VMs run on libvirt's test driver: the install and the status are",
            "  real, but its switches cannot hand a card off (the test driver has no",
            "  guest agent). It is there to try the setup; the dashboard does not",
            "  show it (Settings > Devices & services > GPU Handoff does).",
        ]
    )


def _defaults(form: dict[str, Any]) -> dict[str, Any]:
    """What a form shows filled in: its defaults and suggested values."""
    values: dict[str, Any] = {}
    for field in form.get("data_schema") or []:
        shown_value = (field.get("description") or {}).get("suggested_value")
        if shown_value is None:
            shown_value = field.get("default")
        if shown_value is not None:
            values[field["name"]] = shown_value
    return values


def _expect(result: dict[str, Any], step_id: str) -> None:
    if result.get("step_id") != step_id:
        raise DemoError(
            f"{NAME}: expected the {step_id} step, got {result.get('type')} "
            f"{result.get('step_id')}: {result.get('errors')}"
        )


def _node_options(form: dict[str, Any]) -> list[str]:
    """The Kubernetes nodes the node step offers."""
    for field in form.get("data_schema") or []:
        if field["name"] == CONF_K8S_NODE:
            options = field["selector"]["select"]["options"]
            return [str(o["value"] if isinstance(o, dict) else o) for o in options]
    return []


@dataclass(frozen=True)
class GuidedResult:
    """What the guided install did: the entry, the install's seconds, the
    findings the tower's check showed, libvirtd.service's main process
    before and after (systemd's word)."""

    entry_id: str
    seconds: float
    findings: list[str]
    libvirtd: tuple[int, int]


async def guided_install(
    ha: HomeAssistantClient, fresh: DemoFreshTower, kubeconfig: str
) -> GuidedResult:
    """The config flow's guided install, screen by screen as a user clicks
    through it: address, host key, "Install the agent for me", the
    administrator login (a sudo user with a password), the VMs the form
    proposes, confirm with "Restart libvirtd now" ticked (the tower's
    libvirtd.service restarts for real: DemoError unless systemd shows a new
    main process, started once more), the findings, the cluster and the
    fresh tower's node."""
    tower = fresh.tower
    admin = tower.admins[ADMIN]
    result = await ha.request(
        "POST",
        "/api/config/config_entries/flow",
        {"handler": DOMAIN, "show_advanced_options": False},
    )
    flow_id = result["flow_id"]
    log(f"{NAME}: config flow: the tower's address, account {AGENT_USER}")
    result = await ha.flow_step(
        flow_id, {"host": HOST, "port": tower.port, "username": AGENT_USER}
    )
    _expect(result, "host_key")
    fingerprint = result["description_placeholders"]["fingerprint"]
    if fingerprint != tower.host_fingerprint:
        raise DemoError(f"{NAME}: host key {fingerprint} is not the tower's")
    log(f"{NAME}: config flow: host key {fingerprint} matches, pinning it")
    result = await ha.flow_step(flow_id, {})
    if result.get("type") != "menu" or result["menu_options"][0] != "install_agent":
        raise DemoError(f"{NAME}: expected the guided install first, got {result}")
    result = await ha.flow_step(flow_id, {"next_step_id": "install_agent"})
    _expect(result, "install_agent")
    log(f'{NAME}: config flow: "Install the agent for me"')
    login = _defaults(result) | {
        CONF_ADMIN_USERNAME: admin.name,
        CONF_ADMIN_PASSWORD: admin.password,
        CONF_LIBVIRT_URI: tower.uri,
    }
    result = await ha.flow_step(flow_id, login)
    _expect(result, "install_options")
    log(
        f"{NAME}: config flow: administrator {admin.name} with its password "
        "(sudo asks for it too): the tower surveyed, nothing changed yet"
    )
    chosen = _defaults(result)
    result = await ha.flow_step(flow_id, chosen)
    _expect(result, "install_confirm")
    log(
        f"{NAME}: config flow: GPU node {chosen.get(CONF_GPU_NODE)}, gaming VMs "
        + ", ".join(chosen.get(CONF_GAMING_VMS) or [])
        + " (as proposed)"
    )
    pid_before, starts_before = await asyncio.to_thread(fresh.libvirtd)
    started = time.monotonic()
    result = await ha.flow_step(flow_id, {CONF_RESTART_LIBVIRT: True})
    seconds = time.monotonic() - started
    _expect(result, "install_done")
    if result.get("errors"):
        raise DemoError(f"{NAME}: the install ended with {result['errors']}")
    pid_after, starts_after = await asyncio.to_thread(fresh.libvirtd)
    if pid_after in (0, pid_before) or starts_after != starts_before + 1:
        raise DemoError(
            f"{NAME}: {LIBVIRTD} was not restarted: main process {pid_before} "
            f"then {pid_after}, started {starts_before} then {starts_after} times"
        )
    log(
        f'{NAME}: config flow: confirmed with "Restart libvirtd now"; agent '
        f"{wire.VERSION} installed in {seconds:.1f} s, {LIBVIRTD} restarted "
        f"(main process {pid_before} -> {pid_after}), the tower's check found:"
    )
    findings = result["description_placeholders"]["findings"].splitlines()
    for line in findings:
        log(f"{NAME}:   {line}")
    result = await ha.flow_step(flow_id, {})
    _expect(result, "cluster")
    log(f"{NAME}: config flow: the restricted key logs in; the kubeconfig")
    result = await ha.flow_step(flow_id, {CONF_KUBECONFIG: kubeconfig})
    _expect(result, "node")
    if FRESH_NODE not in _node_options(result):
        raise DemoError(f"{NAME}: the node step does not offer {FRESH_NODE}")
    log(f"{NAME}: config flow: Kubernetes node {FRESH_NODE}")
    result = await ha.flow_step(flow_id, {CONF_K8S_NODE: FRESH_NODE})
    if result.get("type") != "create_entry":
        raise DemoError(f"{NAME}: config flow did not finish: {result}")
    return GuidedResult(
        str(result["result"]["entry_id"]), seconds, findings, (pid_before, pid_after)
    )


# Where the frontend opens the "Add integration" dialog for one integration
# (it asks "Do you want to set up GPU Handoff?" first).
ADD_PATH = f"/config/integrations/dashboard/add?domain={DOMAIN}"
TRANSLATIONS = (
    Path(custom_components.gpu_handoff.__file__).parent / "translations" / "en.json"
)


async def confirm_screenshot(
    ha: HomeAssistantClient,
    fresh: DemoFreshTower,
    output: Path,
    *,
    login: tuple[str, str],
    size: tuple[int, int],
    profile: Path,
) -> list[str]:
    """The guided install's confirm step as the browser shows it: the
    dialog clicked through as a user does (address, host key, "Install the
    agent for me", the administrator login, the VMs as proposed), captured
    once its text has settled, and not confirmed: nothing is installed.
    What is wrong with the page's text (``screenshot.dialog_problems``)."""
    tower = fresh.tower
    admin = tower.admins[ADMIN]
    steps = json.loads(TRANSLATIONS.read_text(encoding="utf-8"))["config"]["step"]
    confirm = steps["install_confirm"]
    expect = [
        confirm["title"].format(host=HOST),
        confirm["data"][CONF_RESTART_LIBVIRT],
        f"uploads the GPU Handoff agent {wire.VERSION}",
        admin.name,
        tower.uri,
    ]
    async with screenshot.logged_in(
        ha, ADD_PATH, login=login, size=size, profile=profile
    ) as browser:
        dialog = screenshot.FlowDialog(browser)
        await dialog.click("OK")
        await dialog.wait("user")
        await dialog.fill({"host": HOST, "port": tower.port, "username": AGENT_USER})
        await dialog.submit()
        await dialog.wait("host_key")
        await screenshot.settled(browser, [tower.host_fingerprint])
        await dialog.submit()
        await dialog.wait("credentials")
        await dialog.choose("install_agent")
        await dialog.wait("install_agent")
        await dialog.fill(
            {
                CONF_ADMIN_USERNAME: admin.name,
                CONF_ADMIN_PASSWORD: admin.password,
                CONF_LIBVIRT_URI: tower.uri,
            }
        )
        await dialog.submit()
        await dialog.wait("install_options")
        await dialog.submit()
        await dialog.wait("install_confirm")
        texts = await screenshot.settled(browser, expect)
        await screenshot.capture(browser, output)
    return screenshot.dialog_problems(texts)


# A findings line of the install_done step: "- code (domain): detail".
FINDING = re.compile(r"^- (?P<code>[a-z0-9_]+) \((?P<domain>[^)]*)\): ")


def finding_issues(entry_id: str, findings: list[str]) -> set[str]:
    """The repairs the integration raises for the findings shown, one per
    finding and VM (as its coordinator names them): the fresh tower's VMs
    have them on purpose (tests/tower/nodes.py)."""
    issues = set()
    for line in findings:
        if found := FINDING.match(line):
            domain = "" if found["domain"] == "-" else found["domain"]
            issues.add(f"{found['code']}_{entry_id}_{domain}")
    return issues


def _look(fresh: DemoFreshTower) -> tuple[bytes | None, bool]:
    """The installed agent's bytes (None: none) and whether the account exists."""
    tower = fresh.tower
    try:
        program = tower.read_bytes(PROGRAM)
        account = tower.run(["id", "-u", AGENT_USER])
    except TOWER_ERRORS as err:
        raise DemoError(f"{NAME}: cannot look at the tower: {err}") from err
    return program, account.returncode == 0


def check_untouched(fresh: DemoFreshTower) -> None:
    """Nothing of GPU Handoff is on the tower (as before a confirmed
    install); DemoError otherwise."""
    program, account = _look(fresh)
    if program is not None or account:
        raise DemoError(f"{NAME}: something was installed before the confirm")


def check_installed(fresh: DemoFreshTower) -> None:
    """The tower now has the agent this release ships and the account;
    DemoError otherwise."""
    program, account = _look(fresh)
    if program != agent_bytes():
        raise DemoError(f"{NAME}: {PROGRAM} is not the agent this release ships")
    if not account:
        raise DemoError(f"{NAME}: no account {AGENT_USER} on the tower")
