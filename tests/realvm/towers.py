"""An agent configuration ("tower") against the private libvirtd, and running
the agent's verbs and waiting for its jobs: shared by the real-VM tests.

The agent runs virsh through a wrapper that logs every invocation with its
time, so the tests see exactly which commands reached libvirt and when; the
wrapper also shows the agent the stand-in cards of a domain's metadata as PCI
hostdevs (see cards.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import datetime as dt
import json
import os
from pathlib import Path
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from tests.realvm.qemu_libvirtd import CARDS_FILTER
from tests.support.agentbuild import AGENT
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from tests.realvm.qemu_libvirtd import QemuLibvirtd

JOB_TIMEOUT = 240.0

VIRSH_WRAPPER = """#!/bin/sh
printf '%s %s\\n' "$(date +%s.%N)" "$*" >>{log}
exec {python} {cards} virsh "$@"
"""


@dataclass
class Tower:
    config: Path
    virsh_log: Path
    env: dict[str, str]
    state_dir: Path

    def agent(self, *args: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, str(AGENT), "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
            check=False,
        )
        try:
            reply: dict[str, Any] = json.loads(proc.stdout)
        except ValueError:
            pytest.fail(f"agent said {proc.stdout!r} / {proc.stderr!r}")
        return reply

    def invocations(self) -> list[tuple[float, str]]:
        if not self.virsh_log.exists():
            return []
        out = []
        for line in self.virsh_log.read_text().splitlines():
            stamp, _, args = line.partition(" ")
            out.append((float(stamp), args))
        return out


def make_tower(
    daemon: QemuLibvirtd,
    name: str,
    gpu_node: str,
    timeouts: dict[str, float],
    *,
    gaming: list[str] | None = None,
    poll_interval: float = 0.5,
) -> Tower:
    base = daemon.data_dir / f"tower-{name}"
    base.mkdir()
    log = base / "virsh.log"
    wrapper = base / "virsh"
    wrapper.write_text(
        VIRSH_WRAPPER.format(
            log=shlex.quote(str(log)),
            python=shlex.quote(sys.executable),
            cards=shlex.quote(str(CARDS_FILTER)),
        )
    )
    wrapper.chmod(0o755)
    config = base / "config.json"
    state_dir = base / "state"
    config.write_text(
        json.dumps(
            {
                "libvirt_uri": daemon.uri,
                "gpu_node": gpu_node,
                "gaming": gaming or [f"{name}-game"],
                "timeouts": timeouts,
                "state_dir": str(state_dir),
                "commands": {"virsh": str(wrapper)},
                "detach": "process",
                "poll_interval": poll_interval,
            }
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(base),
        "LANG": "C.UTF-8",
    }
    return Tower(config=config, virsh_log=log, env=env, state_dir=state_dir)


def wait_job(tower: Tower, job_id: str, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        reply = tower.agent("job", job_id)
        assert reply["ok"], reply
        job: dict[str, Any] = reply["job"]
        return job if job["state"] in ("succeeded", "failed") else None

    job = wait_until(finished, timeout=timeout, interval=0.5, what=f"job {job_id}")
    pid = (job.get("runner") or {}).get("pid")
    if pid:
        # The detached runner may have become our child (when this process is
        # its namespace's init): reap it.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return job


def iso_epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
