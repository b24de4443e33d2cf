"""The install verb: the agent, its configuration, its hook, Home Assistant's key.

Run as root on the tower (by the guided install or by hand). On NixOS it
changes nothing and prints the module's settings instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import shlex

from .accounts import (
    _STEP_ERRORS,
    LIBVIRT_GROUP,
    PROGRAM_MODE,
    StepError,
    Undo,
    as_user,
    compiled_program,
    create_user,
    enable_linger,
    errno_name,
    install_file,
    install_state_dir,
    join_libvirt_group,
    lookup_account,
    own_program,
    restart_libvirt,
    tmpfiles_entry,
)
from .config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_LIBVIRT_URI,
    TIMEOUT_DEFAULTS,
    Config,
    config_path_from,
    validate_config,
)
from .jobs import program_path
from .keys import authorize_key, parse_public_key
from .status import verb_status
from .wire import (
    ERR_BAD_REQUEST,
    ERR_CONFIG_INVALID,
    ERR_EXISTS,
    ERR_INSTALL_FAILED,
    AgentError,
    JsonObj,
    local_libvirt_uri,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, Dict, Iterator, List, Optional, Tuple

DEFAULT_PREFIX = "/usr/local"
DEFAULT_INSTALL_STATE_DIR = "/var/lib/gpu-handoff"
HOOK_PATH = "/etc/libvirt/hooks/qemu.d/gpu-handoff"
# systemd-tmpfiles(8) entries of packages set up by hand (tmpfiles.d(5)).
TMPFILES_PATH = "/etc/tmpfiles.d/gpu-handoff.conf"

# Exception tuples are named: see wire.py.
_READ_ERRORS = (OSError, ValueError)


PLACEHOLDER_KEY = "<public key of Home Assistant>"
# NixOS marks itself twice: every activation creates /etc/NIXOS
# (nixos/modules/system/etc/setup-etc.pl), and its os-release says ID=nixos
# (nixos/modules/misc/version.nix). os-release is read from /etc, or from
# /usr/lib where /etc has none (os-release(5)).
NIXOS_MARKER = "/etc/NIXOS"
OS_RELEASE_FILES = ("/etc/os-release", "/usr/lib/os-release")
OS_RELEASE_MAX = 64 << 10
# The NixOS module, in a checkout of the repository this file comes from.
NIXOS_MODULE_IN_CHECKOUT = os.path.join("nixos", "module.nix")
NIXOS_MODULE_PLACEHOLDER = "/path/to/gpu-handoff/nixos/module.nix"
# A Nix string literal needs these escaped (`${` would interpolate).
_NIX_ESCAPES = (
    ("\\", "\\\\"),
    ('"', '\\"'),
    ("${", "\\${"),
    ("\n", "\\n"),
    ("\r", "\\r"),
    ("\t", "\\t"),
)


def agent_config(
    *,
    gpu_node: str,
    gaming: List[str],
    libvirt_uri: str = DEFAULT_LIBVIRT_URI,
    state_dir: str = DEFAULT_INSTALL_STATE_DIR,
    timeouts: Optional[Dict[str, float]] = None,
    path: Optional[List[str]] = None,
    detach: Optional[str] = None,
) -> JsonObj:
    """The configuration `install` writes for these options.

    The NixOS module writes the same for the same options: nixos/config.nix
    (agentConfig, with these defaults) is its twin, and
    tests/tower/test_nixos.py holds the two to each other. Every timeout is
    written, as seconds in floating point, so the file says what applies.
    """
    seconds: Dict[str, float] = dict(TIMEOUT_DEFAULTS)
    seconds.update(timeouts or {})
    data: JsonObj = {
        "libvirt_uri": libvirt_uri,
        "gpu_node": gpu_node,
        "gaming": list(gaming),
        "state_dir": state_dir,
        "timeouts": {kind: float(value) for kind, value in seconds.items()},
    }
    if path:
        data["path"] = list(path)
    if detach:
        data["detach"] = detach
    return data


def hook_script(program: str, config_path: str) -> str:
    """The libvirt qemu hook: libvirt's arguments to the `hook` verb, as is
    (nixos/config.nix, hookScript, writes the same text).

    libvirtd runs the hook, and waits for it, at every step of every
    domain's start and stop (prepare, start, started, stopped, release: five
    times a start and stop), and only "prepare begin" may ask for the cards
    (verb_hook): the shell answers the other four itself, sparing a start of
    this program on the way to each VM's boot. Leaving the domain XML on
    stdin unread is safe: libvirt's vircommand.c (virCommandProcessIO)
    ignores the EPIPE ("child closed stdin early")."""
    return (
        "#!/bin/sh\n# libvirt qemu hook of gpu-handoff: records, never waits.\n"
        '[ "$2 $3" = "prepare begin" ] || exit 0\n'
        f'exec {shlex.quote(program)} --config {shlex.quote(config_path)} hook "$@"\n'
    )


def authorized_keys_line(program: str, config_path: str, key: str) -> str:
    """The line that lets `key` run the agent's `serve` and nothing else
    (nixos/config.nix, authorizedKeysLine, builds the same)."""
    return f'restrict,command="{program} --config {config_path} serve" {key}'


def _os_release_id(text: str) -> str:
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key == "ID":
            return value.strip().strip("\"'")
    return ""


def is_nixos(root: str) -> bool:
    """Whether the system under `root` ("" for this one) is NixOS."""
    if os.path.lexists(_rooted(root, NIXOS_MARKER)):
        return True
    for name in OS_RELEASE_FILES:
        try:
            with open(_rooted(root, name), encoding="utf-8") as handle:
                text = handle.read(OS_RELEASE_MAX)
        except _READ_ERRORS:
            continue
        return _os_release_id(text) == "nixos"
    return False


def nix_string(text: str) -> str:
    """`text` as a Nix string literal."""
    for plain, escaped in _NIX_ESCAPES:
        text = text.replace(plain, escaped)
    return f'"{text}"'


def nix_number(value: float) -> str:
    """A positive finite number as a Nix literal (Nix has no `1e-05`)."""
    if value.is_integer() and value < 1e15:
        return str(int(value))
    text = repr(value)
    mantissa, sep, exponent = text.partition("e")
    if sep and "." not in mantissa:
        text = f"{mantissa}.0e{exponent}"
    return text


def nixos_module_path() -> Optional[str]:
    """nixos/module.nix of the checkout this program runs from, if it is one."""
    here = os.path.dirname(program_path())
    top = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    module = os.path.join(top, NIXOS_MODULE_IN_CHECKOUT)
    return module if os.path.isfile(module) else None


# A name every useradd takes (POSIX portable characters, lower case, 32 at
# most): never an option, never a path.
USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
CONFIG_MODE = 0o644
# The first line of this module's docstring: how `update` knows the program
# it replaces is this agent (in the first AGENT_HEAD bytes of the file).
AGENT_MARKER = b"gpu-handoff: the tower agent of GPU Handoff."
AGENT_HEAD = 4096
PROGRAM_MAX = 16 << 20
VERSION_LINE_RE = re.compile(rb'^VERSION = "([0-9A-Za-z.+-]{1,40})"$', re.MULTILINE)


def nixos_snippet(opts: Dict[str, Any], module: Optional[str]) -> str:
    """What to add to a NixOS configuration for `install`'s options: the
    module's options, only those that differ from its defaults."""
    settings = [
        "enable = true;",
        f"user = {nix_string(opts['user'])};",
        f"gpuNode = {nix_string(opts['gpu_node'])};",
        "gaming = [ " + " ".join(nix_string(g) for g in opts["gaming"]) + " ];",
    ]
    if opts["uri"] != DEFAULT_LIBVIRT_URI:
        settings.append(f"libvirtUri = {nix_string(opts['uri'])};")
    if opts["state_dir"] != DEFAULT_INSTALL_STATE_DIR:
        settings.append(f"stateDir = {nix_string(opts['state_dir'])};")
    settings.extend(
        f"timeouts.{kind} = {nix_number(seconds)};"
        for kind, seconds in opts["timeouts"].items()
    )
    if opts["detach"]:
        settings.append(f"detach = {nix_string(opts['detach'])};")
    if opts["key"]:
        settings += [
            "# Home Assistant's public key.",
            f"authorizedKeys = [ {nix_string(opts['key'])} ];",
        ]
    else:
        settings += [
            "# Home Assistant's public key: the end of the line its setup shows.",
            f"authorizedKeys = [ {nix_string(PLACEHOLDER_KEY)} ];",
        ]
    where = nix_string(module or NIXOS_MODULE_PLACEHOLDER)
    return "\n".join(
        [
            "# GPU Handoff on NixOS: a module for the system configuration",
            "# (README, Tower setup, NixOS); then run nixos-rebuild switch.",
            "{",
            f"  imports = [ {where} ];",
            "  services.gpu-handoff = {",
            *(f"    {line}" for line in settings),
            "  };",
            "}",
        ]
    )


