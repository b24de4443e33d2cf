"""The guided install, end to end through the config flow, on a fresh tower.

The tower is the test root as it is before GPU Handoff, booted in a box under
its own systemd (tests/support/box_tower.py): the box's sshd (ssh.service)
with password and key logins, real accounts, real sudo, the box's real
libvirtd.service serving libvirt's test driver from a file, and the agent's
real ``install`` run as root over SFTP and SSH. Nothing on the tower side is
mocked or recorded: ``--restart-libvirt`` restarts libvirtd.service, and the
tests read what systemd says of it (its main process, its journal).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
import gc
import json
import logging
from pathlib import Path
import socket
import tempfile
from typing import Any

import asyncssh
from homeassistant.components.repairs import DOMAIN as REPAIRS
from homeassistant.config_entries import SOURCE_USER, ConfigEntry, ConfigEntryState
from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import HomeAssistant
from homeassistant.data_entry_flow import FlowResultType
from homeassistant.helpers import issue_registry as ir
from homeassistant.setup import async_setup_component
from homeassistant.util import dt as dt_util
import pytest
from pytest_homeassistant_custom_component.common import async_fire_time_changed
from pytest_homeassistant_custom_component.components.diagnostics import (
    get_diagnostics_for_config_entry,
)
from pytest_homeassistant_custom_component.typing import ClientSessionGenerator

import custom_components.gpu_handoff
from custom_components.gpu_handoff.config_flow_install import ADMIN_LOGIN_KEPT
from custom_components.gpu_handoff.const import (
    CONF_ADMIN_KEY,
    CONF_ADMIN_PASSPHRASE,
    CONF_ADMIN_PASSWORD,
    CONF_ADMIN_USERNAME,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_HOST_KEY,
    CONF_HOST_KEY_PINNED_AT,
    CONF_K8S_NODE,
    CONF_KUBECONFIG,
    CONF_LIBVIRT_URI,
    CONF_PRIVATE_KEY,
    CONF_RESTART_LIBVIRT,
    CONF_SUDO_PASSWORD,
    DOMAIN,
)
from custom_components.gpu_handoff.installer import (
    AdminLogin,
    AdminSession,
    InstallError,
    admin_session,
)
from custom_components.gpu_handoff.protocol import PROTOCOL
from custom_components.gpu_handoff.repairs import AgentUpdateRepairFlow
from custom_components.gpu_handoff.tower.gpu_handoff import (
    install as agent_install,
    wire,
)
from custom_components.gpu_handoff.tower_client import (
    fingerprint,
    generate_key_pair,
    public_key_of,
)
from tests.conftest import kubeconfig_text
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.support.agentbuild import agent_bytes, agent_variant
from tests.support.box_tower import LIBVIRTD, BoxFreshTower, require_box_tower
from tests.support.sshhome import (
    home_with_ssh_defaults,
    options_taken_from_home,
    record_connections,
)
from tests.support.stories import until

Result = dict[str, Any]
STRINGS = json.loads(
    (Path(custom_components.gpu_handoff.__file__).parent / "strings.json").read_text(
        encoding="utf-8"
    )
)
# The account the agent runs as: the install creates it.
AGENT_USER = "gpu-handoff"
WRITTEN = (
    "/usr/local/bin/gpu-handoff",
    "/etc/gpu-handoff/config.json",
    "/var/lib/gpu-handoff",
    "/etc/libvirt/hooks/qemu.d/gpu-handoff",
)


# libvirt's daemon in the modular layout: not installed on the tower, so
# `systemctl is-active` calls it inactive, and the install leaves it alone.
VIRTQEMUD = "virtqemud.service"


@pytest.fixture
def fresh(tmp_path: Path, socket_enabled: None) -> Iterator[BoxFreshTower]:
    """A tower with libvirt and its VMs, and nothing of GPU Handoff (one per
    test: each installs, and the box boots in about half a second)."""
    require_box_tower()
    with BoxFreshTower(tmp_path / "tower") as tower:
        yield tower


@pytest.fixture(scope="module")
def _shared_tower(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[BoxFreshTower]]:
    """The module's shared tower, once the first test that wants it starts
    it (with sockets allowed: its sshd's port is a free one)."""
    towers = [BoxFreshTower(tmp_path_factory.mktemp("shared") / "tower")]
    yield towers
    towers[0].stop()


@pytest.fixture
def tower(
    _shared_tower: list[BoxFreshTower], socket_enabled: None
) -> Iterator[BoxFreshTower]:
    """A tower with libvirt and its VMs and nothing of GPU Handoff, shared by
    the tests of this module that only look (refused logins, surveys): it
    must be as it was after each of them."""
    require_box_tower()
    [shared] = _shared_tower
    if shared.box is None:
        shared.start()
    _nothing_installed(shared)
    yield shared
    _nothing_installed(shared)


def _put_agent(directory: Path) -> Path:
    """This release's agent in ``directory``, which every user may read."""
    program = agent_variant(directory)
    directory.chmod(0o755)
    return program


def _make_tower(tmp_path: Path, **knobs: Any) -> BoxFreshTower:
    require_box_tower()
    return BoxFreshTower(tmp_path / "tower", **knobs)


def _starts(tower: BoxFreshTower) -> int:
    """How many times systemd started libvirtd.service (its journal)."""
    return tower.journal(LIBVIRTD).count("Started libvirtd.service")


async def _to_menu(hass: HomeAssistant, tower: BoxFreshTower) -> str:
    """Address, host key: the flow is at the credentials menu."""
    result = await hass.config_entries.flow.async_init(
        DOMAIN, context={"source": SOURCE_USER}
    )
    result = await hass.config_entries.flow.async_configure(
        result["flow_id"],
        {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: AGENT_USER},
    )
    assert result["step_id"] == "host_key"
    result = await hass.config_entries.flow.async_configure(result["flow_id"], {})
    assert result["type"] is FlowResultType.MENU
    assert result["menu_options"][0] == "install_agent"
    return str(result["flow_id"])


async def _login(hass: HomeAssistant, flow_id: str, uri: str, **login: str) -> Result:
    result = await hass.config_entries.flow.async_configure(
        flow_id, {"next_step_id": "install_agent"}
    )
    assert result["step_id"] == "install_agent"
    return await hass.config_entries.flow.async_configure(
        flow_id, {CONF_USERNAME: AGENT_USER, CONF_LIBVIRT_URI: uri, **login}
    )


def _password_login(tower: BoxFreshTower, name: str) -> dict[str, str]:
    admin = tower.admins[name]
    return {CONF_ADMIN_USERNAME: admin.name, CONF_ADMIN_PASSWORD: admin.password}


def _key_login(tower: BoxFreshTower, name: str) -> dict[str, str]:
    admin = tower.admins[name]
    return {
        CONF_ADMIN_USERNAME: admin.name,
        CONF_ADMIN_KEY: admin.key_path.read_text(encoding="utf-8"),
    }


def _nothing_installed(tower: BoxFreshTower) -> None:
    """The tower is as it was: no file of GPU Handoff's, no account."""
    for path in WRITTEN:
        assert tower.read(path) is None, path
    assert tower.run(["id", "-u", AGENT_USER]).returncode != 0
    listed = tower.run(["sh", "-c", "ls -d /tmp/gpu-handoff-install-* 2>/dev/null"])
    assert listed.stdout == ""


async def _install(
    hass: HomeAssistant,
    tower: BoxFreshTower,
    login: dict[str, str],
    *,
    restart: bool = False,
) -> tuple[str, Result]:
    """From the menu to the install's findings; (flow id, that step)."""
    flow_id = await _to_menu(hass, tower)
    result = await _login(hass, flow_id, tower.uri, **login)
    assert result["step_id"] == "install_options", result.get("errors")
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1", "win-2"]}
    )
    assert result["step_id"] == "install_confirm"
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: restart}
    )
    return flow_id, result


