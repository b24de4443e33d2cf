"""Detached jobs under a real systemd (the box): the agent's ``systemd-run``.

The agent, logged in as its SSH user, starts each job's runner with
``systemd-run --user --collect --unit=gpu-handoff-job-ID`` in that user's
systemd manager (the manager logind starts for the user), so the job
outlives the SSH request that asked for it. Here that is the root's own
systemd 262, sshd and logind: what the agent sees on a Debian tower.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import json
import re
import time
from typing import Any

from tests.box.conftest import (
    CONFIG,
    PROGRAM,
    USER,
    BoxAgent,
    install_agent,
    job_units,
    user_systemctl,
)
from tests.support.agentbuild import AGENT, REPO, agent_variant_bytes
from tests.support.box import REPOSITORY, Box
from tests.support.waiting import wait_until
from tests.towersim import Tower
from tests.towersim.tower import realistic_domains

# The agent's program as the box sees it (the repository is at /src there).
AGENT_IN_BOX = f"{REPOSITORY}/{AGENT.relative_to(REPO).as_posix()}"
UNIT = re.compile(r"^gpu-handoff-job-(?P<id>[0-9]{8}-[0-9]{6}-[0-9]{6}-[0-9a-f]{6})$")


def job_inside(agent: BoxAgent, job_id: str) -> dict[str, Any]:
    """The job as the agent reports it, asked inside the box without an SSH
    login (no logind session: it keeps nothing of the user's alive)."""
    done = agent.box.run([PROGRAM, "--config", CONFIG, "job", job_id], user=USER)
    job: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])["job"]
    return job


def user_units(agent: BoxAgent) -> str:
    """Every job unit the SSH user's manager has loaded, with its state."""
    return job_units(agent.box)


def sessions(box: Box) -> list[str]:
    """logind's sessions of the SSH user (the user manager's own excluded)."""
    listed = box.run(["loginctl", "list-sessions", "--no-legend", "-j"]).stdout
    return [
        s["session"]
        for s in json.loads(listed or "[]")
        if s["user"] == USER and s.get("class") != "manager"
    ]


def slow_tower(box: Box, shutdown: float) -> Tower:
    """A realistic tower whose GPU node takes ``shutdown`` s to stop."""
    return Tower.create(
        box.shared / "tower", realistic_domains(shutdown_duration=shutdown)
    )


def test_a_job_outlives_the_ssh_session_that_asked_for_it(box: Box) -> None:
    """The request's SSH session ends at once; logind stops its scope, and a
    user manager nothing holds stops UserStopDelaySec (10 s) later. A handoff
    whose GPU node takes 16 s to stop still finishes: the install made the
    SSH user linger, so its manager (and the job's unit in it) stays."""
    tower = slow_tower(box, shutdown=16)
    agent = BoxAgent(box=box, tower=tower, key=box.directory / "hass_key")
    install_agent(box, tower, agent.key)
    linger = box.run(["loginctl", "show-user", USER, "-p", "Linger", "--value"])
    assert linger.stdout.strip() == "yes"

    submitted = agent.ssh("handoff gaming-1")
    job_id = submitted["job"]["id"]
    unit = submitted["job"]["runner"]["unit"]
    assert submitted["job"]["runner"]["mode"] == "systemd"
    named = UNIT.match(unit)
    assert named is not None
    assert named["id"] == job_id
    wait_until(lambda: not sessions(box), timeout=10, what="the SSH session to end")
    # Past UserStopDelaySec with no session: the unit still runs.
    time.sleep(11)
    assert f"{unit}.service loaded active running" in " ".join(
        user_units(agent).split()
    )
    assert job_inside(agent, job_id)["state"] == "running"
    finished = wait_until(
        lambda: (job := job_inside(agent, job_id))["state"] != "running" and job,
        timeout=30,
        what="the handoff to finish",
        interval=0.2,
    )
    assert finished["state"] == "succeeded", finished
    assert tower.is_running("gaming-1")


def started_units(box: Box) -> list[str]:
    """The job units the SSH user's manager started, in order (its journal)."""
    uid = box.run(["id", "-u", USER], check=True).stdout.strip()
    said = box.run(
        ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_UNIT=user@{uid}.service"]
    ).stdout
    return re.findall(r"^Started (gpu-handoff-job-[0-9a-f-]+)\.service", said, re.M)


