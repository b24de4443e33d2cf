"""The simulator's model: PCI exclusivity, the guest agent, shutdown modes,
events, batches, screenshots, destroy refusal and concurrent callers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import re
import signal
import subprocess

import pytest

from tests.support.oldpython import oldest_python
from tests.towersim import DomainSpec, Hostdev, Tower, forkserver
from tests.towersim.helpers import LineReader, png_size, run, sim

PING = '{"execute":"guest-ping"}'
NOT_CONNECTED = (
    "error: Guest agent is not responding: QEMU guest agent is not connected\n"
)


def test_start_refused_while_a_running_domain_holds_a_function(tower: Tower) -> None:
    got = sim(tower, "start", "gaming-1")
    assert got.rc == 1
    assert got.out == "\n"
    assert got.err == (
        "error: Failed to start domain 'gaming-1'\n"
        "error: Requested operation is not valid: PCI device 0000:03:00.0 is in use "
        "by driver QEMU, domain gpu-node\n"
    )
    # libvirt refuses it in qemuProcessPrepareHost, after qemuProcessInit made
    # the domain active: qemuProcessStop(VIR_DOMAIN_SHUTOFF_FAILED) sets the reason
    assert tower.domstate("gaming-1") == "shut off (failed)"
    assert tower.holder("0000:03:00.1") == "gpu-node"


def test_cards_move_when_the_holder_is_off(tower: Tower) -> None:
    tower.set_shutdown_duration("gpu-node", 100_000.0)  # 1000 s at this scale
    # libvirt's agent shutdown gives up after its 60 s (test_agent_shutdown.py)
    assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 1
    # still running (and holding the cards) until the guest has powered off
    assert sim(tower, "start", "gaming-2").rc == 1
    assert tower.domstate("gpu-node") == "running (booted)"
    tower.advance(1000.0)
    assert tower.domstate("gpu-node") == "shut off (shutdown)"
    assert sim(tower, "start", "gaming-2").out == "Domain 'gaming-2' started\n\n"
    assert sim(tower, "start", "gaming-1").rc == 0
    assert tower.holder("0000:04:00.0") == "gaming-2"
    assert tower.holder("0000:01:00.0") is None
    refused = sim(tower, "start", "gpu-node")
    assert (
        "PCI device 0000:03:00.0 is in use by driver QEMU, domain gaming-1"
        in refused.err
    )


def test_guest_agent_comes_up_after_its_delay(tower: Tower) -> None:
    tower.set_agent_delay("gaming-1", 100_000.0)  # 1000 s at this time scale
    sim(tower, "shutdown", "--mode", "agent", "gpu-node")
    tower.advance(1.0)
    assert sim(tower, "start", "gaming-1").rc == 0
    ping = ["qemu-agent-command", "--timeout", "2", "gaming-1", PING]
    assert sim(tower, *ping).err == NOT_CONNECTED
    stop = sim(tower, "shutdown", "--mode", "agent", "gaming-1")
    assert (stop.rc, stop.err) == (
        1,
        "error: Failed to shutdown domain 'gaming-1'\n" + NOT_CONNECTED,
    )
    tower.advance(1000.0)
    assert sim(tower, *ping).out == '{"return":{}}\n\n'
    assert tower.agent_connected("gaming-1")


def test_agent_that_never_starts(tower: Tower) -> None:
    tower.set_agent_delay("gpu-node", None)
    sim(tower, "shutdown", "--mode", "agent", "gpu-node")
    tower.advance(1.0)
    sim(tower, "start", "gpu-node")
    tower.advance(3600.0)
    assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").err.endswith(
        NOT_CONNECTED
    )
    assert tower.domstate("gpu-node") == "running (booted)"


def test_acpi_is_ignored_by_a_guest_that_ignores_it(tower: Tower) -> None:
    got = sim(tower, "shutdown", "--mode", "acpi", "gpu-node")
    assert (got.rc, got.out) == (0, "Domain 'gpu-node' is being shutdown\n\n")
    tower.advance(3600.0)
    assert tower.domstate("gpu-node") == "running (booted)"
    # a guest that honours it powers off
    tower.set_ignore_acpi("gpu-node", False)
    assert sim(tower, "shutdown", "--mode", "acpi", "gpu-node").rc == 0
    tower.advance(1.0)
    assert tower.domstate("gpu-node") == "shut off (shutdown)"


def test_plain_shutdown_uses_the_agent_when_it_is_up_else_acpi(tower: Tower) -> None:
    tower.set_agent_delay("gpu-node", None)
    sim(tower, "shutdown", "gpu-node")
    tower.advance(1.0)  # no agent... but the node was booted with its agent up
    assert tower.domstate("gpu-node") == "shut off (shutdown)"
    sim(tower, "start", "gpu-node")
    assert sim(tower, "shutdown", "gpu-node").rc == 0  # falls back to ACPI: ignored
    tower.advance(3600.0)
    assert tower.domstate("gpu-node") == "running (booted)"


def test_guest_initiated_shutdown(tower: Tower) -> None:
    sim(tower, "shutdown", "--mode", "agent", "gpu-node")
    tower.advance(1.0)
    sim(tower, "start", "gaming-1")
    tower.guest_shutdown("gaming-1")
    tower.advance(1.0)
    assert tower.domstate("gaming-1") == "shut off (shutdown)"
    assert tower.events()[-2:] == [
        tower.events()[-2].split(": ", 1)[0]
        + ": event 'lifecycle' for domain 'gaming-1': Shutdown Finished after guest request",
        tower.events()[-1].split(": ", 1)[0]
        + ": event 'lifecycle' for domain 'gaming-1': Stopped Shutdown",
    ]


def test_destroy_is_refused_and_recorded(tower: Tower) -> None:
    got = sim(tower, "destroy", "gpu-node")
    assert got.rc == 1
    assert got.err.startswith("error: Failed to destroy domain 'gpu-node'\n")
    assert tower.domstate("gpu-node") == "running (booted)"
    assert [c.commands for c in tower.destroy_attempts()] == [[["destroy", "gpu-node"]]]


def test_commands_are_recorded(tower: Tower) -> None:
    sim(tower, "domstate --reason gpu-node; echo x; start gaming-1")
    sim(tower, "frob")
    first, second = tower.commands()
    assert first.commands == [
        ["domstate", "--reason", "gpu-node"],
        ["echo", "x"],
        ["start", "gaming-1"],
    ]
    assert first.rc == 1  # the last command's status
    assert first.end is not None
    assert first.end >= first.t
    assert (second.commands, second.rc) == (None, 1)
    assert [c.argv for c in tower.calls("start", "gaming-1")] == [
        ["-c", tower.uri, "domstate --reason gpu-node; echo x; start gaming-1"]
    ]


def test_batch_runs_on_after_a_failure_and_reports_the_last(tower: Tower) -> None:
    got = sim(tower, "domstate --reason nosuch; domstate --reason gpu-node")
    assert (got.rc, got.out, got.err) == (
        0,
        "\nrunning (booted)\n\n",
        "error: failed to get domain 'nosuch'\n",
    )
    parse_error = sim(tower, "start gaming-2; frob")
    assert (parse_error.rc, parse_error.out, parse_error.err) == (
        1,
        "",
        "error: unknown command: 'frob'\n",
    )
    assert tower.domstate("gaming-2") == "shut off (unknown)"  # nothing ran
    assert tower.commands()[-1].commands is None
    assert sim(tower, "list", "--all", "--name", ";", "echo", "x").err == (
        "error: unexpected data ';'\n"
    )


def test_screenshot_writes_a_png(tower: Tower, tmp_path: Path) -> None:
    path = tmp_path / "shot.png"
    got = sim(tower, "screenshot", "gpu-node", "--file", str(path))
    assert got.out == f"Screenshot saved to {path}, with type of image/png\n"
    assert png_size(path) == (160, 100)
    off = sim(tower, "screenshot", "gaming-1", "--file", str(tmp_path / "off.png"))
    assert off.rc == 1
    assert "domain is not running" in off.err
    assert not (tmp_path / "off.png").exists()


def test_events_stream_as_they_happen(tower: Tower) -> None:
    with subprocess.Popen(
        [str(tower.virsh), "-c", tower.uri, "event", "--loop", "--all", "--timestamp"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    ) as events:
        reader = LineReader(events)
        tower.wait_until(
            lambda: any(c.subscribed for c in tower.calls("event")),
            timeout=20,
            what="the listener",
        )
        assert sim(tower, "shutdown", "--mode", "agent", "gpu-node").rc == 0
        # the guest powers off 0.1 s later: the lines come when it does
        tower.wait_until(
            lambda: any("Stopped Shutdown" in line for line in reader.poll()),
            timeout=20,
            what="Stopped Shutdown",
        )
        assert sim(tower, "start", "gaming-1").rc == 0
        tower.wait_until(
            lambda: any("'connected'" in line for line in reader.poll()),
            timeout=20,
            what="the agent to connect",
        )
        events.send_signal(signal.SIGINT)
        tower.wait_until(
            lambda: reader.poll() and reader.closed, timeout=20, what="EOF"
        )
        assert events.wait(timeout=20) == 0
    tail = [
        re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+0000: ", "", line)
        for line in reader.lines
    ]
    assert tail == [
        "event 'lifecycle' for domain 'gpu-node': Shutdown Finished after guest request",
        "event 'lifecycle' for domain 'gpu-node': Stopped Shutdown",
        "event 'agent-lifecycle' for domain 'gaming-1': state: 'disconnected' reason: 'domain started'",
        "event 'channel-lifecycle' for domain 'gaming-1': channel name: 'org.qemu.guest_agent.0' state: 'disconnected' reason: 'domain started'",
        "event 'lifecycle' for domain 'gaming-1': Resumed Unpaused",
        "event 'lifecycle' for domain 'gaming-1': Started Booted",
        "event 'agent-lifecycle' for domain 'gaming-1': state: 'connected' reason: 'channel event'",
        "event 'channel-lifecycle' for domain 'gaming-1': channel name: 'org.qemu.guest_agent.0' state: 'connected' reason: 'channel event'",
        "event loop interrupted",
        "events received: 8",
        "",
    ]


@pytest.mark.parametrize("how", ["SIGTERM", "reader closed"])
def test_event_process_ends_cleanly(tower: Tower, how: str) -> None:
    events = subprocess.Popen(
        [str(tower.virsh), "-c", tower.uri, "event", "--loop", "--all", "--timestamp"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    tower.wait_until(
        lambda: any(c.subscribed for c in tower.calls("event")),
        timeout=20,
        what="the listener",
    )
    if how == "SIGTERM":
        events.terminate()
        expected = -signal.SIGTERM
    else:
        events.stdout.close()  # type: ignore[union-attr]
        expected = -signal.SIGPIPE  # as real virsh, on its next write
    assert events.wait(timeout=20) == expected
    assert events.stderr.read() == b""  # type: ignore[union-attr]
    events.stderr.close()  # type: ignore[union-attr]


def test_concurrent_starts_of_rivals_only_one_wins(tmp_path: Path) -> None:
    card = [Hostdev("0000:0a:00.0"), Hostdev("0000:0a:00.1")]
    rivals = [DomainSpec(f"rival-{i}", hostdevs=card) for i in range(6)]
    tower = Tower.create(tmp_path / "tower", rivals, time_scale=0.01)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda s: sim(tower, "start", s.name), rivals))
    assert sorted(r.rc for r in results) == [0, 1, 1, 1, 1, 1]
    winners = [s.name for s, r in zip(rivals, results, strict=True) if r.rc == 0]
    assert [d.name for d in tower.world().listing() if d.running] == winners


def test_wrappers_need_no_environment(tower: Tower) -> None:
    got = run(
        [
            "/usr/bin/env",
            "-i",
            str(tower.virsh),
            "-c",
            tower.uri,
            "list",
            "--all",
            "--name",
        ]
    )
    assert got.out == "gpu-node\ngaming-1\ngaming-2\n\n"


def test_realistic_tower_xml(tower: Tower) -> None:
    xml = sim(tower, "dumpxml", "gpu-node").out
    assert xml.count("<hostdev ") == 6
    assert xml.count("<rom bar='off'/>") == 6
    assert "name='org.qemu.guest_agent.0'" in xml
    assert "<title>Gaming station 2</title>" in sim(tower, "dumpxml", "gaming-2").out


def test_runs_on_the_oldest_python(tmp_path: Path) -> None:
    """The agent's compatibility tests may run the simulator on Python 3.9."""
    old, env = oldest_python()
    tower = Tower.create(
        tmp_path / "tower",
        [DomainSpec("a", hostdevs=[Hostdev("0000:01:00.0")], agent_delay=0.0)],
        python=old,
        python_env=env,
        time_scale=0.01,
    )
    # the simulated virsh's server runs on that Python, and so does a call
    # the server cannot take (forkserver.py)
    server = forkserver.server_for(old, env)
    assert server is not None
    assert server.proc.args[0] == old
    assert f"exec={old}\n" in (tower.bin / ".virsh.conf").read_text()
    assert old in tower.systemd_run.read_text()
    assert sim(tower, "start", "a").rc == 0
    tower.wait_until(
        lambda: sim(tower, "qemu-agent-command", "a", PING).rc == 0,
        timeout=20,
        what="ping",
    )
    assert sim(tower, "list --all --name; echo x").out == "a\n\nx\n"
    assert run([str(tower.systemd_run), "--quiet", "--unit=u", "/bin/true"]).rc == 0
    tower.wait_until(tower.unit_runs, timeout=20, what="the unit")
    assert tower.unit_runs()[0].exit_code == 0


def test_status_batch_with_pings_as_the_agent_sends_it(tower: Tower) -> None:
    sim(tower, "start", "gaming-1")  # refused: gpu-node holds its cards
    tower.set_agent_delay("gaming-2", None)
    sim(tower, "shutdown", "--mode", "agent", "gpu-node")
    tower.advance(1.0)
    assert sim(tower, "start", "gaming-2").rc == 0
    batch = (
        "echo @@n-0 ; qemu-agent-command '--timeout' '2' 'gaming-2' "
        "'{\"execute\":\"guest-ping\"}' ; echo @@n-1 ; domstate '--reason' 'gaming-2'"
        " ; echo @@n-2 ; qemu-agent-command '--timeout' '2' 'gpu-node' "
        '\'{"execute":"guest-ping"}\''
    )
    got = sim(tower, batch)
    assert (got.rc, got.out) == (1, "@@n-0\n\n@@n-1\nrunning (booted)\n\n@@n-2\n\n")
    assert got.err == NOT_CONNECTED + (
        "error: Requested operation is not valid: domain is not running\n"
    )