async def test_guided_install_from_nothing_to_a_working_integration(
    hass: HomeAssistant,
    fresh: BoxFreshTower,
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
    hass_storage: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One administrator login (a sudo user with a password) takes a tower
    with nothing of GPU Handoff to a loaded entry: the account, the files,
    the restricted key line, the check; the login is kept nowhere."""
    caplog.set_level(logging.DEBUG)
    admin = fresh.admins["gh-admin-pw"]
    libvirtd = fresh.main_pid(LIBVIRTD)
    assert libvirtd != 0
    _nothing_installed(fresh)
    flow_id = await _to_menu(hass, fresh)
    result = await _login(
        hass, flow_id, fresh.uri, **_password_login(fresh, "gh-admin-pw")
    )
    # Looking changed nothing.
    _nothing_installed(fresh)
    assert result["step_id"] == "install_options"
    options = result["data_schema"].schema[CONF_GPU_NODE].config["options"]
    assert [option["value"] for option in options] == ["gpu-node", "win-1", "win-2"]
    # The GPU node is guessed by its name; the others are offered as gaming VMs.
    schema = {str(key): key for key in result["data_schema"].schema}
    assert schema[CONF_GPU_NODE].default() == "gpu-node"
    assert schema[CONF_GAMING_VMS].default() == ["win-1", "win-2"]

    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["gpu-node"]}
    )
    assert result["errors"] == {CONF_GAMING_VMS: "no_gaming_vm"}
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1", "win-2"]}
    )
    assert result["step_id"] == "install_confirm"
    assert result["description_placeholders"] == {
        "host": "127.0.0.1",
        "admin": admin.name,
        "user": AGENT_USER,
        "gpu_node": "gpu-node",
        "gaming": "win-1, win-2",
        "uri": fresh.uri,
        "version": wire.VERSION,
    }
    _nothing_installed(fresh)
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: False}
    )
    assert result["step_id"] == "install_done", result.get("errors")
    # Logged in with the restricted key at once; what it read is shown: the
    # real agent's findings on this tower (win-2 has no guest-agent channel,
    # one of the GPU node's functions no <rom bar='off'/>).
    assert result["errors"] == {}
    assert result["description_placeholders"]["findings"].splitlines() == [
        (
            "- no_agent_channel (win-2): no <channel> with target name "
            "org.qemu.guest_agent.0: graceful stops cannot work"
        ),
        "- rom_bar_not_off (gpu-node): hostdev 0000:02:00.1 has no <rom bar='off'/>",
    ]
    # The flow forgot the login as the install ended.
    assert hass.config_entries.flow._progress[flow_id]._install.admin is None

    # What the tower has now: the account, the agent, its configuration (the
    # same the agent writes for these options), the key line for HA's key.
    assert fresh.run(["id", "-u", AGENT_USER]).returncode == 0
    assert fresh.read_bytes("/usr/local/bin/gpu-handoff") == agent_bytes()
    config = json.loads(fresh.read("/etc/gpu-handoff/config.json") or "")
    assert config == agent_install.agent_config(
        gpu_node="gpu-node", gaming=["win-1", "win-2"], libvirt_uri=fresh.uri
    )
    keys = fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys") or ""
    [line] = keys.splitlines()
    assert line.startswith(
        'restrict,command="/usr/local/bin/gpu-handoff --config '
        '/etc/gpu-handoff/config.json serve" ssh-ed25519 '
    )
    modes = fresh.run(
        [
            "stat",
            "-c",
            "%a %U",
            f"/home/{AGENT_USER}/.ssh",
            f"/home/{AGENT_USER}/.ssh/authorized_keys",
        ]
    ).stdout.split("\n")
    assert modes[:2] == [f"700 {AGENT_USER}", f"600 {AGENT_USER}"]
    # The upload is gone; libvirtd was not restarted (the box was not ticked).
    listed = fresh.run(["sh", "-c", "ls -d /tmp/gpu-handoff-install-* 2>/dev/null"])
    assert listed.stdout == ""
    assert fresh.main_pid(LIBVIRTD) == libvirtd
    assert _starts(fresh) == 1

    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "cluster", result.get("errors")
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_KUBECONFIG: kubeconfig_text(cluster)}
    )
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_K8S_NODE: GPU_NODE}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    entry = result["result"]
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.LOADED
    assert entry.data[CONF_USERNAME] == AGENT_USER
    # The key it logs in with is the one the install put on the tower.
    assert line.endswith(public_key_of(entry.data[CONF_PRIVATE_KEY]))
    assert sorted(sub.unique_id for sub in entry.subentries.values()) == [
        "win-1",
        "win-2",
    ]
    state = hass.states.get("switch.gaming_station_1")
    assert state is not None
    assert state.state == "off"
    # The tower's state, read through the agent the install put there.
    handoff = hass.states.get("sensor.gpu_node_handoff_state")
    assert handoff is not None
    assert handoff.state == "serving"
    assert [card["held_by"] for card in handoff.attributes["cards"]] == [
        "gpu-node",
        "gpu-node",
    ]

    # The administrator's password is nowhere: not in the entry, not in
    # storage, not in diagnostics, not in the log.
    stored = json.dumps(hass_storage, default=str)
    diagnostics = json.dumps(
        await get_diagnostics_for_config_entry(hass, hass_client, entry), default=str
    )
    for where in (json.dumps(dict(entry.data)), stored, diagnostics, caplog.text):
        assert admin.password not in where


async def test_root_with_a_key_and_libvirtd_restarted_on_request(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """root logs in with a key (no sudo in the way); the ticked box restarts
    libvirt's daemons that run, exactly those, once: the tower's real
    libvirtd.service gets a new process, virtqemud.service (not active) is
    left alone, and the tower's check after the restart reads the same VMs
    through the new daemon."""
    assert fresh.is_active(LIBVIRTD, VIRTQEMUD) == ["active", "inactive"]
    before = fresh.main_pid(LIBVIRTD)
    assert before != 0
    assert _starts(fresh) == 1
    flow_id, result = await _install(
        hass, fresh, _key_login(fresh, "root"), restart=True
    )
    assert result["step_id"] == "install_done", result.get("errors")
    report = hass.config_entries.flow._progress[flow_id]._install.report
    assert (report.libvirt_restarted, report.libvirt_restart_message) == (
        True,
        f"restarted {LIBVIRTD}",
    )
    # systemd's word: a new main process, started once more, running.
    after = fresh.main_pid(LIBVIRTD)
    assert after not in (0, before)
    assert _starts(fresh) == 2
    journal = fresh.journal(LIBVIRTD)
    assert journal.count("Stopping libvirtd.service") == 1, journal
    assert fresh.is_active(LIBVIRTD, VIRTQEMUD) == ["active", "inactive"]
    assert "-- No entries --" in fresh.journal(VIRTQEMUD)
    # The install's check ran after the restart, through the new daemon.
    assert result["description_placeholders"]["findings"].splitlines() == [
        (
            "- no_agent_channel (win-2): no <channel> with target name "
            "org.qemu.guest_agent.0: graceful stops cannot work"
        ),
        "- rom_bar_not_off (gpu-node): hostdev 0000:02:00.1 has no <rom bar='off'/>",
    ]
    state = fresh.run(["virsh", "-c", fresh.uri, "domstate", "gpu-node"], AGENT_USER)
    assert state.stdout.strip() == "running", state.stderr
    assert fresh.read("/etc/gpu-handoff/config.json") is not None


async def test_root_with_a_password(hass: HomeAssistant, fresh: BoxFreshTower) -> None:
    """root logs in with its password; libvirtd is not restarted unasked."""
    before = fresh.main_pid(LIBVIRTD)
    flow_id, result = await _install(hass, fresh, _password_login(fresh, "root"))
    assert result["step_id"] == "install_done", result.get("errors")
    report = hass.config_entries.flow._progress[flow_id]._install.report
    assert report.libvirt_restarted is None
    assert fresh.main_pid(LIBVIRTD) == before
    assert _starts(fresh) == 1


async def test_sudo_without_a_password_and_a_key_login(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """A sudo user whose sudo asks nothing, logging in with a key."""
    flow_id, result = await _install(hass, fresh, _key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_done", result.get("errors")
    # Submitted after someone removed the key line: refused in place, the
    # findings stay on screen.
    fresh.run(["rm", f"/home/{AGENT_USER}/.ssh/authorized_keys"])
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "install_done"
    assert result["errors"] == {"base": "invalid_auth"}


async def test_an_installed_agent_is_installed_again(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """A second guided install over the first replaces its configuration (the
    survey saw it) and adds the new key's line beside the first."""
    flow_id, result = await _install(hass, fresh, _key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_done"
    first = fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys") or ""
    # The user closes the dialog, and later starts again.
    hass.config_entries.flow.async_abort(flow_id)
    flow_id = await _to_menu(hass, fresh)
    result = await _login(hass, flow_id, fresh.uri, **_key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_options"
    assert result["description_placeholders"]["agent"] == wire.VERSION
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-2"]}
    )
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: False}
    )
    assert result["step_id"] == "install_done", result.get("errors")
    config = json.loads(fresh.read("/etc/gpu-handoff/config.json") or "")
    assert config["gaming"] == ["win-2"]
    second = fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys") or ""
    # The first line stays as it was (another key's line is not the
    # install's to remove); the new key has one line of its own.
    [kept, added] = second.splitlines()
    assert first == kept + "\n"
    assert added.startswith('restrict,command="/usr/local/bin/gpu-handoff ')
    assert added.split()[-2] != kept.split()[-2]


