"""The built agent on a Debian 11 tower: bullseye's own Python 3.9, libvirt 7.0,
OpenSSH 8.4 and systemd 247, booted in a box.

The README says the agent runs on a tower's own Python 3.9 or newer; the rest
of the suite runs it on the test root's Python 3.14 and libvirt 12. Here the
box boots a Debian 11 ("bullseye") root file system instead of the test root
(scripts/_common.sh builds it once into the cache from Debian's packages and
their security updates, and shows it read-only at /opt/bullseye in the test
root): systemd 247 is PID 1, sshd 8.4 is ``ssh.service``, libvirtd 7.0 is
``libvirtd.service`` (polkit 0.105 lets the libvirt group in), QEMU 5.2
runs TCG guests, and ``/usr/bin/python3`` is Python 3.9.

One box serves the module. The built agent (``AGENT``, the file a tower gets)
is installed in it as an administrator installs it (``python3 PROGRAM
install --create-user --join-libvirt-group --restart-libvirt ...`` as root),
then updated; Home Assistant's key reaches it through sshd's forced command;
its jobs run detached in the SSH user's systemd manager (``systemd-run
--user``; the user lingers).

The tower's libvirt, which each test names in the configuration install
wrote (``libvirt_uri``; the rest stays as install wrote it):

- ``status``: libvirt's test driver reading a node file (``test:///PATH``),
  in virsh 7.0 itself;
- the jobs and the session: libvirtd 7.0's test driver, which keeps state
  from one call to the next (``test+unix:///default`` through the system
  socket, as the libvirt group's member; a connection kept open holds the
  state) where a node file starts each virsh call afresh. The test driver
  has no guest agent: a running domain's graceful stop ends in
  ``agent_timeout`` (the domain left running), and the tests shut domains
  down themselves where a step needs them off, as an operator would;
- the libvirt hook and screenshots: libvirtd 7.0's QEMU driver
  (``qemu:///system``) with tiny diskless TCG guests. libvirtd runs the hook
  install put in ``/etc/libvirt/hooks/qemu.d`` (loaded by install's libvirtd
  restart); libvirt 7.0's screenshot is QEMU 5.2's screendump, a PPM (the
  test driver's is a PNG file it ships), which the agent converts to PNG.

Found here: virsh 7.0 holds ``event --loop``'s lines in its output buffer
when that is a pipe (it does not flush after each line, as 9.0 does), so a
session or ``watch`` on such a tower saw no libvirt event as it happened;
the agent now runs that virsh under coreutils' ``stdbuf -oL``
(``Virsh.event_argv``).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
import contextlib
from dataclasses import dataclass
import json
import os
from pathlib import Path
import queue
import re
import subprocess
import threading
import time
from typing import Any

import pytest
import pytest_socket

from custom_components.gpu_handoff.tower.gpu_handoff import virsh as agent_virsh, wire
from tests.box.conftest import (
    CONFIG,
    PROGRAM,
    USER,
    job_units,
    pretend_vfio,
    run_install,
)
from tests.support.agentbuild import AGENT, agent_bytes, agent_variant
from tests.support.box import Box, require_box
from tests.support.png import decode, ppm_pixels
from tests.support.sshd import client_argv, generate_key, ssh_environment
from tests.support.waiting import wait_until
from tests.tower import nodes

pytestmark = pytest.mark.system

# Where the test root shows the Debian 11 root file system (scripts/_common.sh).
BULLSEYE_ENV = "GPU_HANDOFF_BULLSEYE_ROOT"
GPU_NODE = "gpu-node"
GAMING = ("win-1", "win-2")
STATE_DIR = "/var/lib/gpu-handoff"
HOOK = "/etc/libvirt/hooks/qemu.d/gpu-handoff"
# A second hook beside the agent's: it records how libvirtd calls hooks.
RECORDER = "/etc/libvirt/hooks/qemu.d/00-record"
HOOK_CALLS = "/run/hook-calls.log"
RECORDER_SCRIPT = f"""#!/bin/sh
# Records each call of libvirtd's qemu hook: its arguments, and whether its
# input was that domain's XML.
input=$(cat)
case $input in
  "<domain"*"<name>$1</name>"*) what=domain-xml ;;
  *) what=other ;;
