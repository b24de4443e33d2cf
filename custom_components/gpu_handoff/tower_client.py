"""Client for the tower agent over SSH; knows nothing about Home Assistant.

One persistent asyncssh connection per tower, host key pinned. On it, one
long-lived agent session (``session``): newline-delimited JSON requests with
ids, their replies, and what the agent pushes (libvirt events, job progress,
the tower's state). One-shot requests (one SSH exec each, whose command line
becomes the agent's ``SSH_ORIGINAL_COMMAND``; the tower's ``authorized_keys``
forces ``gpu-handoff serve``) serve the config flow's first checks and the
time while no session is open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import contextlib
from dataclasses import dataclass
import json
import shlex
from typing import Any, Final

import asyncssh

from .protocol import (
    PROTOCOL,
    Hello,
    JobKind,
    JobRecord,
    ProtocolError,
    Push,
    Screenshot,
    StatusPush,
    Submitted,
    TowerStatus,
    Version,
    decode_line,
    error_of,
    parse_job_reply,
    parse_push,
    parse_screenshot,
    parse_status,
    parse_submitted,
    parse_version,
)

ERR_UNKNOWN_REQUEST: Final = "unknown_request"
CONNECT_TIMEOUT: Final = 10.0
REQUEST_TIMEOUT: Final = 30.0
# A screenshot is shown or saved now or not at all.
SCREENSHOT_TIMEOUT: Final = 10.0
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
    """The agent speaks another protocol version (or sends shapes of another)."""

    def __init__(self, protocol: object, detail: str | None = None) -> None:
        message = f"agent protocol {protocol!r}, expected {PROTOCOL}"
        super().__init__(f"{message}: {detail}" if detail else message)
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


def pinned_host(pinned: asyncssh.SSHKey) -> dict[str, Any]:
    """What every connection to a tower gives asyncssh besides its login: the
    pinned host key as the only one trusted, its algorithms as the only ones
    asked for, and nothing asyncssh would otherwise take from Home
    Assistant's home or environment when an argument is left out
    (``~/.ssh/config``, ``~/.ssh/known_hosts``, the X.509 CAs of
    ``~/.ssh/ca-bundle.crt`` and ``~/.ssh/crt/``, which it trusts before
    the pinned key, an ssh-agent's keys, Kerberos credentials)."""
    return {
        "known_hosts": ([pinned], [], []),
        "server_host_key_algs": [
            algorithm.decode("ascii") for algorithm in pinned.sig_algorithms
        ],
        "x509_trusted_certs": None,
        "x509_trusted_cert_paths": None,
        "config": None,
        "agent_path": None,
        "gss_kex": False,
        "gss_auth": False,
    }


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
            # (config=None: not a host, port or ProxyCommand of ~/.ssh/config)
            key = await asyncssh.get_server_host_key(host, port, config=None)
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
        # The long-lived agent session, while one is open (see open_session).
        self.session: TowerSession | None = None

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
                    password=None,
                    kbdint_auth=False,
                    keepalive_interval=KEEPALIVE_INTERVAL,
                    keepalive_count_max=KEEPALIVE_COUNT_MAX,
                    **pinned_host(pinned),
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

    async def version(self) -> Version:
        """What the agent is and which protocol it speaks (one-shot)."""
        return _parsed(parse_version, await self.call("version"))

    async def status(self) -> TowerStatus:
        """The tower's state now: asked of the session while one is open (the
        agent answers from the state it keeps, after anything it has not
        taken in yet, in milliseconds), else one-shot. Decisions are made on
        this, never on the last push, which may lag a job that just ended."""
        session = self.session
        if session is not None and not session.closed:
            await session.request("status")
            if session.status is not None:
                return session.status
        return _parsed(parse_status, await self.call("status"))

    async def request(
        self,
        verb: str,
        *args: str,
        request_id: str | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """One verb over the session if one is open, else one-shot. A job
        request carries its request id either way, so sending it again after
        a lost reply can never create a second job."""
        session = self.session
        if session is not None and not session.closed:
            return await session.request(
                verb, *args, request_id=request_id, timeout=timeout
            )
        words = [*args, f"--request={request_id}"] if request_id else list(args)
        return await self.call(verb, *words, timeout=timeout)

    async def submit(
        self, kind: JobKind, domain: str | None, request_id: str
    ) -> Submitted:
        """Ask for a tower job under ``request_id`` (chosen and stored by the
        caller first): the agent answers a repeated id with the job it made."""
        reply = await self.request(
            kind.value, *([domain] if domain else []), request_id=request_id
        )
        return _parsed(parse_submitted, reply)

    async def job(self, job_id: str) -> JobRecord:
        """A job with its steps."""
        return _parsed(parse_job_reply, await self.request("job", job_id))

    async def find_request(self, request_id: str) -> JobRecord | None:
        """The job made for ``request_id``, or None if the agent made none."""
        try:
            reply = await self.request("request", request_id)
        except AgentCommandError as err:
            if err.code == ERR_UNKNOWN_REQUEST:
                return None
            raise
        return _parsed(parse_job_reply, reply)

    async def screenshot(self, domain: str) -> Screenshot:
        """The domain's screen, as the agent sends it (a PNG from a current
        agent, converted on the tower when virsh saved a PPM)."""
        return _parsed(
            parse_screenshot,
            await self.request("screenshot", domain, timeout=SCREENSHOT_TIMEOUT),
        )

    async def open_session(self, on_push: Callable[[Push], None]) -> TowerSession:
        """Open the agent session; ``on_push`` gets every pushed message."""
        if self.session is not None and not self.session.closed:
            return self.session

        async def start(conn: asyncssh.SSHClientConnection) -> TowerSession:
            return await TowerSession.open(conn, on_push)

        self.session = await self._session(start)
        return self.session


def _parsed[T](parse: Callable[..., T], reply: dict[str, Any]) -> T:
    """A reply through its parser; a shape this side does not know means the
    agent speaks another protocol than the one it announces."""
    try:
        return parse(reply)
    except ProtocolError as err:
        raise AgentVersionError(reply.get("protocol"), str(err)) from err


class TowerSession:
    """One long-lived agent session on the tower's SSH connection: requests
    with ids and their replies, and the agent's pushed messages (libvirt
    events, job progress, the tower's state), on one channel."""

    def __init__(
        self,
        process: asyncssh.SSHClientProcess[str],
        on_push: Callable[[Push], None],
        hello: Version,
    ) -> None:
        """Use ``open``."""
        self._process = process
        self._on_push = on_push
        self.hello = hello
        self.status: TowerStatus | None = None
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._closed = asyncio.Event()
        self.close_reason: str | None = None
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name="gpu_handoff tower session"
        )

    @classmethod
    async def open(
        cls, conn: asyncssh.SSHClientConnection, on_push: Callable[[Push], None]
    ) -> TowerSession:
        """Start ``session`` on the connection and read its hello."""
        process = await conn.create_process("session", stdin=asyncssh.PIPE)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                line = await process.stdout.readline()
            hello = _hello_of(line)
        except BaseException:
            process.close()
            raise
        return cls(process, on_push, hello.version)

    @property
    def closed(self) -> bool:
        """Whether the session has ended."""
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        """Until the session ends (the tower closed it, or ``close``)."""
        await self._closed.wait()

    async def close(self) -> None:
        """End the session (the agent ends with its stdin)."""
        self._process.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        with contextlib.suppress(*_CONNECTION_LOST):
            await self._process.wait_closed()

    async def request(
        self,
        verb: str,
        *args: str,
        request_id: str | None = None,
        timeout: float = REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """Send one request and wait for its reply. A reply that does not come
        (the session ended, or ``timeout``) raises TowerConnectionError: the
        request may or may not have been carried out."""
        if self.closed:
            raise TowerConnectionError(f"session closed: {self.close_reason}")
        self._next_id += 1
        request_number = self._next_id
        message: dict[str, Any] = {
            "id": request_number,
            "verb": verb,
            "args": list(args),
        }
        if request_id is not None:
            message["request_id"] = request_id
        reply: asyncio.Future[dict[str, Any]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[request_number] = reply
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            async with asyncio.timeout(timeout):
                await self._process.stdin.drain()
                answer = await reply
        except TimeoutError as err:
            raise TowerConnectionError(
                f"{verb} got no reply within {timeout} s"
            ) from err
        except _CONNECTION_LOST as err:
            raise TowerConnectionError(f"session lost: {err}") from err
        finally:
            self._waiting.pop(request_number, None)
        if answer.get("protocol") != PROTOCOL:
            raise AgentVersionError(answer.get("protocol"))
        error = error_of(answer)
        if error is not None:
            raise AgentCommandError(error.code, error.message)
        if verb == "status":
            self.status = _parsed(parse_status, answer)
        return answer

    async def _read(self) -> None:
        reason = "the tower closed the session"
        try:
            async for line in self._process.stdout:
                if not line.strip():
                    continue
                message = _decoded(line)
                if message.get("type") == "reply":
                    waiter = self._waiting.get(message.get("id"))  # type: ignore[arg-type]
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message)
                    continue
                push = parse_push(message)
                if isinstance(push, StatusPush):
                    self.status = push.status
                self._on_push(push)
        except asyncio.CancelledError:
            reason = "closed by Home Assistant"
            raise
        except _CONNECTION_LOST as err:
            reason = f"connection lost: {err}"
        except (TowerError, ProtocolError) as err:
            reason = f"the agent sent what this side cannot read: {err}"
        finally:
            self.close_reason = reason
            self._closed.set()
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(
                        TowerConnectionError(f"session ended: {reason}")
                    )


def _hello_of(line: str) -> Hello:
    """The session's first line: it must be a hello in our protocol."""
    if not line:
        raise AgentMissingError("the session ended before it said hello")
    message = _decoded(line)
    if message.get("protocol") != PROTOCOL:
        raise AgentVersionError(message.get("protocol"))
    error = error_of(message)
    if error is not None:
        raise AgentCommandError(error.code, error.message)
    try:
        hello = parse_push(message)
    except ProtocolError as err:
        raise AgentVersionError(PROTOCOL, str(err)) from err
    if not isinstance(hello, Hello):
        raise AgentVersionError(PROTOCOL, f"expected hello, got {line[:80]!r}")
    return hello


def _decoded(line: str) -> dict[str, Any]:
    try:
        return decode_line(line)
    except ProtocolError as err:
        raise AgentMissingError(
            f"the agent sent something other than JSON: {err}"
        ) from err
