"""The fresh towers of the guided install: real logins, real sudo, real
libvirt, their knobs, and nothing left behind.

Two kinds, each test of what both offer runs on both: ``fresh``
(tests/support/fresh_tower.py: a private mount namespace with overlays, its
own sshd and libvirtd, no systemd), which the benchmark uses, and ``box``
(tests/support/box_tower.py: the test root booted under its own systemd,
whose ssh.service and libvirtd.service are the tower's), which the
guided-install tests and ``scripts/demo --guided`` use: there libvirtd.service
restarts for real, and its domains stay."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import socket
from typing import Any

import asyncssh
import pytest

from tests.support.box import BoxError
from tests.support.box_tower import (
    LIBVIRTD,
    BoxFreshTower,
    BoxTowerError,
    require_box_tower,
)
from tests.support.fresh_tower import (
    ADMIN,
    ADMIN_PW,
    PLAIN,
    ROOT,
    FreshTower,
    FreshTowerError,
    require_fresh_tower,
    root_snapshot,
)
from tests.support.sshd import generate_key

pytestmark = pytest.mark.system

DOMAINS = ["gpu-node", "win-1", "win-2"]
NOT_IN_SUDOERS = ("is not in the sudoers file", "may not run sudo")
KINDS = ("fresh", "box")

type Tower = FreshTower | BoxFreshTower


def _make(kind: str, directory: Path, **knobs: Any) -> Tower:
    """A tower of ``kind`` (not started); skips where it cannot run."""
    if kind == "box":
        require_box_tower()
        return BoxFreshTower(directory, **knobs)
    require_fresh_tower()
    return FreshTower(directory, **knobs)


@pytest.fixture(params=KINDS)
def tower(
    request: pytest.FixtureRequest, tmp_path: Path, socket_enabled: None
) -> Iterator[Tower]:
    """The default tower, of each kind."""
    with _make(request.param, tmp_path / "tower") as started:
        yield started


@pytest.fixture
def fresh(tmp_path: Path, socket_enabled: None) -> Iterator[FreshTower]:
    """The default fresh tower (a mount namespace, no systemd)."""
    require_fresh_tower()
    with FreshTower(tmp_path / "tower") as started:
        yield started


@pytest.fixture
def box(tmp_path: Path, socket_enabled: None) -> Iterator[BoxFreshTower]:
    """The default box tower (systemd as init)."""
    require_box_tower()
    with BoxFreshTower(tmp_path / "tower") as started:
        yield started


def _known_hosts(tower: Tower) -> asyncssh.SSHKnownHosts:
    return asyncssh.import_known_hosts(
        f"[{tower.host}]:{tower.port} {tower.host_public_key}\n"
    )


async def _ssh(
    tower: Tower,
    user: str,
    command: str,
    *,
    password: str | None = None,
    key: Path | None = None,
    stdin: str | None = None,
) -> asyncssh.SSHCompletedProcess:
    """Log in as ``user`` with exactly one of a password or a key, pinned to
    the tower's host key, and run ``command``."""
    async with asyncssh.connect(
        tower.host,
        tower.port,
        username=user,
        password=password,
        client_keys=[str(key)] if key else [],
        known_hosts=_known_hosts(tower),
        agent_path=None,
        preferred_auth="publickey" if key else "password",
        config=None,
    ) as conn:
        return await conn.run(command, input=stdin, check=False)


async def test_password_login_and_a_wrong_password(
    tower: Tower, tmp_path: Path
) -> None:
    """gh-admin-pw logs in with its password; a wrong one is refused, and so
    is a client that pinned another host key."""
    admin = tower.admins[ADMIN_PW]
    done = await _ssh(tower, admin.name, "id -un", password=admin.password)
    assert (done.exit_status, done.stdout) == (0, f"{admin.name}\n")
    with pytest.raises(asyncssh.PermissionDenied):
        await _ssh(tower, admin.name, "id -un", password=admin.password + "x")
    wrong = generate_key(tmp_path / "another_host_key")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        async with asyncssh.connect(
            tower.host,
            tower.port,
            username=admin.name,
            password=admin.password,
            client_keys=[],
            known_hosts=asyncssh.import_known_hosts(
                f"[{tower.host}]:{tower.port} {wrong}\n"
            ),
            agent_path=None,
            config=None,
        ):
            pass
    assert tower.host_fingerprint.startswith("SHA256:")


