"""The fresh tower of the guided install: real logins, real sudo, real
libvirt, its knobs, and nothing left behind.

The tower is tests/support/box_tower.py's: the test root booted in a box
under its own systemd, whose ssh.service and libvirtd.service are the
tower's (libvirtd.service restarts for real, and its domains stay). The
guided-install tests, ``scripts/demo --guided`` and the benchmark use it."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from pathlib import Path
import socket

import asyncssh
import pytest

from tests.support.box import BoxError
from tests.support.box_tower import (
    LIBVIRTD,
    BoxFreshTower,
    BoxTowerError,
    require_box_tower,
)
from tests.support.fresh_tower import ADMIN, ADMIN_PW, PLAIN, ROOT, root_snapshot
from tests.support.sshd import generate_key
from tests.support.waiting import wait_until

pytestmark = pytest.mark.system

DOMAINS = ["gpu-node", "win-1", "win-2"]
NOT_IN_SUDOERS = ("is not in the sudoers file", "may not run sudo")


@pytest.fixture
def tower(tmp_path: Path, socket_enabled: None) -> Iterator[BoxFreshTower]:
    """The default tower."""
    require_box_tower()
    with BoxFreshTower(tmp_path / "tower") as started:
        yield started


def _known_hosts(tower: BoxFreshTower) -> asyncssh.SSHKnownHosts:
    return asyncssh.import_known_hosts(
        f"[{tower.host}]:{tower.port} {tower.host_public_key}\n"
    )


async def _ssh(
    tower: BoxFreshTower,
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
    tower: BoxFreshTower, tmp_path: Path
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


async def test_sudo_as_each_administrator(tower: BoxFreshTower) -> None:
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


async def test_root_logs_in_with_password_and_with_key(tower: BoxFreshTower) -> None:
    root = tower.admins[ROOT]
    by_password = await _ssh(tower, ROOT, "id -u", password=root.password)
    by_key = await _ssh(tower, ROOT, "id -u", key=root.key_path)
    assert (by_password.exit_status, by_password.stdout) == (0, "0\n")
    assert (by_key.exit_status, by_key.stdout) == (0, "0\n")
    with pytest.raises(asyncssh.PermissionDenied):
        await _ssh(tower, ROOT, "id -u", key=tower.admins[PLAIN].key_path)


async def test_the_tower_has_python3_and_libvirt(tower: BoxFreshTower) -> None:
    """As on a Debian tower: python3, and virsh reaching libvirt with the
    GPU node running and its cards as host devices, for root and for the
    libvirt group's members, as Debian's polkit rule says (the agent's user
    is one: the install puts it there); others are refused."""
    admin = tower.admins[ADMIN]
    done = await _ssh(
        tower,
        admin.name,
        "python3 -c 'import sys; print(sys.version_info[:2])'",
        key=admin.key_path,
    )
    assert done.stdout == "(3, 14)\n"
    made = tower.run(["useradd", "--groups", "libvirt", "gh-libvirt"])
    assert made.returncode == 0, made.stderr
    refused = tower.run(["virsh", "-c", tower.uri, "list"], PLAIN)
    assert refused.returncode != 0
    assert "org.libvirt.unix.manage" in refused.stderr
    for user in (ROOT, "gh-libvirt"):
        listed = tower.run(["virsh", "-c", tower.uri, "list", "--all", "--name"], user)
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == DOMAINS
    state = tower.run(["virsh", "-c", tower.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"
    hostdevs = tower.run(["virsh", "-c", tower.uri, "dumpxml", "gpu-node"])
    assert hostdevs.stdout.count("<hostdev ") == 4  # two cards, two functions each


async def test_libvirtd_restarts_for_real(tower: BoxFreshTower) -> None:
    """An administrator's ``sudo systemctl restart`` is systemd's:
    libvirtd.service gets a new main process (its journal says so),
    virtqemud.service stays inactive (it is not installed), and the domains,
    read from the test driver's file, are the same through the new daemon:
    the GPU node running with its cards."""
    assert tower.is_active(LIBVIRTD, "virtqemud.service") == ["active", "inactive"]
    before = tower.main_pid(LIBVIRTD)
    assert before != 0
    admin = tower.admins[ADMIN]
    done = await _ssh(
        tower, admin.name, f"sudo -n systemctl restart {LIBVIRTD}", key=admin.key_path
    )
    assert (done.exit_status, done.stderr) == (0, ""), done.stderr
    after = tower.main_pid(LIBVIRTD)
    assert after not in (0, before)
    journal = tower.journal(LIBVIRTD)
    assert journal.count("Started libvirtd.service") == 2, journal
    # The new daemon's own first lines ("libvirt version: ...") come a
    # moment after systemd's "Started", as its QEMU driver starts.
    wait_until(
        lambda: f"libvirtd[{after}]" in tower.journal(LIBVIRTD),
        timeout=30,
        what=f"libvirtd[{after}]'s lines in the journal",
        interval=0.1,
    )
    assert tower.is_active(LIBVIRTD, "virtqemud.service") == ["active", "inactive"]
    listed = tower.run(["virsh", "-c", tower.uri, "list", "--all", "--name"])
    assert sorted(listed.stdout.split()) == DOMAINS
    state = tower.run(["virsh", "-c", tower.uri, "domstate", "gpu-node"])
    assert state.stdout.strip() == "running"
    hostdevs = tower.run(["virsh", "-c", tower.uri, "dumpxml", "gpu-node"])
    assert hostdevs.stdout.count("<hostdev ") == 4


async def test_sshd_refuses_keys_a_strict_sshd_refuses(tower: BoxFreshTower) -> None:
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
    tower: BoxFreshTower,
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


def test_run_as_a_user_and_read(tower: BoxFreshTower) -> None:
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


def test_useradd_inside_leaves_the_root_unchanged(tower: BoxFreshTower) -> None:
    before = Path("/etc/passwd").read_bytes()
    done = tower.run(["useradd", "--create-home", "gh-extra"])
    assert done.returncode == 0, done.stderr
    assert "gh-extra:" in str(tower.read("/etc/passwd"))
    assert Path("/etc/passwd").read_bytes() == before
    assert not Path("/home/gh-extra").exists()


def test_no_libvirt_old_python_read_only_usr_local(
    tmp_path: Path, socket_enabled: None
) -> None:
    require_box_tower()
    with BoxFreshTower(
        tmp_path / "tower", libvirt=False, python="old", read_only_usr_local=True
    ) as tower:
        assert tower.is_active(LIBVIRTD) == ["inactive"]
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
    require_box_tower()
    with BoxFreshTower(tmp_path / "tower", python="missing", virsh=False) as tower:
        for user in (ROOT, ADMIN):
            listed = tower.run(
                ["sh", "-c", "ls /usr/bin | grep '^python3' || true"], user
            )
            assert listed.stdout == ""
            for program in ("python3", "python3.14", "virsh"):
                assert tower.run(["which", program], user).returncode != 0, program
        # The daemon is there; only the client is gone.
        assert tower.is_active(LIBVIRTD) == ["active"]
    # Where the knobs are off, the same probes find them (the test can fail).
    with BoxFreshTower(tmp_path / "plain") as plain_tower:
        assert plain_tower.run(["which", "python3", "virsh"]).returncode == 0
        assert plain_tower.run(["touch", "/usr/local/bin/x"]).returncode == 0


def test_nothing_leaks(tmp_path: Path, socket_enabled: None) -> None:
    """What an install writes, and the tower's own setup, stay inside:
    outside, the watched paths are as they were, during and after (with
    libvirtd.service restarted too)."""
    require_box_tower()
    tower = BoxFreshTower(tmp_path / "tower")
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
            ["systemctl", "restart", LIBVIRTD],
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
    (the box, its processes and mounts, the directory) is gone."""
    require_box_tower()
    before = root_snapshot()
    directory = tmp_path / "tower"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: no one answers
        tower = BoxFreshTower(directory, port=taken.getsockname()[1])
        # The box's ssh.service fails at boot already: the box boots degraded.
        with pytest.raises((BoxError, BoxTowerError), match=r"ssh\.service"):
            tower.start()
    assert tower.box is None
    assert str(directory) not in Path("/proc/self/mountinfo").read_text("utf-8")
    assert not directory.exists()
    assert root_snapshot() == before
    tower.stop()  # again: nothing to do


