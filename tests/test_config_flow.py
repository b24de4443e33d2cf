"""Tests of the config flow, against a real sshd forcing the real agent.

The tower is libvirt's test driver behind the agent; nothing on the SSH or
agent side is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path
import shlex
import socket
import subprocess
from typing import Any

from homeassistant.config_entries import (
    SOURCE_USER,
)
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_HANDOFF_WHEN_CORDONED,
    CONF_HOST_KEY,
    CONF_K8S_NODE,
    CONF_KNOWN_VMS,
    CONF_KUBECONFIG,
    CONF_LEND_FREE_CARDS,
    CONF_PASSPHRASE,
    CONF_PRIVATE_KEY,
    CONF_SCAN_INTERVAL,
    DOMAIN,
    SUBENTRY_GAMING_VM,
)
from custom_components.gpu_handoff.protocol import PROTOCOL
from custom_components.gpu_handoff.tower_client import fingerprint, generate_key_pair
from tests.conftest import gaming_subentries, kubeconfig_text, tower_entry_data
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.account import SPLIT_USER
from tests.support.sshd import Sshd, generate_key

Result = dict[str, Any]


async def _start(hass: HomeAssistant, server: Sshd) -> Result:
    """Run the user step against ``server``; the flow is then at the host key."""
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    assert result["type"] is FlowResultType.FORM
    assert result["step_id"] == "user"
    return await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: " 127.0.0.1 ", CONF_PORT: server.port, CONF_USERNAME: "root"},
    )


async def _to_credentials(hass: HomeAssistant, server: Sshd) -> Result:
    result = await _start(hass, server)
    assert result["step_id"] == "host_key"
    result = await hass.config_entries.flow.async_configure(result["flow_id"], {})
    assert result["type"] is FlowResultType.MENU
    assert result["step_id"] == "credentials"
    return result


async def _paste(hass: HomeAssistant, flow_id: str, key: str, **extra: str) -> Result:
    result = await hass.config_entries.flow.async_configure(
        flow_id, {"next_step_id": "paste_key"}
    )
    assert result["step_id"] == "paste_key"
    return await hass.config_entries.flow.async_configure(
        flow_id, {CONF_PRIVATE_KEY: key, **extra}
    )


async def test_host_key_is_shown_for_confirmation(
    hass: HomeAssistant, tower: Sshd
) -> None:
    """The user sees the tower's real fingerprint before anything is pinned."""
    result = await _start(hass, tower)
    assert result["type"] is FlowResultType.FORM
    assert result["step_id"] == "host_key"
    assert result["description_placeholders"] == {
        "host": "127.0.0.1",
        "fingerprint": tower.host_fingerprint,
    }


def _name_tower(tower_dir: Path, name: str) -> None:
    """Give the tower's agent a name in its configuration."""
    config = tower_dir / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    config.write_text(json.dumps(data | {"name": name}), encoding="utf-8")