@pytest.mark.parametrize(
    ("login", "error"),
    [
        pytest.param(
            {CONF_ADMIN_USERNAME: "gh-admin-pw", CONF_ADMIN_PASSWORD: "not-it"},
            "admin_auth_failed",
            id="wrong-password",
        ),
        pytest.param(
            {CONF_ADMIN_USERNAME: "gh-admin"}, "admin_login_missing", id="no-secret"
        ),
        pytest.param(
            {CONF_ADMIN_USERNAME: "gh-admin", CONF_ADMIN_KEY: "not a key"},
            "admin_key_invalid",
            id="unreadable-key",
        ),
    ],
)
async def test_a_login_the_tower_refuses(
    hass: HomeAssistant, tower: BoxFreshTower, login: dict[str, str], error: str
) -> None:
    """Each refused login has its own message; nothing changes."""
    flow_id = await _to_menu(hass, tower)
    result = await _login(hass, flow_id, tower.uri, **login)
    assert result["step_id"] == "install_agent"
    assert result["errors"] == {"base": error}
    # Never shown again: the password field comes back empty.
    schema = {str(key): key for key in result["data_schema"].schema}
    assert "suggested_value" not in (schema[CONF_ADMIN_PASSWORD].description or {})
    _nothing_installed(tower)


async def test_sudo_that_wants_a_password(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """A key login whose sudo asks for a password needs it; a wrong one is
    told apart; the right one works."""
    flow_id = await _to_menu(hass, fresh)
    result = await _login(hass, flow_id, fresh.uri, **_key_login(fresh, "gh-admin-pw"))
    assert result["errors"] == {"base": "admin_sudo_password"}
    result = await hass.config_entries.flow.async_configure(
        flow_id,
        {
            CONF_USERNAME: AGENT_USER,
            CONF_LIBVIRT_URI: fresh.uri,
            **_key_login(fresh, "gh-admin-pw"),
            CONF_SUDO_PASSWORD: "wrong",
        },
    )
    assert result["errors"] == {"base": "admin_sudo_wrong_password"}
    result = await hass.config_entries.flow.async_configure(
        flow_id,
        {
            CONF_USERNAME: AGENT_USER,
            CONF_LIBVIRT_URI: fresh.uri,
            **_key_login(fresh, "gh-admin-pw"),
            CONF_SUDO_PASSWORD: fresh.admins["gh-admin-pw"].password,
        },
    )
    assert result["step_id"] == "install_options", result.get("errors")
    _nothing_installed(fresh)
    # The user closes the dialog here (the frontend deletes the flow): the
    # login it held goes with it.
    flow = hass.config_entries.flow._progress[flow_id]
    assert flow._install.admin is not None
    hass.config_entries.flow.async_abort(flow_id)
    assert flow._install.admin is None


async def test_a_user_without_sudo(hass: HomeAssistant, tower: BoxFreshTower) -> None:
    """A user sudo does not know is told so, with sudo's words."""
    flow_id = await _to_menu(hass, tower)
    result = await _login(
        hass, flow_id, tower.uri, **_password_login(tower, "gh-plain")
    )
    assert result["errors"] == {"base": "admin_no_sudo"}
    assert "sudoers" in result["description_placeholders"]["detail"]
    _nothing_installed(tower)


@pytest.mark.parametrize(
    ("knobs", "error"),
    [
        pytest.param({"python": "missing"}, "tower_no_python", id="no-python"),
        pytest.param({"python": "old"}, "tower_no_python", id="python-3.7"),
        pytest.param({"virsh": False}, "tower_no_virsh", id="no-virsh"),
        pytest.param({"libvirt": False}, "tower_not_libvirt", id="no-libvirt"),
    ],
)
async def test_a_tower_that_lacks_what_the_agent_needs(
    hass: HomeAssistant,
    tmp_path: Path,
    socket_enabled: None,
    knobs: dict[str, Any],
    error: str,
) -> None:
    """Found by looking, before anything is written."""
    with _make_tower(tmp_path, **knobs) as tower:
        flow_id = await _to_menu(hass, tower)
        uri = tower.uri if knobs.get("libvirt", True) else "qemu:///system"
        result = await _login(hass, flow_id, uri, **_key_login(tower, "gh-admin"))
        assert result["step_id"] == "install_agent"
        assert result["errors"] == {"base": error}
        _nothing_installed(tower)


async def test_a_read_only_usr_local_leaves_the_tower_as_it_was(
    hass: HomeAssistant, tmp_path: Path, socket_enabled: None
) -> None:
    """The install fails half way: it says why, undoes what it did (the
    account it made included), and asks for the login again."""
    with _make_tower(tmp_path, read_only_usr_local=True) as tower:
        flow_id, result = await _install(hass, tower, _key_login(tower, "gh-admin"))
        assert result["step_id"] == "install_agent"
        assert result["errors"] == {"base": "install_read_only"}
        assert "Read-only file system" in result["description_placeholders"]["detail"]
        assert result["description_placeholders"]["left"] == "-"
        assert hass.config_entries.flow._progress[flow_id]._install.admin is None
        _nothing_installed(tower)


async def test_nixos_gets_the_module_with_home_assistants_key(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """On NixOS nothing is written: the module's settings are shown, with
    Home Assistant's key in them. Submitted before the switch, the key is
    refused in place."""
    fresh.run(["touch", "/etc/NIXOS"])
    flow_id, result = await _install(hass, fresh, _key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_nixos", result.get("errors")
    module = result["description_placeholders"]["module"]
    assert 'gpuNode = "gpu-node";' in module
    assert "ssh-ed25519 " in module
    assert agent_install.PLACEHOLDER_KEY not in module
    _nothing_installed(fresh)
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "install_nixos"
    assert result["errors"] == {"base": "invalid_auth"}

    # The switch (stand-in: no NixOS here): what the module puts in place
    # for these settings is what install writes elsewhere
    # (tests/tower/test_nixos.py holds the two to each other), so install
    # it, with the key the snippet carries.
    key = module.split('authorizedKeys = [ "', 1)[1].split('"', 1)[0]
    fresh.run(["rm", "/etc/NIXOS"])
    # The tower's shared directory: at the same path on both sides.
    with tempfile.TemporaryDirectory(dir=fresh.shared) as upload:
        program = _put_agent(Path(upload))
        switched = fresh.run(
            [
                "python3",
                str(program),
                "install",
                "--user",
                AGENT_USER,
                "--create-user",
                # The module puts the user in libvirt's group (extraGroups).
                "--join-libvirt-group",
                "--gpu-node",
                "gpu-node",
                "--gaming",
                "win-1",
                "--gaming",
                "win-2",
                "--uri",
                fresh.uri,
                "--authorize-key",
                key,
            ]
        )
    assert switched.returncode == 0, switched.stdout + switched.stderr
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "cluster", result.get("errors")


async def _installed_entry(
    hass: HomeAssistant, tower: BoxFreshTower, cluster: K8sEmulator
) -> ConfigEntry:
    """The guided path to a loaded entry."""
    flow_id, result = await _install(hass, tower, _key_login(tower, "gh-admin"))
    assert result["step_id"] == "install_done", result.get("errors")
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_KUBECONFIG: kubeconfig_text(cluster)}
    )
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_K8S_NODE: GPU_NODE}
    )
    assert result["type"] is FlowResultType.CREATE_ENTRY
    await hass.async_block_till_done()
    entry: ConfigEntry = result["result"]
    assert entry.state is ConfigEntryState.LOADED
    return entry


