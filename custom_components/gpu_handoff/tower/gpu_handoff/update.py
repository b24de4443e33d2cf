"""The update verb: replace an installed agent with this one."""

from __future__ import annotations

import contextlib
import os
import stat

from .accounts import PROGRAM_MODE, compiled_program, errno_name, own_program
from .install import (
    AGENT_HEAD,
    AGENT_MARKER,
    CONFIG_MODE,
    DEFAULT_PREFIX,
    PROGRAM_MAX,
    VERSION_LINE_RE,
    _rooted,
    admin_lock,
    is_nixos,
)
from .keys import _read_fd
from .state import _DIR_FLAGS, replace_file_at
from .wire import (
    ERR_BAD_REQUEST,
    ERR_INSTALL_FAILED,
    ERR_NIXOS,
    ERR_NOT_INSTALLED,
    VERSION,
    AgentError,
    JsonObj,
    reply_ok,
)

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, List, Tuple


def _update_options(args: List[str]) -> Tuple[str, str]:
    opts = {"--prefix": DEFAULT_PREFIX, "--root": ""}
    i = 0
    while i < len(args):
        key, sep, value = args[i].partition("=")
        if key not in opts:
            raise AgentError(ERR_BAD_REQUEST, f"update: unknown option {args[i]!r}")
        if not sep:
            if i + 1 >= len(args):
                raise AgentError(ERR_BAD_REQUEST, f"update: {key} needs a value")
            i += 1
            value = args[i]
        opts[key] = value
        i += 1
    if not os.path.isabs(opts["--prefix"]):
        raise AgentError(ERR_BAD_REQUEST, "update: --prefix must be an absolute path")
    return opts["--prefix"], opts["--root"]


def installed_agent(path: str) -> bytes:
    """The bytes of the agent installed at `path`; not_installed if there is
    none, or what is there is not this agent."""
    missing = AgentError(
        ERR_NOT_INSTALLED,
        f"update: no GPU Handoff agent at {path}; install it first, or pass --prefix",
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            data = _read_fd(fd, PROGRAM_MAX) if regular else b""
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise missing from None
    except OSError as error:
        raise AgentError(
            ERR_INSTALL_FAILED, f"update: {error}", reason=errno_name(error)
        ) from None
    if AGENT_MARKER not in data[:AGENT_HEAD]:
        raise missing
    return data


def verb_update(args: List[str], err: IO[str]) -> JsonObj:
    """Replace the installed program with this one, atomically; the
    configuration, the hook, the state directory and the keys stay as they are."""
    prefix, root = _update_options(args)
    root = os.path.abspath(root) if root else ""
    if is_nixos(root):
        raise AgentError(
            ERR_NIXOS,
            "update: this is NixOS: the program lives in the Nix store. Update the "
            "package of the GPU Handoff module (its source), then nixos-rebuild switch",
        )
    with admin_lock(root, "update"):
        return _update(prefix, root, err)


def _update(prefix: str, root: str, err: IO[str]) -> JsonObj:
    """update, under admin_lock."""
    path = _rooted(root, os.path.join(prefix, "bin", "gpu-handoff"))
    found = VERSION_LINE_RE.search(installed_agent(path))
    previous = found.group(1).decode() if found else None
    directory, name = os.path.split(path)
    program = own_program()
    try:
        dfd = os.open(directory, _DIR_FLAGS)
        try:
            replace_file_at(dfd, name, program, PROGRAM_MODE)
        finally:
            os.close(dfd)
    except OSError as error:
        raise AgentError(
            ERR_INSTALL_FAILED,
            f"update: {error}; {path} is as it was",
            reason=errno_name(error),
        ) from None
    notes = [
        (
            f"Updated {path} from {previous or 'an unknown version'} to "
            f"{VERSION}; the configuration, the hook and the state are as they "
            "were. Sessions already open run the previous program until they "
            "reconnect."
        )
    ]
    notes.extend(
        _update_cache(root, os.path.join(prefix, "bin", "gpu-handoff"), program)
    )
    for note in notes:
        err.write(note + "\n")
    return reply_ok(updated=path, previous=previous, version=VERSION, notes=notes)


def _update_cache(root: str, program: str, data: bytes) -> List[str]:
    """The updated program compiled beside it for this Python: a start
    without it compiles the program (slower, nothing else). A compiled
    module of the previous program is never used by this one (its source's
    hash differs)."""
    cache = compiled_program(program, data)
    if cache is None:
        return []
    path = _rooted(root, cache[0])
    directory, name = os.path.split(path)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, PROGRAM_MODE)
        dfd = os.open(directory, _DIR_FLAGS)
        try:
            replace_file_at(dfd, name, cache[1], CONFIG_MODE)
        finally:
            os.close(dfd)
    except OSError as error:
        return [
            f"{path} not written ({error}): the program compiles itself at each start"
        ]
    return []
