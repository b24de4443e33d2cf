"""The agent's trust boundaries, attacked with the real privilege split.

The SSH user (Home Assistant's key, forced to `serve` by the real sshd) is not
root and owns the state directory; the libvirt hook runs as root, in a process
of its own, as libvirtd runs it; what the SSH user does on its own is done as
that user. Each test is an attack that worked before the agent was hardened
(issue 11): root following the SSH user's links (1), state nobody checked (2),
floods (4), streams that outlive or hang on their client (5), leaks (7).
"""

from __future__ import annotations

from collections.abc import Iterator
import json
import os
from pathlib import Path
import signal
import stat
import subprocess
import sys
import time
from typing import Any

import pytest

from custom_components.gpu_handoff.tower.gpu_handoff import (
    config as agent_config,
    jobs as agent_jobs,
    state as agent_state,
    status as agent_status,
    wire,
)
from tests.support.account import user_env
from tests.support.agentbuild import AGENT, SOURCE
from tests.support.waiting import wait_until
from tests.tower import nodes
from tests.tower.conftest import FakeTower
from tests.tower.split import (
    SplitTower,
    alive,
    children,
    cmdline,
    split_tower,
)

pytestmark = pytest.mark.system

RID = "ha-trust-0001"


@pytest.fixture
def split(socket_enabled: None) -> Iterator[SplitTower]:
    """The privilege split around the stand-in virsh (sshd needs sockets)."""
    with split_tower() as tower:
        yield tower


def victim_dir(split: SplitTower) -> Path:
    """A directory of root's that the SSH user may read but not write."""
    victim = split.base / "victim"
    victim.mkdir(mode=0o755)
    return victim


def plant_link(split: SplitTower, target: Path, link: Path) -> None:
    """The SSH user replaces `link` (in its own state directory) by a link."""
    split.as_user(
        "import os, shutil, sys\n"
        "target, link = sys.argv[1:]\n"
        "if os.path.isdir(link) and not os.path.islink(link):\n"
        "    shutil.rmtree(link)\n"
        "elif os.path.lexists(link):\n"
        "    os.unlink(link)\n"
        "os.symlink(target, link)\n",
        str(target),
        str(link),
    )


def status_as_user(split: SplitTower) -> dict[str, Any]:
    """`status` through sshd: it writes the claims cache the hook reads."""
    reply: dict[str, Any] = split.ssh("status")
    assert reply["ok"], reply
    return reply


# --- 1. root never acts on what the SSH user controls ----------------------------


def test_the_hook_as_root_acts_as_the_state_directorys_owner(
    split: SplitTower,
) -> None:
    """Everything the hook and its runner do in the state directory, they do
    as its owner: its files, 0600, and virsh run as that user."""
    split.start_sshd()
    status_as_user(split)
    hook = split.hook("win-1", "prepare", "begin", "-")
    assert (hook.returncode, hook.stdout, hook.stderr) == (0, "", "")
    split.wait_idle()
    (job,) = split.job_records()
    assert (job["requested_by"], job["state"]) == ("hook", "succeeded"), job
    assert split.virsh_uids() == {split.account.pw_uid}  # the runner was not root
    written = [split.state_dir, *split.state_dir.rglob("*")]
    assert {p.relative_to(split.state_dir).parts[:1] for p in written} >= {
        ("jobs",),
        ("requests",),
        ("claims.json",),
    }
    for path in written:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (
            split.account.pw_uid,
            split.account.pw_gid,
        ), path
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0, (path, oct(st.st_mode))


def test_the_hook_never_prunes_through_a_planted_requests_link(
    split: SplitTower,
) -> None:
    """`requests` made a link to a directory of root's: root deleted its files."""
    split.start_sshd()
    status_as_user(split)
    victim = victim_dir(split)
    names = [
        f"2099010{i % 9 + 1}-000000-00000{i % 10}-abcdef-x{i}.json" for i in range(25)
    ]
    for name in [*names, "precious.conf"]:
        (victim / name).write_text("root's\n", encoding="utf-8")
    plant_link(split, victim, split.state_dir / "requests")
    hook = split.hook("win-1", "prepare", "begin", "-")
    assert (hook.returncode, hook.stdout) == (0, "")
    assert "not a directory" in hook.stderr
    split.wait_idle()
    assert sorted(p.name for p in victim.iterdir()) == sorted([*names, "precious.conf"])
    assert all(p.stat().st_uid == 0 for p in victim.iterdir())


