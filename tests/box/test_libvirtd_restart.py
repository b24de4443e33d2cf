"""The guided install's libvirtd restart, for real: systemd, libvirtd, QEMU.

libvirtd looks for its hooks once, when it starts (``virHookInitialize``,
called from the daemon's main in src/remote/remote_daemon.c, and again only on
SIGHUP: src/util/virhook.c), so an install that puts the agent's hook into
``/etc/libvirt/hooks/qemu.d`` under a running libvirtd does nothing until the
daemon starts again. ``install --restart-libvirt`` restarts the libvirt
daemons that run (``restart_libvirt``: ``systemctl is-active`` of
libvirtd.service and virtqemud.service, then ``systemctl restart`` of the
active ones). Here, in a box whose systemd runs Debian's own
``libvirtd.service`` (enabled: it runs from boot, socket-activated after its
``--timeout 120`` idle exit) with its QEMU driver at ``qemu:///system``:

1. a real guest (a tiny diskless TCG domain: SeaBIOS finds nothing to boot
   and the guest runs on) runs through the restart: same QEMU process, still
   running; libvirtd.service has a new main process, virtqemud.service (not
   active) was left alone;
2. before the restart the hook is not loaded: a start of a gaming VM leaves
   no request; after it the agent's hook runs on the next start and leaves
   its request record in the state directory (``verb_hook``: ``prepare
   begin`` of a gaming VM that wants the GPU node's card; the stop of the GPU
   node it submits runs to its end);
3. with no libvirt daemon running the install restarts nothing, and the
   daemon that socket activation starts afterwards loads the hook itself.

The gaming VM and the GPU node carry a PCI hostdev (the card). libvirt
refuses to start a domain with one on a host without VFIO ("VFIO PCI device
assignment is not supported by the host") before it runs any hook; so the
box is given what libvirt looks for: an IOMMU group in /sys/kernel/iommu_groups
(a tmpfs mounted over it, in the box only) and /dev/vfio/vfio. The start
still fails, later, after ``prepare begin`` (here: "cannot limit locked
memory" of the QEMU process, as VFIO wants; there is no such card anyway):
what the hook records is what a tower's hook records when a gaming VM is
started by hand while the GPU node holds its card. Seen here: without the
IOMMU group and /dev/vfio/vfio no hook runs at all for such a start.
"""

from __future__ import annotations

from collections.abc import Iterator
import json
import shutil
import subprocess
import time
from typing import Any

import pytest

from tests.box.conftest import CONFIG, PROGRAM, USER, pretend_vfio, run_install
from tests.support.box import Box
from tests.support.waiting import wait_until

URI = "qemu:///system"
GUEST = "bystander"
GPU_NODE = "gpu-node"
GAMING = "gaming-1"
STATE_DIR = "/var/lib/gpu-handoff"
CARD = "0000:0a:00.0"
HOOK = "/etc/libvirt/hooks/qemu.d/gpu-handoff"
RESTARTED = {
    "done": True,
    "restarted": ["libvirtd.service"],
    "message": "restarted libvirtd.service",
}
NOTHING_RESTARTED = {
    "done": True,
    "restarted": [],
    "message": "neither libvirtd nor virtqemud runs now: libvirt loads the hook "
    "when it starts",
}

HOSTDEV = """    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source>
        <address domain='0x0000' bus='0x0a' slot='0x00' function='0x0'/>
      </source>
    </hostdev>
"""


def domain_xml(name: str, devices: str = "") -> str:
    """A tiny TCG domain: no disk, no network, no display; SeaBIOS finds
    nothing to boot and the guest keeps running (``devices``: more device
    elements, each line indented by four spaces)."""
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>32</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type></os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"}</emulator>
{devices}    <video><model type='none'/></video>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def virsh(box: Box, *args: str) -> subprocess.CompletedProcess[str]:
    return box.run(["virsh", "-c", URI, *args], timeout=180)


