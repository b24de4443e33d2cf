"""The box itself: systemd boots the test root as PID 1, and goes away whole."""

from __future__ import annotations

import os
from pathlib import Path
import re

import pytest

from tests.support import box as box_module
from tests.support.box import Box, BoxError, box_unavailable, require_box


def test_systemd_boots_the_tower_as_pid_1(box: Box) -> None:
    """PID 1 is the root's systemd; the services a tower runs are up; the
    box has a host name of its own and the machine keeps its own."""
    assert box.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert box.systemctl("is-system-running").stdout.strip() == "running"
    units = [
        "systemd-journald.service",
        "dbus.service",
        "systemd-logind.service",
        "ssh.service",
        "libvirtd.socket",
    ]
    assert box.systemctl("is-active", *units).stdout.split() == ["active"] * len(units)
    version = box.systemctl("--version").stdout.split()
    assert version[:1] == ["systemd"]
    # libvirtd is socket-activated: the first client starts it.
    listed = box.run(["virsh", "-c", "qemu:///system", "list", "--all"], check=True)
    assert "Name" in listed.stdout
    assert box.systemctl("is-active", "libvirtd.service").stdout.strip() == "active"
    assert box.run(["hostname"]).stdout.strip() == "tower"
    assert os.uname().nodename != "tower"
    sshd = box.run(["ss", "-Hltn", f"sport = :{box.ssh_port}"]).stdout
    assert f"127.0.0.1:{box.ssh_port}" in sshd


def test_the_box_changes_nothing_outside(box: Box, tmp_path: Path) -> None:
    """Writes land in the box's upper layer; kernel variables and /sys are
    read-only in it, as in any container."""
    box.run(["sh", "-c", "echo inside > /etc/gpu-handoff-box-probe"], check=True)
    assert box.run(["cat", "/etc/gpu-handoff-box-probe"]).stdout == "inside\n"
    assert not Path("/etc/gpu-handoff-box-probe").exists()
    assert (box.upper / "etc/gpu-handoff-box-probe").exists()
    refused = box.run(["sysctl", "-w", "kernel.core_uses_pid=1"])
    assert refused.returncode != 0
    assert box.run(["touch", "/sys/kernel/probe"]).returncode != 0
    # The shared directory crosses at the same path, both ways.
    box.run(["sh", "-c", f"echo hi > {box.shared}/from-inside"], check=True)
    assert (box.shared / "from-inside").read_text() == "hi\n"


def test_a_reboot_keeps_the_disk_and_forgets_run(box: Box) -> None:
    """Power off through systemd, boot again on the same upper layer: what
    was written to /var and /etc is there, /run and /tmp are new, the
    machine id is the one made on the first boot."""
    machine_id = box.run(["cat", "/etc/machine-id"]).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", machine_id)
    box.run(
        ["sh", "-c", "echo kept > /var/lib/probe; echo gone > /run/probe"], check=True
    )
    first_pid1 = box.pid1
    box.reboot()
    assert box.run(["cat", "/var/lib/probe"]).stdout == "kept\n"
    assert box.run(["test", "-e", "/run/probe"]).returncode == 1
    assert box.run(["cat", "/etc/machine-id"]).stdout.strip() == machine_id
    assert box.pid1 != first_pid1
    assert box.boots == 2


def test_closing_leaves_no_process_mount_or_cgroup(
    tmp_path: Path, socket_enabled: None
) -> None:
    """close() powers off; the cgroup sub-tree, every process in it and the
    directory go; a second close() is harmless."""
    require_box()
    box = Box(tmp_path / "box").boot()
    cgroup, pid1 = box.cgroup, box.pid1
    assert cgroup.exists()
    assert pid1 is not None
    assert Path(f"/proc/{pid1}").exists()
    box.close()
    assert not cgroup.exists()
    assert not Path(f"/proc/{pid1}").exists()
    assert not box.directory.exists()
    assert box.leftovers() == []
    assert str(tmp_path / "box") not in Path("/proc/self/mountinfo").read_text()
    box.close()


def test_a_failed_unit_fails_the_boot_by_name(
    tmp_path: Path, socket_enabled: None
) -> None:
    """A boot that ends degraded is no box to test on: BoxError lists the
    failed units and their journal, and the box is gone after close()."""
    require_box()
    box = Box(tmp_path / "box")
    box.write(
        "/etc/systemd/system/broken.service",
        "[Service]\nType=oneshot\nExecStart=/bin/false\n"
        "[Install]\nWantedBy=multi-user.target\n",
    )
    wants = box.upper / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "broken.service").symlink_to("/etc/systemd/system/broken.service")
    with pytest.raises(BoxError, match=r"(?s)booted degraded.*broken\.service"):
        box.boot()
    box.close()
    assert box.leftovers() == []


def test_where_no_box_can_boot_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    require_box()
    monkeypatch.setattr(box_module, "CGROUP2", Path("/nonexistent/cgroup"))
    assert "cgroup2 hierarchy" in str(box_unavailable())
    monkeypatch.setenv("GPU_HANDOFF_ENV", "native")
    assert "provisioned Debian root" in str(box_unavailable())
    monkeypatch.setenv("GPU_HANDOFF_REQUIRE_SYSTEM", "1")
    with pytest.raises(pytest.fail.Exception, match="GPU_HANDOFF_REQUIRE_SYSTEM"):
        require_box()
