"""Jobs: their records, request ids, and how one is submitted and spawned.

A job is a JSON record under the state directory, with an alias per request
id (one job per request). ``submit_job`` creates it and spawns its runner,
detached from the caller (a transient systemd unit or a new session), so a
job outlives the SSH connection that asked for it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import pwd
import subprocess
import sys
import time

from .config import Config
from .state import (
    _NEW_FILE,
    ALIASES_FILE,
    MAX_ALIASES,
    STATE_FILE_MODE,
    _exists_at,
    existing_state_fd,
    open_file_at,
    open_lock_at,
    read_json_at,
    state_dir_fd,
    write_json_at,
    write_json_atomic,
)
from .virsh import resolve_program
from .wire import (
    ERR_BAD_REQUEST,
    ERR_QUEUE_FULL,
    ERR_RUNNER_DIED,
    ERR_SPAWN_FAILED,
    ERR_UNKNOWN_DOMAIN,
    ERR_UNKNOWN_JOB,
    JOB_ID_RE,
    JOB_KINDS,
    START_VM_STEPS,
    STOP_STEPS,
    AgentError,
    JsonObj,
    StepName,
    now_iso,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

# Home Assistant may ask for a request's job after a reconnect: a record that
# carries a request id is kept at least this long, whatever MAX_JOBS says.
REQUEST_KEEP_SECONDS = 3600.0
MAX_JOBS = 50
# A job whose runner has not taken its lock this long after creation is dead.
QUEUED_GRACE_SECONDS = 60.0
SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
# logind keeps a user's systemd manager running without a session while a
# file of the user's name is here (loginctl(1), enable-linger): the manager
# the runners of an unprivileged agent are started in.
LINGER_DIR = "/var/lib/systemd/linger"
# Exception tuples are named: see wire.py.
_NUMBER_ERRORS = (TypeError, ValueError)
# A job record that cannot be read as one.
_JOB_ERRORS = (AgentError, KeyError, TypeError)


def _random_hex(nbytes: int) -> str:
    """``nbytes`` random bytes in hex, as secrets.token_hex makes them (from
    os.urandom), without secrets' imports (hmac, hashlib, random): every
    start of the agent would pay for them."""
    return os.urandom(nbytes).hex()


def jobs_dir(cfg: Config) -> str:
    return os.path.join(cfg.state_dir, "jobs")


def job_path(cfg: Config, job_id: str) -> str:
    return os.path.join(jobs_dir(cfg), job_id + ".json")


def new_job_id() -> str:
    """Time-ordered (sorts as created) and unique: date-time-micros-random."""
    now = dt.datetime.now(dt.timezone.utc)
    return f"{now.strftime('%Y%m%d-%H%M%S')}-{now.microsecond:06d}-{_random_hex(3)}"


def _stop_steps(domain: str) -> List[JsonObj]:
    return [_step(name, domain) for name in STOP_STEPS]


def _start_steps(domain: str) -> List[JsonObj]:
    return [_step(name, domain) for name in START_VM_STEPS]


def _step(name: str, domain: str) -> JsonObj:
    return {
        "name": name,
        "domain": domain,
        "started": None,
        "finished": None,
        "result": None,
        "detail": None,
    }


def plan_job(cfg: Config, kind: str, target: Optional[str]) -> List[JsonObj]:
    if kind == "stop":
        return _stop_steps(str(target))
    if kind == "start":
        return _start_steps(str(target))
    if kind == "handoff":
        return _stop_steps(cfg.gpu_node) + _start_steps(str(target))
    if kind == "lend":
        # Restart the GPU node with the cards no running gaming VM holds.
        return [
            *_stop_steps(cfg.gpu_node),
            _step(StepName.START_FREE.value, cfg.gpu_node),
        ]
    steps = _stop_steps(target) if target else []
    return steps + _start_steps(cfg.gpu_node)


def check_work(cfg: Config, kind: str, target: Optional[str]) -> None:
    """The domains a job of this kind may act on: configured ones only."""
    if kind in ("stop", "start"):
        if target not in cfg.managed:
            raise AgentError(
                ERR_UNKNOWN_DOMAIN, f"{str(target)[:80]!r} is not a configured domain"
            )
    elif kind == "lend":
        # Its domain, if any, is a gaming VM whose cards are not lent.
        if target is not None and target not in cfg.gaming:
            raise AgentError(
                ERR_UNKNOWN_DOMAIN,
                f"{str(target)[:80]!r} is not a configured gaming domain",
            )
    elif (kind == "handoff" or target is not None) and target not in cfg.gaming:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN,
            f"{str(target)[:80]!r} is not a configured gaming domain",
        )


def job_work(cfg: Config, job: JsonObj) -> Tuple[str, Optional[str]]:
    """A job record's kind and domain, checked against the configuration."""
    kind = job.get("kind")
    args = job.get("args")
    target = args.get("domain") if isinstance(args, dict) else None
    if not isinstance(kind, str) or kind not in JOB_KINDS:
        raise AgentError(ERR_BAD_REQUEST, f"{str(kind)[:40]!r} is not a job kind")
    if target is not None and not isinstance(target, str):
        raise AgentError(ERR_BAD_REQUEST, "the job's domain is not a string")
    check_work(cfg, kind, target)
    return kind, target