def _rooted(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root else path


# Options that take no value, and the option each sets.
_INSTALL_FLAGS = {
    "--force": "force",
    "--create-user": "create_user",
    "--join-libvirt-group": "join_libvirt_group",
    "--restart-libvirt": "restart_libvirt",
}


def _install_options(args: List[str], config_option: Optional[str]) -> Dict[str, Any]:
    opts: Dict[str, Any] = {
        "user": None,
        "gpu_node": None,
        "gaming": [],
        "uri": DEFAULT_LIBVIRT_URI,
        "prefix": None,
        "root": "",
        "state_dir": DEFAULT_INSTALL_STATE_DIR,
        "detach": None,
        "config": config_option,
        "timeouts": {},
        "key": None,
        "key_blob": b"",
    }
    opts.update(dict.fromkeys(_INSTALL_FLAGS.values(), False))
    names = {
        "--user": "user",
        "--gpu-node": "gpu_node",
        "--gaming": "gaming",
        "--uri": "uri",
        "--prefix": "prefix",
        "--root": "root",
        "--state-dir": "state_dir",
        "--detach": "detach",
        "--config": "config",
        "--authorize-key": "key",
    }
    names.update({f"--timeout-{kind}": kind for kind in TIMEOUT_DEFAULTS})
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _INSTALL_FLAGS:
            opts[_INSTALL_FLAGS[arg]] = True
            i += 1
            continue
        key, _, value = arg.partition("=")
        if key not in names:
            raise AgentError(ERR_BAD_REQUEST, f"install: unknown option {arg!r}")
        if not _:
            if i + 1 >= len(args):
                raise AgentError(ERR_BAD_REQUEST, f"install: {key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if names[key] == "gaming":
            opts["gaming"].append(value)
        elif names[key] in TIMEOUT_DEFAULTS:
            opts["timeouts"][names[key]] = _install_seconds(key, value)
        elif names[key] == "key":
            opts["key"], opts["key_blob"] = parse_public_key(value)
        else:
            opts[names[key]] = value
    if not opts["user"] or not opts["gpu_node"] or not opts["gaming"]:
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --user, --gpu-node and at least one --gaming are required",
        )
    if not local_libvirt_uri(opts["uri"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: --uri {opts['uri']!r} is not this machine's libvirt: "
            "qemu:///system or qemu:///session (a URI naming a host, or with "
            "parameters, could run programs or read keys as root)",
        )
    if opts["create_user"] and not USER_NAME_RE.match(opts["user"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: --create-user makes only a user named like {USER_NAME_RE.pattern}",
        )
    return opts


def _install_seconds(option: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise AgentError(
            ERR_BAD_REQUEST, f"install: {option} takes a positive number of seconds"
        )
    return seconds


def _install_data(opts: Dict[str, Any]) -> JsonObj:
    data = agent_config(
        gpu_node=opts["gpu_node"],
        gaming=opts["gaming"],
        libvirt_uri=opts["uri"],
        state_dir=opts["state_dir"],
        timeouts=opts["timeouts"],
        detach=opts["detach"],
    )
    problems = validate_config(data)
    if problems:
        raise AgentError(ERR_CONFIG_INVALID, "; ".join(problems))
    return data


def install_on_nixos(opts: Dict[str, Any], err: IO[str]) -> JsonObj:
    """NixOS installs nothing by hand (/etc, the accounts and the libvirt hooks
    are the system configuration's): what to add to it instead, writing
    nothing. --create-user, --join-libvirt-group and --restart-libvirt do
    nothing here: the module declares the user and its groups."""
    if opts["prefix"] is not None or opts["config"] not in (None, DEFAULT_CONFIG_PATH):
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --prefix and --config do not apply on NixOS, where the "
            "module decides where the program and its configuration live",
        )
    _install_data(opts)  # the same checks as elsewhere, before anything is shown
    snippet = nixos_snippet(opts, nixos_module_path())
    notes = [
        "This is NixOS: nothing was written. Add this to the system configuration:",
        snippet,
        "Once switched, restart libvirtd so it loads the hook: systemctl restart libvirtd",
    ]
    for line in notes:
        err.write(line + "\n")
    return reply_ok(installed=[], nixos=True, nixos_module=snippet, notes=notes)


def _install_steps(
    *,
    opts: Dict[str, Any],
    account: Optional[pwd.struct_passwd],
    files: Dict[str, str],
    data: JsonObj,
    env: Dict[str, str],
    undo: Undo,
) -> Tuple[pwd.struct_passwd, JsonObj]:
    """Every step that changes the tower, in order; each registers its undo."""
    done: JsonObj = {"user_created": account is None}
    if account is None:
        account = create_user(opts["user"], env, undo)
    if opts["join_libvirt_group"]:
        done["libvirt_group"] = join_libvirt_group(account, env, undo)
    program = own_program()
    install_file(files["program"], program, PROGRAM_MODE, undo)
    installed = [files["program"]]
    cache = compiled_program(files["program_name"], program)
    if cache is not None:
        cached = _rooted(files["root"], cache[0])
        install_file(cached, cache[1], CONFIG_MODE, undo)
        installed.append(cached)
    config_text = json.dumps(data, indent=2) + "\n"
    install_file(files["config"], config_text.encode(), CONFIG_MODE, undo)
    install_state_dir(files["state"], account, undo)
    installed += [files[k] for k in ("config", "state")]
    if os.path.isdir(_rooted(files["root"], "/usr/lib/tmpfiles.d")):
        entry = tmpfiles_entry(opts["state_dir"], account)
        install_file(files["tmpfiles"], entry, CONFIG_MODE, undo)
        installed.append(files["tmpfiles"])
    hook = hook_script(files["program_name"], files["config_name"])
    install_file(files["hook"], hook.encode(), PROGRAM_MODE, undo)
    done["installed"] = [*installed, files["hook"]]
    if not files["root"]:
        done["linger"] = enable_linger(account, env, undo)
    # Last: nothing after it can fail, and it leaves nothing behind when it does.
    if opts["key"]:
        home = _rooted(files["root"], account.pw_dir)
        line = authorized_keys_line(
            files["program_name"], files["config_name"], opts["key"]
        )
        done["authorized_key"] = authorize_key(account, home, line, opts["key_blob"])
    return account, done


def _install_failed(error: Exception, left: List[str]) -> AgentError:
    if isinstance(error, StepError):
        reason, message = error.reason, error.message
    else:
        reason, message = errno_name(error), f"install: {error}"
    if left:
        message += f"; could not undo: {', '.join(left)}"
    else:
        message += "; everything this install did was undone"
    return AgentError(ERR_INSTALL_FAILED, message, reason=reason, left=left)


def _install_notes(opts: Dict[str, Any], done: JsonObj, key_line: str) -> List[str]:
    user = opts["user"]
    notes: List[str] = []
    if done["user_created"]:
        notes.append(f"Made the user {user} (key logins only: no password).")
    if "authorized_key" in done:
        key = done["authorized_key"]
        notes.append(f"Home Assistant's key is in {key['path']} ({key['action']}).")
    else:
        notes += [f"Add this line to ~{user}/.ssh/authorized_keys:", f"  {key_line}"]
    if done.get("linger") == "enabled":
        notes.append(
            f"{user} lingers (loginctl enable-linger): its jobs outlive the SSH "
            "session that starts them."
        )
    group = done.get("libvirt_group")
    if group is None:
        notes.append(
            f"{user} must be in the libvirt group: usermod -aG {LIBVIRT_GROUP} {user}"
        )
    elif group == "added":
        notes.append(f"Added {user} to the libvirt group.")
    elif group == "missing":
        notes.append(
            f"This system has no {LIBVIRT_GROUP} group: {user} needs access to "
            f"libvirt some other way (virsh -c {opts['uri']} must work as {user})."
        )
    restart = done.get("libvirt_restart")
    if restart is None:
        notes.append(
            "Restart libvirtd so it loads the new hook: systemctl restart libvirtd"
        )
    elif restart["done"] and restart.get("restarted"):
        notes.append("Restarted libvirtd: it loads the new hook.")
    elif restart["done"]:
        notes.append(f"libvirtd was not restarted: {restart['message']}.")
    else:
        notes.append(
            f"libvirtd was not restarted ({restart['message']}): restart it so it "
            "loads the new hook: systemctl restart libvirtd"
        )
    return notes


@contextlib.contextmanager
def admin_lock(root: str, verb: str) -> Iterator[None]:
    """One install or update at a time on a system (``root``: its top
    directory, "/" without --root): an exclusive lock on that directory,
    which only root can open for it there, held until the verb ends. An
    install that Home Assistant gave up on may still run on the tower as
    root: a retry beside it would reuse what it makes, and its rollback
    remove it from under the retry. The second one is refused. (A --root
    not made yet: its nearest directory that is.)"""
    top = root or "/"
    while not os.path.isdir(top):
        top = os.path.dirname(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentError(
                ERR_INSTALL_FAILED,
                f"{verb}: another install or update of GPU Handoff is running on "
                "this tower; try again once it has ended",
                reason="EBUSY",
            ) from None
        yield
    finally:
        os.close(fd)


def verb_install(
    args: List[str], config_option: Optional[str], env: Dict[str, str], err: IO[str]
) -> JsonObj:
    opts = _install_options(args, config_option)
    root = os.path.abspath(opts["root"]) if opts["root"] else ""
    if is_nixos(root):
        return install_on_nixos(opts, err)
    if root and (opts["create_user"] or opts["join_libvirt_group"]):
        raise AgentError(
            ERR_BAD_REQUEST,
            "install: --create-user and --join-libvirt-group change this system's "
            "accounts: not with --root",
        )
    with admin_lock(root, "install"):
        return _install(opts, root, env, err)


def _install(
    opts: Dict[str, Any], root: str, env: Dict[str, str], err: IO[str]
) -> JsonObj:
    """install, under admin_lock."""
    account = lookup_account(opts["user"])
    # Not under --root: the accounts looked up are then those of the system
    # running install, not of the tree it fills, whose user ids it cannot
    # know. (The tests' --root installs are made as root, for themselves.)
    if account is not None and account.pw_uid == 0 and not root:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: {opts['user']!r} is root (user id 0): the agent needs no "
            "privilege, and Home Assistant's key must not get one",
        )
    if account is None and not opts["create_user"]:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"install: no user {opts['user']!r} (--create-user makes it)",
        )
    config_path = config_path_from(opts["config"], {})
    if not os.path.isabs(config_path):
        raise AgentError(ERR_BAD_REQUEST, "install: --config must be an absolute path")
    prefix = opts["prefix"] or DEFAULT_PREFIX
    if not os.path.isabs(prefix):
        raise AgentError(ERR_BAD_REQUEST, "install: --prefix must be an absolute path")
    program = os.path.join(prefix, "bin", "gpu-handoff")
    data = _install_data(opts)
    files = {
        "root": root,
        "program_name": program,
        "config_name": config_path,
        "program": _rooted(root, program),
        "config": _rooted(root, config_path),
        "state": _rooted(root, opts["state_dir"]),
        "hook": _rooted(root, HOOK_PATH),
        "tmpfiles": _rooted(root, TMPFILES_PATH),
    }
    if os.path.exists(files["config"]) and not opts["force"]:
        raise AgentError(
            ERR_EXISTS, f"{files['config']} exists; pass --force to overwrite it"
        )
    undo = Undo()
    try:
        account, done = _install_steps(
            opts=opts, account=account, files=files, data=data, env=env, undo=undo
        )
    except _STEP_ERRORS as error:
        raise _install_failed(error, undo.rollback()) from None
    undo.commit()
    if opts["restart_libvirt"]:
        done["libvirt_restart"] = restart_libvirt(env)
    # Check the tower with the configuration just written (relocated under
    # --root), as the SSH user: root never works in its state directory.
    check_data = dict(data)
    check_data["state_dir"] = files["state"]
    check_cfg = Config(files["config"], check_data, dict(env))
    status = as_user(account, lambda: verb_status(check_cfg), "the status check")
    findings: List[JsonObj] = status["findings"] if status.get("ok") else []
    status_error: Optional[JsonObj] = None if status.get("ok") else status["error"]
    key_line = authorized_keys_line(
        program, config_path, opts["key"] or PLACEHOLDER_KEY
    )
    notes = _install_notes(opts, done, key_line)
    if status_error:
        notes.append(f"status failed: {status_error['message']}")
    notes.extend(
        f"finding {finding['code']} ({finding['domain']}): {finding['detail']}"
        for finding in findings
    )
    for line in notes:
        err.write(line + "\n")
    return reply_ok(
        **done,
        program=program,
        config=config_path,
        hook=HOOK_PATH,
        authorized_keys_line=key_line,
        findings=findings,
        status_error=status_error,
        notes=notes,
    )