async def test_sudo_as_each_administrator(tower: Tower) -> None:
    """gh-admin's sudo asks nothing; gh-admin-pw's asks the password;
    gh-plain has none. No complaint about the host name on stderr."""
    assert {admin.name: admin.sudo for admin in tower.admins.values()} == {
        ADMIN: "nopasswd",
        ADMIN_PW: "password",
        PLAIN: "none",
        ROOT: "root",
    }
    admin = tower.admins[ADMIN]
    done = await _ssh(tower, admin.name, "sudo -n id -u", key=admin.key_path)
    assert (done.exit_status, done.stdout, done.stderr) == (0, "0\n", "")

    with_password = tower.admins[ADMIN_PW]
    done = await _ssh(
        tower, with_password.name, "sudo -n true", key=with_password.key_path
    )
    assert done.exit_status != 0
    assert "a password is required" in str(done.stderr)
    done = await _ssh(
        tower,
        with_password.name,
        "sudo -S -p '' id -un",
        key=with_password.key_path,
        stdin=with_password.password + "\n",
    )
    assert (done.exit_status, done.stdout, done.stderr) == (0, "root\n", "")

    plain = tower.admins[PLAIN]
    done = await _ssh(
        tower,
        plain.name,
        "sudo -S -p '' true",
        key=plain.key_path,
        stdin=plain.password + "\n",
    )
    assert done.exit_status != 0
    assert any(words in str(done.stderr) for words in NOT_IN_SUDOERS), done.stderr
    # The drop-in is what gives gh-admin its sudo, and it is valid.
    assert tower.read(f"/etc/sudoers.d/{ADMIN}") is not None
    assert tower.run(["stat", "-c", "%a", f"/etc/sudoers.d/{ADMIN}"]).stdout == "440\n"


async def test_root_logs_in_with_password_and_with_key(tower: Tower) -> None:
    root = tower.admins[ROOT]
    by_password = await _ssh(tower, ROOT, "id -u", password=root.password)
    by_key = await _ssh(tower, ROOT, "id -u", key=root.key_path)
    assert (by_password.exit_status, by_password.stdout) == (0, "0\n")
    assert (by_key.exit_status, by_key.stdout) == (0, "0\n")
    with pytest.raises(asyncssh.PermissionDenied):
        await _ssh(tower, ROOT, "id -u", key=tower.admins[PLAIN].key_path)