def test_jobs_submitted_at_once_each_get_a_unit_of_their_own(
    box_agent: BoxAgent,
) -> None:
    """Three requests at the same moment, from three SSH sessions: three job
    ids, three units, each started once; all collected when they end."""
    commands = ["stop gaming-1", "stop gaming-2", "release gaming-1"]
    with ThreadPoolExecutor(len(commands)) as pool:
        replies = list(pool.map(box_agent.ssh, commands))
    assert all(reply["ok"] for reply in replies), replies
    units = [reply["job"]["runner"]["unit"] for reply in replies]
    assert len(set(units)) == len(units)
    for reply in replies:
        box_agent.wait_job(reply["job"]["id"])
    assert sorted(started_units(box_agent.box)) == sorted(units)
    assert box_agent.units() == []  # --collect: nothing stays loaded


def test_a_retry_under_the_same_request_id_starts_no_second_unit(
    box_agent: BoxAgent,
) -> None:
    """Home Assistant sends a request again under its request id when the
    reply was lost: the same job answers, and systemd starts nothing new."""
    first = box_agent.ssh("handoff gaming-1 --request=ha-retry-0001")
    again = box_agent.ssh("handoff gaming-1 --request=ha-retry-0001")
    assert again["existing"] is True
    assert again["job"]["id"] == first["job"]["id"]
    assert box_agent.wait_job(first["job"]["id"])["state"] == "succeeded"
    after = box_agent.ssh("handoff gaming-1 --request=ha-retry-0001")
    assert after["job"]["id"] == first["job"]["id"]
    assert started_units(box_agent.box) == [first["job"]["runner"]["unit"]]


def test_a_job_after_an_agent_update_gets_a_new_unit(box_agent: BoxAgent) -> None:
    """The agent replaced under a running job (``update``, as the repair does
    it): the running job's unit goes on, the next job gets a unit of its own."""
    box_agent.tower.set_shutdown_duration("gpu-node", 3)
    first = box_agent.ssh("handoff gaming-1")
    box_agent.box.run(["python3", AGENT_IN_BOX, "update"], check=True)
    second = box_agent.ssh("stop gaming-2")
    assert box_agent.wait_job(first["job"]["id"])["state"] == "succeeded"
    assert box_agent.wait_job(second["job"]["id"])["state"] == "succeeded"
    units = [first["job"]["runner"]["unit"], second["job"]["runner"]["unit"]]
    assert units[0] != units[1]
    assert sorted(started_units(box_agent.box)) == sorted(units)


def test_a_runner_killed_leaves_no_failed_unit_and_a_failed_job(
    box_agent: BoxAgent,
) -> None:
    """SIGKILL to a runner (the OOM killer, an administrator): systemd marks
    the unit failed and, as it was started with --collect, unloads it at
    once; the job is reported failed (runner_died), never left running."""
    box_agent.tower.set_shutdown_duration("gpu-node", 30)
    submitted = box_agent.ssh("handoff gaming-1")
    unit = submitted["job"]["runner"]["unit"]
    wait_until(
        lambda: box_agent.job(submitted["job"]["id"])["state"] == "running",
        timeout=10,
        what="the job to run",
    )
    box_agent.box.run(
        [*user_systemctl(box_agent.box), "kill", "--signal=SIGKILL", unit],
        check=True,
    )
    uid = box_agent.box.run(["id", "-u", USER], check=True).stdout.strip()
    wait_until(
        lambda: (
            f"{unit}.service: Failed with result 'signal'"
            in box_agent.box.journal(f"user@{uid}.service")
        ),
        timeout=10,
        what="systemd to see the runner killed",
    )
    assert box_agent.units() == []
    job = box_agent.job(submitted["job"]["id"])
    assert job["state"] == "failed"
    assert job["error"]["code"] == "runner_died"


