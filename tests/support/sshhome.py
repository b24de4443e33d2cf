"""A home directory for Home Assistant's process holding everything asyncssh
would take from it when a connection leaves an argument out: a client key
(``~/.ssh/id_ed25519``), an ``~/.ssh/config`` that reaches every host
through a command that fails, X.509 CAs it would trust for host keys (``~/.ssh/ca-bundle.crt``
and ``~/.ssh/crt/``), and an ssh-agent socket named in ``SSH_AUTH_SOCK``.
A connection to a tower must use none of it (tower_client.pinned_host)."""

from __future__ import annotations

from pathlib import Path
import shutil
from typing import Any

import asyncssh
import pytest


def home_with_ssh_defaults(
    directory: Path, monkeypatch: pytest.MonkeyPatch, client_key: Path
) -> Path:
    """Make ``directory`` the process's HOME, with ``client_key`` (a private
    key file) as its default key; the home."""
    ssh = directory / ".ssh"
    (ssh / "crt").mkdir(parents=True)
    ssh.chmod(0o700)
    shutil.copyfile(client_key, ssh / "id_ed25519")
    (ssh / "id_ed25519").chmod(0o600)
    (ssh / "config").write_text(
        "Host *\n  ProxyCommand false\n  User nobody\n"
        "  IdentityFile ~/.ssh/id_ed25519\n",
        encoding="utf-8",
    )
    ca_key = asyncssh.generate_private_key("ssh-rsa")
    ca = ca_key.generate_x509_ca_certificate(ca_key, "CN=a CA of this host")
    ca.write_certificate(str(ssh / "ca-bundle.crt"), "pem")
    ca.write_certificate(str(ssh / "crt" / "ca.crt"), "pem")
    monkeypatch.setenv("HOME", str(directory))
    monkeypatch.setenv("SSH_AUTH_SOCK", str(directory / "agent.sock"))
    return directory


def options_taken_from_home(kwargs: dict[str, object]) -> list[str]:
    """What asyncssh itself makes of a connection's arguments (all but host
    and port) that came from the home or the environment. (``~/.ssh/config``
    shows in a real connection: its ProxyCommand fails.)"""
    options = asyncssh.SSHClientConnectionOptions(**kwargs)  # type: ignore[arg-type]
    taken = []
    if options.x509_trusted_certs:
        taken.append("X.509 CAs")
    if getattr(options, "x509_trusted_cert_paths", None):
        taken.append("X.509 CA directory")
    if options.agent_path:
        taken.append("ssh-agent")
    if options.gss_kex or options.gss_auth:
        taken.append("Kerberos")
    home_key = asyncssh.read_private_key(Path("~/.ssh/id_ed25519").expanduser())
    given = kwargs.get("client_keys") or []
    if any(
        pair.public_data == home_key.public_data for pair in options.client_keys or ()
    ) and not any(
        key.public_data == home_key.public_data
        for key in given  # type: ignore[attr-defined]
    ):
        taken.append("~/.ssh/id_ed25519")
    return taken


def record_connections(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments (all but host and port) of every ``asyncssh.connect``
    from now on, each passed on to the real one."""
    made: list[dict[str, Any]] = []
    connect = asyncssh.connect

    async def recording(host: str, port: int, **kwargs: Any) -> Any:
        made.append(kwargs)
        return await connect(host, port, **kwargs)

    monkeypatch.setattr(asyncssh, "connect", recording)
    return made