async def test_the_tower_has_python3_and_libvirt(tower: Tower) -> None:
    """As on a Debian tower: python3, and virsh reaching libvirt with the
    GPU node running and its cards as host devices, for root and for any
    user libvirt lets in (libvirtd knows the tower's accounts): on the
    fresh tower any user, on the box tower the libvirt group's members, as
    Debian's polkit rule says (the agent's user is one: the install puts it
    there)."""
    admin = tower.admins[ADMIN]
    done = await _ssh(
        tower,
        admin.name,
        "python3 -c 'import sys; print(sys.version_info[:2])'",
        key=admin.key_path,
    )
    assert done.stdout == "(3, 14)\n"
    users = [ROOT, PLAIN]
    if isinstance(tower, BoxFreshTower):
        made = tower.run(["useradd", "--groups", "libvirt", "gh-libvirt"])
        assert made.returncode == 0, made.stderr
        users = [ROOT, "gh-libvirt"]
        refused = tower.run(["virsh", "-c", tower.uri, "list"], PLAIN)
        assert refused.returncode != 0
        assert "org.libvirt.unix.manage" in refused.stderr
    for user in users:
        listed = tower.run(["virsh", "-c", tower.uri, "list", "--all", "--name"], user)
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == DOMAINS
    state = tower.run(["virsh", "-c", tower.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"
    hostdevs = tower.run(["virsh", "-c", tower.uri, "dumpxml", "gpu-node"])
    assert hostdevs.stdout.count("<hostdev ") == 4  # two cards, two functions each


async def test_the_box_towers_libvirtd_restarts_for_real(box: BoxFreshTower) -> None:
    """On the box tower an administrator's ``sudo systemctl restart`` is
    systemd's: libvirtd.service gets a new main process (its journal says
    so), virtqemud.service stays inactive (it is not installed), and the
    domains, read from the test driver's file, are the same through the
    new daemon: the GPU node running with its cards."""
    assert box.is_active(LIBVIRTD, "virtqemud.service") == ["active", "inactive"]
    before = box.main_pid(LIBVIRTD)
    assert before != 0
    admin = box.admins[ADMIN]
    done = await _ssh(
        box, admin.name, f"sudo -n systemctl restart {LIBVIRTD}", key=admin.key_path
    )
    assert (done.exit_status, done.stderr) == (0, ""), done.stderr
    after = box.main_pid(LIBVIRTD)
    assert after not in (0, before)
    journal = box.journal(LIBVIRTD)
    assert journal.count("Started libvirtd.service") == 2, journal
    assert f"libvirtd[{after}]" in journal
    assert box.is_active(LIBVIRTD, "virtqemud.service") == ["active", "inactive"]
    listed = box.run(["virsh", "-c", box.uri, "list", "--all", "--name"])
    assert sorted(listed.stdout.split()) == DOMAINS
    state = box.run(["virsh", "-c", box.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"
    hostdevs = box.run(["virsh", "-c", box.uri, "dumpxml", "gpu-node"])
    assert hostdevs.stdout.count("<hostdev ") == 4


async def test_the_fresh_towers_systemctl_restarts_nothing(fresh: FreshTower) -> None:
    """The fresh tower has no systemd: its systemctl is the root's own, which
    reaches no service manager (it refuses, or in a chroot ignores what it is
    told), so it never calls libvirtd active and never restarts the tower's
    libvirtd. A restart is the box tower's to show."""
    assert fresh.libvirt is not None
    assert fresh.libvirt.process is not None
    daemon = fresh.libvirt.process.pid
    admin = fresh.admins[ADMIN]
    asked = await _ssh(
        fresh,
        admin.name,
        f"sudo -n systemctl is-active {LIBVIRTD}",
        key=admin.key_path,
    )
    assert str(asked.stdout).split() != ["active"]
    await _ssh(
        fresh, admin.name, f"sudo -n systemctl restart {LIBVIRTD}", key=admin.key_path
    )
    assert fresh.libvirt.process.poll() is None
    assert fresh.libvirt.process.pid == daemon
    state = fresh.run(["virsh", "-c", fresh.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"


async def test_sshd_refuses_keys_a_strict_sshd_refuses(tower: Tower) -> None:
    """StrictModes is on: a home others may write to lets no key in (an
    install must leave the SSH user's files as a real sshd wants them)."""
    plain = tower.admins[PLAIN]
    done = await _ssh(tower, plain.name, "true", key=plain.key_path)
    assert done.exit_status == 0
    assert tower.run(["chmod", "o+w", f"/home/{plain.name}"]).returncode == 0
    with pytest.raises(asyncssh.PermissionDenied):
        await _ssh(tower, plain.name, "true", key=plain.key_path)
    assert "bad ownership or modes" in tower.log


async def test_upload_by_sftp_and_run_it_with_sudo_python3(
    tower: Tower,
) -> None:
    """The guided install's path: SFTP into /tmp as an administrator, then
    ``sudo python3`` on what was uploaded runs as root."""
    admin = tower.admins[ADMIN]
    async with asyncssh.connect(
        tower.host,
        tower.port,
        username=admin.name,
        client_keys=[str(admin.key_path)],
        known_hosts=_known_hosts(tower),
        agent_path=None,
        config=None,
    ) as conn:
        upload = f"/tmp/gh-upload-{tower.port}"
        try:
            async with conn.start_sftp_client() as sftp:
                await sftp.mkdir(upload)
                async with sftp.open(f"{upload}/probe.py", "w") as handle:
                    await handle.write("import os\nprint(os.geteuid())\n")
            done = await conn.run(f"sudo -n python3 {upload}/probe.py", check=False)
            assert (done.exit_status, done.stdout, done.stderr) == (0, "0\n", "")
            owner = tower.run(["stat", "-c", "%U", f"{upload}/probe.py"])
            assert owner.stdout == f"{admin.name}\n"
        finally:
            await conn.run(f"rm -rf {upload}", check=False)


def test_run_as_a_user_and_read(tower: Tower) -> None:
    done = tower.run(["id", "-un"], user=PLAIN)
    assert (done.returncode, done.stdout) == (0, f"{PLAIN}\n")
    keys = tower.read(f"/home/{PLAIN}/.ssh/authorized_keys")
    assert keys == tower.admins[PLAIN].public_key + "\n"
    modes = tower.run(
        [
            "stat",
            "-c",
            "%U %a",
            f"/home/{PLAIN}/.ssh",
            f"/home/{PLAIN}/.ssh/authorized_keys",
        ]
    )
    assert modes.stdout.split("\n")[:2] == [f"{PLAIN} 700", f"{PLAIN} 600"]
    assert tower.read("/etc/no-such-file") is None
    assert "127.0.1.1" in str(tower.read("/etc/hosts"))


def test_useradd_inside_leaves_the_root_unchanged(tower: Tower) -> None:
    before = Path("/etc/passwd").read_bytes()
    done = tower.run(["useradd", "--create-home", "gh-extra"])
    assert done.returncode == 0, done.stderr
    assert "gh-extra:" in str(tower.read("/etc/passwd"))
    assert Path("/etc/passwd").read_bytes() == before
    assert not Path("/home/gh-extra").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_no_libvirt_old_python_read_only_usr_local(
    tmp_path: Path, socket_enabled: None, kind: str
) -> None:
    with _make(
        kind, tmp_path / "tower", libvirt=False, python="old", read_only_usr_local=True
    ) as tower:
        if isinstance(tower, BoxFreshTower):
            assert tower.is_active(LIBVIRTD) == ["inactive"]
        else:
            assert tower.libvirt is None
        failed = tower.run(["virsh", "-c", "qemu:///system", "list"])
        assert failed.returncode != 0
        assert tower.run(["virsh", "-c", tower.uri, "list"]).returncode != 0

        probe = "import sys; print(sys.version_info[:2], sys.version_info >= (3, 9))"
        for flags in ([], ["-I"], ["-E"]):
            done = tower.run(["python3", *flags, "-c", probe], user=PLAIN)
            assert done.stdout == "(3, 7) False\n", (flags, done)
        assert tower.run(["python3", "--version"]).stdout == "Python 3.7.17\n"
        hexversion = tower.run(["python3", "-c", "import sys; print(sys.hexversion)"])
        assert hexversion.stdout == f"{0x030711F0}\n"

        touched = tower.run(["touch", "/usr/local/bin/x"])
        assert touched.returncode != 0
        assert "Read-only file system" in touched.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_no_python_no_virsh(tmp_path: Path, socket_enabled: None, kind: str) -> None:
    with _make(kind, tmp_path / "tower", python="missing", virsh=False) as tower:
        for user in (ROOT, ADMIN):
            listed = tower.run(
                ["sh", "-c", "ls /usr/bin | grep '^python3' || true"], user
            )
            assert listed.stdout == ""
            for program in ("python3", "python3.14", "virsh"):
                assert tower.run(["which", program], user).returncode != 0, program
        # The daemon is there; only the client is gone.
        if isinstance(tower, BoxFreshTower):
            assert tower.is_active(LIBVIRTD) == ["active"]
        else:
            assert tower.libvirt is not None
            listed = tower.libvirt.virsh("list", "--all", "--name")
            assert sorted(listed.stdout.split()) == DOMAINS
    # Where the knobs are off, the same probes find them (the test can fail).
    with _make(kind, tmp_path / "plain") as plain_tower:
        assert plain_tower.run(["which", "python3", "virsh"]).returncode == 0
        assert plain_tower.run(["touch", "/usr/local/bin/x"]).returncode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_leaks(tmp_path: Path, socket_enabled: None, kind: str) -> None:
    """What an install writes, and the tower's own setup, stay inside:
    outside, the watched paths are as they were, during and after (on the
    box tower, libvirtd.service restarted too)."""
    tower = _make(kind, tmp_path / "tower")
    before = root_snapshot()
    mounts = Path("/proc/self/mountinfo").read_text(encoding="utf-8")
    directory = tower.directory
    with tower:
        steps = [
            ["useradd", "--create-home", "--groups", "libvirt", "gpu-handoff"],
            ["install", "-d", "-m", "0755", "/etc/gpu-handoff", "/var/lib/gpu-handoff"],
            ["install", "-d", "-m", "0755", "/etc/libvirt/hooks"],
            ["sh", "-c", "echo '{}' > /etc/gpu-handoff/config.json"],
            ["sh", "-c", "echo '#!/bin/sh' > /etc/libvirt/hooks/qemu"],
            ["cp", "/bin/true", "/usr/local/bin/gpu-handoff"],
            [
                "sh",
                "-c",
                "echo 'gpu-handoff ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/x",
            ],
            [
                "sh",
                "-c",
                "mkdir -p /root/.ssh && echo key >> /root/.ssh/authorized_keys",
            ],
        ]
        if isinstance(tower, BoxFreshTower):
            steps.append(["systemctl", "restart", LIBVIRTD])
        for step in steps:
            done = tower.run(step)
            assert done.returncode == 0, (step, done.stderr)
        assert tower.run(["sudo", "-n", "true"], user=ADMIN).returncode == 0
        assert tower.read("/etc/gpu-handoff/config.json") == "{}\n"
        python3 = tower.run(["readlink", "/usr/bin/python3"])
        assert python3.stdout == "python3.14\n"
        assert root_snapshot() == before
        inside = tower.run(["id", "gpu-handoff"])
        assert inside.returncode == 0
    assert root_snapshot() == before
    assert Path("/proc/self/mountinfo").read_text(encoding="utf-8") == mounts
    assert not directory.exists()


def test_the_snapshot_sees_a_change(tmp_path: Path) -> None:
    """What test_nothing_leaks compares would show a file added, changed,
    or its mode changed."""
    watched = tmp_path / "watched"
    (watched / "sub").mkdir(parents=True)
    snapshots = [root_snapshot([str(watched)])]
    (watched / "sub" / "file").write_text("a", encoding="utf-8")
    snapshots.append(root_snapshot([str(watched)]))
    (watched / "sub" / "file").write_text("b", encoding="utf-8")
    snapshots.append(root_snapshot([str(watched)]))
    (watched / "sub" / "file").chmod(0o600)
    snapshots.append(root_snapshot([str(watched)]))
    assert len({repr(snapshot) for snapshot in snapshots}) == len(snapshots)


@pytest.mark.parametrize("kind", KINDS)
def test_stop_after_a_failed_start_leaves_nothing(
    tmp_path: Path, socket_enabled: None, kind: str
) -> None:
    """sshd cannot bind (the port is taken): start fails, and what it made
    (processes, mounts, the directory; the box) is gone."""
    before = root_snapshot()
    directory = tmp_path / "tower"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: no one answers
        tower = _make(kind, directory, port=taken.getsockname()[1])
        # The box's ssh.service fails at boot already: the box boots degraded.
        with pytest.raises(
            (FreshTowerError, BoxError, BoxTowerError),
            match=r"sshd exited|ssh\.service",
        ):
            tower.start()
    if isinstance(tower, BoxFreshTower):
        assert tower.box is None
    else:
        assert tower.keeper is None
        assert tower.libvirt is None
    assert not directory.exists()
    assert root_snapshot() == before
    tower.stop()  # again: nothing to do


def test_sessions_and_what_they_started_end_with_the_tower(
    tmp_path: Path, socket_enabled: None
) -> None:
    """A process left running inside (as a detached job would be) dies with
    the tower, so the namespace and its mounts go away."""
    require_fresh_tower()
    with FreshTower(tmp_path / "tower") as tower:
        started = tower.run(
            ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"]
        )
        pid = int(started.stdout)
        namespace = Path(f"/proc/{pid}/ns/mnt").readlink()
        assert namespace == Path(f"/proc/{tower.pid}/ns/mnt").readlink()
    assert not Path(f"/proc/{pid}").exists() or (
        Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").split()[2] == "Z"
    )


def test_a_directory_that_cannot_be_an_overlay_is_refused(tmp_path: Path) -> None:
    """Refused before anything is made, and nothing of it removed."""
    with pytest.raises(ValueError, match="plain path"):
        FreshTower(tmp_path / "a,b").start()
    with pytest.raises(ValueError, match="under /etc"):
        FreshTower(Path("/etc/gh-tower")).start()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep").write_text("mine", encoding="utf-8")
    with pytest.raises(ValueError, match="must be new"):
        FreshTower(used).start()
    assert not (tmp_path / "a,b").exists()
    assert not Path("/etc/gh-tower").exists()
    assert (used / "keep").read_text(encoding="utf-8") == "mine"
