"""The guided install's checks that need no tower: what a plan may contain,
how the tower's answers are read, and that a login never shows its secrets.
The install itself is tested end to end in tests/test_guided_install.py."""

from __future__ import annotations

from dataclasses import replace
import shlex
from types import SimpleNamespace

import pytest

from custom_components.gpu_handoff.config_flow import _findings_text, _guess_gpu_node
from custom_components.gpu_handoff.installer import (
    AdminLogin,
    InstallError,
    InstallPlan,
    InstallReport,
    Survey,
    _agent_version,
    _install_error,
    _python_ok,
    check_plan,
    check_uri,
    check_user_name,
)
from custom_components.gpu_handoff.protocol import Finding

SURVEY = Survey(
    sudo="nopasswd",
    python="3.11",
    nixos=False,
    config_exists=False,
    agent_version=None,
    domains=["gpu-node", "win-1", "win-2"],
)


def _plan(**changes: object) -> InstallPlan:
    fields: dict[str, object] = {
        "user": "gpu-handoff",
        "gpu_node": "gpu-node",
        "gaming": ["win-1"],
        "uri": "qemu:///system",
        "public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA home-assistant",
        "restart_libvirt": False,
        "replace_config": False,
    }
    fields.update(changes)
    return InstallPlan(**fields)  # type: ignore[arg-type]


def test_a_login_never_shows_its_secrets() -> None:
    """repr (what a log line or a traceback would show) names the user only."""
    login = AdminLogin(
        username="admin",
        password="hunter2-secret",  # noqa: S106 - a test value
        private_key="-----BEGIN OPENSSH PRIVATE KEY-----\nsecret-key\n",
        passphrase="pass-secret",  # noqa: S106 - a test value
        sudo_password="sudo-secret",  # noqa: S106 - a test value
    )
    shown = repr(login) + str(login) + f"{login!r}"
    assert "admin" in shown
    for secret in ("hunter2", "secret-key", "pass-secret", "sudo-secret"):
        assert secret not in shown


def test_sudo_gets_its_own_password_else_the_logins() -> None:
    """A separate sudo password wins; without one sudo gets the login's."""
    login, sudo = "login-word", "sudo-word"
    assert AdminLogin(username="a", password=login).password_for_sudo == login
    both = AdminLogin(username="a", password=login, sudo_password=sudo)
    assert both.password_for_sudo == sudo
    assert AdminLogin(username="a", private_key="k").password_for_sudo is None


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"user": "Root"}, "invalid_agent_user"),
        ({"user": "a b"}, "invalid_agent_user"),
        ({"user": "-rf"}, "invalid_agent_user"),
        ({"user": "root"}, "invalid_agent_user"),
        ({"uri": "qemu:///system; reboot"}, "invalid_uri"),
        ({"uri": "$(reboot)"}, "invalid_uri"),
        ({"gpu_node": "other"}, "unknown_domain"),
        ({"gaming": ["win-1", "x; reboot"]}, "unknown_domain"),
        ({"gaming": ["gpu-node"]}, "unknown_domain"),
        ({"gaming": []}, "no_gaming_vm"),
    ],
)
def test_a_plan_holds_only_the_towers_own_names(
    changes: dict[str, object], key: str
) -> None:
    """Names come from the tower's own list; the user's words are checked."""
    with pytest.raises(InstallError) as caught:
        check_plan(_plan(**changes), SURVEY)
    assert caught.value.key == key


@pytest.mark.parametrize(
    "changes",
    [
        {"gpu_node": "1"},
        {"gaming": ["win-1", "02"]},
        {"gaming": ["6695eb01-f6a4-8304-79aa-97f2502e193f"]},
    ],
)
def test_a_plan_never_names_a_vm_virsh_would_read_as_an_id_or_uuid(
    changes: dict[str, object],
) -> None:
    """virsh looks a domain up by id, then UUID, then name (tools/virsh-util.c
    virshLookupDomainInternal): such a name could make the agent act on
    another VM, even if the tower lists it (the survey leaves it out)."""
    survey = replace(
        SURVEY,
        domains=[*SURVEY.domains, "1", "02", "6695eb01-f6a4-8304-79aa-97f2502e193f"],
    )
    with pytest.raises(InstallError) as caught:
        check_plan(_plan(**changes), survey)
    assert caught.value.key == "ambiguous_domain"
    assert caught.value.detail in {"1", "02", "6695eb01-f6a4-8304-79aa-97f2502e193f"}


