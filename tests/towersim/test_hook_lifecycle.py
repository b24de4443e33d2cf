"""libvirt's qemu hook in the tower simulator: run on every start and stop.

Each test cites the libvirt sources it reproduces (libvirt's ``docs/hooks.rst``,
``src/util/virhook.c``, ``src/util/vircommand.c``, ``src/qemu/qemu_process.c``).
libvirt's test driver runs no hook (hooks are the qemu driver's), so none of
this is pinned against a live virsh here: the sources are the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.towersim import DomainSpec, Tower, realistic_tower
from tests.towersim.helpers import sim

FAST = 0.01
HOOK = "/etc/libvirt/hooks/qemu"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# A hook that records its arguments, stdin and environment; told by a JSON
# file to fail or sleep on an operation, or to ask virsh for a domain's state.
RECORDER = r"""
import json, os, subprocess, sys, time
conf = json.load(open(sys.argv[1]))
args = sys.argv[2:]
xml = sys.stdin.read()
op = args[1]
seen = None
if conf.get("virsh") and op in conf.get("ask", []):
    seen = subprocess.run([conf["virsh"], "domstate", "--reason", "--domain", args[0]],
                          capture_output=True, text=True).stdout.strip()
time.sleep(conf.get("sleep", {}).get(op, 0))
with open(conf["log"], "a") as log:
    log.write(json.dumps({"args": args, "xml": xml, "env": dict(os.environ),
                          "cwd": os.getcwd(), "seen": seen}) + "\n")
if op in conf.get("fail", {}):
    sys.stderr.write(conf["fail"][op])
    sys.exit(1)
"""


def install_recorder(
    tower: Tower, directory: Path, *, path: str = HOOK, **conf: Any
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "recorder.py"
    script.write_text(RECORDER, encoding="utf-8")
    log = directory / "calls.jsonl"
    settings = directory / "conf.json"
    settings.write_text(json.dumps({"log": str(log), **conf}), encoding="utf-8")
    tower.set_hook([sys.executable, str(script), str(settings)], path=path)
    return log


def calls(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text("utf-8").splitlines()]


def ops(log: Path) -> list[list[str]]:
    return [c["args"] for c in calls(log)]


def start_ops(name: str) -> list[list[str]]:
    return [[name, op, "begin", "-"] for op in ("prepare", "start", "started")]


def stop_ops(name: str, reason: str) -> list[list[str]]:
    return [[name, "stopped", "end", "-"], [name, "release", "end", reason]]


@pytest.fixture
def plain(tmp_path: Path) -> Tower:
    """Two domains without PCI functions, fast time."""
    return Tower.create(
        tmp_path / "plain",
        [DomainSpec("vm-a"), DomainSpec("vm-b")],
        time_scale=FAST,
    )


def test_start_runs_prepare_start_started(plain: Tower, tmp_path: Path) -> None:
    """qemu_process.c: qemuProcessInit allocates the id and runs ``prepare
    begin -``; qemuProcessLaunch runs ``start begin -`` before it spawns QEMU;
    qemuProcessFinishStartup runs ``started begin -`` once the CPUs run. Each
    gets the live XML (qemuProcessStartHook, with the id); virhook.c
    virRunScript: ``LC_ALL=C`` and libvirtd's PATH only."""
    log = install_recorder(plain, tmp_path / "hook")
    result = sim(plain, "start", "--domain", "vm-a")
    assert (result.rc, result.out, result.err) == (0, "Domain 'vm-a' started\n\n", "")
    assert ops(log) == start_ops("vm-a")
    first = calls(log)[0]
    assert first["env"] == {"LC_ALL": "C", "PATH": PATH}
    assert first["cwd"] == "/"
    assert all(c["xml"] == plain.live_xml("vm-a") for c in calls(log))
    assert "id='1'" in first["xml"]


def test_create_gives_the_live_definition(tmp_path: Path) -> None:
    """qemu_driver.c qemuDomainCreateXML starts the file's definition through
    the same qemuProcessStart: the hooks see the created definition."""
    tower = realistic_tower(tmp_path / "tower", time_scale=FAST, gpu_node_running=False)
    log = install_recorder(tower, tmp_path / "hook")
    xml = tower.defined_xml("gpu-node")
    kept = xml.split("<hostdev")
    # drop every hostdev but the first (the GTX 960's VGA function)
    live = kept[0] + "<hostdev" + kept[1].split("</hostdev>")[0] + "</hostdev>\n"
    live += xml[xml.rindex("</hostdev>") + len("</hostdev>\n") :]
    path = tmp_path / "live.xml"
    path.write_text(live, encoding="utf-8")
    result = sim(tower, "create", str(path))
    assert result.rc == 0, result.err
    assert ops(log) == start_ops("gpu-node")
    assert calls(log)[0]["xml"] == tower.live_xml("gpu-node")
    assert calls(log)[0]["xml"].count("<hostdev") == 1
    tower.close()