def _edit_installed_agent(tower: BoxFreshTower, line: str, becomes: str) -> None:
    """The installed agent's line ``line`` (a whole line) becomes ``becomes``:
    the installed program is overwritten in place (its owner and mode kept)
    by this agent with that line changed."""
    with tempfile.TemporaryDirectory(dir=tower.shared) as upload:
        edited = agent_variant(
            Path(upload), replace=[(f"\n{line}\n", f"\n{becomes}\n")]
        )
        done = tower.run(["cp", "--", str(edited), "/usr/local/bin/gpu-handoff"])
        assert done.returncode == 0, done.stderr
        assert tower.read_bytes("/usr/local/bin/gpu-handoff") == edited.read_bytes()


async def _age_the_agent(
    hass: HomeAssistant, tower: BoxFreshTower, entry: ConfigEntry
) -> str:
    """The tower runs an older agent (same protocol): its repair is raised."""
    _edit_installed_agent(tower, f'VERSION = "{wire.VERSION}"', 'VERSION = "0.2.0"')
    assert await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    issue_id = f"agent_version_{entry.entry_id}"
    await until(
        lambda: ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
    )
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.translation_key == "agent_older"
    assert issue.is_fixable
    return issue_id


async def _open_fix(
    hass: HomeAssistant, hass_client: ClientSessionGenerator, issue_id: str
) -> tuple[dict[str, Any], Any]:
    """The issue's fix flow as the frontend opens it; (first step, submit)."""
    assert await async_setup_component(hass, REPAIRS, {})
    client = await hass_client()
    response = await client.post(
        "/api/repairs/issues/fix", json={"handler": DOMAIN, "issue_id": issue_id}
    )
    flow: dict[str, Any] = await response.json()

    async def submit(data: dict[str, Any]) -> dict[str, Any]:
        response = await client.post(
            f"/api/repairs/issues/fix/{flow['flow_id']}", json=data
        )
        result: dict[str, Any] = await response.json()
        await hass.async_block_till_done()
        return result

    return flow, submit