def test_the_seeds_fixed_unit_name_fails_for_real(box_agent: BoxAgent) -> None:
    """The seed named every job's unit alike. Put back, real systemd refuses
    the second job while the first runs, with its own words; the product's
    names (the job's id in the unit's) start both."""
    box = box_agent.box
    program = box.root / PROGRAM.lstrip("/")
    installed = program.read_bytes()
    seeds = agent_variant_bytes(
        replace=[('unit = f"gpu-handoff-job-{job_id}"', 'unit = "gpu-handoff-job"')]
    )
    config = box.root / CONFIG.lstrip("/")
    data = json.loads(config.read_text(encoding="utf-8"))
    data["detach"] = "systemd"  # as configured; "auto" would fall back
    config.write_text(json.dumps(data), encoding="utf-8")
    box_agent.tower.set_shutdown_duration("gpu-node", 5)
    box_agent.tower.set_agent_delay("gaming-1", 0.5)

    program.write_bytes(seeds)
    first = box_agent.ssh("handoff gaming-1")
    second = box_agent.ssh("stop gaming-2")
    assert box_agent.job(first["job"]["id"])["state"] in ("queued", "running")
    assert first["job"]["runner"]["unit"] == "gpu-handoff-job"
    assert second["ok"] is False
    assert second["error"]["code"] == "spawn_failed"
    assert (
        "Unit gpu-handoff-job.service was already loaded or has a fragment file"
        in second["error"]["message"]
    )
    box_agent.wait_job(first["job"]["id"])

    program.write_bytes(installed)
    box_agent.tower.set_shutdown_duration("gaming-1", 3)
    first = box_agent.ssh("stop gaming-1")
    second = box_agent.ssh("stop gaming-2")
    assert box_agent.job(first["job"]["id"])["state"] in ("queued", "running")
    assert second["ok"] is True, second
    for reply in (first, second):
        assert box_agent.wait_job(reply["job"]["id"])["state"] == "succeeded"


def test_without_a_user_manager_systemd_run_fails_and_auto_falls_back(
    box_agent: BoxAgent,
) -> None:
    """A user that does not linger and has no session has no systemd
    manager: the real ``systemd-run --user`` cannot reach one. With detach
    "systemd" the request fails with systemd-run's own words; with "auto"
    (the default) the agent does not even try it and runs the job as a
    plain detached process, which finishes."""
    box = box_agent.box
    uid = box.run(["id", "-u", USER], check=True).stdout.strip()
    # The install's enable-linger returns before logind has started the
    # manager. Turned off while that start is under way, lingering ends and
    # logind forgets the user, but the manager comes up and stays (seen
    # here: still active 15 s later). A tower's user turns it off later.
    wait_until(
        lambda: (
            box.systemctl("is-active", f"user@{uid}.service").stdout.strip() == "active"
        ),
        timeout=30,
        what="the user's manager that lingering started",
    )
    box.run(["loginctl", "disable-linger", USER], check=True)
    wait_until(
        lambda: box.run(["test", "-e", f"/run/user/{uid}"]).returncode == 1,
        timeout=30,
        what="the user's manager to stop",
    )
    config = box.root / CONFIG.lstrip("/")
    data = json.loads(config.read_text(encoding="utf-8"))

    def ask(detach: str, command: str) -> dict[str, Any]:
        config.write_text(json.dumps({**data, "detach": detach}), encoding="utf-8")
        done = box.run([PROGRAM, "--config", CONFIG, *command.split()], user=USER)
        reply: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return reply

    refused = ask("systemd", "stop gaming-1")
    assert refused["error"]["code"] == "spawn_failed"
    assert refused["error"]["message"].startswith("systemd-run failed (1): ")
    assert "bus" in refused["error"]["message"]  # systemd-run's own words
    fallback = ask("auto", "stop gaming-2")
    assert fallback["job"]["runner"]["mode"] == "process"
    assert job_inside(box_agent, fallback["job"]["id"])["state"] in (
        "queued",
        "running",
        "succeeded",
    )
    finished = wait_until(
        lambda: (
            (job := job_inside(box_agent, fallback["job"]["id"]))["state"]
            not in ("queued", "running")
            and job
        ),
        timeout=30,
        what="the job to finish",
        interval=0.1,
    )
    assert finished["state"] == "succeeded"