def test_root_never_makes_a_file_through_a_planted_lock_link(
    split: SplitTower,
) -> None:
    """A dangling `tower.lock` link made root create (and chown to the SSH user)
    a file in a directory of root's: a way to root through /etc/ld.so.preload."""
    split.start_sshd()
    status_as_user(split)
    preload = victim_dir(split) / "ld.so.preload"
    plant_link(split, preload, split.state_dir / "tower.lock")
    hook = split.hook("win-1", "prepare", "begin", "-")
    assert (hook.returncode, hook.stdout) == (0, "")
    split.wait_idle()
    assert not preload.exists()
    (job,) = split.job_records()
    assert job["state"] == "failed"
    assert job["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE
    assert "tower.lock" in job["error"]["message"]


def _queued_record(job_id: str) -> dict[str, Any]:
    return {
        "id": job_id,
        "kind": "stop",
        "args": {"domain": "win-1"},
        "state": "queued",
        "step": None,
        "steps": [],
        "created": wire.now_iso(),
        "created_epoch": time.time(),
        "started": None,
        "finished": None,
        "error": None,
        "requested_by": "hook",
        "request_id": None,
        "runner": None,
    }


def test_root_never_opens_a_runner_log_through_a_link(split: SplitTower) -> None:
    """A planted jobs/ID.log link got a file of root's made (and chowned to the
    SSH user) by root's spawn: root refuses the SSH user's directory, and a link
    in its own."""
    job_id = "20990101-000000-000000-abcdef"
    victim = victim_dir(split)
    jobs = split.state_dir / "jobs"
    split.as_user(
        "import os, sys; os.mkdir(sys.argv[1], 0o700)\n"
        "os.symlink(sys.argv[2], os.path.join(sys.argv[1], sys.argv[3] + '.log'))",
        str(jobs),
        str(victim / "made-by-root"),
        job_id,
    )
    cfg = agent_config.load_config(str(split.config), {"PATH": os.environ["PATH"]})
    job = _queued_record(job_id)
    with pytest.raises(wire.AgentError) as refused:
        agent_jobs.spawn_runner(cfg, job)  # as root, in this process: no drop
    assert refused.value.code == wire.ERR_STATE_DIR_UNSAFE
    assert not (victim / "made-by-root").exists()
    # A state directory of root's own, with a link in it: not followed either.
    own = split.base / "root-state"
    (own / "jobs").mkdir(parents=True, mode=0o700)
    own.chmod(0o700)
    (own / "jobs" / f"{job_id}.log").symlink_to(victim / "made-by-root")
    cfg.state_dir = str(own)
    with pytest.raises(wire.AgentError) as refused:
        agent_jobs.spawn_runner(cfg, job)
    assert refused.value.code == wire.ERR_STATE_DIR_UNSAFE
    assert "symbolic link" in refused.value.message
    assert not (victim / "made-by-root").exists()


def test_state_files_get_their_mode_on_the_descriptor(
    fake_tower: FakeTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temporary files were chmod/chowned by path (a race away from a link)."""

    def by_path(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"set by path: {args}")

    for name in ("chmod", "chown", "lchown"):
        monkeypatch.setattr(os, name, by_path)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "win-1", "cli")
    agent_state.write_json_atomic(
        agent_jobs.job_path(cfg, job["id"]), job, cfg.state_dir
    )
    agent_status.status_body(cfg)
    for path in fake_tower.state_dir.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) in (0o600, 0o700), path
    assert not list(fake_tower.state_dir.rglob(".tmp-*"))


# --- 2. the state directory is checked; runners trust no record ------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_state_directory_others_may_write_to_is_refused(
    split: SplitTower, mode: int
) -> None:
    split.start_sshd()
    split.state_dir.chmod(mode)
    for command in ("stop win-1", "status", "jobs", "session"):
        reply = split.ssh(command)
        assert reply["ok"] is False, (command, reply)
        assert reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE, reply
        assert "writable by its group or by others" in reply["error"]["message"]
    # Nor does the hook (root) work there.
    split.state_dir.chmod(0o700)
    status_as_user(split)
    split.state_dir.chmod(mode)
    assert split.hook("win-1", "prepare", "begin", "-").returncode == 0
    assert not (split.state_dir / "jobs").exists()
    assert not (split.state_dir / "requests").exists()
    assert "shutdown" not in split.fake.commands()


def test_a_state_directory_of_someone_else_is_refused(split: SplitTower) -> None:
    split.start_sshd()
    os.chown(split.state_dir, 0, 0)
    split.state_dir.chmod(0o755)
    reply = split.ssh("stop win-1")
    assert reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE, reply
    assert f"not to uid {split.account.pw_uid}" in reply["error"]["message"]
    assert split.fake.log() == []


def test_a_subdirectory_others_may_write_to_is_refused(split: SplitTower) -> None:
    split.start_sshd()
    split.as_user(
        "import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
        str(split.state_dir / "jobs"),
    )
    reply = split.ssh("stop win-1")
    assert reply["error"]["code"] == wire.ERR_STATE_DIR_UNSAFE, reply
    assert "jobs" in reply["error"]["message"]


def test_a_rewritten_record_never_redirects_roots_runner(split: SplitTower) -> None:
    """The SSH user rewrites a queued job's steps to an unconfigured domain and
    root's runner (the hook's) runs it: it runs the configured work only."""
    split.fake.set_domain("win-1", state="running", reason="booted")
    state = split.fake.load()
    state["domains"]["other-vm"] = dict(state["domains"]["win-1"], shutdown_polls=0)
    split.fake.save(state)
    made = split.as_user(
        "import json, os, sys\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"
        "from gpu_handoff import config as agent_config, jobs as agent_jobs, state as agent_state\n"
        "cfg = agent_config.load_config(sys.argv[2], dict(os.environ))\n"
        "job = agent_jobs.create_job(cfg, 'stop', 'win-1', 'hook')\n"
        "for step in job['steps']:\n"
        "    step['domain'] = 'other-vm'\n"
        "agent_state.write_json_atomic(agent_jobs.job_path(cfg, job['id']), job, cfg.state_dir)\n"
        "print(job['id'])\n",
        str(SOURCE),
        str(split.config),
    )
    job_id = made.stdout.strip()
    runner = subprocess.run(
        [sys.executable, str(AGENT), "--config", str(split.config), "run-job", job_id],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=60,
        check=False,
    )
    assert runner.returncode == 0, runner
    job = json.loads((split.state_dir / "jobs" / f"{job_id}.json").read_text())
    assert job["state"] == "succeeded", job
    assert {s["domain"] for s in job["steps"]} == {"win-1"}
    touched = [argv for argv in split.fake.log() if "other-vm" in " ".join(argv)]
    assert touched == []
    assert split.fake.load()["domains"]["other-vm"]["state"] == "running"
    assert split.fake.load()["domains"]["win-1"]["state"] == "shut off"
    assert split.virsh_uids() == {split.account.pw_uid}


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"args": {"domain": "other-vm"}}, "unknown_domain"),
        ({"kind": "handoff", "args": {"domain": "gpu-node"}}, "unknown_domain"),
        ({"kind": "release", "args": {"domain": "other-vm"}}, "unknown_domain"),
        ({"kind": "undefine"}, "bad_request"),
        ({"args": "win-1"}, "unknown_domain"),
    ],
)
def test_a_runner_refuses_work_the_configuration_does_not_allow(
    fake_tower: FakeTower, change: dict[str, Any], code: str
) -> None:
    state = fake_tower.load()
    state["domains"]["other-vm"] = dict(state["domains"]["gpu-node"])
    fake_tower.save(state)
    cfg = agent_config.load_config(str(fake_tower.config), dict(os.environ))
    job = agent_jobs.create_job(cfg, "stop", "win-1", "cli")
    job.update(change)
    agent_state.write_json_atomic(
        agent_jobs.job_path(cfg, job["id"]), job, cfg.state_dir
    )
    run = fake_tower.run("run-job", job["id"])
    assert run.rc == 1
    done = fake_tower.run("job", job["id"]).reply["job"]
    assert done["state"] == "failed"
    assert done["error"]["code"] == code
    assert fake_tower.log() == []


# --- 4. floods are capped ----------------------------------------------------------------

WORKS = [
    ("stop", "gpu-node"),
    ("stop", "win-1"),
    ("stop", "win-2"),
    ("start", "gpu-node"),
    ("start", "win-1"),
    ("start", "win-2"),
    ("handoff", "win-1"),
    ("handoff", "win-2"),
    ("release", None),
    ("release", "win-1"),
    ("release", "win-2"),
]


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


class TowerLock:
    """The SSH user's process holding tower.lock: every job stays queued."""

    def __init__(self, split: SplitTower) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HOLD_LOCK,
                str(split.state_dir / "tower.lock"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            user=split.account.pw_uid,
            group=split.account.pw_gid,
            extra_groups=[],
            env=user_env(split.account),
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"locked\n"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def session_lines(split: SplitTower, requests: list[dict[str, Any]]) -> list[Any]:
    """A session through sshd given these requests, then its end: every line."""
    proc = split.ssh_popen("session")
    payload = "".join(json.dumps(r) + "\n" for r in requests).encode()
    out, err = proc.communicate(payload, timeout=120)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_forty_requests_make_at_most_max_queued_jobs_runners(
    split: SplitTower,
) -> None:
    """40 job requests gave 39 live runners: now the same work is one job, and
    a full queue is refused."""
    split.configure(timeouts={"agent": 1, "shutdown": 2, "start": 1})
    split.start_sshd()
    lock = TowerLock(split)
    try:
        requests = []
        for i in range(40):
            kind, domain = WORKS[i % len(WORKS)]
            requests.append(
                {
                    "id": i,
                    "verb": kind,
                    "args": [domain] if domain else [],
                    "request_id": f"ha-flood-{i:04d}",
                }
            )
        lines = session_lines(split, requests)
        replies = {m["id"]: m for m in lines if m["type"] == "reply"}
        assert len(replies) == 40
        made: dict[tuple[str, str | None], str] = {}
        for i in range(40):
            work = WORKS[i % len(WORKS)]
            reply = replies[i]
            if WORKS.index(work) < agent_config.MAX_QUEUED_JOBS_DEFAULT:
                assert reply["ok"], reply
                if work in made:
                    assert reply["existing"] is True
                    assert reply["job"]["id"] == made[work]
                else:
                    assert reply["existing"] is False
                    made[work] = reply["job"]["id"]
            else:
                assert reply["error"]["code"] == wire.ERR_QUEUE_FULL, reply
                assert "max_queued_jobs" in reply["error"]["message"]
        assert len(made) == agent_config.MAX_QUEUED_JOBS_DEFAULT
        wait_until(
            lambda: len(split.runners()) == len(made), timeout=30, what="runners"
        )
        time.sleep(0.5)
        assert len(split.runners()) == len(made)
        # A request id answered with another request's queued job finds it.
        again = split.ssh("request ha-flood-0011")
        assert again["job"]["id"] == made[WORKS[0]], again
    finally:
        lock.release()
    split.wait_idle(timeout=120)
    assert len(split.job_records()) == agent_config.MAX_QUEUED_JOBS_DEFAULT


def test_streams_are_capped(split: SplitTower) -> None:
    split.configure(max_streams=2)
    split.start_sshd()
    first, second = split.ssh_popen("session"), split.ssh_popen("watch")
    try:
        for proc in (first, second):
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline())["ok"] is True
        refused = split.ssh("session")
        assert refused["ok"] is False
        assert refused["error"]["code"] == wire.ERR_TOO_MANY_STREAMS
        assert "max_streams" in refused["error"]["message"]
        assert split.ssh("watch")["error"]["code"] == wire.ERR_TOO_MANY_STREAMS
        assert split.ssh("version")["ok"] is True  # one-shot verbs go on
    finally:
        assert first.stdin is not None
        first.stdin.close()
        first.wait(timeout=30)
    third = split.ssh_popen("session")
    try:
        assert third.stdout is not None
        assert json.loads(third.stdout.readline())["type"] == "hello"
    finally:
        for proc in (second, third):
            proc.kill()
            proc.wait()
    for proc in (first, second, third):
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


# --- 5. a stream ends with its client, its children with it ------------------------------


def agent_of(split: SplitTower, verb: str) -> int:
    """The pid of the tower's agent process serving `verb` through sshd."""

    def find() -> int | None:
        for pid in split.processes():
            if cmdline(pid).endswith(" serve ") and any(
                "event" in cmdline(child) for child in children(pid)
            ):
                return pid
        return None

    pid: int = wait_until(find, timeout=30, what=f"the agent of {verb}")
    return pid


def event_child(pid: int) -> int:
    """The one ``virsh event`` child of ``pid``. Looked for again for a
    moment: the stand-in virsh is a script that execs Python, and a process
    between two execs has no command line yet (the kernel sets it up after
    it replaced the old image), so one read can find no child."""

    def found() -> int | None:
        events = [c for c in children(pid) if "event" in cmdline(c)]
        assert len(events) <= 1, events
        return events[0] if events else None

    child: int = wait_until(found, timeout=10, interval=0.02, what="virsh event")
    return child


def test_a_killed_session_leaves_no_virsh_event_behind(split: SplitTower) -> None:
    split.start_sshd()
    proc = split.ssh_popen("session")
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["type"] == "hello"
        pid = agent_of(split, "session")
        child = event_child(pid)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not alive(child), timeout=15, what="virsh event to end")
    finally:
        proc.kill()
        proc.communicate()


