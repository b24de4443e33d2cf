"""The ``status`` verb: the tower's domains, cards, jobs and requests."""

from __future__ import annotations

from .config import Config
from .hook import hook_requests
from .jobs import _JOB_ERRORS, job_summary, list_job_ids, load_job
from .observe import card_table, findings_for, observe
from .state import CLAIMS_FILE, state_dir_fd, write_json_at
from .virsh import Virsh
from .wire import JsonObj, now_iso, reply_ok

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional, Set


def status_body(cfg: Config, virsh: Optional[Virsh] = None) -> JsonObj:
    """What `status` answers (without protocol/ok): one-shot and sessions."""
    virsh = virsh or Virsh(cfg)
    # Jobs before libvirt: a job that is over when read has done all it does
    # to libvirt by then, so no status shows a job gone but not its effect.
    active = []
    stopping: Set[str] = set()
    for job_id in list_job_ids(cfg):
        try:
            job = load_job(cfg, job_id)
            if job.get("state") in ("queued", "running"):
                active.append(job_summary(job))
                stopping.update(shutting_down(job))
        except _JOB_ERRORS:
            continue
    requests = hook_requests(cfg)
    snap = observe(cfg, virsh, ping=True, busy=stopping)
    cards = card_table(cfg, snap)
    found = findings_for(cfg, snap, cards)
    gpu = snap.domains[cfg.gpu_node]
    with state_dir_fd(cfg.state_dir) as sfd:
        write_json_at(
            sfd,
            CLAIMS_FILE,
            {
                "gpu_node": cfg.gpu_node,
                "addresses": sorted(d["address"] for d in gpu["hostdevs"]),
                "written": now_iso(),
            },
        )
    domains = []
    for name in cfg.managed:
        dom = dict(snap.domains[name])
        dom["role"] = "gpu_node" if name == cfg.gpu_node else "gaming"
        domains.append(dom)
    return {
        "uri": cfg.libvirt_uri,
        "gpu_node": cfg.gpu_node,
        "gaming": cfg.gaming,
        "domains": domains,
        "cards": cards,
        "findings": found,
        "hook_requests": requests,
        "active_jobs": active,
        "virsh_calls": snap.virsh_calls,
    }


def shutting_down(job: JsonObj) -> List[str]:
    """The domain a running job is shutting down (its `shutdown` step runs):
    libvirt's `shutdown --mode agent` holds that domain's guest agent until
    the guest is off (or 60 s), and a ping would wait for it."""
    step = job.get("step")
    steps = job.get("steps")
    if job.get("state") != "running" or not isinstance(steps, list):
        return []
    if not isinstance(step, int) or not 0 <= step < len(steps):
        return []
    current = steps[step]
    if (
        isinstance(current, dict)
        and current.get("name") == "shutdown"
        and current.get("result") is None
        and isinstance(current.get("domain"), str)
    ):
        return [current["domain"]]
    return []


def verb_status(cfg: Config) -> JsonObj:
    return reply_ok(**status_body(cfg))
