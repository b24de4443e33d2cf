"""Installing, Home Assistant's key: checked, and authorized with a forced command.

The key is parsed as OpenSSH does, and its line in ``authorized_keys`` runs
only the agent's ``serve``, with no forwarding and no terminal.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import pwd
import stat

from .accounts import StepError, as_user, errno_name
from .state import _DIR_FLAGS, replace_file_at
from .wire import ERR_BAD_REQUEST, ERR_INSTALL_FAILED, AgentError, JsonObj, reply_ok

# For the type checker only (see the package's docstring).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional, Tuple

# The key types an OpenSSH public key line for Home Assistant may name.
KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
# A 16384-bit RSA key is 2.8 KB of base64.
KEY_LINE_MAX = 8192
SSH_DIR = ".ssh"
SSH_DIR_MODE = 0o700
AUTHORIZED_KEYS = "authorized_keys"
AUTHORIZED_KEYS_MODE = 0o600
AUTHORIZED_KEYS_MAX = 4 << 20


def _key_type_of(blob: bytes) -> bytes:
    """The first field of an SSH key blob: the key type, as an RFC 4253 string
    (a 32-bit big-endian length, then the bytes); b"" if it is not one."""
    size = int.from_bytes(blob[:4], "big")
    name = blob[4 : 4 + size]
    return name if len(blob) >= 4 and len(name) == size else b""


def _decoded_key(kind: bytes, text: bytes) -> Optional[bytes]:
    """A base64 key blob's bytes, if they name the key type `kind`."""
    try:
        blob = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        return None
    return blob if blob and _key_type_of(blob) == kind else None


def parse_public_key(line: str) -> Tuple[str, bytes]:
    """An OpenSSH public key line `TYPE BASE64 [COMMENT]`, checked: the line
    as authorized_keys will hold it, and the key's bytes."""
    prefix = "install: --authorize-key takes an OpenSSH public key line"
    if len(line) > KEY_LINE_MAX or not line.isprintable():
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: one line, printable characters")
    fields = line.split(None, 2)
    if len(fields) < 2:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: TYPE BASE64 [COMMENT]")
    kind, text = fields[0], fields[1]
    comment = fields[2].strip() if len(fields) == 3 else ""
    if kind not in KEY_TYPES:
        raise AgentError(
            ERR_BAD_REQUEST,
            f"{prefix}: {kind[:40]!r} is not one of {', '.join(KEY_TYPES)}",
        )
    blob = _decoded_key(kind.encode(), text.encode())
    if blob is None:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: its key is not a {kind} key")
    if '"' in comment or "'" in comment:
        raise AgentError(ERR_BAD_REQUEST, f"{prefix}: its comment has quotes")
    return " ".join(field for field in (kind, text, comment) if field), blob


def _past_options(text: bytes) -> bytes:
    """What follows an authorized_keys line's options, as sshd skips them
    (sshkey_advance_past_options): up to the first blank outside double
    quotes, a backslash-quote being no quote."""
    quoted = False
    i = 0
    while i < len(text) and (quoted or text[i] not in b" \t"):
        if text[i : i + 2] == b'\\"':
            i += 1
        elif text[i : i + 1] == b'"':
            quoted = not quoted
        i += 1
    return text[i:]


def authorized_key_of(line: bytes) -> Optional[bytes]:
    """The key an authorized_keys line holds (its bytes), with or without
    options before it; None for a comment, a blank line or a line sshd
    could not read a key from."""
    text = line.strip()
    if not text or text.startswith(b"#"):
        return None
    for rest in (text, _past_options(text)):
        fields = rest.split(None, 2)
        if len(fields) >= 2:
            blob = _decoded_key(fields[0], fields[1])
            if blob is not None:
                return blob
    return None


def authorized_keys_content(
    old: bytes, line: str, blob: bytes
) -> Tuple[Optional[bytes], str]:
    """authorized_keys with `line` in it (None: unchanged), and what changed:
    "present" (the line is there, the key's only one), "replaced" (the key's
    first line becomes `line`, its other lines go) or "added" (at the end).
    Every other line is kept byte for byte, and the file ends with a newline."""
    new = line.encode()
    parts = old.split(b"\n")
    last = parts.pop()
    lines = [part + b"\n" for part in parts] + ([last + b"\n"] if last else [])
    mine = [i for i, text in enumerate(lines) if authorized_key_of(text) == blob]
    if len(mine) == 1 and lines[mine[0]].rstrip(b"\r\n") == new:
        return None, "present"
    if not mine:
        return b"".join([*lines, new + b"\n"]), "added"
    lines[mine[0]] = new + b"\n"
    kept = [text for i, text in enumerate(lines) if i not in mine[1:]]
    return b"".join(kept), "replaced"


def _read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from the descriptor, up to its end."""
    chunks: List[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _read_authorized_keys(ssh_fd: int) -> Tuple[bytes, int]:
    """authorized_keys' bytes and mode (b"" and 0600 when missing); never
    through a symbolic link."""
    try:
        fd = os.open(
            AUTHORIZED_KEYS,
            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            dir_fd=ssh_fd,
        )
    except FileNotFoundError:
        return b"", AUTHORIZED_KEYS_MODE
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", AUTHORIZED_KEYS)
        data = _read_fd(fd, AUTHORIZED_KEYS_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > AUTHORIZED_KEYS_MAX:
        raise OSError(errno.EFBIG, "too large for authorized_keys", AUTHORIZED_KEYS)
    return data, stat.S_IMODE(st.st_mode)


def write_authorized_key(home: str, line: str, blob: bytes) -> JsonObj:
    """Put `line` in HOME/.ssh/authorized_keys, as whoever runs this (as_user
    makes it the account): ~/.ssh made 0700 and the file 0600 when missing,
    the file never reached through a symbolic link, and replaced atomically
    (its mode kept). On failure, nothing is changed."""
    home_fd = os.open(home, _DIR_FLAGS)
    try:
        made = False
        try:
            ssh_fd = os.open(SSH_DIR, _DIR_FLAGS, dir_fd=home_fd)
        except FileNotFoundError:
            os.mkdir(SSH_DIR, SSH_DIR_MODE, dir_fd=home_fd)
            made = True
            ssh_fd = os.open(SSH_DIR, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=home_fd)
        try:
            if made:
                os.fchmod(ssh_fd, SSH_DIR_MODE)
            old, mode = _read_authorized_keys(ssh_fd)
            new, action = authorized_keys_content(old, line, blob)
            if new is not None:
                replace_file_at(ssh_fd, AUTHORIZED_KEYS, new, mode)
        except BaseException:
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(SSH_DIR, dir_fd=home_fd)
            raise
        finally:
            os.close(ssh_fd)
    finally:
        os.close(home_fd)
    return {"path": os.path.join(home, SSH_DIR, AUTHORIZED_KEYS), "action": action}


def authorize_key(
    account: pwd.struct_passwd, home: str, line: str, blob: bytes
) -> JsonObj:
    """write_authorized_key as the account; a failure is a StepError."""

    def work() -> JsonObj:
        try:
            return reply_ok(authorized_key=write_authorized_key(home, line, blob))
        except OSError as error:
            raise AgentError(
                ERR_INSTALL_FAILED, f"install: {error}", reason=errno_name(error)
            ) from None

    answer = as_user(account, work, "writing authorized_keys")
    if not answer.get("ok"):
        error = answer["error"]
        raise StepError(str(error.get("reason", "internal")), str(error["message"]))
    result: JsonObj = answer["authorized_key"]
    return result