async def test_generated_key_flow(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator, tower_dir: Path
) -> None:
    """A generated key works once its line is in authorized_keys; then the
    user picks gaming VMs and reaches the cluster step. The entry is titled
    with the agent's name for the tower and identified by its host key."""
    _name_tower(tower_dir, "Tower in the attic")
    result = await _to_credentials(hass, tower)
    flow_id = result["flow_id"]
    result = await hass.config_entries.flow.async_configure(
        flow_id, {"next_step_id": "generate_key"}
    )
    assert result["step_id"] == "generate_key"
    public = result["description_placeholders"]["public_key"]
    line = result["description_placeholders"]["authorized_keys_line"]
    assert public.startswith("ssh-ed25519 ")
    assert line.startswith('restrict,command="')
    assert line.endswith(public)

    # Submitted before the key is on the tower: refused, nothing stored.
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["errors"] == {"base": "invalid_auth"}
    # The same key is offered again, not a new one.
    assert result["description_placeholders"]["public_key"] == public

    tower.authorize(public)
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "gaming_vms"
    assert result["description_placeholders"]["gpu_node"].startswith(
        "GPU node (gpu-node): 0000:01:00.0, "
    )

    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GAMING_VMS: []}
    )
    assert result["errors"] == {CONF_GAMING_VMS: "no_gaming_vm"}
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GAMING_VMS: ["gaming-1"]}
    )
    assert result["step_id"] == "cluster"
    assert hass.config_entries.async_entries(DOMAIN) == []

    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_KUBECONFIG: kubeconfig_text(cluster)}
    )
    assert result["step_id"] == "node"
    options = result["data_schema"].schema[CONF_K8S_NODE].config["options"]
    assert options == ["control-plane", GPU_NODE]
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_K8S_NODE: GPU_NODE}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    entry = result["result"]
    assert entry.title == "Tower in the attic"
    assert entry.unique_id == tower.host_fingerprint
    assert (entry.version, entry.minor_version) == (1, 2)
    assert entry.data[CONF_GPU_NODE] == "gpu-node"
    # gaming-2 was left out: the user's choice, not a new VM later.
    assert entry.data[CONF_KNOWN_VMS] == ["gaming-1", "gaming-2"]
    assert entry.data[CONF_K8S_NODE] == GPU_NODE
    assert entry.data[CONF_HOST_KEY].split() == tower.host_public_key.split()[:2]
    assert entry.options == {
        CONF_SCAN_INTERVAL: 30,
        CONF_DRAIN_TIMEOUT: 300,
        CONF_AUTO_RETURN: True,
    }
    assert [
        (sub.subentry_type, sub.unique_id, dict(sub.data))
        for sub in entry.subentries.values()
    ] == [(SUBENTRY_GAMING_VM, "gaming-1", {CONF_DOMAIN_NAME: "gaming-1"})]


async def test_pasted_key_flow(hass: HomeAssistant, tower: Sshd) -> None:
    """An unreadable key is refused in place; the tower's key goes on."""
    result = await _to_credentials(hass, tower)
    result = await _paste(hass, result["flow_id"], "not a key")
    assert result["errors"] == {CONF_PRIVATE_KEY: "invalid_key"}
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_PRIVATE_KEY: tower.client_key.read_text(encoding="utf-8")},
    )
    assert result["step_id"] == "gaming_vms"


async def test_encrypted_key_needs_its_passphrase(
    hass: HomeAssistant, tower: Sshd, tmp_path: Path
) -> None:
    """A passphrase-protected key works with its passphrase only."""
    key = tmp_path / "encrypted"
    public = generate_key(key, passphrase="s3cret")  # noqa: S106 - a test key
    tower.authorize(public)
    result = await _to_credentials(hass, tower)
    text = key.read_text(encoding="utf-8")
    result = await _paste(hass, result["flow_id"], text, passphrase="wrong")  # noqa: S106 - a test key
    assert result["errors"] == {CONF_PRIVATE_KEY: "invalid_key"}
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_PRIVATE_KEY: text, CONF_PASSPHRASE: "s3cret"}
    )
    assert result["step_id"] == "gaming_vms"


@pytest.mark.parametrize(
    ("user_input", "errors"),
    [
        (
            {CONF_HOST: "tower lan", CONF_PORT: 22, CONF_USERNAME: "hass"},
            {CONF_HOST: "invalid_host"},
        ),
        (
            {CONF_HOST: "   ", CONF_PORT: 22, CONF_USERNAME: "hass"},
            {CONF_HOST: "invalid_host"},
        ),
        (
            {CONF_HOST: "tower", CONF_PORT: 22, CONF_USERNAME: "h ass"},
            {CONF_USERNAME: "invalid_username"},
        ),
    ],
)
async def test_user_step_rejects_bad_input(
    hass: HomeAssistant, user_input: dict[str, object], errors: dict[str, str]
) -> None:
    """Bad input shows the form again with a translated error and creates nothing."""
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], user_input
    )
    assert result["type"] is FlowResultType.FORM
    assert result["errors"] == errors
    assert hass.config_entries.async_entries(DOMAIN) == []