esac
echo "$* $what" >> {HOOK_CALLS}
"""

# The node file of the status test: the GPU node runs with every card, an
# unmanaged domain claims one of them too (tests/tower/nodes.py).
NODE_FILE = "/var/lib/libvirt/tower/node.xml"
NODE_URI = f"test://{NODE_FILE}"
# libvirtd's test driver, shared by every connection while one stays open.
SYSTEM_SOCKET = "/run/libvirt/libvirt-sock"
DAEMON_URI = f"test+unix:///default?socket={SYSTEM_SOCKET}"
KEEPER = "test-driver-keeper"
PROBE = "keeper-probe"
QEMU_URI = "qemu:///system"
# Seconds: the test driver's guests never answer a guest-ping.
TIMEOUTS = ("--timeout-agent", "1", "--timeout-shutdown", "1", "--timeout-start", "1")

CARD = "0000:0a:00.0"
HOSTDEV = """    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source>
        <address domain='0x0000' bus='0x0a' slot='0x00' function='0x0'/>
      </source>
    </hostdev>
"""
# What QEMU's VGA shows in text mode (80x25 cells of 9x16 pixels): SeaBIOS.
VGA_TEXT_SIZE = (720, 400)


def bullseye_root() -> Path:
    """The Debian 11 root file system; skip without it, or fail where the
    system must have it (GPU_HANDOFF_REQUIRE_SYSTEM)."""
    require_box()
    found = os.environ.get(BULLSEYE_ENV)
    if found and Path(found, "usr/lib/systemd/systemd").exists():
        return Path(found)
    reason = (
        f"no Debian 11 root file system ({BULLSEYE_ENV}: {found!r}): "
        "scripts/_common.sh builds one with debootstrap"
    )
    if os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"):
        pytest.fail(f"{reason} (GPU_HANDOFF_REQUIRE_SYSTEM)")
    pytest.skip(reason)


@contextlib.contextmanager
def sockets_allowed() -> Iterator[None]:
    """The module's box boots before any test's ``socket_enabled`` applies,
    and it picks sshd's free port with a socket (Home Assistant's test
    plugin blocks them by then)."""
    pytest_socket.enable_socket()
    try:
        yield
    finally:
        pytest_socket.disable_socket(allow_unix_socket=True)


@dataclass
class Tower:
    """The Debian 11 tower in its box, with the agent installed."""

    box: Box
    key: Path
    install_reply: dict[str, Any]
    updates: list[dict[str, Any]]

    def ssh(self, command: str) -> dict[str, Any]:
        """One SSH request with Home Assistant's key (sshd runs the forced
        command); its JSON reply."""
        done = subprocess.run(
            client_argv(self.key, self.box.ssh_port, USER, command),
            env=ssh_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return last_json(done)

    def agent(self, *args: str) -> dict[str, Any]:
        """The installed agent run in the box as the SSH user (no login)."""
        done = self.box.run([PROGRAM, "--config", CONFIG, *args], user=USER)
        return last_json(done)

    def virsh(self, uri: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Bullseye's virsh as root in the box."""
        return self.box.run(["virsh", "-c", uri, *args], timeout=120)

    def must_virsh(self, uri: str, *args: str) -> str:
        done = self.virsh(uri, *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    def use(self, uri: str) -> None:
        """Point the agent at ``uri`` (the configuration's libvirt_uri)."""
        path = self.box.root / CONFIG.lstrip("/")
        data = json.loads(path.read_text(encoding="utf-8"))
        data["libvirt_uri"] = uri
        path.write_text(json.dumps(data), encoding="utf-8")

    def state(self, uri: str, name: str) -> str:
        return self.must_virsh(uri, "domstate", name).strip()

    def wait_job(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        """The job once it reached its final state (asked inside the box)."""

        def finished() -> dict[str, Any] | None:
            reply = self.agent("job", job_id)
            assert reply["ok"], reply
            job: dict[str, Any] = reply["job"]
            return job if job["state"] in ("succeeded", "failed") else None

        return wait_until(finished, timeout=timeout, what=f"job {job_id}", interval=0.1)


def last_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"no reply (rc {done.returncode}): {done.stderr}")
    reply: dict[str, Any] = json.loads(lines[-1])
    return reply


def node_file() -> str:
    body = "".join(
        nodes.domain_xml(name, devices, running=name == GPU_NODE)
        for name, devices in nodes.domains(other=True).items()
    )
    return f"<node>{body}</node>\n"


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tower]:
    """The booted Debian 11 tower, the agent installed in it as root (as the
    guided install runs it: creating the SSH user, joining it to the libvirt
    group, restarting libvirtd so it loads the hook), then updated twice
    (to a newer program and back to the built one)."""
    lower = bullseye_root()
    directory = tmp_path_factory.mktemp("bullseye") / "box"
    box = Box(directory, lower=lower)
    try:
        with sockets_allowed():
            box.boot()
        box.write(NODE_FILE, node_file())
        box.write(RECORDER, RECORDER_SCRIPT, mode=0o755)
        key = directory.parent / "hass_key"
        public = generate_key(key)
        reply = run_install(
            box,
            "--join-libvirt-group",
            "--restart-libvirt",
            "--gpu-node",
            GPU_NODE,
            *(option for name in GAMING for option in ("--gaming", name)),
            "--uri",
            NODE_URI,
            "--authorize-key",
            public,
            *TIMEOUTS,
        )
        newer = agent_variant(box.shared / "newer", version=f"{wire.VERSION}+newer")
        updates = [
            last_json(box.run(["python3", str(program), "update"], check=True))
            for program in (newer, AGENT)
        ]
        yield Tower(box=box, key=key, install_reply=reply, updates=updates)
    finally:
        box.close()