def test_the_install_command_is_one_word_per_option() -> None:
    """Each option reaches the agent as one word, the key line included."""
    plan = _plan(gaming=["win-1", "win-2"], restart_libvirt=True, replace_config=True)
    check_plan(plan, SURVEY)
    argv = plan.argv("/tmp/gpu-handoff-install-00/gpu-handoff")
    assert shlex.split(shlex.join(argv)) == argv
    assert argv[:3] == [
        "python3",
        "/tmp/gpu-handoff-install-00/gpu-handoff",
        "install",
    ]
    assert argv.count("--gaming") == 2
    assert argv[argv.index("--authorize-key") + 1] == plan.public_key
    assert argv[-2:] == ["--restart-libvirt", "--force"]
    assert "--restart-libvirt" not in _plan().argv("p")
    assert "--force" not in _plan().argv("p")


def test_names_and_uris() -> None:
    """useradd's portable names; libvirt URIs of the tower's own libvirt."""
    assert check_user_name("gpu-handoff")
    assert check_user_name("_svc1")
    assert not check_user_name("x" * 33)
    assert check_uri("qemu:///system")
    assert check_uri("qemu:///session")
    assert check_uri("test+unix:///default?socket=/tmp/s/libvirt-sock")
    assert not check_uri("qemu:///system `id`")
    assert not check_uri("system")
    # The survey and the install run virsh as root with it: nothing that
    # names a host, runs a program, reads a key or reaches elsewhere.
    assert not check_uri("qemu+ssh://root@host/system?keyfile=/k")
    assert not check_uri("qemu+ext:///system?command=/tmp/x")
    assert not check_uri("qemu://host/system")
    assert not check_uri("qemu:///system?socket=/tmp/fake-sock")


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("3.9", True),
        ("3.14", True),
        ("4.0", True),
        ("3.8", False),
        ("2.7", False),
        ("", False),
        ("broken", False),
        ("3.x", False),
    ],
)
def test_python_versions(version: str, ok: bool) -> None:
    """3.9 or newer, compared as numbers."""
    assert _python_ok(version) is ok


def test_the_installed_agents_version_is_read_from_its_reply() -> None:
    """The survey's `version` reply; anything else is no version."""
    assert _agent_version('{"ok": true, "version": "0.3.0"}') == "0.3.0"
    assert _agent_version("") is None
    assert _agent_version("not json") is None
    assert _agent_version('{"version": 3}') is None
    assert _agent_version("[]") is None


@pytest.mark.parametrize(
    ("error", "key"),
    [
        (
            {"code": "install_failed", "reason": "EROFS", "message": "m"},
            "install_read_only",
        ),
        (
            {"code": "install_failed", "reason": "EACCES", "message": "m"},
            "install_failed",
        ),
        (
            {"code": "install_failed", "reason": "EBUSY", "message": "m"},
            "install_busy",
        ),
        ({"code": "not_installed", "message": "m"}, "update_not_installed"),
        ({"code": "nixos", "message": "m"}, "update_nixos"),
        ({"code": "bad_request", "message": "m"}, "install_failed"),
    ],
)
def test_the_agents_failures_are_translated(error: dict[str, str], key: str) -> None:
    """Each failure the agent reports has its message; what it left is kept."""
    err = _install_error({"ok": False, "error": error | {"left": ["/x"]}})
    assert err.key == key
    assert err.detail == "m"
    assert err.left == ["/x"]
    assert _install_error({"ok": False}).key == "install_failed"


def test_the_gpu_node_is_guessed_by_its_name() -> None:
    """A name that says GPU or Kubernetes wins; else the first domain."""
    assert _guess_gpu_node(["win-1", "k3s-worker", "win-2"]) == "k3s-worker"
    assert _guess_gpu_node(["alpha", "GPU-box"]) == "GPU-box"
    assert _guess_gpu_node(["beta", "alpha"]) == "beta"


def test_the_findings_say_what_the_check_and_the_restart_found() -> None:
    """Each finding a line: those read with Home Assistant's key when it
    logged in, else the install's own (and a failed status); a failed
    restart either way."""
    report = InstallReport(
        nixos=False,
        findings=[{"code": "hook_missing", "domain": "gpu-node", "detail": "d"}],
        status_error="virsh failed",
        libvirt_restarted=False,
        libvirt_restart_message="systemctl is not on PATH",
    )
    assert _findings_text(InstallReport(nixos=False), None) == "-"
    assert _findings_text(report, None).splitlines() == [
        "- hook_missing (gpu-node): d",
        "- virsh failed",
        "- libvirtd: systemctl is not on PATH",
    ]
    # Only its findings are read: the status of a tower is otherwise large.
    status = SimpleNamespace(
        findings=(
            Finding(code="no_agent_channel", domain="win-2", detail="x"),
            Finding(code="config", domain=None, detail="y"),
        )
    )
    shown = _findings_text(report, status)  # type: ignore[arg-type]
    assert shown.splitlines() == [
        "- no_agent_channel (win-2): x",
        "- config (-): y",
        "- libvirtd: systemctl is not on PATH",
    ]
