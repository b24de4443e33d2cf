"""Capture the fixtures in ``fixtures/`` from real virsh (libvirt's test driver).

Run: ``scripts/env python -m tests.tower.capture_fixtures`` (rewrites the files).
``test_fixtures_conformance`` runs the same capture and compares, so the
fixtures stay what real virsh prints.
"""

from __future__ import annotations

from pathlib import Path
import re
import subprocess
import tempfile

from tests.support.libvirtd import LibvirtTestDriver, wait_until
from tests.tower import nodes

FIXTURES = Path(__file__).parent / "fixtures"
BATCH_NONCE = "fixture"


def _run(uri: str, *args: str) -> tuple[str, str, int]:
    proc = subprocess.run(
        ["virsh", "-c", uri, *args], capture_output=True, text=True, check=False
    )
    return proc.stdout, proc.stderr, proc.returncode


def normalise(name: str, text: str) -> str:
    """Drop what differs between runs: generated UUIDs, timestamps, paths."""
    text = re.sub(r"<uuid>[0-9a-f-]+</uuid>", "<uuid>UUID</uuid>", text)
    text = re.sub(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+0000", "TIME", text, flags=re.M
    )
    return re.sub(r"/tmp/[^'\s]+/", "TMP/", text)


def capture_static(directory: Path) -> dict[str, str]:
    """Outputs from ``test:///node.xml`` (no daemon)."""
    node = nodes.write_node_file(directory / "node.xml", other=True)
    uri = f"test://{node}"
    out: dict[str, str] = {}
    for name in ("gpu-node", "win-1", "win-2", "other-vm"):
        out[f"dumpxml-{name}.xml"] = _run(uri, "dumpxml", name)[0]
    out["domstate-running.txt"] = _run(uri, "domstate", "--reason", "gpu-node")[0]
    out["domstate-shutoff.txt"] = _run(uri, "domstate", "--reason", "win-1")[0]
    out["list.txt"] = _run(uri, "list", "--all", "--name")[0]
    batch = " ; ".join(
        [
            f"echo @@gpu-handoff-{BATCH_NONCE}-0",
            "list --all --name",
            f"echo @@gpu-handoff-{BATCH_NONCE}-1",
            "dumpxml 'no-such-vm'",
            f"echo @@gpu-handoff-{BATCH_NONCE}-2",
            "domstate --reason 'win-1'",
            f"echo @@gpu-handoff-{BATCH_NONCE}-3",
            "qemu-agent-command --timeout 2 'gpu-node' '{\"execute\":\"guest-ping\"}'",
            f"echo @@gpu-handoff-{BATCH_NONCE}-4",
            "domstate --reason 'gpu-node'",
        ]
    )
    stdout, stderr, rc = _run(uri, batch)
    out["batch.stdout"] = stdout
    out["batch.stderr"] = stderr
    out["batch.rc"] = f"{rc}\n"
    stdout, stderr, rc = _run(uri, "echo a", ";", "echo b")
    out["batch-argv-token.stderr"] = stderr
    out["shutdown-agent-test-driver.stderr"] = _run(
        uri, "shutdown", "--mode", "agent", "gpu-node"
    )[1]
    out["start-active.stderr"] = _run(uri, "start", "gpu-node")[1]
    out["domstate-missing.stderr"] = _run(uri, "domstate", "--reason", "no-such-vm")[1]
    out["unreachable.stderr"] = _run(
        f"test+unix:///default?socket={directory}/no-sock", "list", "--all", "--name"
    )[1]
    shot = directory / "shot"
    out["screenshot.stdout"] = _run(uri, "screenshot", "gpu-node", "--file", str(shot))[
        0
    ]
    return {name: normalise(name, text) for name, text in out.items()}


def capture_events(directory: Path) -> str:
    """``virsh event --loop --all --timestamp`` lines for a domain's life."""
    with LibvirtTestDriver(directory) as lv:
        xml = nodes.domain_xml(
            "gpu-node", nodes.GPU_NODE_DEVICES, running=True, test_driver_file=False
        )
        lv.define(xml)
        for verb in ("start", "shutdown", "start", "suspend", "resume"):
            lv.virsh(verb, "gpu-node", check=True)
        # Only to capture the line a destroy by someone else produces.
        lv.virsh("destroy", "gpu-node", check=True)
        lv.virsh("undefine", "gpu-node", check=True)

        def lines() -> list[str]:
            return [line for line in lv.new_event_lines() if "'gpu-node'" in line]

        wait_until(lambda: len(lines()) >= 8, timeout=20, what="8 event lines")
        return "".join(line + "\n" for line in lines())


def capture_all() -> dict[str, str]:
    """Every fixture, normalised."""
    with tempfile.TemporaryDirectory() as tmp:
        out = capture_static(Path(tmp))
        events_dir = Path(tmp) / "events"
        events_dir.mkdir()  # the daemon's directory
        out["events.txt"] = capture_events(events_dir)
    return out


if __name__ == "__main__":
    FIXTURES.mkdir(exist_ok=True)
    for fixture, content in capture_all().items():
        (FIXTURES / fixture).write_text(content, encoding="utf-8")
        print(f"wrote {fixture}")