def test_shutdown_runs_stop_hooks_once(plain: Tower, tmp_path: Path) -> None:
    """qemu_process.c qemuProcessStop: ``stopped end -`` once the process is
    gone, ``release end REASON`` after the resources are released (docs/hooks.rst:
    the shut-off reason since libvirt 10.5, ``-`` before); the XML has no id.
    The simulator runs them when a process first sees the stop, once (an
    ACPI shutdown returns at once; an agent one waits for the power-off, so
    it sees the stop itself: test_agent_shutdown.py)."""
    assert sim(plain, "start", "--domain", "vm-a").rc == 0
    log = install_recorder(plain, tmp_path / "hook")
    assert sim(plain, "shutdown", "--mode", "acpi", "--domain", "vm-a").rc == 0
    plain.wait_until(lambda: not plain.is_running("vm-a"), timeout=10, what="stop")
    assert ops(log) == []  # nothing saw the stop yet
    for _ in range(3):
        assert sim(plain, "domstate", "--reason", "--domain", "vm-a").out == (
            "shut off (shutdown)\n\n"
        )
    assert ops(log) == stop_ops("vm-a", "shutdown")
    assert all("id=" not in c["xml"].split("\n")[0] for c in calls(log))
    assert "<name>vm-a</name>" in calls(log)[0]["xml"]