def create_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> JsonObj:
    """A new job's record (under submit.lock): its id, and with it the name
    of its systemd unit, is one no record in jobs/ has, even for jobs made
    in the same microsecond."""
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        job_id = new_job_id()
        while _exists_at(jfd, job_id + ".json"):
            job_id = new_job_id()
    job: JsonObj = {
        "id": job_id,
        "kind": kind,
        "args": {"domain": target},
        "state": "queued",
        "step": None,
        "steps": plan_job(cfg, kind, target),
        "created": now_iso(),
        "created_epoch": time.time(),
        "started": None,
        "finished": None,
        "error": None,
        "requested_by": requested_by,
        "request_id": request_id,
        "runner": None,
    }
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        write_json_at(jfd, job_id + ".json", job)
    prune_jobs(cfg)
    return job


def list_job_ids(cfg: Config) -> List[str]:
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        if jfd is None:
            return []
        names = os.listdir(jfd)
    ids = [
        n[: -len(".json")]
        for n in names
        if n.endswith(".json") and not n.startswith(".")
    ]
    return sorted(i for i in ids if JOB_ID_RE.match(i))


def read_job(cfg: Config, job_id: str) -> Optional[Any]:
    """A job record as stored (no liveness check); None if there is none."""
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        return None if jfd is None else read_json_at(jfd, job_id + ".json")


def _kept_for_request(job: JsonObj) -> bool:
    """A young record with a request id: Home Assistant may still ask for it."""
    if not job.get("request_id"):
        return False
    try:
        created = float(job.get("created_epoch") or 0)
    except _NUMBER_ERRORS:
        return False
    return time.time() - created < REQUEST_KEEP_SECONDS


def read_aliases(cfg: Config) -> Dict[str, str]:
    """Young request ids answered with another request's queued job: job ids."""
    with existing_state_fd(cfg.state_dir) as sfd:
        data = read_json_at(sfd, ALIASES_FILE) if sfd is not None else None
    out: Dict[str, str] = {}
    if not isinstance(data, dict):
        return out
    for request_id, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("job"), str):
            continue
        try:
            age = time.time() - float(entry.get("time") or 0)
        except _NUMBER_ERRORS:
            continue
        if age < REQUEST_KEEP_SECONDS:
            out[str(request_id)] = entry["job"]
    return out


def add_alias(cfg: Config, request_id: str, job_id: str) -> None:
    """Remember that `request_id` was answered with `job_id` (under submit.lock)."""
    with state_dir_fd(cfg.state_dir) as sfd:
        data = read_json_at(sfd, ALIASES_FILE)
        entries = data if isinstance(data, dict) else {}
        young = read_aliases(cfg)
        kept = {k: v for k, v in entries.items() if k in young}
        kept[request_id] = {"job": job_id, "time": time.time()}
        newest = sorted(kept, key=lambda k: float(kept[k]["time"]))[-MAX_ALIASES:]
        write_json_at(sfd, ALIASES_FILE, {k: kept[k] for k in newest})


def prune_jobs(cfg: Config) -> None:
    """Keep the newest MAX_JOBS records (and any active or still asked-for one).

    Only names the agent writes itself are removed: ID.json, ID.lock, ID.log.
    """
    ids = list_job_ids(cfg)
    if len(ids) <= MAX_JOBS:
        return
    aliased = set(read_aliases(cfg).values())
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        for job_id in ids[: len(ids) - MAX_JOBS]:
            job = read_json_at(jfd, job_id + ".json")
            if job_id in aliased or (
                isinstance(job, dict)
                and (
                    job.get("state") in ("queued", "running") or _kept_for_request(job)
                )
            ):
                continue
            for suffix in (".json", ".lock", ".log"):
                with contextlib.suppress(OSError):
                    os.unlink(job_id + suffix, dir_fd=jfd)