def _outside(tower: BoxFreshTower, pid: int) -> int:
    """The process id outside of the box's process ``pid``."""
    assert tower.box is not None
    namespace = Path(f"/proc/{tower.box.pid1}/ns/pid").readlink()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, StopIteration):
            if (entry / "ns/pid").readlink() != namespace:
                continue
            status = (entry / "status").read_text(encoding="utf-8").splitlines()
            nspid = next(line for line in status if line.startswith("NSpid:"))
            if int(nspid.split()[-1]) == pid:
                return int(entry.name)
    raise AssertionError(f"no process {pid} in the box")


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or (
        Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").split()[2] == "Z"
    )


async def test_sessions_and_what_they_started_end_with_the_tower(
    tower: BoxFreshTower,
) -> None:
    """Processes left running inside (as a detached job would be) die with
    the tower: one an SSH session left, and one started by ``run()``, which
    is in no cgroup of the box (nsenter keeps the caller's) and goes with
    the box's PID namespace."""
    detach = "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"
    admin = tower.admins[ADMIN]
    by_ssh = await _ssh(tower, admin.name, detach, key=admin.key_path)
    by_run = tower.run(["sh", "-c", detach])
    pids = [_outside(tower, int(str(done.stdout))) for done in (by_ssh, by_run)]
    assert not any(_gone(pid) for pid in pids)
    tower.stop()
    assert all(_gone(pid) for pid in pids)


def test_a_directory_that_cannot_be_an_overlay_is_refused(tmp_path: Path) -> None:
    """The box's directory holds its overlay's layers, whose mount options
    are comma and colon separated: a path with one of those, or with
    whitespace, is refused before the box boots, and so is a directory that
    holds anything (stop() would remove it), which is left as it was."""
    require_box_tower()
    for name in ("a,b", "a:b", "a b"):
        with pytest.raises(ValueError, match="plain path"):
            BoxFreshTower(tmp_path / name).start()
        assert not (tmp_path / name).exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep").write_text("mine", encoding="utf-8")
    with pytest.raises(ValueError, match="must be new"):
        BoxFreshTower(used).start()
    assert (used / "keep").read_text(encoding="utf-8") == "mine"
