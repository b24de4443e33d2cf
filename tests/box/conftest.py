"""Fixtures of the box tests: a booted box, and the agent installed in one.

``box`` is a fresh box per test (it boots in about half a second).
``box_agent`` is a box with the agent installed as a tower's administrator
installs it (``sudo python3 gpu-handoff install --create-user ...``, run
as root inside), reached by Home Assistant's key through the box's own sshd
(``ssh.service``), with its jobs detached by the box's own ``systemd-run``.
Its libvirt is the tower simulator (tests/towersim) in the box's shared
directory: the box makes systemd, sshd and logind real; the domains' timing
is the simulator's, which a test sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
import json
from pathlib import Path
import subprocess
import time
from typing import Any

import pytest

from tests.support.box import Box, require_box
from tests.support.sshd import client_argv, generate_key, ssh_environment
from tests.support.testdriver import AGENT
from tests.towersim import Tower
from tests.towersim.tower import realistic_domains

USER = "gpu-handoff"
CONFIG = "/etc/gpu-handoff/config.json"
PROGRAM = "/usr/local/bin/gpu-handoff"


@pytest.fixture(autouse=True)
def auto_enable_custom_integrations() -> None:
    """The box tests need no Home Assistant instance."""
    return


@pytest.fixture
def box(tmp_path: Path, socket_enabled: None) -> Iterator[Box]:
    """A booted box, powered off and checked for leftovers afterwards."""
    require_box()
    with Box(tmp_path / "box") as booted:
        yield booted


def python3_in(box: Box) -> None:
    """``/usr/bin/python3``, as Debian's python3 package makes it (the root
    has only python3.14)."""
    link = box.root / "usr/bin/python3"
    if not link.exists():
        link.symlink_to("python3.14")


@dataclass
class BoxAgent:
    """The agent installed in ``box`` for ``tower`` (see the module)."""

    box: Box
    tower: Tower
    key: Path

    def ssh(self, command: str, timeout: float = 60) -> dict[str, Any]:
        """One request over SSH (the forced command answers); its JSON reply."""
        done = subprocess.run(
            client_argv(self.key, self.box.ssh_port, USER, command),
            env=ssh_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if not lines:
            raise AssertionError(
                f"no reply to {command!r} (rc {done.returncode}): {done.stderr}"
            )
        reply: dict[str, Any] = json.loads(lines[-1])
        return reply

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self.ssh(f"job {job_id}")["job"]
        return job

    def wait_job(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["state"] in ("succeeded", "failed"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']}")
            time.sleep(0.1)

    def units(self, pattern: str = "gpu-handoff-job-*") -> list[str]:
        """The job units the SSH user's systemd knows (any state)."""
        done = self.box.run(
            [
                *user_systemctl(self.box),
                "list-units",
                "--all",
                "--plain",
                "--no-legend",
                pattern,
            ],
            check=True,
        )
        return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def user_systemctl(box: Box) -> list[str]:
    """``systemctl --user`` of the SSH user's manager, run as that user with
    the bus its manager listens on (no login session needed, none made)."""
    uid = box.run(["id", "-u", USER], check=True).stdout.strip()
    return [
        "/usr/sbin/runuser",
        "-u",
        USER,
        "--",
        "env",
        f"XDG_RUNTIME_DIR=/run/user/{uid}",
        "systemctl",
        "--user",
    ]


def job_units(box: Box) -> str:
    """Every job unit the SSH user's manager has loaded, with its state."""
    return box.run(
        [
            *user_systemctl(box),
            "list-units",
            "--all",
            "--plain",
            "--no-legend",
            "gpu-handoff-job-*",
        ],
        check=True,
    ).stdout


def pretend_vfio(box: Box) -> None:
    """What libvirt takes for a host with VFIO: an IOMMU group in
    /sys/kernel/iommu_groups (a tmpfs mounted over it, in the box only) and
    /dev/vfio/vfio (tests/box/test_libvirtd_restart.py says what follows)."""
    box.run(
        [
            "sh",
            "-ec",
            (
                "mkdir -p /dev/vfio && touch /dev/vfio/vfio && "
                "mount -t tmpfs -o mode=0755 iommu-groups /sys/kernel/iommu_groups && "
                "mkdir /sys/kernel/iommu_groups/0"
            ),
        ],
        check=True,
    )


def run_install(box: Box, *options: str) -> dict[str, Any]:
    """The agent's install run as root in the box, as the guided install runs
    it (``sudo python3 gpu-handoff install``), making the SSH user; its
    JSON reply, which must say ok."""
    python3_in(box)
    done = box.run(
        ["python3", str(AGENT), "install", "--user", USER, "--create-user", *options],
        timeout=180,
    )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert lines, done.stderr
    reply: dict[str, Any] = json.loads(lines[-1])
    assert reply["ok"] is True, reply
    return reply


def install_agent(box: Box, tower: Tower, key: Path, *extra: str) -> None:
    """Install the agent in ``box`` as root, as the guided install does it,
    then point it at ``tower``'s virsh (the one thing a real tower would not
    need)."""
    public = generate_key(key)
    run_install(
        box,
        "--gpu-node",
        "gpu-node",
        "--gaming",
        "gaming-1",
        "--gaming",
        "gaming-2",
        "--authorize-key",
        public,
        *extra,
    )
    config_path = box.root / CONFIG.lstrip("/")
    data = json.loads(config_path.read_text(encoding="utf-8"))
    data["commands"] = {"virsh": str(tower.virsh)}
    data["sysfs"] = str(tower.sysfs)
    data["poll_interval"] = 0.05
    config_path.write_text(json.dumps(data), encoding="utf-8")
    tower.set_hook([PROGRAM, "--config", CONFIG, "hook"])
    # The simulator's state is the SSH user's to change (its virsh runs as
    # that user; libvirt's socket would be the libvirt group's).
    box.run(["chown", "-R", f"{USER}:", str(tower.root)], check=True)


@pytest.fixture
def box_agent(box: Box) -> BoxAgent:
    """The agent installed in a box, over a realistic simulated tower whose
    GPU node stops in a second (a test sets it slower where it matters)."""
    tower = Tower.create(box.shared / "tower", realistic_domains(shutdown_duration=1))
    key = box.directory / "hass_key"
    install_agent(box, tower, key)
    return BoxAgent(box=box, tower=tower, key=key)
