"""Requests: one checked verb with its arguments, from wherever it comes.

The forced command (``serve``: sshd's SSH_ORIGINAL_COMMAND), the command
line and a session's request lines all come through ``check_request`` and
``run_request``: an unknown verb, a wrong argument count or a domain the
configuration does not name is refused before anything runs.
"""

from __future__ import annotations

import os
import shlex

from .config import Config
from .jobs import (
    _JOB_ERRORS,
    check_work,
    find_request,
    job_path,
    job_summary,
    list_job_ids,
    load_job,
    submit_job,
)
from .status import verb_status
from .virsh import Virsh
from .wire import (
    ERR_BAD_REQUEST,
    ERR_NOT_ALLOWED,
    ERR_UNKNOWN_DOMAIN,
    ERR_UNKNOWN_JOB,
    ERR_UNKNOWN_REQUEST,
    JOB_ID_RE,
    JOB_VERBS,
    REQUEST_ID_RE,
    REQUEST_OPTION,
    SERVE_MAX_LENGTH,
    SERVE_VERBS,
    VERSION,
    AgentError,
    JsonObj,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, Optional, Tuple


def check_request_id(value: Any) -> str:
    if not isinstance(value, str) or not REQUEST_ID_RE.fullmatch(value):
        raise AgentError(
            ERR_BAD_REQUEST,
            "invalid request id (a letter or digit, then 7..63 letters, digits, _ or -)",
        )
    return value


def split_request_option(verb: str, args: List[str]) -> Tuple[List[str], Optional[str]]:
    """A job verb's `--request=RID` word (anywhere), taken out of its arguments."""
    if verb not in JOB_VERBS:
        return list(args), None
    request_id: Optional[str] = None
    rest: List[str] = []
    for word in args:
        if not word.startswith(REQUEST_OPTION):
            rest.append(word)
        elif request_id is not None:
            raise AgentError(ERR_BAD_REQUEST, "--request given more than once")
        else:
            request_id = check_request_id(word[len(REQUEST_OPTION) :])
    return rest, request_id


def check_request(cfg: Config, verb: str, args: List[str]) -> None:
    """Validate a user verb's arguments before anything runs."""
    low, high = SERVE_VERBS[verb]
    if not low <= len(args) <= high:
        raise AgentError(
            ERR_BAD_REQUEST, f"{verb} takes {low}..{high} arguments, got {len(args)}"
        )
    if verb == "screenshot" and args[0] not in cfg.managed:
        raise AgentError(
            ERR_UNKNOWN_DOMAIN, f"{args[0][:80]!r} is not a configured domain"
        )
    if verb in JOB_VERBS:
        check_work(cfg, verb, args[0] if args else None)
    if verb == "job":
        if not JOB_ID_RE.fullmatch(args[0]):
            raise AgentError(ERR_BAD_REQUEST, "invalid job id")
        if not os.path.exists(job_path(cfg, args[0])):
            raise AgentError(ERR_UNKNOWN_JOB, f"no job {args[0]!r}")
    if verb == "request":
        check_request_id(args[0])


def run_request(
    cfg: Config,
    verb: str,
    args: List[str],
    request_id: Optional[str],
    requested_by: str,
) -> JsonObj:
    """The reply to one validated request (any user verb but watch and session)."""
    if verb == "version":
        return version_reply(cfg)
    if verb == "status":
        return verb_status(cfg)
    if verb in JOB_VERBS:
        Virsh(cfg)  # fail now, not in the runner, when virsh is missing
        job, existing = submit_job(
            cfg, verb, args[0] if args else None, requested_by, request_id
        )
        return reply_ok(job=job, existing=existing)
    if verb == "job":
        return reply_ok(job=load_job(cfg, args[0]))
    if verb == "request":
        job_id = find_request(cfg, args[0])
        if job_id is None:
            raise AgentError(ERR_UNKNOWN_REQUEST, f"no job has request id {args[0]!r}")
        return reply_ok(job=load_job(cfg, job_id))
    if verb == "jobs":
        summaries = []
        for job_id in reversed(list_job_ids(cfg)):
            try:
                summaries.append(job_summary(load_job(cfg, job_id)))
            except _JOB_ERRORS:
                continue
        return reply_ok(jobs=summaries)
    if verb == "screenshot":
        from .screenshot import verb_screenshot  # its imports: only for a screenshot

        return verb_screenshot(cfg, args[0])
    raise AgentError(ERR_NOT_ALLOWED, f"verb {verb[:40]!r} is not a request")


def parse_serve_request(
    cfg: Config, command: Optional[str]
) -> Tuple[str, List[str], Optional[str]]:
    """Validate SSH_ORIGINAL_COMMAND: (verb, arguments, request id)."""
    if command is None or not command.strip():
        raise AgentError(
            ERR_BAD_REQUEST, "no command given (SSH_ORIGINAL_COMMAND is unset)"
        )
    if len(command) > SERVE_MAX_LENGTH:
        raise AgentError(
            ERR_BAD_REQUEST, f"command longer than {SERVE_MAX_LENGTH} characters"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in command):
        raise AgentError(ERR_BAD_REQUEST, "control characters in command")
    try:
        words = shlex.split(command)
    except ValueError as err:
        raise AgentError(ERR_BAD_REQUEST, f"cannot parse command: {err}") from None
    if not words:
        raise AgentError(ERR_BAD_REQUEST, "empty command")
    verb = words[0]
    if verb not in SERVE_VERBS:
        raise AgentError(ERR_NOT_ALLOWED, f"verb {verb[:40]!r} is not allowed")
    args, request_id = split_request_option(verb, words[1:])
    check_request(cfg, verb, args)
    return verb, args, request_id


def version_reply(cfg: Optional[Config] = None) -> JsonObj:
    """The protocol (in every reply), the agent's version, its verbs and the
    tower's name. Without a configuration (the command line's ``version``,
    which answers even when the configuration is broken) the name is the
    machine's host name, the configuration's default."""
    host_name = cfg.name if cfg is not None else os.uname().nodename
    return reply_ok(version=VERSION, verbs=sorted(SERVE_VERBS), host_name=host_name)
