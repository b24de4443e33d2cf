"""The tower's name: what Home Assistant calls the tower (entry title, device).

The agent's configuration may set it ("name"); by default it is the machine's
host name. Every ``version`` reply and a session's hello carry it.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.tower.conftest import FakeTower, run_agent

PROBLEM = "name: must be 1 to 63 printable characters, not only spaces"


def _named(tower: FakeTower) -> dict[str, Any]:
    """The name as check-config, serve's version, the CLI's version and a
    session's hello report it."""
    config = tower.run("check-config").reply["config"]["name"]
    served = tower.run("serve", env={"SSH_ORIGINAL_COMMAND": "version"}).reply
    cli = run_agent(["version"]).reply
    session = tower.run("session")
    hello = session.lines[0]
    assert hello["type"] == "hello"
    return {
        "config": config,
        "serve": served["host_name"],
        "cli": cli["host_name"],
        "hello": hello["host_name"],
    }


def test_the_name_defaults_to_the_host_name(fake_tower: FakeTower) -> None:
    """Without "name", everything reports the machine's host name."""
    host = socket.gethostname()
    assert host
    assert _named(fake_tower) == dict.fromkeys(
        ("config", "serve", "cli", "hello"), host
    )


@pytest.mark.parametrize("name", ["Tower in the attic", "Tour de Zoé", "t" * 63])
def test_a_configured_name_is_reported(fake_tower: FakeTower, name: str) -> None:
    """The configured name, as written, wherever the configuration is read
    (the command line's bare ``version`` reads none: the host name)."""
    fake_tower.configure(name=name)
    assert _named(fake_tower) == {
        "config": name,
        "serve": name,
        "cli": socket.gethostname(),
        "hello": name,
    }


@pytest.mark.parametrize(
    "name",
    ["", "t" * 64, "tab\there", "bell\x07", "line\nbreak", "   ", 7, None, ["x"]],
)
def test_an_unusable_name_is_a_configuration_error(
    fake_tower: FakeTower, name: object
) -> None:
    """Empty, too long, control characters, only spaces, not a string: the
    configuration is refused with a message that names the key."""
    fake_tower.configure(name=name)
    run = fake_tower.run("check-config")
    assert run.rc == 1
    assert run.reply["error"]["code"] == "config_invalid"
    assert PROBLEM in run.reply["error"]["message"]
    served = fake_tower.run("serve", env={"SSH_ORIGINAL_COMMAND": "version"})
    assert served.reply["error"]["code"] == "config_invalid"