def _lock_is_free(path: str) -> bool:
    """Whether no process holds the lock file at `path` (a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDWR | _NEW_FILE, STATE_FILE_MODE)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def load_job(cfg: Config, job_id: str) -> JsonObj:
    """A job's record; a job whose runner died is reported (and stored) as failed.

    A runner holds jobs/ID.lock from before it reads its job until it has
    written the job's end, and it waits for that lock rather than taking a busy
    one for a rival's: so this probe may take it for an instant. Held: the
    runner lives. Free: a job still queued and young has a runner starting (or
    about to), anything else not finished lost its runner.
    """
    if not JOB_ID_RE.match(job_id):
        raise AgentError(ERR_BAD_REQUEST, f"invalid job id {job_id!r}")
    name = job_id + ".json"
    with existing_state_fd(cfg.state_dir, "jobs") as jfd:
        job = read_json_at(jfd, name) if jfd is not None else None
        if jfd is None or not isinstance(job, dict):
            raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
        if job.get("state") not in ("queued", "running"):
            return job
        lock_name = job_id + ".lock"
        young = _young_job(job)
        if job["state"] == "queued" and young and not _exists_at(jfd, lock_name):
            return job
        try:
            lock = open_lock_at(jfd, lock_name, os.path.join(jobs_dir(cfg), lock_name))
        except (OSError, AgentError):
            return job
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return job  # the runner holds it: alive
            job = read_json_at(jfd, name)
            if not isinstance(job, dict):
                raise AgentError(ERR_UNKNOWN_JOB, f"no job {job_id!r}")
            if job.get("state") == "running" or (
                job.get("state") == "queued" and not _young_job(job)
            ):
                job["state"] = "failed"
                job["finished"] = now_iso()
                job["error"] = {
                    "code": ERR_RUNNER_DIED,
                    "message": "the job's runner is gone before the job finished",
                }
                write_json_at(jfd, name, job)
        finally:
            os.close(lock)
    return job


def _young_job(job: JsonObj) -> bool:
    try:
        created = float(job.get("created_epoch") or 0)
    except _NUMBER_ERRORS:
        return False
    return time.time() - created < QUEUED_GRACE_SECONDS


def job_summary(job: JsonObj) -> JsonObj:
    step = job.get("step")
    current = (
        job["steps"][step]
        if isinstance(step, int) and step < len(job["steps"])
        else None
    )
    return {
        "id": job["id"],
        "kind": job["kind"],
        "args": job["args"],
        "state": job["state"],
        "step": current["name"] if current else None,
        "created": job["created"],
        "finished": job["finished"],
        "error": job["error"],
        "requested_by": job["requested_by"],
        # Records written before protocol 2 have none.
        "request_id": job.get("request_id"),
    }


def find_request(cfg: Config, request_id: str) -> Optional[str]:
    """The id of the job made for this request id (or that answered it)."""
    for job_id in reversed(list_job_ids(cfg)):
        job = read_job(cfg, job_id)
        if isinstance(job, dict) and job.get("request_id") == request_id:
            return job_id
    aliased = read_aliases(cfg).get(request_id)
    if aliased is not None and JOB_ID_RE.match(aliased) and read_job(cfg, aliased):
        return aliased
    return None


def program_path() -> str:
    """This program: the built agent (a zip archive of these sources, see
    build.py) this module was loaded from, or, run as it is (a checkout, the
    tests), this package's directory, which Python runs (its __main__.py)."""
    archive = getattr(globals().get("__loader__"), "archive", None)
    if isinstance(archive, str):
        return os.path.realpath(archive)
    return os.path.dirname(os.path.realpath(__file__))


def program_argv(cfg: Config, job_id: str) -> List[str]:
    """A runner's command line: this program, under this interpreter, without
    site-packages if this process was started without (-S: the agent is the
    standard library alone)."""
    return [
        sys.executable,
        *(["-S"] if sys.flags.no_site else []),
        program_path(),
        "--config",
        os.path.abspath(cfg.path),
        "run-job",
        job_id,
        "--state-dir",
        os.path.abspath(cfg.state_dir),
    ]


# Runners this process started as plain child processes: a long-lived session
# reaps them (reap_runners), or they would stay zombies until it ends.
_RUNNERS: List["subprocess.Popen[bytes]"] = []


def reap_runners() -> None:
    _RUNNERS[:] = [child for child in _RUNNERS if child.poll() is None]


def user_lingers() -> bool:
    """Whether this user's systemd manager outlives its sessions. One that
    does not is stopped when the last SSH session of the user has ended
    (logind.conf(5), UserStopDelaySec, 10 s by default), and every job unit
    in it with it: such a user's runners are plain detached processes."""
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return False
    return os.path.isfile(os.path.join(LINGER_DIR, name))