def versions(box: Box) -> dict[str, str]:
    """What the tower's programs say their versions are."""
    said = {
        "python3": box.run(["python3", "--version"]).stdout,
        "virsh": box.run(["virsh", "--version"]).stdout,
        "libvirtd": box.run(["libvirtd", "--version"]).stdout,
        "systemd": box.run(["systemctl", "--version"]).stdout.split("\n")[0],
        "openssh-server": box.run(
            ["dpkg-query", "-W", "-f", "${Version}", "openssh-server"]
        ).stdout,
        "qemu": box.run(["qemu-system-x86_64", "--version"]).stdout.split("\n")[0],
        "debian": box.run(["cat", "/etc/debian_version"]).stdout,
    }
    return {name: text.strip() for name, text in said.items()}


def test_the_tower_is_debian_11_and_the_agent_installs_and_updates(
    tower: Tower,
) -> None:
    box = tower.box
    said = versions(box)
    print("the tower's versions:", json.dumps(said, indent=1))
    assert re.fullmatch(r"Python 3\.9\.\d+", said["python3"]), said
    assert re.fullmatch(r"7\.0\.\d+", said["virsh"]), said
    assert re.fullmatch(r"libvirtd \(libvirt\) 7\.0\.\d+", said["libvirtd"]), said
    assert said["systemd"].startswith("systemd 247 "), said
    assert said["openssh-server"].startswith("1:8.4p1-"), said
    assert said["qemu"].startswith("QEMU emulator version 5.2."), said
    assert said["debian"].startswith("11."), said
    # No other Python: whatever runs the agent here (root, sshd's forced
    # command, libvirtd's hook, systemd-run's runners) runs Python 3.9.
    pythons = box.run(["sh", "-c", "ls -d /usr/bin/python* /usr/local/bin/python*"])
    assert pythons.stdout.split() == ["/usr/bin/python3", "/usr/bin/python3.9"]
    # The install (with bullseye's /usr/bin/python3), and its status check
    # as the SSH user through virsh 7.0.
    reply = tower.install_reply
    assert reply["user_created"] is True
    assert reply["libvirt_group"] == "added"
    assert reply["linger"] == "enabled"
    assert reply["libvirt_restart"]["restarted"] == ["libvirtd.service"], reply
    assert reply["status_error"] is None, reply
    assert "/usr/local/bin/__pycache__/gpu-handoff.cpython-39.pyc" in reply["installed"]
    assert {finding["code"] for finding in reply["findings"]} == {
        wire.FINDING_NO_AGENT_CHANNEL,
        wire.FINDING_ROM_BAR,
        wire.FINDING_CLAIMED_BY_UNMANAGED,
    }
    # The updates: to a newer program, and back to the built one.
    newer, back = tower.updates
    assert (newer["ok"], newer["previous"]) == (True, wire.VERSION), newer
    assert newer["version"] == f"{wire.VERSION}+newer"
    assert (back["previous"], back["version"]) == (newer["version"], wire.VERSION)
    installed = (box.root / PROGRAM.lstrip("/")).read_bytes()
    assert installed == agent_bytes()
    # sshd's forced command runs the installed program on Python 3.9.
    version = tower.ssh("version")
    assert (version["ok"], version["version"], version["host_name"]) == (
        True,
        wire.VERSION,
        "tower",
    )


