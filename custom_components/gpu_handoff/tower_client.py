"""Client for the tower agent over SSH; knows nothing about Home Assistant.

One persistent asyncssh connection per tower, host key pinned. Every request is
one SSH exec whose command line becomes the agent's ``SSH_ORIGINAL_COMMAND``
(the tower's ``authorized_keys`` forces ``gpu-handoff serve``); the agent
answers one JSON object per line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
import contextlib
from dataclasses import dataclass
import json
import shlex
from typing import Any, Final

import asyncssh

from .tower import gpu_handoff as agent

PROTOCOL: Final = agent.PROTOCOL
CONNECT_TIMEOUT: Final = 10.0
REQUEST_TIMEOUT: Final = 30.0
KEEPALIVE_INTERVAL: Final = 15
KEEPALIVE_COUNT_MAX: Final = 3
# Exit status OpenSSH reports when the forced command does not exist.
EXIT_COMMAND_NOT_FOUND: Final = 127


# What asyncssh raises when the connection died under a request: any
# disconnect (ConnectionLost, a protocol error, ...) once the connection was up.
_CONNECTION_LOST: Final = (
    asyncssh.ChannelOpenError,
    asyncssh.DisconnectError,
    BrokenPipeError,
    ConnectionError,
)


class TowerError(Exception):
    """Base of every error talking to the tower."""


class TowerConnectionError(TowerError):
    """The tower cannot be reached (network, SSH handshake, timeout)."""


class TowerAuthError(TowerError):
    """The tower refused the key."""


class TowerHostKeyError(TowerError):
    """The tower's host key is not the pinned one."""


class AgentMissingError(TowerError):
    """The forced command is not the GPU Handoff agent (absent or not JSON)."""


class AgentVersionError(TowerError):
    """The agent speaks another protocol version."""

    def __init__(self, protocol: object) -> None:
        super().__init__(f"agent protocol {protocol!r}, expected {PROTOCOL}")
        self.protocol = protocol


class AgentCommandError(TowerError):
    """The agent answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True)
class TowerCredentials:
    """Where the tower is and how to log in; ``host_key`` is the pinned key."""

    host: str
    port: int
    username: str
    private_key: str
    passphrase: str | None = None
    host_key: str

    def __repr__(self) -> str:
        """Never show the key material."""
        return f"TowerCredentials(host={self.host!r}, port={self.port}, username={self.username!r})"


def generate_key_pair() -> tuple[str, str]:
    """A new ed25519 key pair: (OpenSSH private key, public key line)."""
    key = asyncssh.generate_private_key(
        "ssh-ed25519", comment="home-assistant-gpu-handoff"
    )
    private = key.export_private_key("openssh").decode()
    public = key.export_public_key("openssh").decode().strip()
    return private, public


def load_private_key(
    private_key: str, passphrase: str | None = None
) -> asyncssh.SSHKey:
    """Parse a private key; ``TowerAuthError`` if unreadable or the passphrase is
    wrong. CPU-heavy for encrypted keys (bcrypt KDF): run it in an executor."""
    try:
        return asyncssh.import_private_key(private_key, passphrase)
    except (asyncssh.KeyImportError, ValueError, TypeError) as err:
        raise TowerAuthError(f"cannot read the private key: {err}") from err


def public_key_of(private_key: str, passphrase: str | None = None) -> str:
    """The public key line of a private key (see ``load_private_key``)."""
    key = load_private_key(private_key, passphrase)
    return key.export_public_key("openssh").decode().strip()


def fingerprint(public_key: str) -> str:
    """SHA256 fingerprint of a public key line, as ``ssh-keygen -l`` prints it."""
    return str(asyncssh.import_public_key(public_key).get_fingerprint("sha256"))


def authorized_keys_line(
    public_key: str, agent_command: str = "gpu-handoff serve"
) -> str:
    """The line the tower's ``authorized_keys`` needs for this key."""
    return f'restrict,command="{agent_command}" {public_key}'