def must(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (done.args, done.stdout, done.stderr)
    return done.stdout


def define(box: Box, name: str, devices: str = "") -> None:
    box.write(f"/root/{name}.xml", domain_xml(name, devices))
    must(virsh(box, "define", f"/root/{name}.xml"))


def main_pid(box: Box, unit: str) -> int:
    return int(box.systemctl("show", "-p", "MainPID", "--value", unit).stdout)


def is_active(box: Box, unit: str) -> str:
    return box.systemctl("is-active", unit).stdout.strip()


def qemu_pid(box: Box, name: str) -> int:
    """The pid libvirt keeps for the domain's QEMU process (in the box)."""
    return int((box.root / f"run/libvirt/qemu/{name}.pid").read_text().strip())


def qemu_processes(box: Box) -> dict[int, str]:
    """QEMU processes in the box: pid (in the box) -> the guest's name."""
    out = box.run(["ps", "-eo", "pid=,args="]).stdout
    found = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "qemu-system" in args and "guest=" in args:
            found[int(pid)] = args.split("guest=", 1)[1].split(",", 1)[0]
    return found


def install(box: Box, *extra: str) -> dict[str, Any]:
    """The agent's install as root in the box, as the guided install runs it
    (no SSH key: nothing here logs in); its JSON reply."""
    reply = run_install(
        box,
        "--join-libvirt-group",
        "--gpu-node",
        GPU_NODE,
        "--gaming",
        GAMING,
        "--uri",
        URI,
        *extra,
    )
    print("install notes:", *reply["notes"], sep="\n  ")
    return reply


def requests(box: Box) -> list[dict[str, Any]]:
    """The hook's request records in the state directory, oldest first."""
    directory = box.root / STATE_DIR.lstrip("/") / "requests"
    if not directory.is_dir():
        return []
    return [
        json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(directory.glob("*.json"))
    ]


def claims(box: Box) -> dict[str, Any]:
    """What the install's status check recorded of the GPU node's cards."""
    path = box.root / STATE_DIR.lstrip("/") / "claims.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def start_gaming(box: Box) -> subprocess.CompletedProcess[str]:
    """Start the gaming VM by hand, as someone at the tower would; it fails
    (there is no card at CARD), after libvirt ran the hook's ``prepare
    begin`` if the hook is loaded."""
    done = virsh(box, "start", GAMING)
    print(f"virsh start {GAMING}: rc {done.returncode}: {done.stderr.strip()}")
    assert done.returncode != 0, "a start with a card that does not exist"
    assert must(virsh(box, "domstate", GAMING)).strip() == "shut off"
    return done


def agent_job(box: Box, job_id: str) -> dict[str, Any]:
    """The job as the agent reports it (run as the SSH user, its CLI)."""
    done = box.run([PROGRAM, "--config", CONFIG, "job", job_id], user=USER)
    reply: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply["ok"], reply
    job: dict[str, Any] = reply["job"]
    return job


def check_request(box: Box) -> None:
    """The one request the hook recorded for the start of the gaming VM, and
    the stop of the GPU node it submitted (the GPU node is shut off: the job
    succeeds, its steps skipped)."""
    found = requests(box)
    assert len(found) == 1, found
    request = found[0]
    print("the hook's request record:", json.dumps(request))
    assert request["domain"] == GAMING
    assert request["operation"] == "prepare begin"
    assert request["addresses"] == [CARD]
    assert isinstance(request["job"], str), request

    def finished() -> dict[str, Any] | None:
        job = agent_job(box, request["job"])
        return job if job["state"] in ("succeeded", "failed") else None

    job = wait_until(finished, timeout=60, what="the job the hook submitted")
    print("its job:", job["kind"], job["args"], job["state"], job["error"])
    assert (job["kind"], job["args"], job["requested_by"]) == (
        "stop",
        {"domain": GPU_NODE},
        "hook",
    )
    assert job["state"] == "succeeded", job


@pytest.fixture
def tower(box: Box) -> Iterator[Box]:
    """The box with the GPU node and the gaming VM defined (shut off; each
    with the card), libvirt fooled into VFIO (the box has no /dev/kvm: TCG).
    Guests still running at the end are destroyed (the box powers off in
    0.3 s rather than 5 s)."""
    started = time.monotonic()
    define(box, GPU_NODE, HOSTDEV)
    define(box, GAMING, HOSTDEV)
    print(f"defined the domains in {time.monotonic() - started:.1f} s")
    pretend_vfio(box)
    yield box
    for name in virsh(box, "list", "--name").stdout.split():
        virsh(box, "destroy", name)  # teardown only: the test looked already


def test_the_restart_keeps_the_guest_and_loads_the_hook(tower: Box) -> None:
    box = tower
    define(box, GUEST)
    started = time.monotonic()
    must(virsh(box, "start", GUEST))
    print(f"{GUEST} started in {time.monotonic() - started:.1f} s")
    assert is_active(box, "libvirtd.service") == "active"
    assert is_active(box, "virtqemud.service") != "active"
    libvirtd_before = main_pid(box, "libvirtd.service")
    qemu_before = qemu_pid(box, GUEST)
    assert qemu_processes(box) == {qemu_before: GUEST}

    # Installed without the restart: libvirtd, running since before, has not
    # looked for hooks since it started; the hook is there but never runs.
    reply = install(box)
    assert "libvirt_restart" not in reply
    assert reply["status_error"] is None, reply["status_error"]
    assert (box.root / HOOK.lstrip("/")).is_file()
    assert claims(box)["addresses"] == [CARD]
    start_gaming(box)
    assert requests(box) == []
    assert main_pid(box, "libvirtd.service") == libvirtd_before

    # The guided install again, this time with --restart-libvirt.
    started = time.monotonic()
    reply = install(box, "--force", "--restart-libvirt")
    print(f"install --restart-libvirt took {time.monotonic() - started:.1f} s")
    assert reply["libvirt_restart"] == RESTARTED
    libvirtd_after = main_pid(box, "libvirtd.service")
    print(f"libvirtd.service MainPID {libvirtd_before} -> {libvirtd_after}")
    assert libvirtd_after not in (0, libvirtd_before)
    assert is_active(box, "libvirtd.service") == "active"
    # virtqemud.service did not run: not restarted, so not started either.
    assert is_active(box, "virtqemud.service") != "active"

    # The guest ran through it: the same QEMU process, reconnected to.
    assert must(virsh(box, "domstate", GUEST)).strip() == "running"
    assert qemu_pid(box, GUEST) == qemu_before
    assert qemu_processes(box) == {qemu_before: GUEST}
    print(f"{GUEST}'s QEMU pid {qemu_before} before and after the restart")

    # The restarted libvirtd runs the hook on the next start.
    start_gaming(box)
    check_request(box)
    assert must(virsh(box, "domstate", GUEST)).strip() == "running"


def test_with_no_daemon_running_the_install_restarts_nothing(tower: Box) -> None:
    """libvirtd.service stopped (its sockets listen on, as after its idle
    exit): the install restarts nothing; the status check that follows it
    connects, socket activation starts libvirtd, and that daemon has the
    hook: it runs on the first start."""
    box = tower
    box.systemctl("stop", "libvirtd.service", check=True)
    wait_until(
        lambda: is_active(box, "libvirtd.service") == "inactive",
        timeout=30,
        what="libvirtd.service to stop",
    )
    assert is_active(box, "virtqemud.service") != "active"
    assert is_active(box, "libvirtd.socket") == "active"
    reply = install(box, "--restart-libvirt")
    assert reply["libvirt_restart"] == NOTHING_RESTARTED
    assert reply["status_error"] is None, reply["status_error"]
    # Started after the hook was in place, by the status check's virsh.
    assert is_active(box, "libvirtd.service") == "active"
    assert is_active(box, "virtqemud.service") != "active"
    start_gaming(box)
    check_request(box)
