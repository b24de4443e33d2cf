"""The tower client against a real OpenSSH server that forces the real agent.

Real parts: sshd on 127.0.0.1 with a ``restrict,command=...`` authorized_keys
line, the agent program, and virsh with libvirt's test driver. Nothing mocked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
import json
import os
from pathlib import Path
import shutil
from typing import Any

import asyncssh
import pytest

from custom_components.gpu_handoff.protocol import PROTOCOL, Push, StatusPush
from custom_components.gpu_handoff.tower_client import (
    AgentCommandError,
    AgentMissingError,
    AgentVersionError,
    TowerAuthError,
    TowerClient,
    TowerConnectionError,
    TowerCredentials,
    TowerHostKeyError,
    authorized_keys_line,
    fetch_host_key,
    fingerprint,
    generate_key_pair,
    public_key_of,
)
from tests.support.sshd import Sshd, generate_key, sshd_available
from tests.support.sshhome import (
    home_with_ssh_defaults,
    options_taken_from_home,
    record_connections,
)
from tests.support.testdriver import agent_command, write_tower

pytestmark = pytest.mark.skipif(
    not (sshd_available() and shutil.which("virsh"))
    and not os.environ.get("GPU_HANDOFF_REQUIRE_SYSTEM"),
    reason="needs OpenSSH's sshd and libvirt's virsh",
)


@pytest.fixture
def sshd(tmp_path: Path, socket_enabled: None) -> Iterator[Sshd]:
    """sshd forcing the agent with a test-driver tower."""
    config = write_tower(tmp_path)
    server = Sshd(tmp_path / "sshd", agent_command(config)).start()
    yield server
    server.stop()


def credentials(server: Sshd, **changes: str) -> TowerCredentials:
    """Credentials that log in to ``server`` with its client key."""
    values = {
        "host": "127.0.0.1",
        "port": server.port,
        "username": server.user,
        "private_key": server.client_key.read_text(encoding="utf-8"),
        "host_key": server.host_public_key,
    } | changes
    return TowerCredentials(**values)  # type: ignore[arg-type]


@pytest.fixture
async def client(sshd: Sshd) -> AsyncIterator[TowerClient]:
    """A connected client."""
    tower = TowerClient(credentials(sshd))
    yield tower
    await tower.close()


async def test_version_and_status_over_forced_command(client: TowerClient) -> None:
    """The forced agent answers version and status over one reused connection."""
    version = await client.version()
    assert version.protocol == PROTOCOL
    assert "status" in version.verbs
    assert "session" in version.verbs or "request" in version.verbs
    status = await client.status()
    assert client.connected
    assert status.domains["gpu-node"].state == "running"
    assert status.domains["gaming-1"].state == "shut_off"
    holders = {card.address: card.held_by for card in status.cards}
    assert holders["0000:02:00.0"] == "gpu-node"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("status;", "id"), "not_allowed"),
        (("stop", "../x"), "unknown_domain"),
        (("stop", "not-a-vm"), "unknown_domain"),
        (("start", "gaming-1", "--force"), "bad_request"),
        (("run-job", "abc"), "not_allowed"),
        (("install",), "not_allowed"),
        (("status", "x" * 600), "bad_request"),
    ],
)
async def test_forced_command_rejects_bad_requests(
    client: TowerClient, args: tuple[str, ...], code: str
) -> None:
    """The agent refuses anything but its verbs with configured domains."""
    with pytest.raises(AgentCommandError) as err:
        await client.call(*args)
    assert err.value.code == code


async def test_shell_metacharacters_reach_no_shell(
    client: TowerClient, sshd: Sshd, tmp_path: Path
) -> None:
    """A request with shell syntax is one rejected request, not a command."""
    marker = tmp_path / "pwned"
    with pytest.raises(AgentCommandError):
        await client.call("status", f"$(touch {marker})")
    with pytest.raises(AgentCommandError):
        await client.call(f"status && touch {marker}")
    assert not marker.exists()


async def test_host_key_mismatch_refuses(sshd: Sshd, tmp_path: Path) -> None:
    """A host key other than the pinned one refuses to connect."""
    other = generate_key(tmp_path / "other_host_key")
    tower = TowerClient(credentials(sshd, host_key=other))
    with pytest.raises(TowerHostKeyError):
        await tower.status()
    assert not tower.connected
    await tower.close()


async def test_refused_key(sshd: Sshd) -> None:
    """A key the tower does not know is refused as an authentication error."""
    private, _public = generate_key_pair()
    tower = TowerClient(credentials(sshd, private_key=private))
    with pytest.raises(TowerAuthError):
        await tower.connect()
    await tower.close()


async def test_unreadable_key_and_pin(sshd: Sshd) -> None:
    """Garbage key material is an auth error; a garbage pin a host key error."""
    with pytest.raises(TowerAuthError):
        await TowerClient(credentials(sshd, private_key="not a key")).connect()
    with pytest.raises(TowerHostKeyError):
        await TowerClient(credentials(sshd, host_key="ssh-ed25519 ####")).connect()


async def test_unreachable_tower(sshd: Sshd) -> None:
    """Nothing listening is a connection error."""
    port = sshd.port
    sshd.stop()
    tower = TowerClient(credentials(sshd, port=port))  # type: ignore[arg-type]
    with pytest.raises(TowerConnectionError):
        await tower.connect()
    with pytest.raises(TowerConnectionError):
        await fetch_host_key("127.0.0.1", port)


async def test_reconnects_after_the_tower_restarts(sshd: Sshd) -> None:
    """A request after sshd restarted reconnects once and succeeds."""
    tower = TowerClient(credentials(sshd))
    await tower.version()
    sshd.stop()
    sshd.start_again()
    assert (await tower.version()).protocol == PROTOCOL
    await tower.close()


def _echo(message: dict[str, Any]) -> str:
    """A shell line printing ``message`` as one JSON line."""
    return f"echo '{json.dumps(message)}'"


def _forcing(tmp_path: Path, script: str, *extra_config: str) -> Sshd:
    program = tmp_path / "fake-agent"
    program.write_text(f"#!/bin/sh\n{script}\n", encoding="utf-8")
    program.chmod(0o755)
    return Sshd(
        tmp_path / "sshd", [str(program)], extra_config=list(extra_config)
    ).start()


@pytest.mark.parametrize(
    ("script", "error"),
    [
        ("exit 127", AgentMissingError),
        ("echo 'command not found' >&2; exit 1", AgentMissingError),
        ("echo hello", AgentMissingError),
        ("echo '[1]'", AgentMissingError),
        ('echo \'{"protocol": 99, "ok": true}\'', AgentVersionError),
    ],
)
async def test_something_else_than_the_agent(
    tmp_path: Path, socket_enabled: None, script: str, error: type[Exception]
) -> None:
    """A forced command that is not (this version of) the agent is reported as such.

    The forced command here is a shell script standing in for a missing or
    foreign program: that is the case under test.
    """
    server = _forcing(tmp_path, script)
    tower = TowerClient(credentials(server))
    try:
        with pytest.raises(error):
            await tower.version()
    finally:
        await tower.close()
        server.stop()


async def test_host_key_fetch_and_fingerprint(sshd: Sshd) -> None:
    """The fetched host key is the server's, with ssh-keygen's fingerprint."""
    key = await fetch_host_key("127.0.0.1", sshd.port)
    assert key.split()[:2] == sshd.host_public_key.split()[:2]
    assert fingerprint(key) == sshd.host_fingerprint


def test_key_pair_helpers() -> None:
    """Generated keys round-trip; unreadable keys are auth errors."""
    private, public = generate_key_pair()
    assert public.startswith("ssh-ed25519 ")
    assert public_key_of(private) == public
    line = authorized_keys_line(public, "/usr/local/bin/gpu-handoff serve")
    assert line == f'restrict,command="/usr/local/bin/gpu-handoff serve" {public}'
    with pytest.raises(TowerAuthError):
        public_key_of("-----BEGIN OPENSSH PRIVATE KEY-----\nnope\n")
    assert "PRIVATE" not in repr(
        TowerCredentials(
            host="h", port=22, username="u", private_key=private, host_key=public
        )
    )


async def test_a_session_says_hello_pushes_and_answers(client: TowerClient) -> None:
    """One long-lived session: hello, the tower's state pushed at once,
    requests answered by id, and closing ends it cleanly."""
    pushes: list[Push] = []
    session = await client.open_session(pushes.append)
    assert session.hello.protocol == PROTOCOL
    assert await client.open_session(pushes.append) is session
    async with asyncio.timeout(10):
        while session.status is None:  # noqa: ASYNC110 - pushed by the tower
            await asyncio.sleep(0.02)
    assert any(isinstance(push, StatusPush) for push in pushes)
    assert (await client.status()).domains["gpu-node"].state == "running"
    reply = await session.request("version")
    assert reply["type"] == "reply"
    replies = await asyncio.gather(
        *(session.request("status") for _ in range(5)), session.request("jobs")
    )
    assert [reply["id"] for reply in replies] == sorted(
        reply["id"] for reply in replies
    )
    with pytest.raises(AgentCommandError) as err:
        await session.request("stop", "not-a-vm", request_id="ha-0123456789ab")
    assert err.value.code == "unknown_domain"
    await session.close()
    assert session.closed
    with pytest.raises(TowerConnectionError):
        await session.request("status")
    assert (await client.version()).protocol == PROTOCOL


async def test_tower_going_away_under_a_connection(sshd: Sshd) -> None:
    """A request on a connection whose tower died reconnects, and reports it gone."""
    tower = TowerClient(credentials(sshd))
    await tower.version()
    sshd.stop()
    with pytest.raises(TowerConnectionError):
        await tower.version()
    assert not tower.connected
    await tower.close()


async def test_sessions_refused(tmp_path: Path, socket_enabled: None) -> None:
    """A tower that accepts the login but no channel is a connection error,
    for requests and for the agent session, after one reconnect."""
    server = _forcing(tmp_path, "exit 0", "MaxSessions 0")
    tower = TowerClient(credentials(server))
    try:
        with pytest.raises(TowerConnectionError):
            await tower.version()
        with pytest.raises(TowerConnectionError):
            await tower.open_session(lambda push: None)
    finally:
        await tower.close()
        server.stop()


async def test_request_timeout(tmp_path: Path, socket_enabled: None) -> None:
    """An agent that does not answer in time is reported, not waited for."""
    server = _forcing(tmp_path, "exec sleep 30")
    tower = TowerClient(credentials(server))
    try:
        with pytest.raises(TowerConnectionError, match="did not answer"):
            await tower.call("version", timeout=0.5)
    finally:
        await tower.close()
        server.stop()


@pytest.mark.parametrize(
    ("script", "error"),
    [
        ("echo; echo 'not json'", AgentMissingError),
        ("exit 0", AgentMissingError),
        ('echo \'{"protocol": 99, "type": "hello"}\'', AgentVersionError),
        ("echo '[]'", AgentMissingError),
        (
            _echo(
                {
                    "protocol": PROTOCOL,
                    "ok": False,
                    "type": "error",
                    "error": {"code": "libvirt_unreachable", "message": "down"},
                }
            ),
            AgentCommandError,
        ),
        (
            _echo({"protocol": PROTOCOL, "type": "status", "status": {}}),
            AgentVersionError,
        ),
        (
            _echo(
                {
                    "protocol": PROTOCOL,
                    "type": "event",
                    "time": "t",
                    "domain": "gpu-node",
                    "event": "lifecycle",
                }
            ),
            AgentVersionError,
        ),
    ],
)
async def test_a_session_that_is_not_the_agents(
    tmp_path: Path, socket_enabled: None, script: str, error: type[Exception]
) -> None:
    """A session whose first line is not this protocol's hello is refused.

    The forced command is a shell script standing in for a broken agent.
    """
    server = _forcing(tmp_path, script)
    tower = TowerClient(credentials(server))
    try:
        with pytest.raises(error):
            await tower.open_session(lambda push: None)
        assert tower.session is None
    finally:
        await tower.close()
        server.stop()


async def test_a_reply_that_never_comes(tmp_path: Path, socket_enabled: None) -> None:
    """A session that says hello and then nothing: a request times out as a
    connection error (it may or may not have been carried out), and a session
    that ends fails what waits on it."""
    hello = _echo(
        {"protocol": PROTOCOL, "type": "hello", "ok": True, "version": "x", "verbs": []}
    )
    server = _forcing(tmp_path, f"{hello}; exec sleep 30")
    tower = TowerClient(credentials(server))
    try:
        session = await tower.open_session(lambda push: None)
        with pytest.raises(TowerConnectionError, match="no reply"):
            await session.request("status", timeout=0.5)
        waiting = asyncio.ensure_future(session.request("status", timeout=10))
        await asyncio.sleep(0.1)
        await tower.close()
        with pytest.raises(TowerConnectionError):
            await waiting
        await session.wait_closed()
        assert session.close_reason
    finally:
        await tower.close()
        server.stop()


async def test_a_request_lookup_answers_none_or_refuses(client: TowerClient) -> None:
    """A request id nobody asked for finds no job; a malformed one is refused
    by the agent, and that refusal is not taken for 'no job'."""
    assert await client.find_request("ha-nobody-asked-for-this") is None
    with pytest.raises(AgentCommandError) as err:
        await client.find_request("no")
    assert err.value.code == "bad_request"


async def test_a_tower_connection_takes_nothing_from_home_assistants_home(
    sshd: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncssh fills what a connection leaves out from the home directory:
    it would trust host certificates of any X.509 CA in
    ``~/.ssh/ca-bundle.crt`` or ``~/.ssh/crt/`` before comparing the pinned
    key, follow ``~/.ssh/config``, use an ssh-agent and Kerberos. With a home
    that has all of it (and, as its default key, the very key the tower
    authorizes), a client connects with its own key to the pinned host
    alone, and a client with another key is refused."""
    home_with_ssh_defaults(tmp_path / "home", monkeypatch, sshd.client_key)
    # The key shown to be pinned is the tower's, fetched without ~/.ssh/config.
    shown = await fetch_host_key("127.0.0.1", sshd.port)
    assert shown.split()[:2] == sshd.host_public_key.split()[:2]
    made = record_connections(monkeypatch)
    tower = TowerClient(credentials(sshd))
    assert (await tower.version()).protocol == PROTOCOL  # despite ~/.ssh/config
    await tower.close()
    private, _public = generate_key_pair()
    stranger = TowerClient(credentials(sshd, private_key=private))
    with pytest.raises(TowerAuthError):
        await stranger.connect()
    await stranger.close()
    assert len(made) == 2
    for kwargs in made:
        assert options_taken_from_home(kwargs) == []
        pinned = asyncssh.import_public_key(sshd.host_public_key)
        assert kwargs["server_host_key_algs"] == ["ssh-ed25519"]
        assert kwargs["known_hosts"] == ([pinned], [], [])