async def test_an_older_agent_is_updated_from_its_repair(
    hass: HomeAssistant,
    fresh: BoxFreshTower,
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
    hass_storage: dict[str, Any],
) -> None:
    """ "Update the agent" asks for the administrator login again, replaces
    the program only (configuration, hook, keys untouched), reloads, and the
    repair goes away once the tower runs the agent this release ships."""
    entry = await _installed_entry(hass, fresh, cluster)
    config = fresh.read("/etc/gpu-handoff/config.json")
    keys = fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys")
    issue_id = await _age_the_agent(hass, fresh, entry)

    flow, submit = await _open_fix(hass, hass_client, issue_id)
    assert flow["type"] == "menu"
    assert flow["menu_options"] == ["update_login", "update_by_hand"]
    result = await submit({"next_step_id": "update_login"})
    assert result["step_id"] == "update_login"
    # The pinned key's fingerprint, to compare before a password is typed.
    pinned = entry.data[CONF_HOST_KEY]
    assert result["description_placeholders"]["fingerprint"] == fingerprint(pinned)
    admin = fresh.admins["gh-admin-pw"]
    # The key was pinned at setup, minutes ago: whoever holds it could be
    # faking this old agent to be given a password. None is taken for a day
    # (the sudo password either), before anything is sent.
    for password in (
        {CONF_ADMIN_PASSWORD: admin.password},
        {**_key_login(fresh, "gh-admin-pw"), CONF_SUDO_PASSWORD: admin.password},
    ):
        result = await submit({CONF_ADMIN_USERNAME: admin.name, **password})
        assert result["errors"] == {"base": "password_after_pin"}
        assert result["description_placeholders"]["hours"] == "24"
    assert fresh.read_bytes("/usr/local/bin/gpu-handoff") != agent_bytes()
    day_ago = dt_util.utcnow() - timedelta(hours=25)
    hass.config_entries.async_update_entry(
        entry, data=entry.data | {CONF_HOST_KEY_PINNED_AT: day_ago.isoformat()}
    )
    result = await submit(
        {CONF_ADMIN_USERNAME: admin.name, CONF_ADMIN_PASSWORD: "not-it"}
    )
    assert result["errors"] == {"base": "admin_auth_failed"}
    result = await submit(
        {CONF_ADMIN_USERNAME: admin.name, CONF_ADMIN_PASSWORD: admin.password}
    )
    assert result["type"] == "create_entry", result
    await until(lambda: entry.state is ConfigEntryState.LOADED)
    assert fresh.read_bytes("/usr/local/bin/gpu-handoff") == agent_bytes()
    assert fresh.read("/etc/gpu-handoff/config.json") == config
    assert fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys") == keys
    await until(lambda: ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None)
    assert admin.password not in json.dumps(hass_storage, default=str)


async def test_an_update_by_hand_keeps_the_repair(
    hass: HomeAssistant,
    fresh: BoxFreshTower,
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
) -> None:
    """The by-hand path shows the command and leaves the repair open; an
    agent installed elsewhere is not guessed at."""
    entry = await _installed_entry(hass, fresh, cluster)
    issue_id = await _age_the_agent(hass, fresh, entry)
    _flow, submit = await _open_fix(hass, hass_client, issue_id)
    result = await submit({"next_step_id": "update_by_hand"})
    assert result["type"] == "abort"
    assert result["reason"] == "update_by_hand"
    assert ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None

    # The program moved away (installed by hand elsewhere): said, not guessed.
    fresh.run(["mv", "/usr/local/bin/gpu-handoff", "/usr/local/bin/gpu-handoff.moved"])
    _flow, submit = await _open_fix(hass, hass_client, issue_id)
    await submit({"next_step_id": "update_login"})
    result = await submit(_key_login(fresh, "gh-admin"))
    assert result["errors"] == {"base": "update_not_installed"}
    assert fresh.read("/usr/local/bin/gpu-handoff") is None


async def test_an_update_for_a_removed_tower_stops(hass: HomeAssistant) -> None:
    """The tower's entry was removed while its repair stayed open."""
    flow = AgentUpdateRepairFlow("removed-entry")
    flow.hass = hass
    flow.handler = DOMAIN
    flow.flow_id = "flow"
    flow.issue_id = "agent_version_removed-entry"
    result = await flow.async_step_update_login()
    assert result["type"] is FlowResultType.ABORT
    assert result["reason"] == "entry_removed"