async def fetch_host_key(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str:
    """The tower's current host key, to show its fingerprint before pinning it."""
    try:
        async with asyncio.timeout(timeout):
            key = await asyncssh.get_server_host_key(host, port)
    except (OSError, TimeoutError, asyncssh.Error) as err:
        raise TowerConnectionError(f"cannot reach {host}:{port}: {err}") from err
    if key is None:  # pragma: no cover - asyncssh returns None only for a bad call
        raise TowerConnectionError(f"{host}:{port} sent no host key")
    return key.export_public_key("openssh").decode().strip()


def parse_reply(line: str) -> dict[str, Any]:
    """One agent reply; raises the matching error for an error reply."""
    try:
        reply = json.loads(line)
    except ValueError as err:
        raise AgentMissingError(
            f"the tower answered something other than JSON: {line[:200]!r}"
        ) from err
    if not isinstance(reply, dict):
        raise AgentMissingError("the tower answered JSON that is not an object")
    if reply.get("protocol") != PROTOCOL:
        raise AgentVersionError(reply.get("protocol"))
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise AgentCommandError(
            str(error.get("code", "unknown")), str(error.get("message", ""))
        )
    return reply


class TowerClient:
    """One tower: a persistent SSH connection, reconnected on demand."""

    def __init__(self, credentials: TowerCredentials) -> None:
        """Prepare the client; ``connect`` or the first request opens the connection."""
        self._credentials = credentials
        self._conn: asyncssh.SSHClientConnection | None = None
        self._key: asyncssh.SSHKey | None = None
        self._lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        """Whether a connection is open now."""
        return self._conn is not None and not self._conn.is_closed()

    async def connect(self) -> None:
        """Open the connection if it is not open."""
        await self._connection()

    async def _open(self) -> asyncssh.SSHClientConnection:
        creds = self._credentials
        if self._key is None:
            self._key = await asyncio.get_running_loop().run_in_executor(
                None, load_private_key, creds.private_key, creds.passphrase
            )
        key = self._key
        try:
            pinned = asyncssh.import_public_key(creds.host_key)
        except (asyncssh.KeyImportError, ValueError) as err:
            raise TowerHostKeyError(
                f"the pinned host key is unreadable: {err}"
            ) from err
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                return await asyncssh.connect(
                    creds.host,
                    creds.port,
                    username=creds.username,
                    client_keys=[key],
                    known_hosts=([pinned], [], []),
                    config=None,
                    agent_path=None,
                    password=None,
                    kbdint_auth=False,
                    keepalive_interval=KEEPALIVE_INTERVAL,
                    keepalive_count_max=KEEPALIVE_COUNT_MAX,
                )
        except asyncssh.HostKeyNotVerifiable as err:
            raise TowerHostKeyError(str(err)) from err
        except asyncssh.PermissionDenied as err:
            raise TowerAuthError(str(err)) from err
        except (OSError, TimeoutError, asyncssh.Error) as err:
            raise TowerConnectionError(
                f"cannot reach {creds.host}:{creds.port}: {err}"
            ) from err

    async def close(self) -> None:
        """Close the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            await conn.wait_closed()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._open()
            return self._conn

    async def _session[T](
        self, start: Callable[[asyncssh.SSHClientConnection], Awaitable[T]]
    ) -> T:
        """Run ``start`` on the connection; reconnect once if the connection died
        under us (tower rebooted, network blip)."""
        lost: Exception | None = None
        for _attempt in range(2):
            conn = await self._connection()
            try:
                return await start(conn)
            except _CONNECTION_LOST as err:
                await self.close()
                lost = err
        raise TowerConnectionError(f"connection lost: {lost}") from lost

    async def call(
        self, verb: str, *args: str, timeout: float = REQUEST_TIMEOUT
    ) -> dict[str, Any]:
        """Run one agent verb and return its reply; errors raise ``TowerError``s."""
        command = shlex.join([verb, *args])

        async def run(
            conn: asyncssh.SSHClientConnection,
        ) -> asyncssh.SSHCompletedProcess:
            return await conn.run(command, check=False, stdin=asyncssh.DEVNULL)

        try:
            async with asyncio.timeout(timeout):
                result = await self._session(run)
        except TimeoutError as err:
            raise TowerConnectionError(
                f"{verb} did not answer within {timeout} s"
            ) from err
        return self._reply_of(result)

    @staticmethod
    def _reply_of(result: asyncssh.SSHCompletedProcess) -> dict[str, Any]:
        stdout = result.stdout if isinstance(result.stdout, str) else ""
        lines = [line for line in stdout.splitlines() if line.strip()]
        if not lines:
            if result.exit_status == EXIT_COMMAND_NOT_FOUND:
                raise AgentMissingError(
                    "the agent is not installed where authorized_keys points"
                )
            stderr = result.stderr if isinstance(result.stderr, str) else ""
            raise AgentMissingError(
                f"no answer (exit status {result.exit_status}): {stderr.strip()[:200]}"
            )
        return parse_reply(lines[-1])

    async def version(self) -> dict[str, Any]:
        """The agent's version reply."""
        return await self.call("version")

    async def status(self) -> dict[str, Any]:
        """Every managed domain, card ownership and findings."""
        return await self.call("status")

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        """The agent's event stream; ends when the tower closes it."""

        async def start(
            conn: asyncssh.SSHClientConnection,
        ) -> asyncssh.SSHClientProcess[str]:
            return await conn.create_process("watch", stdin=asyncssh.PIPE)

        process = await self._session(start)
        try:
            async for line in process.stdout:
                yield self._stream_message(line)
        except _CONNECTION_LOST as err:
            await self.close()
            raise TowerConnectionError(f"event stream lost: {err}") from err
        finally:
            process.close()
            with contextlib.suppress(*_CONNECTION_LOST):
                await process.wait_closed()

    @staticmethod
    def _stream_message(line: str) -> dict[str, Any]:
        """One line of the watch stream; errors raise like replies do."""
        try:
            message = json.loads(line)
        except ValueError as err:
            raise AgentMissingError(
                f"watch sent something other than JSON: {line[:200]!r}"
            ) from err
        if not isinstance(message, dict) or message.get("protocol") != PROTOCOL:
            raise AgentVersionError(
                message.get("protocol") if isinstance(message, dict) else None
            )
        if message.get("type") == "error" or message.get("ok") is False:
            error = message.get("error") or {}
            raise AgentCommandError(
                str(error.get("code", "unknown")), str(error.get("message", ""))
            )
        return message
