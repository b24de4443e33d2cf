"""libvirt's qemu hook: a gaming VM started by hand gets its cards.

libvirtd runs the hook on every start of every domain (the agent's own
starts too). On a start of a gaming VM by hand (not by a job of the agent's)
while the GPU node holds its cards, the hook asks for a handoff and waits for
it, so the start succeeds; the request it leaves is what Home Assistant reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import xml.etree.ElementTree as ET

from .config import Config
from .jobs import _JOB_ERRORS, list_job_ids, load_job, new_job_id, submit_job
from .state import (
    CLAIMS_FILE,
    act_as_state_owner,
    existing_state_fd,
    read_json_at,
    state_dir_fd,
    write_json_at,
)
from .virsh import parse_domain_xml
from .wire import START_STEPS, AgentError, JsonObj, now_iso

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

MAX_HOOK_REQUESTS = 20


# The hook's request records: requests/JOBID-DOMAIN.json (JOBID as new_job_id).
REQUEST_FILE_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9]{6}-[0-9a-f]{6}-.+\.json$")


def _request_names(rfd: int) -> List[str]:
    """The request records in requests/, oldest first: only names the hook writes."""
    return sorted(n for n in os.listdir(rfd) if REQUEST_FILE_RE.match(n))


def hook_requests(cfg: Config) -> List[JsonObj]:
    out: List[JsonObj] = []
    with existing_state_fd(cfg.state_dir, "requests") as rfd:
        if rfd is None:
            return out
        for name in _request_names(rfd)[-MAX_HOOK_REQUESTS:]:
            data = read_json_at(rfd, name)
            if isinstance(data, dict):
                out.append(data)
    return out


def starting_job(cfg: Config, domain: str) -> Optional[str]:
    """The id of a live job of ours that is starting `domain` now (its
    runner began a start step of it and has not ended it), if any.

    A runner writes the step's begin before it calls virsh, and libvirtd runs
    the qemu hook inside that call: so the hook always sees its own job's
    step. A job whose runner died is not one (load_job checks its lock).
    """
    for job_id in reversed(list_job_ids(cfg)):
        try:
            job = load_job(cfg, job_id)
        except _JOB_ERRORS:
            continue
        index = job.get("step")
        steps = job.get("steps")
        if job.get("state") != "running" or not isinstance(index, int):
            continue
        if not isinstance(steps, list) or not 0 <= index < len(steps):
            continue
        step = steps[index]
        if (
            isinstance(step, dict)
            and step.get("name") in START_STEPS
            and step.get("domain") == domain
            and step.get("started")
            and step.get("result") is None
        ):
            return str(job["id"])
    return None


def verb_hook(cfg: Config, args: List[str], xml_text: str) -> None:
    """libvirt's qemu hook: never waits, never calls libvirt, prints nothing.

    libvirt writes the domain XML to stdin and, for some operations, reads the
    hook's stdout as new XML: so stdin is always read and stdout never written.
    libvirtd runs it as root: it becomes the state directory's owner before it
    reads or writes anything there, and so does the runner it starts.
    """
    if len(args) < 3:
        return
    domain, operation, subop = args[0], args[1], args[2]
    if operation != "prepare" or subop != "begin" or domain not in cfg.gaming:
        return
    try:
        wanted = {d["address"] for d in parse_domain_xml(xml_text)["hostdevs"]}
    except ET.ParseError:
        return
    act_as_state_owner(cfg)
    if starting_job(cfg, domain) is not None:
        # libvirtd runs the hook on every start, the agent's own too: a
        # start a job of ours makes is that job's, never a request.
        return
    with existing_state_fd(cfg.state_dir) as sfd:
        cache = read_json_at(sfd, CLAIMS_FILE) if sfd is not None else None
    if not isinstance(cache, dict) or cache.get("gpu_node") != cfg.gpu_node:
        return
    shared = sorted(wanted & set(cache.get("addresses") or []))
    if not shared:
        return
    request: JsonObj = {
        "domain": domain,
        "operation": f"{operation} {subop}",
        "addresses": shared,
        "time": now_iso(),
        "job": None,
    }
    try:
        submitted, _ = submit_job(cfg, "stop", cfg.gpu_node, "hook")
        request["job"] = submitted["id"]
    except AgentError as err:
        request["error"] = {"code": err.code, "message": err.message}
    with state_dir_fd(cfg.state_dir, "requests") as rfd:
        write_json_at(rfd, f"{new_job_id()}-{domain}.json", request)
        names = _request_names(rfd)
        for old in names[: max(0, len(names) - MAX_HOOK_REQUESTS)]:
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=rfd)