async def test_the_account_and_uri_are_checked_before_anything_runs(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """A name useradd would refuse and a URI with shell characters are
    refused in the form, before the tower runs anything with them."""
    flow_id = await _to_menu(hass, fresh)
    result = await hass.config_entries.flow.async_configure(
        flow_id, {"next_step_id": "install_agent"}
    )
    # The pinned host key's fingerprint, to compare with the tower's before
    # a password is typed; the key field comes before the password's.
    shown = result["description_placeholders"]["fingerprint"]
    assert shown == fingerprint(fresh.host_public_key)
    fields = [str(key) for key in result["data_schema"].schema]
    assert fields.index(CONF_ADMIN_KEY) < fields.index(CONF_ADMIN_PASSWORD)
    login = _key_login(fresh, "gh-admin")
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_USERNAME: "Bad User", CONF_LIBVIRT_URI: fresh.uri, **login}
    )
    assert result["errors"] == {"base": "invalid_agent_user"}
    assert result["description_placeholders"]["user"] == "Bad User"
    # Not one the survey would run as root to run a program or reach
    # elsewhere either.
    for uri in ("qemu:///system; id", "qemu+ext:///system?command=/tmp/x"):
        result = await hass.config_entries.flow.async_configure(
            flow_id, {CONF_USERNAME: AGENT_USER, CONF_LIBVIRT_URI: uri, **login}
        )
        assert result["errors"] == {"base": "invalid_uri"}, uri
    # Never root, by name or by user id: the agent needs no privilege.
    assert fresh.run(["useradd", "--non-unique", "--uid", "0", "toor"]).returncode == 0
    for name in ("root", "toor"):
        result = await hass.config_entries.flow.async_configure(
            flow_id, {CONF_USERNAME: name, CONF_LIBVIRT_URI: fresh.uri, **login}
        )
        assert result["errors"] == {"base": "invalid_agent_user"}, name
    _nothing_installed(fresh)


def _empty_node_file(directory: Path) -> str:
    """A libvirt test-driver node with no domain at all (in ``directory``,
    which the tower sees at the same path)."""
    node = directory / "empty.xml"
    node.write_text("<node/>\n", encoding="utf-8")
    directory.chmod(0o755)
    node.chmod(0o644)
    return f"test://{node}"


async def test_a_libvirt_without_vms_and_the_sessions_own_failures(
    hass: HomeAssistant, tower: BoxFreshTower
) -> None:
    """libvirt answers but knows no VM; a host key other than the one
    confirmed; a closed port; and a failure or a timeout inside a session."""
    login = AdminLogin(
        username="gh-admin",
        private_key=tower.admins["gh-admin"].key_path.read_text(encoding="utf-8"),
    )
    with tempfile.TemporaryDirectory(dir=tower.shared) as directory:
        uri = _empty_node_file(Path(directory))
        async with admin_session(
            "127.0.0.1", tower.port, tower.host_public_key, login
        ) as session:
            with pytest.raises(InstallError) as caught:
                await session.survey(AGENT_USER, uri)
    assert caught.value.key == "tower_no_domains"

    other_key = generate_key_pair()[1]
    with pytest.raises(InstallError) as caught:
        async with admin_session("127.0.0.1", tower.port, other_key, login):
            pass
    assert caught.value.key == "host_key_changed"

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        with pytest.raises(InstallError) as caught:
            async with admin_session("127.0.0.1", port, tower.host_public_key, login):
                pass
    assert caught.value.key == "cannot_connect"

    for raised, key in (
        (OSError("gone"), "install_failed"),
        (TimeoutError(), "install_timeout"),
    ):
        with pytest.raises(InstallError) as caught:
            async with admin_session(
                "127.0.0.1", tower.port, tower.host_public_key, login
            ):
                raise raised
        assert caught.value.key == key


async def test_a_password_login_offers_no_key_of_home_assistants(
    hass: HomeAssistant,
    tower: BoxFreshTower,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given an empty list of keys, asyncssh loads ~/.ssh/id_*: Home
    Assistant's own keys would be offered before the password (one the
    tower authorizes skips the password check; six or more exhaust sshd's
    MaxAuthTries, and a right password shows as refused). With Home
    Assistant's home holding the very key the tower authorizes for
    gh-admin, and an ssh config, X.509 CAs and an ssh-agent besides, a
    wrong password is refused and the right one logs in, each offering the
    password alone."""
    admin = tower.admins["gh-admin"]
    home_with_ssh_defaults(tmp_path / "home", monkeypatch, admin.key_path)
    made = record_connections(monkeypatch)
    wrong = AdminLogin(username=admin.name, password="not-it")  # noqa: S106
    with pytest.raises(InstallError) as caught:
        async with admin_session("127.0.0.1", tower.port, tower.host_public_key, wrong):
            pass
    assert caught.value.key == "admin_auth_failed"
    right = AdminLogin(username=admin.name, password=admin.password)
    async with admin_session("127.0.0.1", tower.port, tower.host_public_key, right):
        pass
    assert len(made) == 2
    for kwargs in made:
        assert kwargs["client_keys"] is None
        assert options_taken_from_home(kwargs) == []


def _node_file(directory: Path, names: list[str]) -> str:
    """A libvirt test-driver node with these shut-off domains (in
    ``directory``, which the tower sees at the same path)."""
    domains = "".join(
        "<domain type='test'><name>"
        + name
        + "</name><memory>1024</memory><os><type>hvm</type></os></domain>"
        for name in names
    )
    node = directory / "node.xml"
    node.write_text(f"<node>{domains}</node>\n", encoding="utf-8")
    directory.chmod(0o755)
    node.chmod(0o644)
    return f"test://{node}"


async def test_vms_virsh_would_look_up_by_id_or_uuid_are_not_offered(
    hass: HomeAssistant, tower: BoxFreshTower
) -> None:
    """virsh looks `--domain WORD` up by a running domain's id first, then
    by UUID, then by name (tools/virsh-util.c, virshLookupDomainInternal): a
    VM named `1` or like a UUID could make the agent act on another VM. The
    tower's list offers the others and names these with the reason; a tower
    with only such names is refused with the reason, and nothing is written."""
    uuid_name = "6695eb01-f6a4-8304-79aa-97f2502e193f"
    login = _key_login(tower, "gh-admin")
    with tempfile.TemporaryDirectory(dir=tower.shared) as directory:
        uri = _node_file(Path(directory), ["gpu-node", "win-1", "1", uuid_name])
        flow_id = await _to_menu(hass, tower)
        result = await _login(hass, flow_id, uri, **login)
    assert result["step_id"] == "install_options", result.get("errors")
    options = result["data_schema"].schema[CONF_GPU_NODE].config["options"]
    assert [option["value"] for option in options] == ["gpu-node", "win-1"]
    assert result["description_placeholders"]["left_out"] == f"1, {uuid_name}"
    assert "{left_out}" in STRINGS["config"]["step"]["install_options"]["description"]
    _nothing_installed(tower)
    hass.config_entries.flow.async_abort(flow_id)

    with tempfile.TemporaryDirectory(dir=tower.shared) as directory:
        uri = _node_file(Path(directory), ["1", "02"])
        flow_id = await _to_menu(hass, tower)
        result = await _login(hass, flow_id, uri, **login)
    assert result["step_id"] == "install_agent"
    assert result["errors"] == {"base": "ambiguous_domain"}
    assert result["description_placeholders"]["detail"] == "02, 1"
    assert "id or UUID" in STRINGS["config"]["error"]["ambiguous_domain"]
    _nothing_installed(tower)
    hass.config_entries.flow.async_abort(flow_id)


async def test_a_reply_lost_after_the_install_is_retried_safely(
    hass: HomeAssistant,
    fresh: BoxFreshTower,
    cluster: K8sEmulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The install ran on the tower but its reply never came back (the
    connection cut at that moment). The user is told it failed and logs in
    again; the second install finds the first one's work and completes it
    without doubling anything: one account, one key line (the same key, the
    flow keeps it), and the entry works. The cut itself is made on Home
    Assistant's side, after the real install returned: no real network can
    be cut at that exact moment here."""
    real_agent = AdminSession._agent
    cuts: list[list[str]] = []

    async def cut_after(self: AdminSession, words: list[str]) -> dict[str, Any]:
        reply = await real_agent(self, words)
        if not cuts:
            cuts.append(words)
            raise asyncssh.ConnectionLost("connection cut before the reply")
        return reply

    monkeypatch.setattr(AdminSession, "_agent", cut_after)
    flow_id, result = await _install(hass, fresh, _key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_agent"
    assert result["errors"] == {"base": "install_failed"}
    assert "connection cut" in result["description_placeholders"]["detail"]
    # It did happen on the tower.
    assert fresh.read("/etc/gpu-handoff/config.json") is not None
    first_keys = fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys")

    result = await hass.config_entries.flow.async_configure(
        flow_id,
        {
            CONF_USERNAME: AGENT_USER,
            CONF_LIBVIRT_URI: fresh.uri,
            **_key_login(fresh, "gh-admin"),
        },
    )
    assert result["step_id"] == "install_options"
    assert result["description_placeholders"]["agent"] == wire.VERSION
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1", "win-2"]}
    )
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: False}
    )
    assert result["step_id"] == "install_done", result.get("errors")
    assert fresh.read(f"/home/{AGENT_USER}/.ssh/authorized_keys") == first_keys
    assert len((first_keys or "").splitlines()) == 1
    assert fresh.run(["grep", "-c", f"^{AGENT_USER}:", "/etc/passwd"]).stdout == "1\n"
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "cluster", result.get("errors")