def test_stop_hooks_in_order_seen_by_the_event_loop(
    plain: Tower, tmp_path: Path
) -> None:
    """Stops of two domains, seen first by ``virsh event --loop``: their hooks
    run in the order the stops happened (libvirtd runs qemuProcessStop as each
    stop happens, before it sends the stop's event)."""
    for name in ("vm-a", "vm-b"):
        assert sim(plain, "start", "--domain", name).rc == 0
    log = install_recorder(plain, tmp_path / "hook")
    events = subprocess.Popen(
        [str(plain.virsh), "-c", plain.uri, "event", "--loop", "--all"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        plain.guest_shutdown("vm-b")
        plain.wait_until(lambda: not plain.is_running("vm-b"), timeout=10, what="stop")
        plain.guest_shutdown("vm-a")
        plain.wait_until(lambda: len(ops(log)) == 4, timeout=10, what="hooks")
    finally:
        events.terminate()
        events.wait(10)
    assert ops(log) == stop_ops("vm-b", "shutdown") + stop_ops("vm-a", "shutdown")
    sim(plain, "list", "--all")
    assert len(ops(log)) == 4


def test_refused_prepare(plain: Tower, tmp_path: Path) -> None:
    """A non-zero ``prepare`` refuses the start: qemuProcessInit ``goto stop``
    calls qemuProcessStop(VIR_DOMAIN_SHUTOFF_FAILED), which runs the stop hooks
    (the domain is active: its id was allocated) and leaves it ``shut off
    (failed)``. The error: virhook.c virRunScript (VIR_ERR_HOOK_SCRIPT_FAILED
    around vircommand.c virCommandWait's ``Child process (CMD) unexpected exit
    status N: STDERR``, CMD with the environment virCommandToString shows)."""
    log = install_recorder(plain, tmp_path / "hook", fail={"prepare": "no GPU\n"})
    result = sim(plain, "start", "--domain", "vm-a")
    assert result.rc == 1
    assert result.out == "\n"
    assert result.err == (
        "error: Failed to start domain 'vm-a'\n"
        "error: Hook script execution failed: internal error: Child process "
        f"(LC_ALL=C PATH={PATH} {HOOK} vm-a prepare begin -) unexpected exit "
        "status 1: no GPU\n\n"
    )
    assert ops(log) == [["vm-a", "prepare", "begin", "-"], *stop_ops("vm-a", "failed")]
    assert plain.domstate("vm-a") == "shut off (failed)"
    assert not any("'vm-a'" in e and "Started" in e for e in plain.events())
    # the failed start used id 1 up (qemuDriverAllocateID)
    plain.set_hook(None)
    assert sim(plain, "start", "--domain", "vm-a").rc == 0
    assert "id='2'" in plain.live_xml("vm-a")


def test_several_scripts_run_in_order(plain: Tower, tmp_path: Path) -> None:
    """virhook.c virHookCall: ``hooks/qemu`` first, then ``hooks/qemu.d/*`` in
    strcmp order; a failure does not stop the others; the last error is shown."""
    first = install_recorder(plain, tmp_path / "main", fail={"prepare": "one"})
    second = install_recorder(
        plain, tmp_path / "d", path=HOOK + ".d/zz", fail={"prepare": "two"}
    )
    result = sim(plain, "start", "--domain", "vm-a")
    assert result.rc == 1
    assert f"{HOOK}.d/zz vm-a prepare begin -) unexpected exit status 1: two\n" in (
        result.err
    )
    assert ops(first)[0] == ops(second)[0] == ["vm-a", "prepare", "begin", "-"]
    runs = [(r["path"], r["args"][1]) for r in plain.hook_runs()]
    assert runs[:2] == [(HOOK, "prepare"), (HOOK + ".d/zz", "prepare")]


@pytest.mark.parametrize("reason", ["disk", "vfio"])
def test_start_failing_after_the_hook(tmp_path: Path, reason: str) -> None:
    """A missing disk fails in qemuProcessPrepareHost (after ``prepare``, before
    ``start``): ``Cannot access storage file ... (as uid:U, gid:G): No such
    file or directory``; QEMU failing to open a VFIO group fails after
    qemuProcessLaunch's ``start begin``: ``QEMU unexpectedly closed the monitor
    (vm='X'): ...``. Both go through qemuProcessStop(..._FAILED): the stop
    hooks run, the domain stays ``shut off (failed)``."""
    tower = realistic_tower(tmp_path / "tower", time_scale=FAST, gpu_node_running=False)
    log = install_recorder(tower, tmp_path / "hook")
    tower.fail_next_start("gaming-1", reason)
    result = sim(tower, "start", "--domain", "gaming-1")
    assert result.rc == 1
    lines = result.err.splitlines()
    assert lines[0] == "error: Failed to start domain 'gaming-1'"
    if reason == "disk":
        assert lines[1] == (
            "error: Cannot access storage file '/var/lib/libvirt/images/gaming-1.qcow2' "
            "(as uid:64055, gid:109): No such file or directory"
        )
        before = [["gaming-1", "prepare", "begin", "-"]]
    else:
        assert lines[1].startswith(
            "error: internal error: QEMU unexpectedly closed the monitor (vm='gaming-1'): "
        )
        assert lines[1].endswith(
            "vfio 0000:03:00.0: failed to open /dev/vfio/13: Device or resource busy"
        )
        before = start_ops("gaming-1")[:2]
    assert ops(log) == before + stop_ops("gaming-1", "failed")
    assert tower.domstate("gaming-1") == "shut off (failed)"
    assert tower.holder("0000:03:00.0") is None
    # only the next start fails
    assert sim(tower, "start", "--domain", "gaming-1").rc == 0
    tower.close()


def test_every_start_fails_until_cleared(plain: Tower) -> None:
    plain.fail_next_start("vm-a", "disk", every=True)
    for _ in range(2):
        assert sim(plain, "start", "--domain", "vm-a").rc == 1
    plain.clear_start_failure("vm-a")
    assert sim(plain, "start", "--domain", "vm-a").rc == 0


def test_pci_in_use_is_refused_after_prepare(tmp_path: Path) -> None:
    """qemuProcessPrepareHost takes the PCI functions after qemuProcessInit's
    ``prepare`` hook: a start refused for a function another domain holds runs
    ``prepare begin`` and the stop hooks (reason ``failed``)."""
    tower = realistic_tower(tmp_path / "tower", time_scale=FAST)
    log = install_recorder(tower, tmp_path / "hook")
    result = sim(tower, "start", "--domain", "gaming-1")
    assert result.err == (
        "error: Failed to start domain 'gaming-1'\n"
        "error: Requested operation is not valid: PCI device 0000:03:00.0 is in "
        "use by driver QEMU, domain gpu-node\n"
    )
    assert ops(log) == [
        ["gaming-1", "prepare", "begin", "-"],
        *stop_ops("gaming-1", "failed"),
    ]
    assert tower.is_running("gpu-node")
    tower.close()


def test_calls_wait_while_the_hook_runs(plain: Tower, tmp_path: Path) -> None:
    """libvirtd holds the domain's lock while it runs the hook: a virsh call
    about that domain waits for the start to end and then sees it running. The
    hook itself (which must not call libvirt: docs/hooks.rst) is let through
    by the simulator and sees the domain still shut off during ``prepare``."""
    log = install_recorder(
        plain,
        tmp_path / "hook",
        sleep={"prepare": 0.5},
        virsh=str(plain.virsh),
        ask=["prepare", "started"],
    )
    starter = subprocess.Popen(
        [str(plain.virsh), "start", "--domain", "vm-a"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)
        asked = time.monotonic()
        state = sim(plain, "domstate", "--reason", "--domain", "vm-a")
        waited = time.monotonic() - asked
        other = sim(plain, "domstate", "--reason", "--domain", "vm-b")
    finally:
        assert starter.wait(20) == 0
    assert state.out == "running (booted)\n\n"
    assert waited > 0.2
    assert other.out == "shut off (unknown)\n\n"
    seen = {c["args"][1]: c["seen"] for c in calls(log)}
    assert seen["prepare"] == "shut off (unknown)"
    assert seen["started"] == "running (booted)"
