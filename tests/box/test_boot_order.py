"""Boot order, and systemd stopping a job: a tower in a box powers off and
boots again (``box.reboot()``: systemd stops every unit in order, then the
box boots on the same disk, its /run and /tmp new).

1. What the install put on the tower is there after the boot as before: the
   state directory (its owner and mode), the configuration, the program, the
   hook; and a job that was running when the tower went down is reported as
   failed (runner_died), never as running: at shutdown the SSH user's
   systemd stops the job's unit with SIGTERM and the runner records that
   (``RunnerSignals``); a runner that could not (killed) is found dead by the
   next look at its job (``load_job``). No job unit runs after the boot.
2. The state directory removed, the boot makes it again, the SSH user's
   with mode 0700: the install's systemd-tmpfiles entry
   (/etc/tmpfiles.d/gpu-handoff.conf, ``d /var/lib/gpu-handoff 0700
   gpu-handoff gpu-handoff -``), which systemd-tmpfiles-setup.service applies
   at every boot.
3. ``systemctl --user stop`` of a running job's unit: the job is failed,
   runner_died, "stopped (SIGTERM)".

The jobs are handoffs of the simulated tower (tests/towersim) whose GPU node
takes an hour to shut down: the runner waits in its ``shutdown`` step (for
virsh: ``shutdown --mode agent`` returns once the guest is off, or after
libvirt's 60 s) or, after that, in ``wait_shut_off``.
"""

from __future__ import annotations

import hashlib
import json
import stat
import time
from typing import Any

from custom_components.gpu_handoff.tower.gpu_handoff import (
    install as agent_install,
    runner as agent_runner,
    wire,
)
from tests.box.conftest import CONFIG, PROGRAM, USER, BoxAgent, user_systemctl
from tests.support.box import Box
from tests.support.waiting import wait_until

STATE_DIR = "/var/lib/gpu-handoff"
TMPFILES = "/etc/tmpfiles.d/gpu-handoff.conf"
TMPFILES_LINE = f"d {STATE_DIR} 0700 {USER} {USER} -"
STOPPED_BY_SIGTERM = (
    "the job's runner was stopped (SIGTERM) before the job finished: "
    + agent_runner.RUNNER_STOP_SIGNALS[15]
)
GONE = "the job's runner is gone before the job finished"
ACTIVE_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")


def installed_files(box: Box) -> dict[str, tuple[int, int, int, str]]:
    """Owner, group, mode and a digest of what the install put on the tower
    (the state directory: no digest)."""
    hook = agent_install.HOOK_PATH
    out = {}
    for path in (STATE_DIR, CONFIG, PROGRAM, hook):
        where = box.root / path.lstrip("/")
        info = where.stat()
        digest = (
            ""
            if where.is_dir()
            else hashlib.sha256(where.read_bytes()).hexdigest()[:16]
        )
        out[path] = (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode), digest)
    return out


def account(box: Box) -> tuple[int, int]:
    """The SSH user's uid and gid in the box."""
    uid = box.run(["id", "-u", USER], check=True).stdout.strip()
    gid = box.run(["id", "-g", USER], check=True).stdout.strip()
    return int(uid), int(gid)


def systemctl_user(box: Box, *args: str) -> str:
    """``systemctl --user ARGS`` of the SSH user's manager (conftest's
    user_systemctl); its output."""
    done = box.run([*user_systemctl(box), *args])
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def job_units(box: Box) -> dict[str, str]:
    """The SSH user's job units its systemd knows: unit -> active state."""
    out = systemctl_user(
        box, "list-units", "--all", "--plain", "--no-legend", "gpu-handoff-job-*"
    )
    return {
        line.split()[0]: line.split()[2] for line in out.splitlines() if line.strip()
    }


def stored_job(box: Box, job_id: str) -> dict[str, Any]:
    """The job's record as the runner (or nobody) left it, read from outside."""
    path = box.root / STATE_DIR.lstrip("/") / "jobs" / f"{job_id}.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def step_name(job: dict[str, Any]) -> str | None:
    """The name of the step under way (the record keeps its index)."""
    index = job["step"]
    return job["steps"][index]["name"] if isinstance(index, int) else None


def long_handoff(box_agent: BoxAgent) -> tuple[str, str]:
    """A handoff whose runner waits for the GPU node to shut down (an hour,
    simulated at full speed): its job id and its unit, once it waits."""
    box_agent.tower.set_shutdown_duration("gpu-node", 3600)
    reply = box_agent.ssh("handoff gaming-1")
    assert reply["ok"], reply
    job_id = reply["job"]["id"]
    assert reply["job"]["runner"]["mode"] == "systemd", reply["job"]
    unit = reply["job"]["runner"]["unit"] + ".service"

    def waiting() -> dict[str, Any] | None:
        job = box_agent.job(job_id)
        if job["state"] not in ("queued", "running"):
            raise AssertionError(f"the handoff ended: {job}")
        return job if step_name(job) in ("shutdown", "wait_shut_off") else None

    job = wait_until(
        waiting,
        timeout=60,
        what="the handoff waiting for the GPU node to shut down",
    )
    assert job["state"] == "running", job
    print("steps:", [(step["name"], step["result"]) for step in job["steps"]])
    assert job_units(box_agent.box).get(unit) == "active"
    return job_id, unit


