"""The command line: the verbs, their dispatch, and the agent's exit codes."""

from __future__ import annotations

import contextlib
import os
import sys

from .config import Config, config_path_from, load_config
from .requests import (
    check_request,
    parse_serve_request,
    run_request,
    split_request_option,
    version_reply,
)
from .state import act_as_state_owner, internal_error, log_internal
from .wire import (
    _STREAM_ERRORS,
    ERR_BAD_REQUEST,
    JOB_ID_RE,
    SERVE_VERBS,
    AgentError,
    JsonObj,
    reply_error,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Dict, List, Optional, Tuple

USAGE = (
    "usage: gpu-handoff [--config PATH] VERB [ARGS]\n"
    "verbs: version, status, stop DOMAIN, start DOMAIN, handoff GAMING, release [GAMING]\n"
    "       (the four job verbs take --request=RID: one job per request id),\n"
    "       job ID, request RID, jobs, watch, session, screenshot DOMAIN,\n"
    "       hook DOMAIN OP SUBOP EXTRA, serve, check-config,\n"
    "       install --user U --gpu-node N --gaming G [--gaming G2]\n"
    "       [--uri URI] [--prefix DIR] [--state-dir DIR] [--root DIR] [--force]\n"
    "       [--timeout-agent S] [--timeout-shutdown S] [--timeout-start S]\n"
    "       [--detach MODE] [--authorize-key 'TYPE BASE64 [COMMENT]']\n"
    "       [--create-user] [--join-libvirt-group] [--restart-libvirt]\n"
    "       (on NixOS: prints the module's settings instead),\n"
    "       update [--prefix DIR] [--root DIR] (replaces the installed program)"
)


def _dispatch(
    *,
    verb: str,
    args: List[str],
    request_id: Optional[str],
    cfg: Config,
    requested_by: str,
    stdin: IO[str],
    stdout: IO[str],
) -> Tuple[Optional[JsonObj], int]:
    """Run one validated user verb; (reply or None if it streamed, exit code)."""
    if verb == "watch":
        from .stream import verb_watch

        return None, verb_watch(cfg, stdin, stdout)
    if verb == "session":
        from .session import verb_session

        return None, verb_session(cfg, stdin, stdout, requested_by)
    return run_request(cfg, verb, args, request_id, requested_by), 0


def _run_verb(
    *,
    verb: str,
    args: List[str],
    config_option: Optional[str],
    env: Dict[str, str],
    stdin: IO[str],
    stdout: IO[str],
    stderr: IO[str],
    loaded: List[Config],
) -> Tuple[Optional[JsonObj], int]:
    """Any verb; (reply to print, or None when it printed itself; exit code).

    The configuration, once loaded, is appended to `loaded` (for the log of an
    unexpected error). Run as root, every verb that uses the state directory
    first becomes its owner (act_as_state_owner).

    A verb's module is imported when the verb runs, not at every start: the
    hook runs the agent as libvirt starts and stops a VM (libvirt waits for
    it), and sshd at every connection; neither pays for install's, update's
    or the runner's imports.
    """
    path = config_path_from(config_option, env)
    if verb == "version":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "version takes no arguments")
        return version_reply(), 0
    if verb == "install":
        from .install import verb_install

        return verb_install(args, config_option, env, stderr), 0
    if verb == "update":
        from .update import verb_update

        return verb_update(args, stderr), 0
    if verb == "hook":
        from .hook import verb_hook

        try:
            # libvirt writes the domain XML to stdin: always read it.
            xml_text = "" if stdin.isatty() else stdin.read()
            verb_hook(load_config(path, env), args, xml_text)
        except Exception as err:  # noqa: BLE001 - a hook must never fail libvirt
            # To libvirtd's log, on the tower; never to stdout (read as XML).
            with contextlib.suppress(*_STREAM_ERRORS):
                stderr.write(f"gpu-handoff hook: {err}\n")
        return None, 0
    cfg = load_config(path, env)
    loaded.append(cfg)
    if verb == "check-config":
        return reply_ok(config=cfg.as_json()), 0
    if verb == "run-job":
        if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--state-dir"):
            raise AgentError(ERR_BAD_REQUEST, "usage: run-job ID [--state-dir DIR]")
        if not JOB_ID_RE.match(args[0]):
            raise AgentError(ERR_BAD_REQUEST, "invalid job id")
        if len(args) == 3:
            cfg.state_dir = args[2]
        act_as_state_owner(cfg)
        from .runner import run_job

        return None, run_job(cfg, args[0])
    if verb == "serve":
        if args:
            raise AgentError(ERR_BAD_REQUEST, "serve takes no arguments")
        verb, args, request_id = parse_serve_request(
            cfg, env.get("SSH_ORIGINAL_COMMAND")
        )
        requested_by = "ssh"
    elif verb in SERVE_VERBS:
        args, request_id = split_request_option(verb, args)
        check_request(cfg, verb, args)
        requested_by = "cli"
    else:
        raise AgentError(ERR_BAD_REQUEST, f"unknown verb {verb[:40]!r}\n{USAGE}")
    act_as_state_owner(cfg)
    return _dispatch(
        verb=verb,
        args=args,
        request_id=request_id,
        cfg=cfg,
        requested_by=requested_by,
        stdin=stdin,
        stdout=stdout,
    )


def main(
    argv: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
    stdin: Optional[IO[str]] = None,
    stdout: Optional[IO[str]] = None,
    stderr: Optional[IO[str]] = None,
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr

    def answer(reply: JsonObj) -> int:
        from .stream import StreamClosedError, _emit

        try:
            _emit(stdout, reply)
        except StreamClosedError:
            return 1
        return 0 if reply.get("ok") else 1

    config_option: Optional[str] = None
    while argv and argv[0].startswith("--"):
        option = argv.pop(0)
        if option == "--config" and argv:
            config_option = argv.pop(0)
        elif option.startswith("--config="):
            config_option = option.split("=", 1)[1]
        elif option in ("--help", "-h"):
            stderr.write(USAGE + "\n")
            return 0
        else:
            return answer(
                reply_error(ERR_BAD_REQUEST, f"unknown option {option!r}\n{USAGE}")
            )
    if not argv:
        return answer(reply_error(ERR_BAD_REQUEST, "no verb given\n" + USAGE))
    verb, args = argv[0], argv[1:]
    loaded: List[Config] = []
    try:
        reply, code = _run_verb(
            verb=verb,
            args=args,
            config_option=config_option,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            loaded=loaded,
        )
    except AgentError as err:
        return answer(reply_error(err.code, err.message, **err.extra))
    except Exception as err:  # noqa: BLE001 - logged on the tower, answered with a code
        incident = log_internal(loaded[0] if loaded else None, f"verb {verb[:40]}", err)
        return answer(reply_error(**internal_error(incident)))
    if reply is None:
        return code
    return answer(reply)
