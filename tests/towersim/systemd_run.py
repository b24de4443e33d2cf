# ruff: noqa: PTH103, PTH112, PTH118, PTH123
"""A stand-in ``systemd-run`` for transient services, as the agent uses it.

``systemd-run [--user] [--collect] [--quiet] [--unit=NAME] [--description=TEXT]
[--setenv=K=V]... [--] PROGRAM ARGS...`` registers a unit, starts PROGRAM
detached (its own session; it survives the caller) under a small supervisor
that records how it ended, and returns at once. As with systemd: a unit that
ends successfully is unloaded; a failed unit stays loaded (``failed``) unless
``--collect`` was given; starting a unit whose name is loaded fails with
systemd's message and rc 1; without ``--unit`` the name is ``run-uN.service``.
PROGRAM gets a service's environment (not the caller's) plus ``--setenv``.

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time

from . import model

# A process per call, as virsh's: shutil, secrets and typing stay out of its
# imports (a third of each start); the names are for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any

SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROG = "systemd-run"


def _usage_error(stderr: IO[str], text: str) -> int:
    stderr.write(f"{PROG}: {text}\n")
    return 1


def main(
    state_dir: str,
    argv: list[str],
    boot: list[str],
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """``boot`` is the argv prefix that runs this package's supervisor."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    args = list(argv)
    user = collect = quiet = False
    unit: str | None = None
    description: str | None = None
    setenv: dict[str, str] = {}
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "--":
            break
        name, eq, value = opt.partition("=")
        if name in (
            "--unit",
            "-u",
            "--description",
            "--setenv",
            "-E",
            "--property",
            "-p",
        ):
            if not eq:
                if not args:
                    return _usage_error(stderr, f"option '{name}' requires an argument")
                value = args.pop(0)
            if name in ("--unit", "-u"):
                unit = value
            elif name == "--description":
                description = value
            elif name in ("--setenv", "-E"):
                key, _, val = value.partition("=")
                setenv[key] = val if _ else os.environ.get(key, "")
        elif opt == "--user":
            user = True
        elif opt == "--system":
            user = False
        elif opt in ("--collect", "-G"):
            collect = True
        elif opt in ("--quiet", "-q"):
            quiet = True
        elif opt == "--no-block":
            pass
        else:
            return _usage_error(stderr, f"unrecognized option '{opt}'")
    if not args:
        stderr.write("Command line to execute required.\n")
        return 1
    program = args[0]
    if "/" in program:
        path: str | None = program
    else:
        import shutil  # only a bare program name is looked up

        path = shutil.which(program)
    if path is None or not os.access(path, os.X_OK):
        stderr.write(
            f"Failed to find executable {program}: No such file or directory\n"
        )
        return 1
    with model.locked(state_dir):
        data = model.load(state_dir)
        units = data["units"]
        if unit is None:
            data["unit_counter"] = int(data.get("unit_counter", 0)) + 1
            unit = f"run-u{data['unit_counter']}.service"
        elif "." not in unit:
            unit = f"{unit}.service"
        if unit in units and units[unit]["loaded"]:
            stderr.write(
                "Failed to start transient service unit: "
                f"Unit {unit} was already loaded or has a fragment file.\n"
            )
            return 1
        invocation = os.urandom(16).hex()  # secrets.token_hex's bytes
        units[unit] = {
            "name": unit,
            "argv": [path, *args[1:]],
            "user": user,
            "collect": collect,
            "description": description or " ".join(args),
            "setenv": setenv,
            "invocation_id": invocation,
            "state": "activating",
            "loaded": True,
            "started": model.now(data),
            "finished": None,
            "exit_code": None,
            "supervisor_pid": None,
            "pid": None,
            "history": data.get("unit_runs", 0),
        }
        data["unit_runs"] = int(data.get("unit_runs", 0)) + 1
        model.save(state_dir, data)
    log_dir = os.path.join(state_dir, "units")
    os.makedirs(log_dir, exist_ok=True)
    try:
        with open(os.path.join(log_dir, unit + ".log"), "ab") as log:
            supervisor = subprocess.Popen(
                [*boot, "supervise", unit],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                close_fds=True,
                start_new_session=True,
                cwd="/",
            )
    except OSError as err:
        with model.locked(state_dir):
            data = model.load(state_dir)
            data["units"][unit].update(state="failed", exit_code=None, error=str(err))
            model.save(state_dir, data)
        stderr.write(f"Failed to start transient service unit: {err}\n")
        return 1
    with model.locked(state_dir):
        data = model.load(state_dir)
        data["units"][unit]["supervisor_pid"] = supervisor.pid
        model.save(state_dir, data)
    if not quiet:
        stderr.write(f"Running as unit: {unit}; invocation ID: {invocation}\n")
    stdout.flush()
    return 0


def _service_env(unit: dict[str, Any]) -> dict[str, str]:
    entry = pwd.getpwuid(os.getuid())
    env = {
        "PATH": SERVICE_PATH,
        "LANG": "C.UTF-8",
        "HOME": entry.pw_dir,
        "USER": entry.pw_name,
        "LOGNAME": entry.pw_name,
        "SHELL": entry.pw_shell or "/bin/sh",
        "INVOCATION_ID": str(unit["invocation_id"]),
    }
    env.update(unit["setenv"])
    return env


def supervise(state_dir: str, unit_name: str) -> int:
    """Runs in the unit's own session: start the program, record its end."""
    with model.locked(state_dir):
        data = model.load(state_dir)
        unit = data["units"][unit_name]
    cwd = "/"
    if unit["user"]:
        home = pwd.getpwuid(os.getuid()).pw_dir
        cwd = home if os.path.isdir(home) else "/"
    try:
        child = subprocess.Popen(
            unit["argv"],
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=_service_env(unit),
            close_fds=True,
        )
    except OSError as err:
        _finish(state_dir, unit_name, 203, str(err))
        return 1
    with model.locked(state_dir):
        data = model.load(state_dir)
        data["units"][unit_name].update(state="active", pid=child.pid)
        model.save(state_dir, data)

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    _finish(state_dir, unit_name, code, None)
    return 0


def _finish(state_dir: str, unit_name: str, code: int, error: str | None) -> None:
    with model.locked(state_dir):
        data = model.load(state_dir)
        unit = data["units"][unit_name]
        failed = code != 0
        unit.update(
            state="failed" if failed else "inactive",
            exit_code=code,
            finished=model.now(data),
            loaded=failed and not unit["collect"],
        )
        if error:
            unit["error"] = error
        history = data.setdefault("unit_history", [])
        history.append(dict(unit))
        model.save(state_dir, data)
    time.sleep(0)