def test_a_reboot_keeps_the_install_and_fails_the_running_job(
    box_agent: BoxAgent,
) -> None:
    box = box_agent.box
    before = installed_files(box)
    uid, gid = account(box)
    assert before[STATE_DIR][:3] == (uid, gid, 0o700)
    job_id, unit = long_handoff(box_agent)

    started = time.monotonic()
    box.reboot()
    print(f"reboot took {time.monotonic() - started:.1f} s")

    # As the runner (or nobody) left it at shutdown, before anyone looked.
    stored = stored_job(box, job_id)
    print("stored after the boot:", stored["state"], stored["error"])
    assert installed_files(box) == before
    job = box_agent.job(job_id)
    print("reported:", job["state"], job["error"])
    assert job["state"] == "failed"
    assert job["error"]["code"] == wire.ERR_RUNNER_DIED
    assert job["error"]["message"] in (STOPPED_BY_SIGTERM, GONE)
    # What the runner wrote itself at shutdown (the unit stopped with
    # SIGTERM by the SSH user's systemd), not found out afterwards.
    assert stored["state"] == "failed", stored
    assert stored["error"]["message"] == STOPPED_BY_SIGTERM
    running = {u: s for u, s in job_units(box).items() if s in ACTIVE_STATES}
    assert running == {}, running
    assert unit not in job_units(box)
    # The agent lists no job as under way. (Not `status`: it pings the GPU
    # node's guest agent, whose job libvirt holds for the agent shutdown the
    # killed virsh asked for (qemuDomainShutdownFlagsAgent; the simulator
    # models it): some 10 s here.)
    jobs = box_agent.ssh("jobs")
    assert jobs["ok"], jobs
    assert [(j["id"], j["state"]) for j in jobs["jobs"]] == [(job_id, "failed")]


def test_the_boot_makes_the_state_directory_again(box_agent: BoxAgent) -> None:
    """Needs the install's systemd-tmpfiles entry (see the module)."""
    box = box_agent.box
    entry = box.root / TMPFILES.lstrip("/")
    assert entry.is_file(), (
        f"the install wrote no {TMPFILES}: the state directory is not made at boot"
    )
    lines = [
        line.split()
        for line in entry.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == [TMPFILES_LINE.split()], lines
    uid, gid = account(box)
    box.run(["rm", "-rf", STATE_DIR], check=True)
    assert not (box.root / STATE_DIR.lstrip("/")).exists()
    box.reboot()
    state = box.root / STATE_DIR.lstrip("/")  # the new PID 1's view
    info = state.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (uid, gid, 0o700)
    tmpfiles = box.systemctl("is-active", "systemd-tmpfiles-setup.service")
    assert tmpfiles.stdout.strip() == "active"
    # And the agent works in it.
    status = box_agent.ssh("status")
    assert status["ok"], status
    assert (state / "jobs").is_dir() or (state / "claims.json").exists()


def test_a_stopped_unit_fails_its_job(box_agent: BoxAgent) -> None:
    """``systemctl --user stop`` of the job's unit, as the SSH user's systemd
    does it: SIGTERM to every process of the unit (the runner and the
    simulator's virsh it may be waiting for)."""
    box = box_agent.box
    job_id, unit = long_handoff(box_agent)
    started = time.monotonic()
    systemctl_user(box, "stop", unit)
    print(f"systemctl --user stop took {time.monotonic() - started:.2f} s")
    stored = stored_job(box, job_id)
    assert stored["state"] == "failed", stored
    assert stored["error"] == {
        "code": wire.ERR_RUNNER_DIED,
        "message": STOPPED_BY_SIGTERM,
    }
    job = box_agent.job(job_id)
    assert (job["state"], job["error"]) == ("failed", stored["error"])
    # The step under way left as begun (a shutdown of the GPU node asked for
    # and not answered yet, or the wait for it to be off).
    step = stored["steps"][stored["step"]]
    assert step["name"] in ("shutdown", "wait_shut_off"), step
    assert step["started"]
    assert (step["result"], step["finished"]) == (None, None)
    assert unit not in job_units(box)  # ended cleanly: collected, not failed
    journal = box.run(
        ["journalctl", "--no-pager", "-o", "cat", f"_UID={account(box)[0]}"]
    ).stdout
    assert f"gpu-handoff: job {job_id}: {STOPPED_BY_SIGTERM}" in journal
    # Nothing more happened to the tower: the GPU node still shuts down, the
    # gaming VM was never started.
    assert box_agent.tower.domstate("gaming-1").startswith("shut off")