def spawn_runner(cfg: Config, job: JsonObj) -> JsonObj:
    """Start the job's runner detached from this process; describe how."""
    job_id = job["id"]
    mode = cfg.detach
    systemd_run = resolve_program("systemd-run", cfg.cmd_systemd_run, cfg)
    if mode == "auto":
        mode = (
            "systemd"
            if systemd_run
            and os.path.isdir(SYSTEMD_RUNTIME_DIR)
            and (os.geteuid() == 0 or user_lingers())
            else "process"
        )
    if mode == "systemd":
        if systemd_run is None:
            raise AgentError(ERR_SPAWN_FAILED, "systemd-run not found")
        unit = f"gpu-handoff-job-{job_id}"
        argv = [systemd_run]
        if os.geteuid() != 0:
            argv.append("--user")
        argv += [
            "--collect",
            "--quiet",
            f"--unit={unit}",
            "--",
            *program_argv(cfg, job_id),
        ]
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=cfg.env,
            timeout=60,
            check=False,
        )
        if proc.returncode == 0:
            return {"mode": "systemd", "unit": unit}
        if cfg.detach == "systemd":
            raise AgentError(
                ERR_SPAWN_FAILED,
                f"systemd-run failed ({proc.returncode}): {proc.stderr.strip()}",
            )
    name = job_id + ".log"
    with state_dir_fd(cfg.state_dir, "jobs") as jfd:
        log = open_file_at(
            jfd, name, os.O_WRONLY | os.O_APPEND, os.path.join(jobs_dir(cfg), name)
        )
    try:
        child = subprocess.Popen(
            program_argv(cfg, job_id),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            close_fds=True,
            start_new_session=True,
            env=cfg.env,
        )
    except OSError as err:
        raise AgentError(ERR_SPAWN_FAILED, f"cannot start runner: {err}") from None
    finally:
        os.close(log)
    reap_runners()
    _RUNNERS.append(child)
    return {"mode": "process", "pid": child.pid}


def _submitted(job: JsonObj, runner: Optional[JsonObj]) -> JsonObj:
    """The `job` of a submit's reply."""
    return {
        "id": job["id"],
        "state": job["state"],
        "kind": job["kind"],
        "runner": runner,
        "request_id": job.get("request_id"),
    }


def _create_and_spawn(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str],
) -> JsonObj:
    job = create_job(cfg, kind, target, requested_by, request_id)
    try:
        runner = spawn_runner(cfg, job)
    except AgentError as err:
        job["state"] = "failed"
        job["finished"] = now_iso()
        job["error"] = {"code": err.code, "message": err.message}
        write_json_atomic(job_path(cfg, job["id"]), job, cfg.state_dir)
        raise
    # The runner may already have written its own record: only add the spawn info.
    return _submitted(job, runner)


def queued_jobs(cfg: Config) -> List[JsonObj]:
    """The jobs still waiting for their turn, newest first (liveness checked)."""
    out = []
    for job_id in reversed(list_job_ids(cfg)):
        try:
            job = load_job(cfg, job_id)
        except AgentError:
            continue
        if job.get("state") == "queued":
            out.append(job)
    return out


def _same_work(job: JsonObj, kind: str, target: Optional[str]) -> bool:
    args = job.get("args")
    return (
        job.get("kind") == kind
        and isinstance(args, dict)
        and args.get("domain") == target
    )


def submit_job(
    cfg: Config,
    kind: str,
    target: Optional[str],
    requested_by: str,
    request_id: Optional[str] = None,
) -> Tuple[JsonObj, bool]:
    """Create a job and start its runner: (the reply's `job`, whether it existed).

    A request id that a job record already carries creates nothing: that job
    is answered. Neither does the same work (kind and domain) as a job still
    queued: that job is answered (and the request id remembered for it). A
    queue of max_queued_jobs is full: refused. All of it holds submit.lock, so
    processes asking at once (sessions, one-shot commands, the hook) agree.
    """
    with state_dir_fd(cfg.state_dir) as sfd:
        lock = open_lock_at(
            sfd, "submit.lock", os.path.join(cfg.state_dir, "submit.lock")
        )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if request_id is not None:
            existing = find_request(cfg, request_id)
            if existing is not None:
                job = load_job(cfg, existing)
                return _submitted(job, job.get("runner")), True
        queued = queued_jobs(cfg)
        same = next((job for job in queued if _same_work(job, kind, target)), None)
        if same is not None:
            if request_id is not None:
                add_alias(cfg, request_id, same["id"])
            return _submitted(same, same.get("runner")), True
        if len(queued) >= cfg.max_queued_jobs:
            raise AgentError(
                ERR_QUEUE_FULL,
                f"{len(queued)} jobs wait for their turn already "
                f"(max_queued_jobs = {cfg.max_queued_jobs}); ask again once one has started",
            )
        return _create_and_spawn(cfg, kind, target, requested_by, request_id), False
    finally:
        os.close(lock)