async def test_user_step_unreachable(hass: HomeAssistant, tower: Sshd) -> None:
    """Nothing listening: cannot_connect, and the user can retry."""
    port = tower.port
    tower.stop()
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_HOST: "127.0.0.1", CONF_PORT: port, CONF_USERNAME: "u"}
    )
    assert result["errors"] == {"base": "cannot_connect"}
    tower.start_again()
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_HOST: "127.0.0.1", CONF_PORT: port, CONF_USERNAME: "u"}
    )
    assert result["step_id"] == "host_key"


@pytest.mark.parametrize("migrated", [True, False])
async def test_user_step_aborts_for_a_configured_tower(
    hass: HomeAssistant, tower: Sshd, migrated: bool
) -> None:
    """The same tower under another name is the same host key: refused,
    whether its entry has the host key's identity already or still the
    address it was set up with (one not set up since the update)."""
    MockConfigEntry(
        domain=DOMAIN,
        unique_id=tower.host_fingerprint if migrated else f"tower.lan:{tower.port}",
        minor_version=2 if migrated else 1,
        data={
            CONF_HOST: "tower.lan",
            CONF_PORT: tower.port,
            CONF_HOST_KEY: tower.host_public_key,
        },
    ).add_to_hass(hass)
    result = await _start(hass, tower)
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "already_configured"


async def test_user_step_goes_on_for_another_tower(
    hass: HomeAssistant, tower: Sshd, tmp_path: Path
) -> None:
    """Entries of other towers, at the same address before, or without a
    readable key, do not stop a tower with a key of its own."""
    MockConfigEntry(
        domain=DOMAIN,
        unique_id=f"127.0.0.1:{tower.port}",
        data={CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_HOST_KEY: "x"},
    ).add_to_hass(hass)
    MockConfigEntry(
        domain=DOMAIN,
        unique_id="SHA256:another-tower",
        minor_version=2,
        data={CONF_HOST_KEY: generate_key(tmp_path / "other_host_key")},
    ).add_to_hass(hass)
    result = await _start(hass, tower)
    assert result["step_id"] == "host_key"


def _older_agent(tower: Sshd) -> None:
    """The real agent behind a forced command that answers ``version`` as
    an agent from before the tower's name did."""
    reply = {"protocol": PROTOCOL, "ok": True, "version": "0.2.0", "verbs": []}
    real = shlex.join(tower.command)
    _fake_agent(
        tower,
        f'if [ "$SSH_ORIGINAL_COMMAND" = version ]; then\n'
        f"  echo '{json.dumps(reply)}'\nelse\n  exec {real}\nfi",
    )


@pytest.mark.parametrize("agent", ["named", "default", "older"])
async def test_entry_title_is_the_towers_name(
    hass: HomeAssistant,
    tower: Sshd,
    tower_dir: Path,
    cluster: K8sEmulator,
    agent: str,
) -> None:
    """The agent's configured name, else the host name it runs on, else (an
    agent too old to say) the address the user typed."""
    expected = {
        "named": "Gaming tower",
        "default": socket.gethostname(),
        "older": "127.0.0.1",
    }[agent]
    if agent == "named":
        _name_tower(tower_dir, "Gaming tower")
    if agent == "older":
        _older_agent(tower)
    result = await _to_cluster(hass, tower)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_KUBECONFIG: kubeconfig_text(cluster)}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_K8S_NODE: GPU_NODE}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    assert result["title"] == expected
    assert result["result"].unique_id == tower.host_fingerprint


def _fake_agent(tower: Sshd, script: str) -> None:
    """Point the forced command at a stand-in for a broken or foreign agent."""
    program = tower.directory / "fake-agent"
    program.write_text(f"#!/bin/sh\n{script}\n", encoding="utf-8")
    program.chmod(0o755)
    tower.command = [str(program)]
    tower.authorized_keys.write_text("", encoding="utf-8")
    tower.authorize(tower.client_key.with_suffix(".pub").read_text().strip())


