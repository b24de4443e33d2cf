"""A private OpenSSH server on 127.0.0.1 that forces one command, as a tower's
``authorized_keys`` line does for Home Assistant's key.

The server is the real ``sshd``; only its configuration is private (its own
host key, authorized_keys, pid file and port). Tests connect to the literal
``127.0.0.1`` (``localhost`` may resolve to ::1 first).

It logs in as root unless ``user`` names another account (see
tests/support/account.py): sshd reads authorized_keys as that user, so the
file then lives in a directory of its own under /tmp that every user may read
(kept for start_again; the test environment's /tmp is its own).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import os
from pathlib import Path
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "ssh-keygen"


def sshd_available() -> bool:
    """Whether OpenSSH's server and key generator are installed."""
    return Path(SSHD).exists() and shutil.which(SSH_KEYGEN) is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def generate_key(path: Path, passphrase: str = "") -> str:
    """Write a new ed25519 key pair at ``path`` (+ ``.pub``); return the public line."""
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(
        [
            SSH_KEYGEN,
            "-q",
            "-t",
            "ed25519",
            "-N",
            passphrase,
            "-C",
            path.name,
            "-f",
            str(path),
        ],
        check=True,
    )
    return path.with_suffix(".pub").read_text(encoding="utf-8").strip()


def key_fingerprint(private_key: Path) -> str:
    """The SHA256 fingerprint of the key pair at ``private_key`` (its ``.pub``
    beside it), as ``ssh-keygen -l`` prints it."""
    listed = subprocess.run(
        [SSH_KEYGEN, "-l", "-f", str(private_key.with_suffix(".pub"))],
        check=True,
        capture_output=True,
        text=True,
    )
    return listed.stdout.split()[1]


def client_argv(key: Path, port: int, user: str, command: str) -> list[str]:
    """OpenSSH's client logging in to 127.0.0.1:``port`` as ``user`` with
    ``key`` alone, no configuration file and no host key check, to run
    ``command``."""
    return [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(key),
        "-p",
        str(port),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        f"{user}@127.0.0.1",
        command,
    ]


@dataclass
class Sshd:
    """One running sshd whose only client key is forced to run ``command``."""

    directory: Path
    command: list[str]
    user: str = "root"
    port: int = 0
    extra_config: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    keys_dir: Path | None = field(default=None, repr=False)

    @property
    def client_key(self) -> Path:
        """Private key file of the client (Home Assistant's key)."""
        return self.directory / "client_key"

    @property
    def host_key(self) -> Path:
        """Private host key file of the server."""
        return self.directory / "host_key"

    @property
    def host_public_key(self) -> str:
        """The server's public host key line (``ssh-ed25519 AAAA...``)."""
        return self.host_key.with_suffix(".pub").read_text(encoding="utf-8").strip()

    @property
    def authorized_keys(self) -> Path:
        """The authorized_keys file sshd reads (as ``user``)."""
        if self.user == "root":
            return self.directory / "authorized_keys"
        if self.keys_dir is None:
            self.keys_dir = Path(tempfile.mkdtemp(prefix="gh-keys-", dir="/tmp"))
            self.keys_dir.chmod(0o755)
        return self.keys_dir / "authorized_keys"

    def client_argv(self, command: str) -> list[str]:
        """OpenSSH's client, logging in with the client key to run ``command``
        (the key's forced command runs instead; sshd passes this one on as
        SSH_ORIGINAL_COMMAND). Run it with ``ssh_environment()``."""
        return client_argv(self.client_key, self.port, self.user, command)

    def authorize(self, public_key: str) -> None:
        """Let ``public_key`` log in, forced to run the command (as a user would)."""
        forced = shlex.join(self.command).replace("\\", "\\\\").replace('"', '\\"')
        with self.authorized_keys.open("a", encoding="utf-8") as handle:
            handle.write(f'restrict,command="{forced}" {public_key}\n')

    @property
    def host_fingerprint(self) -> str:
        """The host key's SHA256 fingerprint as ``ssh-keygen -l`` prints it."""
        return key_fingerprint(self.host_key)

    @property
    def log(self) -> str:
        """What sshd wrote to its log so far."""
        path = self.directory / "sshd.log"
        return path.read_text(encoding="utf-8") if path.exists() else ""

    def start(self, timeout: float = 10.0) -> Sshd:
        """Write the configuration, start sshd and wait until it accepts."""
        self.directory.mkdir(parents=True, exist_ok=True)
        client_line = generate_key(self.client_key)
        generate_key(self.host_key)
        self.authorized_keys.write_text("", encoding="utf-8")
        self.authorized_keys.chmod(0o644)
        self.authorize(client_line)
        self.port = self.port or _free_port()
        config = self.directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.directory / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "AuthenticationMethods publickey",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    f"AllowUsers {self.user}",
                    "LogLevel VERBOSE",
                    *self.extra_config,
                    "",
                ]
            ),
            encoding="utf-8",
        )
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation
        return self.start_again(timeout)

    def start_again(self, timeout: float = 10.0) -> Sshd:
        """Start the configured server (again): same port, same keys."""
        config = self.directory / "sshd_config"
        log = self.directory / "sshd.log"
        self.process = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config), "-E", str(log)],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"sshd exited with {self.process.returncode}: {self.log}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sshd did not listen on port {self.port}: {self.log}")

    def cut_connections(self) -> None:
        """Kill sshd's per-connection processes (SIGKILL): every connection
        drops at once; the listener stays, so clients can connect again."""
        if self.process is None:
            return
        for pid in _descendants(self.process.pid):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8")
                if comm.startswith("sshd"):
                    os.kill(pid, signal.SIGKILL)
            except OSError, ProcessLookupError:
                continue

    def stop(self) -> None:
        """Stop sshd and every session it still serves (the tower goes away)."""
        if self.process is None:
            return
        sessions = _descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process = None


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (sshd forks one per connection)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ssh_environment() -> dict[str, str]:
    """Environment for OpenSSH's client: no agent, no user configuration."""
    env = {
        key: value for key, value in os.environ.items() if not key.startswith("SSH_")
    }
    env["HOME"] = "/nonexistent"
    return env