async def test_the_install_form_as_the_frontend_gets_it(
    hass: HomeAssistant, tower: BoxFreshTower, hass_client: ClientSessionGenerator
) -> None:
    """Through the REST API the frontend uses: the menu offers the guided
    install first, its form serialises with a label for every field, and
    the secrets are password fields."""
    assert await async_setup_component(hass, "config", {})
    client = await hass_client()

    async def post(path: str, data: dict[str, Any]) -> dict[str, Any]:
        response = await client.post(path, json=data)
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer

    flow = await post("/api/config/config_entries/flow", {"handler": DOMAIN})
    step = f"/api/config/config_entries/flow/{flow['flow_id']}"
    await post(
        step, {CONF_HOST: "127.0.0.1", CONF_PORT: tower.port, CONF_USERNAME: AGENT_USER}
    )
    menu = await post(step, {})
    assert menu["menu_options"][0] == "install_agent"
    form = await post(step, {"next_step_id": "install_agent"})
    fields = {field["name"]: field for field in form["data_schema"]}
    assert list(fields) == [
        CONF_USERNAME,
        CONF_ADMIN_USERNAME,
        # A key first: its signature is bound to the session; a password
        # goes to whoever holds the pinned host key.
        CONF_ADMIN_KEY,
        CONF_ADMIN_PASSPHRASE,
        CONF_ADMIN_PASSWORD,
        CONF_SUDO_PASSWORD,
        CONF_LIBVIRT_URI,
    ]
    for name in (CONF_ADMIN_PASSWORD, CONF_ADMIN_PASSPHRASE, CONF_SUDO_PASSWORD):
        assert fields[name]["selector"]["text"]["type"] == "password"
    labels = STRINGS["config"]["step"]["install_agent"]["data"]
    assert set(labels) == set(fields)
    assert STRINGS["config"]["step"]["credentials"]["menu_options"]["install_agent"]


async def test_a_key_sshd_refuses_after_the_install_is_shown_and_retried(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """The account existed already, with a home anyone may write to: sshd
    (StrictModes) would refuse the key the install puts there, and the
    survey says so first. Made so again between the survey and the install
    (a race no look can rule out), the check right after the install says
    so, with the install's own findings; once the home is fixed, submitting
    logs in."""
    home = f"/home/{AGENT_USER}"
    made = fresh.run(["useradd", "--create-home", "--password", "*", AGENT_USER])
    assert made.returncode == 0, made.stderr
    fresh.run(["chmod", "o+w", home])
    login = _key_login(fresh, "gh-admin")
    flow_id = await _to_menu(hass, fresh)
    result = await _login(hass, flow_id, fresh.uri, **login)
    assert result["errors"] == {"base": "agent_user_home_unsafe"}
    fresh.run(["chmod", "o-w", home])
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_USERNAME: AGENT_USER, CONF_LIBVIRT_URI: fresh.uri, **login}
    )
    assert result["step_id"] == "install_options", result.get("errors")
    fresh.run(["chmod", "o+w", home])
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1", "win-2"]}
    )
    # passwd -S of useradd's "*": locked.
    assert result["step_id"] == "install_confirm_existing"
    assert result["description_placeholders"]["password"] == "L"  # noqa: S105
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: False}
    )
    assert result["step_id"] == "install_done"
    assert result["errors"] == {"base": "invalid_auth"}
    assert "Authentication refused: bad ownership or modes" in fresh.log
    fresh.run(["chmod", "o-w", home])
    result = await hass.config_entries.flow.async_configure(flow_id, {})
    assert result["step_id"] == "cluster", result.get("errors")