@pytest.mark.parametrize(
    ("script", "error"),
    [
        ("exit 127", "agent_missing"),
        ('echo \'{"protocol": 0, "ok": true}\'', "agent_version"),
        # An agent of the first protocol: told to update, not an obscure error.
        (
            'echo \'{"protocol": 1, "ok": true, "version": "0.1.0", "verbs": []}\'',
            "agent_version",
        ),
        (
            "echo '"
            + json.dumps(
                {
                    "protocol": PROTOCOL,
                    "ok": False,
                    "error": {"code": "virsh_missing", "message": "x"},
                }
            )
            + "'",
            "agent_error",
        ),
        # The right protocol number, but a shape this side cannot read.
        (
            "echo '" + json.dumps({"protocol": PROTOCOL, "ok": True}) + "'",
            "agent_version",
        ),
    ],
)
async def test_agent_problems_are_named(
    hass: HomeAssistant, tower: Sshd, script: str, error: str
) -> None:
    """A missing, foreign or failing agent gets its own message.

    The forced command is a shell script standing in for the broken agent.
    """
    _fake_agent(tower, script)
    result = await _to_credentials(hass, tower)
    result = await _paste(
        hass, result["flow_id"], tower.client_key.read_text(encoding="utf-8")
    )
    assert result["errors"] == {"base": error}


async def test_invalid_agent_configuration(
    hass: HomeAssistant, tower: Sshd, tower_dir: Path
) -> None:
    """The real agent with a broken configuration file says so."""
    config = tower_dir / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["gaming"] = []
    config.write_text(json.dumps(data), encoding="utf-8")
    result = await _to_credentials(hass, tower)
    result = await _paste(
        hass, result["flow_id"], tower.client_key.read_text(encoding="utf-8")
    )
    assert result["errors"] == {"base": "agent_config_invalid"}


async def test_an_agent_configured_with_a_vm_named_like_an_id_is_refused(
    hass: HomeAssistant, tower: Sshd, tower_dir: Path
) -> None:
    """Installed by hand with a gaming VM named `1`: virsh would look it up as
    a domain id first (tools/virsh-util.c virshLookupDomainInternal), so the
    agent refuses its configuration (check-config says why) and the flow
    stores nothing."""
    config = tower_dir / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["gaming"] = ["gaming-1", "1"]
    config.write_text(json.dumps(data), encoding="utf-8")
    result = await _to_credentials(hass, tower)
    result = await _paste(
        hass, result["flow_id"], tower.client_key.read_text(encoding="utf-8")
    )
    assert result["errors"] == {"base": "agent_config_invalid"}
    assert hass.config_entries.async_entries(DOMAIN) == []


def _renamed_replies(command: list[str], directory: Path) -> dict[str, str]:
    """The real agent's version and status replies (its CLI), gaming-2
    renamed `1`, each also written to ``directory``/VERB.json."""
    replies = {}
    for verb in ("version", "status"):
        run = subprocess.run(
            [*command, verb], capture_output=True, text=True, check=True
        )
        replies[verb] = run.stdout.replace('"gaming-2"', '"1"')
        (directory / f"{verb}.json").write_text(replies[verb], encoding="utf-8")
    return replies


