"""The fresh tower of the guided-install tests (tests/support/fresh_tower.py):
real logins, real sudo, real libvirt, its knobs, and nothing left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import socket

import asyncssh
import pytest

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


@pytest.fixture
def tower(tmp_path: Path, socket_enabled: None) -> Iterator[FreshTower]:
    """The default fresh tower."""
    require_fresh_tower()
    with FreshTower(tmp_path / "tower") as started:
        yield started


def _known_hosts(tower: FreshTower) -> asyncssh.SSHKnownHosts:
    return asyncssh.import_known_hosts(
        f"[{tower.host}]:{tower.port} {tower.host_public_key}\n"
    )


async def _ssh(
    tower: FreshTower,
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
    tower: FreshTower, tmp_path: Path
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


async def test_sudo_as_each_administrator(tower: FreshTower) -> None:
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


async def test_root_logs_in_with_password_and_with_key(tower: FreshTower) -> None:
    root = tower.admins[ROOT]
    by_password = await _ssh(tower, ROOT, "id -u", password=root.password)
    by_key = await _ssh(tower, ROOT, "id -u", key=root.key_path)
    assert (by_password.exit_status, by_password.stdout) == (0, "0\n")
    assert (by_key.exit_status, by_key.stdout) == (0, "0\n")
    with pytest.raises(asyncssh.PermissionDenied):
        await _ssh(tower, ROOT, "id -u", key=tower.admins[PLAIN].key_path)


async def test_the_tower_has_python3_libvirt_and_a_recording_systemctl(
    tower: FreshTower,
) -> None:
    """As on a Debian tower: python3, virsh reaching libvirt (for any user:
    libvirtd knows the tower's accounts), systemctl recorded."""
    admin = tower.admins[ADMIN]
    done = await _ssh(
        tower,
        admin.name,
        "python3 -c 'import sys; print(sys.version_info[:2])'",
        key=admin.key_path,
    )
    assert done.stdout == "(3, 14)\n"
    for user in (ROOT, PLAIN):
        listed = tower.run(["virsh", "-c", tower.uri, "list", "--all", "--name"], user)
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == DOMAINS
    state = tower.run(["virsh", "-c", tower.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"
    hostdevs = tower.run(["virsh", "-c", tower.uri, "dumpxml", "gpu-node"])
    assert hostdevs.stdout.count("<hostdev ") == 4  # two cards, two functions each

    assert tower.systemctl_calls() == []
    done = await _ssh(
        tower, admin.name, "sudo -n systemctl restart libvirtd", key=admin.key_path
    )
    assert done.exit_status == 0, done.stderr
    assert tower.systemctl_calls() == [["restart", "libvirtd"]]


async def test_sshd_refuses_keys_a_strict_sshd_refuses(tower: FreshTower) -> None:
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
    tower: FreshTower,
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


def test_run_as_a_user_and_read(tower: FreshTower) -> None:
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


def test_useradd_inside_leaves_the_root_unchanged(tower: FreshTower) -> None:
    before = Path("/etc/passwd").read_bytes()
    done = tower.run(["useradd", "--create-home", "gh-extra"])
    assert done.returncode == 0, done.stderr
    assert "gh-extra:" in str(tower.read("/etc/passwd"))
    assert Path("/etc/passwd").read_bytes() == before
    assert not Path("/home/gh-extra").exists()


def test_no_libvirt_old_python_read_only_usr_local(
    tmp_path: Path, socket_enabled: None
) -> None:
    require_fresh_tower()
    with FreshTower(
        tmp_path / "tower", libvirt=False, python="old", read_only_usr_local=True
    ) as tower:
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


def test_no_python_no_virsh(tmp_path: Path, socket_enabled: None) -> None:
    require_fresh_tower()
    with FreshTower(tmp_path / "tower", python="missing", virsh=False) as tower:
        for user in (ROOT, ADMIN):
            listed = tower.run(
                ["sh", "-c", "ls /usr/bin | grep '^python3' || true"], user
            )
            assert listed.stdout == ""
            for program in ("python3", "python3.14", "virsh"):
                assert tower.run(["which", program], user).returncode != 0, program
        # The daemon is there; only the client is gone.
        assert tower.libvirt is not None
        assert (
            sorted(tower.libvirt.virsh("list", "--all", "--name").stdout.split())
            == DOMAINS
        )
    # Where the knobs are off, the same probes find them (the test can fail).
    with FreshTower(tmp_path / "plain") as plain_tower:
        assert plain_tower.run(["which", "python3", "virsh"]).returncode == 0
        assert plain_tower.run(["touch", "/usr/local/bin/x"]).returncode == 0


def test_nothing_leaks(tmp_path: Path, socket_enabled: None) -> None:
    """What an install writes, and the tower's own setup, stay inside:
    outside, the watched paths are as they were, during and after."""
    require_fresh_tower()
    before = root_snapshot()
    mounts = Path("/proc/self/mountinfo").read_text(encoding="utf-8")
    directory = tmp_path / "tower"
    with FreshTower(directory) as tower:
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
            ["systemctl", "restart", "libvirtd"],
        ]
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


def test_stop_after_a_failed_start_leaves_nothing(
    tmp_path: Path, socket_enabled: None
) -> None:
    """sshd cannot bind (the port is taken): start fails, and what it made
    (processes, mounts, the directory) is gone."""
    require_fresh_tower()
    before = root_snapshot()
    directory = tmp_path / "tower"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: no one answers
        tower = FreshTower(directory, port=taken.getsockname()[1])
        with pytest.raises(FreshTowerError, match="sshd exited"):
            tower.start()
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