def test_a_bad_configuration_is_refused_with_its_code(tower: Tower) -> None:
    """The forced command with a broken configuration answers config_invalid
    (and check-config says why) rather than failing some other way."""
    path = tower.box.root / CONFIG.lstrip("/")
    good = path.read_text(encoding="utf-8")
    data = json.loads(good)
    try:
        path.write_text(
            json.dumps({**data, "gaming": [GPU_NODE], "timeouts": {"agent": -1}}),
            encoding="utf-8",
        )
        for reply in (tower.ssh("status"), tower.agent("check-config")):
            assert reply["ok"] is False, reply
            assert reply["error"]["code"] == wire.ERR_CONFIG_INVALID, reply
            assert GPU_NODE in reply["error"]["message"], reply
        path.write_text(good[: len(good) // 2], encoding="utf-8")
        reply = tower.ssh("status")
        assert reply["error"]["code"] == wire.ERR_CONFIG_INVALID, reply
        assert "not valid JSON" in reply["error"]["message"], reply
    finally:
        path.write_text(good, encoding="utf-8")
    assert tower.agent("check-config")["ok"] is True


def test_status_over_sshd_reads_the_node_file_through_virsh_7(tower: Tower) -> None:
    """Domains, card ownership and findings as virsh 7.0 reads them, the same
    as the agent on the test root's Python and libvirt reads the same file."""
    tower.use(NODE_URI)
    reply = tower.ssh("status")
    assert reply["ok"] is True, reply
    domains = {d["name"]: d for d in reply["domains"]}
    assert {name: (d["state"], d["role"]) for name, d in domains.items()} == {
        GPU_NODE: ("running", "gpu_node"),
        "win-1": ("shut_off", "gaming"),
        "win-2": ("shut_off", "gaming"),
    }
    assert domains["win-1"]["title"] == "Gaming station 1"
    assert [
        (d["address"], d["managed"], d["rom_bar"]) for d in domains["win-1"]["hostdevs"]
    ] == [
        ("0000:01:00.0", True, "on"),
        ("0000:01:00.1", False, "off"),
    ]
    assert (domains["win-1"]["agent_channel"], domains["win-2"]["agent_channel"]) == (
        True,
        False,
    )
    cards = {card["address"]: card for card in reply["cards"]}
    assert {a: (c["held_by"], c["claimed_by"]) for a, c in cards.items()} == {
        "0000:01:00.0": (GPU_NODE, [GPU_NODE, "win-1"]),
        "0000:01:00.1": (GPU_NODE, [GPU_NODE, "win-1"]),
        "0000:02:00.0": (GPU_NODE, [GPU_NODE, "other-vm", "win-2"]),
        "0000:02:00.1": (GPU_NODE, [GPU_NODE, "win-2"]),
    }
    assert sorted((f["code"], f["domain"]) for f in reply["findings"]) == [
        (wire.FINDING_CLAIMED_BY_UNMANAGED, "other-vm"),
        (wire.FINDING_NO_AGENT_CHANNEL, "win-2"),
        (wire.FINDING_ROM_BAR, GPU_NODE),
    ]
    # The same file read by the same agent here (Python 3.14, libvirt 12).
    assert comparable(reply) == comparable(status_here(tower))


def comparable(status: dict[str, Any]) -> dict[str, Any]:
    """A status without what depends on the tower's history (jobs, hook
    requests) or on where the node file lies."""
    left_out = ("uri", "virsh_calls", "hook_requests", "active_jobs")
    return {key: value for key, value in status.items() if key not in left_out}


def status_here(tower: Tower) -> dict[str, Any]:
    """The status of the tower's node file as the test root's agent sees it."""
    here = tower.box.shared / "here"
    here.mkdir(exist_ok=True)
    (here / "node.xml").write_text(node_file(), encoding="utf-8")
    config = json.loads((tower.box.root / CONFIG.lstrip("/")).read_text())
    config.update(
        libvirt_uri=f"test://{here / 'node.xml'}", state_dir=str(here / "state")
    )
    (here / "config.json").write_text(json.dumps(config), encoding="utf-8")
    done = subprocess.run(
        ["python3", "-S", str(AGENT), "--config", str(here / "config.json"), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return last_json(done)


# --- libvirtd's test driver: jobs and the session --------------------------------------


@pytest.fixture(scope="module")
def daemon_driver(tower: Tower) -> Tower:
    """libvirtd 7.0's test driver, its state held by a connection kept open
    (a transient service of the box's systemd running ``virsh event``)."""
    tower.box.run(
        [
            "systemd-run",
            f"--unit={KEEPER}",
            "--",
            "virsh",
            "-c",
            DAEMON_URI,
            "event",
            "--loop",
            "--all",
        ],
        check=True,
    )
    probe = (
        f"<domain type='test'><name>{PROBE}</name><memory>1024</memory>"
        "<os><type>hvm</type></os></domain>"
    )

    def held() -> bool:
        """A domain an earlier connection defined is still there: another
        connection (the keeper's) held the state in between."""
        if PROBE in tower.must_virsh(DAEMON_URI, "list", "--all", "--name").split():
            return True
        define(tower, DAEMON_URI, PROBE, probe)
        return False

    wait_until(held, timeout=30, what="the keeper to hold the test driver")
    return tower


def define(tower: Tower, uri: str, name: str, xml: str) -> None:
    tower.box.write(f"/root/{name}.xml", xml)
    tower.must_virsh(uri, "define", f"/root/{name}.xml")


def reset_test_driver(tower: Tower, running: tuple[str, ...]) -> None:
    """libvirtd's test driver holding only the tower's domains (as
    tests/tower/nodes.py defines them), those in ``running`` running."""
    for name in tower.must_virsh(DAEMON_URI, "list", "--all", "--name").split():
        tower.virsh(DAEMON_URI, "destroy", name)
        tower.must_virsh(DAEMON_URI, "undefine", name)
    for name, devices in nodes.domains().items():
        xml = nodes.domain_xml(name, devices, running=True, test_driver_file=False)
        define(tower, DAEMON_URI, name, xml)
        if name in running:
            tower.must_virsh(DAEMON_URI, "start", name)


def hostdevs(tower: Tower, name: str, *options: str) -> list[str]:
    xml = tower.must_virsh(DAEMON_URI, "dumpxml", name, *options)
    return [d["address"] for d in agent_virsh.parse_domain_xml(xml)["hostdevs"]]


def submit(tower: Tower, command: str) -> dict[str, Any]:
    """A job verb over SSH: its reply says the runner is a systemd unit."""
    reply = tower.ssh(command)
    assert reply["ok"] is True, (command, reply)
    job = reply["job"]
    assert job["runner"] == {"mode": "systemd", "unit": f"gpu-handoff-job-{job['id']}"}
    return reply


def run_job(tower: Tower, command: str) -> dict[str, Any]:
    """Submit over SSH, then wait for the job's final state."""
    return tower.wait_job(submit(tower, command)["job"]["id"])


def results(job: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    return [(s["name"], s["domain"], s["result"]) for s in job["steps"]]


def error_code(job: dict[str, Any]) -> str | None:
    return job["error"]["code"] if job["error"] else None


def test_every_job_kind_runs_detached_to_its_end(daemon_driver: Tower) -> None:
    """stop, start, handoff, lend and release (the agent's JOB_KINDS), each
    started by an SSH request as a unit of the SSH user's systemd manager,
    against libvirtd 7.0's test driver."""
    tower = daemon_driver
    assert set(wire.JOB_KINDS) == {"stop", "start", "handoff", "lend", "release"}
    tower.use(DAEMON_URI)
    reset_test_driver(tower, running=(GPU_NODE,))
    units = []

    def check(command: str, state: str, code: str | None) -> dict[str, Any]:
        job = run_job(tower, command)
        print(command, "->", job["state"], job["error"], results(job))
        assert (job["state"], error_code(job)) == (state, code), job
        units.append(f"gpu-handoff-job-{job['id']}")
        return job

    # A running guest whose agent never answers is never stopped.
    job = check(f"stop {GPU_NODE}", "failed", wire.ERR_AGENT_TIMEOUT)
    assert results(job)[0] == ("wait_agent", GPU_NODE, "failed")
    assert tower.state(DAEMON_URI, GPU_NODE) == "running"
    # A start waits for the cards the running GPU node holds, then gives up.
    job = check("start win-2", "failed", wire.ERR_DEVICES_BUSY)
    assert results(job)[0] == ("wait_devices_free", "win-2", "failed")
    assert tower.state(DAEMON_URI, "win-2") == "shut off"
    # The GPU node shut down (by the operator): a handoff starts win-1.
    tower.must_virsh(DAEMON_URI, "destroy", GPU_NODE)
    job = check("handoff win-1", "succeeded", None)
    assert [r for _, _, r in results(job)] == ["skipped"] * 3 + ["ok", "ok"]
    assert tower.state(DAEMON_URI, "win-1") == "running"
    # Lending starts the GPU node with the cards win-1 does not hold: a
    # live definition (virsh create), the persistent one unchanged.
    job = check("lend", "succeeded", None)
    assert job["steps"][-1]["detail"] == (
        "started without 0000:01:00 (live definition only)"
    ), job["steps"][-1]
    assert tower.state(DAEMON_URI, GPU_NODE) == "running"
    assert hostdevs(tower, GPU_NODE) == ["0000:02:00.0", "0000:02:00.1"]
    assert len(hostdevs(tower, GPU_NODE, "--inactive")) == 4
    # Releasing win-1 must stop it first: it has no guest agent here either.
    job = check("release win-1", "failed", wire.ERR_AGENT_TIMEOUT)
    assert tower.state(DAEMON_URI, "win-1") == "running"
    # Both shut down (by the operator): win-1's stop is done already, and the
    # release starts the GPU node with every card.
    for name in (GPU_NODE, "win-1"):
        tower.must_virsh(DAEMON_URI, "destroy", name)
    job = check("stop win-1", "succeeded", None)
    assert results(job)[0] == ("wait_agent", "win-1", "skipped")
    job = check("release", "succeeded", None)
    assert results(job) == [
        ("wait_devices_free", GPU_NODE, "ok"),
        ("start", GPU_NODE, "ok"),
    ]
    assert tower.state(DAEMON_URI, GPU_NODE) == "running"
    assert len(hostdevs(tower, GPU_NODE)) == 4
    # Each ran as a unit of the user's manager, which collected it after.
    assert set(units) <= set(user_units_started(tower.box))
    assert user_units_loaded(tower.box) == []


# The journal's message id of "a unit started" (systemd's catalog,
# SD_MESSAGE_UNIT_STARTED): the user manager logs it with the unit's name.
UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"


def user_units_started(box: Box) -> list[str]:
    """The job units the SSH user's manager started (its journal)."""
    uid = box.run(["id", "-u", USER], check=True).stdout.strip()
    box.run(["journalctl", "--sync"])
    said = box.run(
        [
            "journalctl",
            "--no-pager",
            "-o",
            "json",
            f"MESSAGE_ID={UNIT_STARTED}",
            f"_UID={uid}",
        ]
    ).stdout
    entries = [json.loads(line) for line in said.splitlines() if line.strip()]
    return sorted(
        entry["USER_UNIT"].removesuffix(".service")
        for entry in entries
        if entry.get("USER_UNIT", "").startswith("gpu-handoff-job-")
    )


def user_units_loaded(box: Box) -> list[str]:
    return [line.split()[0] for line in job_units(box).splitlines() if line.strip()]


class SshSession:
    """``session`` over SSH: JSON lines both ways; a thread reads replies."""

    def __init__(self, tower: Tower) -> None:
        self.proc = subprocess.Popen(
            client_argv(tower.key, tower.box.ssh_port, USER, "session"),
            env=ssh_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.lines: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            message: dict[str, Any] = json.loads(raw)
            assert message["protocol"] == wire.PROTOCOL
            self.queue.put(message)
        self.queue.put(None)

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def expect(
        self, match: Callable[[dict[str, Any]], object], timeout: float = 30
    ) -> dict[str, Any]:
        """The next message that matches; those before it stay in ``lines``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"nothing matched; got {self.lines}") from None
            if message is None:
                stderr = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"the session ended ({stderr}); got {self.lines}")
            self.lines.append(message)
            if match(message):
                return message

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=30)
        self.thread.join(timeout=10)
        return rc

    def kill(self) -> None:
        """End the session at once; the reader thread ends with its pipe
        (joined, so no thread outlives the test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=10)


def domain_of(status: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(d for d in status["domains"] if d["name"] == name)
    return found


def test_a_session_over_ssh_answers_and_pushes_what_libvirt_7_tells(
    daemon_driver: Tower,
) -> None:
    """hello and the status at once; a handoff asked in the session: its job
    pushed to its end, then the status with the gaming VM running and
    holding its card; the same request again is the same job; end of input
    ends the session. (libvirt's events: the next test.)"""
    tower = daemon_driver
    tower.use(DAEMON_URI)
    reset_test_driver(tower, running=())
    session = SshSession(tower)
    try:
        hello = session.expect(lambda m: True)
        assert (hello["type"], hello["ok"], hello["version"]) == (
            "hello",
            True,
            wire.VERSION,
        )
        assert hello["verbs"] == sorted(wire.SESSION_VERBS)
        first = session.expect(lambda m: True)
        assert first["type"] == "status"
        assert {d["state"] for d in first["status"]["domains"]} == {"shut_off"}
        request = {
            "id": 1,
            "verb": "handoff",
            "args": ["win-2"],
            "request_id": "ha-bullseye-0001",
        }
        session.send(request)
        reply = session.expect(lambda m: m["type"] == "reply" and m["id"] == 1)
        assert reply["ok"] is True, reply
        job_id = reply["job"]["id"]
        assert reply["job"]["runner"]["mode"] == "systemd"
        session.expect(
            lambda m: (
                m["type"] == "job"
                and m["job"]["id"] == job_id
                and m["job"]["state"] == "succeeded"
            )
        )
        final = session.expect(
            lambda m: (
                m["type"] == "status"
                and domain_of(m["status"], "win-2")["state"] == "running"
                and m["status"]["active_jobs"] == []
            )
        )
        held = {c["address"]: c["held_by"] for c in final["status"]["cards"]}
        assert held["0000:02:00.0"] == held["0000:02:00.1"] == "win-2"
        session.send({**request, "id": 2})
        again = session.expect(lambda m: m["type"] == "reply" and m["id"] == 2)
        assert (again["existing"], again["job"]["id"]) == (True, job_id)
        session.send({"id": 3, "verb": "status", "args": []})
        status = session.expect(lambda m: m["type"] == "reply" and m["id"] == 3)
        assert domain_of(status, "win-2")["state"] == "running"
        assert session.close() == 0
    finally:
        session.kill()


def test_a_session_pushes_libvirt_7_events_as_they_happen(daemon_driver: Tower) -> None:
    """Domains started and stopped by hand while a session is open: each
    change is an event of virsh's, which the session pushes at once. Tried
    for 6 s, a start and a stop each second (in case virsh connected after
    the first)."""
    tower = daemon_driver
    tower.use(DAEMON_URI)
    reset_test_driver(tower, running=())
    session = SshSession(tower)
    try:
        assert session.expect(lambda m: True)["type"] == "hello"
        deadline = time.monotonic() + 6
        while True:
            for verb in ("start", "destroy"):
                tower.must_virsh(DAEMON_URI, verb, "win-1")
            with contextlib.suppress(AssertionError):
                event = session.expect(lambda m: m["type"] == "event", timeout=1)
                break
            assert time.monotonic() < deadline, [m["type"] for m in session.lines]
        assert event["domain"] == "win-1"
        assert event["event"] == "lifecycle"
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", event["time"]), event
    finally:
        session.kill()


# --- libvirtd's QEMU driver: the hook and screenshots ------------------------------------


def qemu_domain(name: str, devices: str = "") -> str:
    """A tiny TCG domain: no disk, no network; SeaBIOS finds nothing to boot
    and shows so on its VGA screen, and the guest keeps running."""
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
{devices}    <video><model type='vga'/></video>
    <memballoon model='none'/>
  </devices>
</domain>
"""


@pytest.fixture(scope="module")
def qemu_tower(tower: Tower) -> Tower:
    """The tower's domains as QEMU domains: the GPU node and win-1 claim the
    same card (libvirt fooled into VFIO: an IOMMU group in a tmpfs over
    /sys/kernel/iommu_groups and /dev/vfio/vfio, in the box only), win-2
    has none and runs."""
    pretend_vfio(tower.box)
    define(tower, QEMU_URI, GPU_NODE, qemu_domain(GPU_NODE, HOSTDEV))
    define(tower, QEMU_URI, "win-1", qemu_domain("win-1", HOSTDEV))
    define(tower, QEMU_URI, "win-2", qemu_domain("win-2"))
    return tower


def hook_calls(tower: Tower) -> list[str]:
    path = tower.box.root / HOOK_CALLS.lstrip("/")
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def requests(tower: Tower) -> list[dict[str, Any]]:
    directory = tower.box.root / STATE_DIR.lstrip("/") / "requests"
    return [
        json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(directory.glob("*.json"))
    ]


def test_libvirtd_7_runs_the_installed_hook(qemu_tower: Tower) -> None:
    """A start of win-1 by hand while the GPU node claims its card: libvirtd
    runs the hook install put in qemu.d with the domain's XML on stdin; the
    agent records the request and submits the GPU node's stop, which ends
    (the GPU node is shut off: its steps are skipped). Every other call of
    the hook is answered by the script itself."""
    tower = qemu_tower
    tower.use(QEMU_URI)
    assert (tower.box.root / HOOK.lstrip("/")).is_file()
    status = tower.ssh("status")  # as Home Assistant does: the card claims
    assert status["ok"] is True, status
    assert [c["address"] for c in status["cards"]] == [CARD]
    before = len(requests(tower))
    calls = len(hook_calls(tower))
    started = tower.virsh(QEMU_URI, "start", "win-1")
    print("virsh start win-1:", started.returncode, started.stderr.strip())
    assert started.returncode != 0, "a start with a card that does not exist"
    assert tower.state(QEMU_URI, "win-1") == "shut off"
    assert hook_calls(tower)[calls : calls + 1] == ["win-1 prepare begin - domain-xml"]
    found = requests(tower)[before:]
    assert len(found) == 1, found
    request = found[0]
    assert (request["domain"], request["operation"], request["addresses"]) == (
        "win-1",
        "prepare begin",
        [CARD],
    )
    job = tower.wait_job(request["job"])
    assert (job["kind"], job["args"], job["requested_by"]) == (
        "stop",
        {"domain": GPU_NODE},
        "hook",
    )
    assert job["state"] == "succeeded", job
    assert [r for _, _, r in results(job)] == ["skipped"] * 3


def test_libvirtd_7_calls_hooks_at_every_start_and_stop(qemu_tower: Tower) -> None:
    """A guest without cards started and destroyed: libvirtd calls the hooks
    with its name, the operation, the sub-operation and "-", the domain's
    XML on stdin, five times; the agent's script answers each (a failing
    prepare would refuse the start) and records nothing."""
    tower = qemu_tower
    tower.use(QEMU_URI)
    before = len(requests(tower))
    calls = len(hook_calls(tower))
    tower.must_virsh(QEMU_URI, "start", "win-2")
    tower.must_virsh(QEMU_URI, "destroy", "win-2")
    wait_until(
        lambda: len(hook_calls(tower)) >= calls + 5,
        timeout=30,
        what="the stop's hooks",
    )
    assert hook_calls(tower)[calls:] == [
        f"win-2 {op} {sub} - domain-xml"
        for op, sub in (
            ("prepare", "begin"),
            ("start", "begin"),
            ("started", "begin"),
            ("stopped", "end"),
            ("release", "end"),
        )
    ]
    assert len(requests(tower)) == before


def test_a_ppm_screen_of_libvirt_7_arrives_as_a_png(qemu_tower: Tower) -> None:
    """libvirt 7.0 saves QEMU 5.2's screendump as it is, a PPM: the agent's
    reply over SSH is a PNG of the guest's size with exactly its pixels
    (the guest paused, so QEMU's text cursor cannot blink in between)."""
    tower = qemu_tower
    tower.use(QEMU_URI)
    box = tower.box
    tower.must_virsh(QEMU_URI, "start", "win-2")
    try:

        def screen() -> bytes | None:
            said = tower.must_virsh(QEMU_URI, "screenshot", "win-2", "/root/screen")
            assert said.strip().endswith("with type of image/x-portable-pixmap"), said
            data = (box.root / "root/screen").read_bytes()
            width, height, pixels = ppm_pixels(data)
            # SeaBIOS wrote on its text screen. Before the guest sets up its
            # display QEMU shows a 640x480 placeholder ("Guest has not
            # initialized the display (yet).") of more than one colour too.
            text = (width, height) == VGA_TEXT_SIZE
            return data if text and len(set(pixels)) > 1 else None

        wait_until(screen, timeout=60, what="SeaBIOS on the screen", interval=0.2)
        tower.must_virsh(QEMU_URI, "suspend", "win-2")
        frame = screen()
        assert frame is not None
        width, height, pixels = ppm_pixels(frame)
        assert (width, height) == VGA_TEXT_SIZE
        reply = tower.ssh("screenshot win-2")
        assert reply["ok"] is True, reply
        assert reply["mime"] == "image/png"
        data = base64.b64decode(reply["data"])
        assert reply["size"] == len(data)
        picture = decode(data)
        assert (picture.width, picture.height) == VGA_TEXT_SIZE
        assert picture.rgb == pixels
    finally:
        tower.virsh(QEMU_URI, "destroy", "win-2")