async def test_an_older_agent_reporting_a_vm_named_like_an_id_gets_no_switch_for_it(
    hass: HomeAssistant, tower: Sshd, tower_dir: Path
) -> None:
    """An agent older than its own check may still report a gaming VM named
    `1` (here: the real agent's replies, gaming-2 renamed `1`): neither the
    setup nor an added gaming VM offers it."""
    replies = await hass.async_add_executor_job(
        _renamed_replies, tower.command[:-1], tower_dir
    )
    assert '"1"' in replies["status"]
    _fake_agent(
        tower,
        'case "$SSH_ORIGINAL_COMMAND" in\n'
        f"  version*) cat {shlex.quote(str(tower_dir / 'version.json'))} ;;\n"
        f"  status*) cat {shlex.quote(str(tower_dir / 'status.json'))} ;;\n"
        "  *) exit 1 ;;\n"
        "esac",
    )
    result = await _to_credentials(hass, tower)
    result = await _paste(
        hass, result["flow_id"], tower.client_key.read_text(encoding="utf-8")
    )
    assert result["step_id"] == "gaming_vms", result.get("errors")
    options = result["data_schema"].schema[CONF_GAMING_VMS].config["options"]
    assert [option["value"] for option in options] == ["gaming-1"]
    hass.config_entries.flow.async_abort(result["flow_id"])

    entry = MockConfigEntry(
        domain=DOMAIN,
        data=tower_entry_data(tower),
        subentries_data=gaming_subentries(1),
    )
    entry.add_to_hass(hass)
    result = await hass.config_entries.subentries.async_init(
        (entry.entry_id, SUBENTRY_GAMING_VM), context={"source": SOURCE_USER}
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "no_more_gaming_vms"


async def test_host_key_changing_during_setup(hass: HomeAssistant, tower: Sshd) -> None:
    """A host key that changes after the user confirmed it is refused."""
    result = await _to_credentials(hass, tower)
    tower.stop()
    tower.host_key.unlink()
    tower.host_key.with_suffix(".pub").unlink()
    generate_key(tower.host_key)
    tower.start_again()
    result = await _paste(
        hass, result["flow_id"], tower.client_key.read_text(encoding="utf-8")
    )
    assert result["errors"] == {"base": "host_key_changed"}


# --- reauth ------------------------------------------------------------------


@pytest.fixture
def tower_entry(hass: HomeAssistant, tower: Sshd) -> MockConfigEntry:
    """A config entry for the tower, with gaming-1 added."""
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="127.0.0.1",
        unique_id=tower.host_fingerprint,
        minor_version=2,
        data=tower_entry_data(tower),
        options={
            CONF_SCAN_INTERVAL: 30,
            CONF_DRAIN_TIMEOUT: 300,
            CONF_AUTO_RETURN: True,
        },
        subentries_data=gaming_subentries(1),
    )
    entry.add_to_hass(hass)
    return entry


async def test_reauth_with_a_new_key(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """A refused key is replaced with a pasted one that works."""
    hass.config_entries.async_update_entry(
        tower_entry, data=tower_entry.data | {CONF_PRIVATE_KEY: generate_key_pair()[0]}
    )
    result = await tower_entry.start_reauth_flow(hass)
    assert result["type"] is FlowResultType.MENU
    assert result["step_id"] == "reauth_confirm"
    new_private, new_public = generate_key_pair()
    result = await _paste(hass, result["flow_id"], new_private)
    assert result["errors"] == {"base": "invalid_auth"}
    tower.authorize(new_public)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_PRIVATE_KEY: new_private}
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "reauth_successful"
    assert tower_entry.data[CONF_PRIVATE_KEY] == new_private.strip() + "\n"


# --- reconfigure -------------------------------------------------------------