def test_a_client_that_stops_reading_ends_its_session(split: SplitTower) -> None:
    """A client that takes nothing held the session (and its virsh event)
    forever: now a write waits write_timeout seconds at most."""
    split.configure(write_timeout=1.0)
    state = split.fake.load()
    state["screenshot_hex"] = "89504e47" + "ab" * (1 << 20)  # ~1.4 MiB a reply
    split.fake.save(state)
    split.start_sshd()
    proc = split.ssh_popen("session")
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert json.loads(proc.stdout.readline())["type"] == "hello"
        pid = agent_of(split, "session")
        child = event_child(pid)
        for i in range(30):
            line = {"id": i, "verb": "screenshot", "args": ["win-1"]}
            proc.stdin.write(json.dumps(line).encode() + b"\n")
        proc.stdin.flush()
        # ... and the client reads nothing more.
        wait_until(lambda: not alive(pid), timeout=90, what="the session to end")
        wait_until(lambda: not alive(child), timeout=15, what="virsh event to end")
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _agent_as_user(split: SplitTower, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(AGENT), "--config", str(split.config), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        user=split.account.pw_uid,
        group=split.account.pw_gid,
        extra_groups=[],
        env=user_env(split.account),
    )


def test_sigterm_ends_watch_and_its_virsh_event(split: SplitTower) -> None:
    proc = _agent_as_user(split, "watch")
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["type"] == "watching"
    child = event_child(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    wait_until(lambda: not alive(child), timeout=15, what="virsh event to end")
    _, err = proc.communicate()
    assert err == b""


@pytest.mark.parametrize("verb", ["session", "watch"])
def test_a_closed_client_gets_no_traceback(split: SplitTower, verb: str) -> None:
    proc = _agent_as_user(split, verb)
    assert proc.stdout is not None
    assert proc.stdin is not None
    assert json.loads(proc.stdout.readline())["ok"] is True
    child = event_child(proc.pid)
    proc.stdout.close()  # the client is gone (its end of the pipe)
    # Something to say: a reply (session) and a job's progress (both).
    proc.stdin.write(b'{"id": 1, "verb": "version"}\n')
    proc.stdin.flush()
    split.as_user(
        "import os, sys\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"
        "from gpu_handoff import config as agent_config, jobs as agent_jobs, state as agent_state\n"
        "agent_jobs.create_job(agent_config.load_config(sys.argv[2], dict(os.environ)), 'stop', 'win-1', 'cli')\n",
        str(SOURCE),
        str(split.config),
    )
    assert proc.wait(timeout=30) == 0
    err = proc.stderr.read() if proc.stderr else b""
    assert err == b"", err.decode()
    assert not alive(child)
    proc.stdin.close()
    if proc.stderr is not None:
        proc.stderr.close()


# --- 7. what a client learns -------------------------------------------------------------


def test_version_says_protocol_agent_version_and_name_only(split: SplitTower) -> None:
    """No Python version, no paths: the tower's name is the only thing about
    the machine, and it is the one its administrator configured."""
    split.configure(name="Tower in the attic")
    split.start_sshd()
    reply = split.ssh("version")
    assert reply == {
        "protocol": wire.PROTOCOL,
        "ok": True,
        "version": wire.VERSION,
        "verbs": sorted(wire.SERVE_VERBS),
        "host_name": "Tower in the attic",
    }


def test_internal_errors_are_logged_on_the_tower_not_told(split: SplitTower) -> None:
    """An internal error echoed its exception's text (here a path) to the client."""
    state = split.fake.load()
    state["screenshot_no_file"] = True  # virsh says it saved one; there is none
    split.fake.save(state)
    split.start_sshd()
    reply = split.ssh("screenshot win-1")
    assert reply["ok"] is False
    error = reply["error"]
    assert error["code"] == wire.ERR_INTERNAL
    assert "/" not in error["message"]
    assert "Error" not in error["message"]
    incident = error["message"].split()[2].rstrip(";")
    log = split.state_dir / "agent.log"
    st = log.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (split.account.pw_uid, 0o600)
    text = log.read_text(encoding="utf-8")
    assert f"internal error {incident} in verb serve" in text
    assert "FileNotFoundError" in text


def test_records_are_readable_by_the_agents_user_alone(split: SplitTower) -> None:
    split.start_sshd()
    status_as_user(split)
    submitted = split.ssh(f"stop win-1 --request={RID}")
    assert submitted["ok"], submitted
    split.wait_idle()
    assert split.hook("win-1", "prepare", "begin", "-").returncode == 0
    split.wait_idle()
    files = [p for p in split.state_dir.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".json", ".lock", ".log"}
    for path in [split.state_dir, *split.state_dir.rglob("*")]:
        st = path.lstat()
        assert st.st_uid == split.account.pw_uid, path
        assert stat.S_IMODE(st.st_mode) in (0o600, 0o700), (path, oct(st.st_mode))
    # Another local user reads none of it.
    other = subprocess.run(
        ["cat", str(split.state_dir / "claims.json")],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        check=False,
    )
    assert other.returncode != 0
    assert b"Permission denied" in other.stderr


def test_install_gives_the_state_directory_to_the_ssh_user_alone(
    split: SplitTower,
) -> None:
    """`install` (root) makes the state directory the SSH user's, 0700, and
    checks the tower as that user: root writes nothing in it."""
    node = nodes.write_node_file(split.base / "node.xml")
    node.chmod(0o644)
    root = split.base / "root"
    root.mkdir(mode=0o755)
    done = subprocess.run(
        [
            sys.executable,
            str(AGENT),
            "install",
            "--root",
            str(root),
            "--user",
            split.account.pw_name,
            "--gpu-node",
            "gpu-node",
            "--gaming",
            "win-1",
            "--gaming",
            "win-2",
            "--uri",
            f"test://{node}",
        ],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    reply = json.loads(done.stdout)
    assert reply["status_error"] is None, reply
    codes = {f["code"] for f in reply["findings"]}
    assert codes == {"rom_bar_not_off", "no_agent_channel"}
    state = root / "var/lib/gpu-handoff"
    for path in (state, state / "claims.json"):
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (split.account.pw_uid, split.account.pw_gid)
        assert stat.S_IMODE(st.st_mode) in (0o700, 0o600), (path, oct(st.st_mode))