async def test_an_agent_of_an_older_protocol_is_updated_from_its_repair(
    hass: HomeAssistant,
    fresh: BoxFreshTower,
    cluster: K8sEmulator,
    hass_client: ClientSessionGenerator,
) -> None:
    """An agent that speaks an older protocol (one released before this
    integration's) raises its repair, and the same guided update fixes it."""
    entry = await _installed_entry(hass, fresh, cluster)
    _edit_installed_agent(fresh, f"PROTOCOL = {PROTOCOL}", f"PROTOCOL = {PROTOCOL - 1}")
    await hass.config_entries.async_reload(entry.entry_id)
    await hass.async_block_till_done()
    issue_id = f"agent_outdated_{entry.entry_id}"
    await until(
        lambda: ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is not None
    )
    # The entry cannot load with that agent: the repair is the way out.
    assert entry.state is ConfigEntryState.SETUP_RETRY
    issue = ir.async_get(hass).async_get_issue(DOMAIN, issue_id)
    assert issue is not None
    assert issue.is_fixable
    _flow, submit = await _open_fix(hass, hass_client, issue_id)
    await submit({"next_step_id": "update_login"})
    result = await submit(_key_login(fresh, "gh-admin"))
    assert result["type"] == "create_entry", result
    assert fresh.read_bytes("/usr/local/bin/gpu-handoff") == agent_bytes()
    await until(lambda: entry.state is ConfigEntryState.LOADED)
    await until(lambda: ir.async_get(hass).async_get_issue(DOMAIN, issue_id) is None)


async def test_an_existing_account_is_looked_at_before_it_is_used(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """The install keeps an existing account as it is (its groups, shell and
    password) and gives it Home Assistant's key: an administrator (in the
    sudo group, or with sudo rights of its own) is refused, and so is a
    home sshd's StrictModes would refuse a key in; another account is shown
    on the confirm step as it is now. Nothing is installed."""
    flow_id = await _to_menu(hass, fresh)
    await hass.config_entries.flow.async_configure(
        flow_id, {"next_step_id": "install_agent"}
    )
    login = _key_login(fresh, "gh-admin")

    async def as_account(name: str) -> Result:
        return await hass.config_entries.flow.async_configure(
            flow_id, {CONF_USERNAME: name, CONF_LIBVIRT_URI: fresh.uri, **login}
        )

    for name in ("gh-admin-pw", "gh-admin"):
        result = await as_account(name)
        assert result["errors"] == {"base": "agent_user_is_admin"}, name
        assert "sudo" in result["description_placeholders"]["detail"]
    assert fresh.run(["chmod", "0777", "/home/gh-plain"]).returncode == 0
    result = await as_account("gh-plain")
    assert result["errors"] == {"base": "agent_user_home_unsafe"}
    assert "/home/gh-plain 777 gh-plain" in result["description_placeholders"]["detail"]
    assert fresh.run(["chmod", "0755", "/home/gh-plain"]).returncode == 0
    result = await as_account("gh-plain")
    assert result["step_id"] == "install_options", result.get("errors")
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1"]}
    )
    assert result["step_id"] == "install_confirm_existing"
    shown = result["description_placeholders"]
    assert shown["groups"].split()[0] == "gh-plain"
    assert shown["shell"] == "/bin/bash"
    assert shown["password"] == "P"  # noqa: S105 - passwd -S: a usable password
    assert shown["home"] == "/home/gh-plain (755 gh-plain)"
    hass.config_entries.flow.async_abort(flow_id)
    for path in WRITTEN:
        assert fresh.read(path) is None, path


async def test_the_admin_login_is_kept_ten_minutes_at_most(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """A browser tab closed half way leaves the flow open until Home
    Assistant restarts: the administrator login goes after
    ADMIN_LOGIN_KEPT all the same (nothing refers to it any more), and an
    install confirmed after that asks for it again and installs nothing."""
    flow_id = await _to_menu(hass, fresh)
    login = _password_login(fresh, "gh-admin-pw")
    result = await _login(hass, flow_id, fresh.uri, **login)
    assert result["step_id"] == "install_options"
    assert _logins_in_memory(login[CONF_ADMIN_PASSWORD]) == 1
    async_fire_time_changed(
        hass, dt_util.utcnow() + timedelta(seconds=ADMIN_LOGIN_KEPT - 5)
    )
    await hass.async_block_till_done()
    assert _logins_in_memory(login[CONF_ADMIN_PASSWORD]) == 1
    async_fire_time_changed(
        hass, dt_util.utcnow() + timedelta(seconds=ADMIN_LOGIN_KEPT + 1)
    )
    await hass.async_block_till_done()
    assert _logins_in_memory(login[CONF_ADMIN_PASSWORD]) == 0
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1"]}
    )
    assert result["step_id"] == "install_agent"
    assert result["errors"] == {"base": "admin_login_expired"}
    _nothing_installed(fresh)
    # Given again, it is kept again, until the flow is closed.
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_USERNAME: AGENT_USER, CONF_LIBVIRT_URI: fresh.uri, **login}
    )
    assert result["step_id"] == "install_options"
    assert _logins_in_memory(login[CONF_ADMIN_PASSWORD]) == 1
    hass.config_entries.flow.async_abort(flow_id)
    assert _logins_in_memory(login[CONF_ADMIN_PASSWORD]) == 0


def _logins_in_memory(password: str) -> int:
    """How many administrator logins with this password anything still
    refers to."""
    gc.collect()
    return sum(
        1
        for item in gc.get_objects()
        if isinstance(item, AdminLogin) and item.password == password
    )


async def test_python_removed_between_the_survey_and_the_install(
    hass: HomeAssistant, fresh: BoxFreshTower
) -> None:
    """The tower changed between looking and doing (python3 removed while the
    user read the plan): the install fails with the tower's own words, the
    upload is gone, nothing was written."""
    flow_id = await _to_menu(hass, fresh)
    result = await _login(hass, flow_id, fresh.uri, **_key_login(fresh, "gh-admin"))
    assert result["step_id"] == "install_options"
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_GPU_NODE: "gpu-node", CONF_GAMING_VMS: ["win-1"]}
    )
    assert result["step_id"] == "install_confirm"
    removed = fresh.run(["sh", "-c", "rm /usr/bin/python3"])
    assert removed.returncode == 0, removed.stderr
    result = await hass.config_entries.flow.async_configure(
        flow_id, {CONF_RESTART_LIBVIRT: False}
    )
    assert result["step_id"] == "install_agent"
    assert result["errors"] == {"base": "install_failed"}
    assert "python3" in result["description_placeholders"]["detail"]
    _nothing_installed(fresh)