async def test_reconfigure_same_address(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """A new user name on the same address is checked and stored; the pinned
    host key and the identity stay."""
    # The entry logged in as another account, one this tower's sshd refuses.
    hass.config_entries.async_update_entry(
        tower_entry, data=tower_entry.data | {CONF_USERNAME: SPLIT_USER}
    )
    before = dict(tower_entry.data)
    result = await tower_entry.start_reconfigure_flow(hass)
    assert result["step_id"] == "reconfigure"
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "reconfigure_successful"
    assert tower_entry.data[CONF_USERNAME] == "root" != before[CONF_USERNAME]
    assert tower_entry.data == before | {CONF_USERNAME: "root"}
    assert tower_entry.data[CONF_HOST_KEY] == before[CONF_HOST_KEY]
    assert tower_entry.unique_id == tower.host_fingerprint


async def test_reconfigure_same_address_never_repins_a_changed_host_key(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """The tower at the same address presents another host key: that is a
    mismatch (the repair shows both fingerprints), never pinned quietly."""
    before = dict(tower_entry.data)
    tower.stop()
    generate_key(tower.host_key)
    tower.start_again()
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "host_key_changed"
    assert dict(tower_entry.data) == before
    assert tower_entry.unique_id == fingerprint(before[CONF_HOST_KEY])
    assert tower_entry.unique_id != tower.host_fingerprint


def _move(tower: Sshd, *, new_host_key: bool) -> None:
    """The tower's sshd on another port: with the same host key (the same
    tower reached another way) or a new one. The client key stays."""
    tower.stop()
    config = tower.directory / "sshd_config"
    old = f"Port {tower.port}\n"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        tower.port = probe.getsockname()[1]
    text = config.read_text(encoding="utf-8")
    assert old in text
    config.write_text(text.replace(old, f"Port {tower.port}\n"), encoding="utf-8")
    if new_host_key:
        generate_key(tower.host_key)
    tower.start_again()


async def test_reconfigure_to_another_tower_aborts(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """An address that presents another host key leads to another tower (a
    tower is its host key, the entry's unique id): refused with both
    fingerprints, and nothing is asked, pinned or stored."""
    before = dict(tower_entry.data)
    pinned = tower.host_fingerprint
    _move(tower, new_host_key=True)
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "different_tower"
    assert result["description_placeholders"] == {
        "fingerprint": tower.host_fingerprint,
        "pinned": pinned,
    }
    assert tower.host_fingerprint != pinned
    assert dict(tower_entry.data) == before
    assert tower_entry.unique_id == pinned


async def test_reconfigure_new_address_same_host_key(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """The same host key at another address is the same tower: nothing to
    confirm, the pinned key and the identity stay."""
    before = dict(tower_entry.data)
    _move(tower, new_host_key=False)
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["reason"] == "reconfigure_successful"
    assert tower_entry.data == before | {CONF_PORT: tower.port}
    assert tower_entry.unique_id == tower.host_fingerprint


async def test_reconfigure_to_another_configured_tower_aborts(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """An address whose host key is another set-up tower's is refused before
    anything is asked or stored."""
    before = dict(tower_entry.data)
    _move(tower, new_host_key=True)
    MockConfigEntry(
        domain=DOMAIN,
        title="the other tower",
        unique_id=tower.host_fingerprint,
        minor_version=2,
        data={CONF_HOST_KEY: tower.host_public_key},
    ).add_to_hass(hass)
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "other_tower_configured"
    assert dict(tower_entry.data) == before
    assert tower_entry.unique_id == fingerprint(before[CONF_HOST_KEY])


async def test_reconfigure_errors(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """Bad input, an unreachable address and a bad kubeconfig change nothing."""
    before = dict(tower_entry.data)
    result = await tower_entry.start_reconfigure_flow(hass)
    flow_id = result["flow_id"]
    good = {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"}
    result = await hass.config_entries.flow.async_configure(
        flow_id, good | {CONF_USERNAME: "r oot"}
    )
    assert result["errors"] == {CONF_USERNAME: "invalid_username"}
    result = await hass.config_entries.flow.async_configure(
        flow_id, good | {CONF_PORT: 1}
    )
    assert result["errors"] == {"base": "cannot_connect"}
    result = await hass.config_entries.flow.async_configure(
        flow_id, good | {CONF_KUBECONFIG: "clusters: ["}
    )
    assert result["errors"] == {"base": "invalid_kubeconfig"}
    assert dict(tower_entry.data) == before


async def test_reconfigure_when_the_agent_names_another_gpu_node_aborts(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry, tower_dir: Path
) -> None:
    """The same tower (its host key) whose agent now names another GPU node:
    the entry's devices and entities are the old one's, so it is refused and
    nothing is stored."""
    before = dict(tower_entry.data)
    config = tower_dir / "config.json"
    data = json.loads(config.read_text(encoding="utf-8"))
    data["gpu_node"], data["gaming"] = "gaming-2", ["gaming-1"]
    config.write_text(json.dumps(data), encoding="utf-8")
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "gpu_node_changed"
    assert result["description_placeholders"] == {
        "gpu_node": "gaming-2",
        "configured": "gpu-node",
    }
    assert dict(tower_entry.data) == before


async def test_reconfigure_with_refused_key_aborts(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """Reconfigure keeps the key: a refused key ends it with that reason."""
    hass.config_entries.async_update_entry(
        tower_entry, data=tower_entry.data | {CONF_PRIVATE_KEY: generate_key_pair()[0]}
    )
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"},
    )
    assert result["reason"] == "invalid_auth"


# --- options -----------------------------------------------------------------


async def test_options_flow(hass: HomeAssistant, tower_entry: MockConfigEntry) -> None:
    """Options are shown with their values and stored as numbers; the two
    safety options are off unless the user turns them on."""
    result = await hass.config_entries.options.async_init(tower_entry.entry_id)
    assert result["step_id"] == "init"
    schema = result["data_schema"].schema
    defaults = {str(key): key.default() for key in schema if callable(key.default)}
    assert defaults[CONF_EVICT_UNMANAGED] is False
    assert defaults[CONF_HANDOFF_WHEN_CORDONED] is False
    assert defaults[CONF_LEND_FREE_CARDS] is False
    result = await hass.config_entries.options.async_configure(
        result["flow_id"],
        {CONF_SCAN_INTERVAL: 10.0, CONF_DRAIN_TIMEOUT: 120.0, CONF_AUTO_RETURN: False},
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    assert tower_entry.options == {
        CONF_SCAN_INTERVAL: 10,
        CONF_DRAIN_TIMEOUT: 120,
        CONF_AUTO_RETURN: False,
        CONF_EVICT_UNMANAGED: False,
        CONF_HANDOFF_WHEN_CORDONED: False,
        CONF_LEND_FREE_CARDS: False,
    }

    result = await hass.config_entries.options.async_init(tower_entry.entry_id)
    result = await hass.config_entries.options.async_configure(
        result["flow_id"],
        {
            CONF_SCAN_INTERVAL: 10.0,
            CONF_DRAIN_TIMEOUT: 120.0,
            CONF_AUTO_RETURN: True,
            CONF_EVICT_UNMANAGED: True,
            CONF_HANDOFF_WHEN_CORDONED: True,
            CONF_LEND_FREE_CARDS: True,
        },
    )
    assert tower_entry.options[CONF_EVICT_UNMANAGED] is True
    assert tower_entry.options[CONF_HANDOFF_WHEN_CORDONED] is True
    assert tower_entry.options[CONF_LEND_FREE_CARDS] is True


# --- gaming VM subentries ----------------------------------------------------


async def test_add_gaming_vm(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """Only gaming VMs without a switch are offered; then none are left."""
    result = await hass.config_entries.subentries.async_init(
        (tower_entry.entry_id, SUBENTRY_GAMING_VM), context={"source": SOURCE_USER}
    )
    assert result["step_id"] == "user"
    options = result["data_schema"].schema[CONF_DOMAIN_NAME].config["options"]
    assert [option["value"] for option in options] == ["gaming-2"]
    result = await hass.config_entries.subentries.async_configure(
        result["flow_id"], {CONF_DOMAIN_NAME: "gaming-2"}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    assert {sub.unique_id for sub in tower_entry.subentries.values()} == {
        "gaming-1",
        "gaming-2",
    }
    result = await hass.config_entries.subentries.async_init(
        (tower_entry.entry_id, SUBENTRY_GAMING_VM), context={"source": SOURCE_USER}
    )
    assert result["reason"] == "no_more_gaming_vms"


async def test_add_gaming_vm_tower_unreachable(
    hass: HomeAssistant, tower: Sshd, tower_entry: MockConfigEntry
) -> None:
    """Without the tower there is nothing to offer."""
    tower.stop()
    result = await hass.config_entries.subentries.async_init(
        (tower_entry.entry_id, SUBENTRY_GAMING_VM), context={"source": SOURCE_USER}
    )
    assert result["reason"] == "cannot_connect"


# --- the cluster -------------------------------------------------------------


async def _to_cluster(hass: HomeAssistant, server: Sshd) -> Result:
    result = await _to_credentials(hass, server)
    result = await _paste(
        hass, result["flow_id"], server.client_key.read_text(encoding="utf-8")
    )
    return await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_GAMING_VMS: ["gaming-1", "gaming-2"]}
    )


KUBECONFIG_WITH_FILES = """
apiVersion: v1
kind: Config
current-context: c
contexts: [{name: c, context: {cluster: k, user: u}}]
clusters: [{name: k, cluster: {server: "https://127.0.0.1:6443", certificate-authority: /etc/ca.crt}}]
users: [{name: u, user: {token: abc}}]
"""


@pytest.mark.parametrize(
    ("kubeconfig", "error"),
    [
        ("clusters: [", "invalid_kubeconfig"),
        ("- a list", "invalid_kubeconfig"),
        (KUBECONFIG_WITH_FILES, "invalid_kubeconfig"),
    ],
)
async def test_cluster_step_rejects_unusable_kubeconfigs(
    hass: HomeAssistant, tower: Sshd, kubeconfig: str, error: str
) -> None:
    """Kubeconfigs that cannot be used are named as such; nothing is stored."""
    result = await _to_cluster(hass, tower)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], {CONF_KUBECONFIG: kubeconfig}
    )
    assert result["errors"] == {"base": error}


async def test_cluster_step_auth_and_reachability(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator
) -> None:
    """A refused token and a stopped API server get their own messages."""
    result = await _to_cluster(hass, tower)
    flow_id = result["flow_id"]
    result = await hass.config_entries.flow.async_configure(
        flow_id,
        {CONF_KUBECONFIG: kubeconfig_text(cluster, token="wrong-token")},  # noqa: S106
    )
    assert result["errors"] == {"base": "cluster_auth"}
    good = kubeconfig_text(cluster)
    await cluster.stop()
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_KUBECONFIG: good}
    )
    assert result["errors"] == {"base": "cluster_unreachable"}


async def test_cluster_step_needs_the_list_verb(
    hass: HomeAssistant, tower: Sshd, cluster: K8sEmulator
) -> None:
    """A ServiceAccount that may not list nodes is refused (403)."""
    cluster.add_token("limited", (), user="limited")
    result = await _to_cluster(hass, tower)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_KUBECONFIG: kubeconfig_text(cluster, token="limited")},  # noqa: S106
    )
    assert result["errors"] == {"base": "cluster_auth"}


async def test_reconfigure_kubeconfig(
    hass: HomeAssistant,
    tower: Sshd,
    tower_entry: MockConfigEntry,
    cluster: K8sEmulator,
) -> None:
    """A new kubeconfig must still know the entry's node, then it is stored."""
    text = kubeconfig_text(cluster)
    good = {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: "root"}
    hass.config_entries.async_update_entry(
        tower_entry, data=tower_entry.data | {CONF_K8S_NODE: "gone-node"}
    )
    result = await tower_entry.start_reconfigure_flow(hass)
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], good | {CONF_KUBECONFIG: text}
    )
    assert result["errors"] == {"base": "node_not_found"}
    hass.config_entries.async_update_entry(
        tower_entry, data=tower_entry.data | {CONF_K8S_NODE: GPU_NODE}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"], good | {CONF_KUBECONFIG: text}
    )
    assert result["reason"] == "reconfigure_successful"
    assert tower_entry.data[CONF_KUBECONFIG] == text.strip()
