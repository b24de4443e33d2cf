"""Conformance: the simulator and real virsh (libvirt's test driver in a
private libvirtd) answer the same commands with the same bytes and exit codes.

Both sides get the same domains (the simulator's specs, defined in the test
driver from ``DomainSpec.define_xml``) and run the same command sequence; every
step's rc, stdout and stderr must be identical. What the test driver cannot
show (the guest agent, shutdown modes, PCI exclusivity, a QEMU domain's
errors) is pinned against a recording of real QEMU guests in
``test_recorded.py`` and lives as a live test in tests/realvm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
import re
import signal
import subprocess

import pytest

from tests.support.libvirtd import LibvirtTestDriver, require_libvirtd, wait_until
from tests.towersim import DomainSpec, Tower, realistic_domains
from tests.towersim.helpers import LineReader, Result, png_size, real, sim

pytestmark = pytest.mark.system

PING = '{"execute":"guest-ping"}'
TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+0000: "
NAMES = ("gpu-node", "gaming-1", "gaming-2")
# Domains whose names virsh could read as options: the agent passes every
# domain as `--domain NAME`, which virsh takes as a value whatever it looks like.
DASHED = ("--bogus", "-x")


def conformance_specs() -> list[DomainSpec]:
    """The realistic tower, all shut off, as test-driver domains whose guests
    stop at once (the test driver's shutdown is immediate)."""
    specs = realistic_domains(
        gpu_node_running=False, agent_delay=0.0, shutdown_duration=0.0
    )
    specs += [DomainSpec(name=name, agent_delay=0.0) for name in DASHED]
    for spec in specs:
        spec.domain_type = "test"
        spec.ignore_acpi = False
        spec.shutdown_duration = 0.0
    return specs


class Pair:
    """The same commands on real virsh and on the simulator."""

    def __init__(
        self, daemon: LibvirtTestDriver, tower: Tower, events: subprocess.Popen[bytes]
    ) -> None:
        self.daemon = daemon
        self.tower = tower
        self.events = events
        self.event_lines = LineReader(events)
        self.mismatches: list[str] = []

    def both(self, *args: str) -> tuple[Result, Result]:
        return real(self.daemon.test_uri, *args), sim(self.tower, *args)

    def same(self, *args: str) -> Result:
        want, got = self.both(*args)
        if want != got:
            self.mismatches.append(
                f"virsh {list(args)}:\n  real: {want}\n  sim:  {got}"
            )
        return got

    def sim_events_include(
        self, want: list[str], strip: Callable[[str], str], *, timeout: float
    ) -> None:
        """The simulator's event lines (``strip`` of each) come to hold
        ``want`` in order; else both lists are shown."""

        def got() -> list[str]:
            return [strip(line) for line in self.event_lines.poll()]

        try:
            wait_until(
                lambda: _is_subsequence(want, got()),
                timeout=timeout,
                what="the simulator's events",
            )
        except TimeoutError:
            raise AssertionError(
                "the simulator's events are not the test driver's, in order:\n"
                f"real: {want}\nsim:  {got()}"
            ) from None

    def check(self) -> None:
        mismatches, self.mismatches = self.mismatches, []
        assert not mismatches, "\n".join(mismatches)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require_libvirtd()
    base = tmp_path_factory.mktemp("conformance")
    (base / "libvirtd").mkdir()
    specs = conformance_specs()
    with LibvirtTestDriver(base / "libvirtd") as daemon:
        # the test driver's own `test` domain had id 1: started domains count on
        tower = Tower.create(base / "tower", first_id=2)
        events = subprocess.Popen(
            [
                str(tower.virsh),
                "-c",
                tower.uri,
                "event",
                "--loop",
                "--all",
                "--timestamp",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        try:
            for spec in specs:
                daemon.define(spec.define_xml("test"))
            # defined while both listen: both report `Defined Added`
            wait_until(
                lambda: any(c.subscribed for c in tower.calls("event")),
                timeout=20,
                what="the event listener",
            )
            for spec in specs:
                tower.define(spec)
            yield Pair(daemon, tower, events)
        finally:
            if events.poll() is None:
                events.send_signal(signal.SIGINT)
                events.communicate(timeout=10)


STATIC: list[list[str]] = [
    ["list", "--all", "--name"],
    ["list", "--all"],
    ["-q", "list", "--all"],
    ["list", "--name"],
    ["list"],
    *[["domstate", "--reason", n] for n in NAMES],
    *[["domstate", n] for n in NAMES],
    *[["dumpxml", n] for n in NAMES],
    ["dumpxml", "--inactive", "gaming-1"],
    ["dumpxml", "--domain", "gaming-2"],
    ["domstate", "--reason", "nosuch"],
    ["-q", "domstate", "--reason", "nosuch"],
    ["dumpxml", "nosuch"],
    ["start", "nosuch"],
    ["shutdown", "--mode", "agent", "nosuch"],
    ["qemu-agent-command", "--timeout", "2", "nosuch", PING],
    ["frobnicate", "gpu-node"],
    ["list", "--bogus"],
    ["domstate"],
    ["start"],
    ["qemu-agent-command", "--timeout", "2", "gpu-node"],
    ["qemu-agent-command", "--timeout", "x", "gpu-node", PING],
    ["shutdown", "--mode", "frob", "gpu-node"],
    ["--frob", "list"],
    ["domstate", "--reason=yes", "gpu-node"],
    ["shutdown", "gpu-node", "--mode"],
    # a `;` token in argv is data, not a separator
    ["list", "--all", "--name", ";", "echo", "x"],
    ["domstate", "--reason", "gpu-node", ";", "domstate", "gaming-1"],
    ["echo", ";"],
    ["echo", "hello", "world"],
    ["-q", "echo", "a", "b"],
    ["echo"],
    ["list --all --name", "echo x"],
    # one argument: a command string, parsed whole before anything runs
    [
        "list --all --name; echo @@m-0; domstate --reason nosuch; echo @@m-1; domstate --reason gpu-node"
    ],
    ["domstate --reason gaming-1; domstate --reason nosuch"],
    ["domstate --reason nosuch; domstate --reason gaming-1"],
    ["domstate --reason gaming-1; frob; echo x"],
    ["domstate --reason gaming-1; list --bogus"],
    ["echo 'a b' \"c d\" e\\;f x#y #comment\necho next"],
    ['echo "unterminated'],
    ["echo 'unterminated"],
    ["echo trailing\\"],
    [" "],
    [""],
    ["  ;  echo x ; "],
    ["list --all --name;;echo y"],
    ["echo ---x---"],
    ["echo -- ---x---"],
    ["-q", "list --all --name; echo x; domstate --reason gpu-node"],
    # domains as the value of --domain (the agent's form), and the bare form
    # that a name starting with `--` turns into an option error
    *[["domstate", "--reason", "--domain", n] for n in (*DASHED, "gpu-node")],
    *[["dumpxml", "--domain", n] for n in DASHED],
    ["domstate", "--reason", "--bogus"],
    ["domstate", "--reason", "-x"],
    ["dumpxml", "--bogus"],
    ["dumpxml", "--domain", "--"],
    ["dumpxml", "--", "--bogus"],
    ["domstate", "--domain=--bogus"],
    ["domstate", "--reason", "--domain"],
    ["domstate", "--domain", "--reason"],
    ["domstate", "--reason", "--domain", "gpu-node", "--domain", "gpu-node"],
    ["domstate", "--reason", "--domain", "gpu-node", "gaming-1"],
    ["start", "--domain", "nosuch"],
    ["shutdown", "--mode", "agent", "--domain", "nosuch"],
    ["qemu-agent-command", "--timeout", "2", "--domain", "nosuch", PING],
    ["qemu-agent-command", "--timeout", "2", "--domain", "--bogus"],
    ["screenshot", "--domain", "nosuch", "--file", "/tmp/conformance-none.png"],
    [
        (
            "echo @@gpu-handoff-0a1b2c-0 ; dumpxml '--domain' '--bogus' ; "
            "echo @@gpu-handoff-0a1b2c-1 ; domstate '--reason' '--domain' '--bogus' ; "
            "echo @@gpu-handoff-0a1b2c-2 ; domstate '--reason' '--domain' '-x' ; "
            "echo @@gpu-handoff-0a1b2c-3 ; qemu-agent-command '--timeout' '2' "
            "'--domain' 'nosuch' '{\"execute\":\"guest-ping\"}'"
        )
    ],
    # the agent's former form: one such name made the whole batch a parse error
    ["echo @@m-0 ; dumpxml '--bogus' ; echo @@m-1 ; domstate '--reason' 'gpu-node'"],
    # the agent's own batch form (tests/towersim/CONTRACT.md)
    [
        (
            "echo @@gpu-handoff-0a1b2c-0 ; list '--all' '--name' ; "
            "echo @@gpu-handoff-0a1b2c-1 ; domstate '--reason' 'gpu-node' ; "
            "echo @@gpu-handoff-0a1b2c-2 ; dumpxml 'gaming-1' ; "
            "echo @@gpu-handoff-0a1b2c-3 ; domstate '--reason' 'no-such'"
        )
    ],
]


@pytest.mark.parametrize("args", STATIC, ids=lambda a: " ".join(a)[:60])
def test_static_commands_match_real_virsh(pair: Pair, args: list[str]) -> None:
    pair.same(*args)
    pair.check()


def test_lifecycle_matches_real_virsh(pair: Pair, tmp_path: Path) -> None:
    shot = tmp_path / "screen.png"
    steps: list[list[str]] = [
        ["start", "gpu-node"],
        ["start", "gpu-node"],
        ["-q", "start", "gpu-node"],
        ["domstate", "--reason", "gpu-node"],
        ["dumpxml", "gpu-node"],
        ["list", "--all"],
        ["list", "--all", "--name"],
        ["list", "--name"],
        ["list", "--inactive", "--name"],
        ["-q", "list", "--all"],
        ["screenshot", "gpu-node", "--file", str(shot)],
        ["-q", "screenshot", "gpu-node", "--file", str(shot)],
        ["screenshot", "gpu-node", "--file", str(tmp_path / "missing" / "x.png")],
        ["start gpu-node; echo after"],
        ["echo before; start gpu-node"],
        ["-q", "echo before; start gpu-node"],
        ["shutdown", "gpu-node"],
        ["domstate", "--reason", "gpu-node"],
        ["dumpxml", "gpu-node"],
        ["start", "gaming-1"],
        ["start", "gaming-2"],
        ["list", "--all"],
        ["list", "--all", "--name"],
        ["shutdown", "gaming-1"],
        ["list", "--all"],
        ["-q", "shutdown", "gaming-2"],
        ["domstate", "--reason", "gaming-2"],
    ]
    for args in steps:
        pair.same(*args)
    pair.check()
    assert png_size(shot) == (160, 100)


def test_domain_options_through_a_lifecycle_match_real_virsh(
    pair: Pair, tmp_path: Path
) -> None:
    """The agent's argument forms for a domain named like an option."""
    shot = tmp_path / "dashed.png"
    steps: list[list[str]] = [
        ["start", "--domain", "--bogus"],
        ["start", "--domain", "--bogus"],
        ["domstate", "--reason", "--domain", "--bogus"],
        ["dumpxml", "--domain", "--bogus"],
        ["screenshot", "--domain", "--bogus", "--file", str(shot)],
        ["list", "--all", "--name"],
        ["shutdown", "--domain", "--bogus"],
        ["domstate", "--reason", "--domain", "--bogus"],
        ["list", "--all"],
    ]
    for args in steps:
        pair.same(*args)
    pair.check()
    assert png_size(shot) == (160, 100)


def test_events_match_real_virsh(pair: Pair) -> None:
    """The test driver's lifecycle lines, in order, are among the simulator's
    (which adds what QEMU also says: agent and channel lifecycle, Resumed
    Unpaused, Shutdown Finished), with the same timestamp format."""
    pair.same("start", "gaming-2")
    pair.same("shutdown", "gaming-2")
    pair.check()
    pair.daemon.await_last_event(
        "event 'lifecycle' for domain 'gaming-2': Stopped Shutdown"
    )

    def strip(line: str) -> str:
        assert re.match(TIMESTAMP, line), line
        return line.split(": ", 1)[1]

    want = [strip(line) for line in pair.daemon.new_event_lines()]
    assert want, "the test driver reported no events"
    assert want[-2:] == [
        "event 'lifecycle' for domain 'gaming-2': Started Booted",
        "event 'lifecycle' for domain 'gaming-2': Stopped Shutdown",
    ]

    pair.sim_events_include(want, strip, timeout=20)


def test_event_timeout_matches_real_virsh(pair: Pair) -> None:
    pair.same("event", "--all", "--timestamp", "--timeout", "1")
    pair.same("event", "--timeout", "1")
    pair.check()


def _is_subsequence(needles: list[str], haystack: list[str]) -> bool:
    it = iter(haystack)
    return all(any(n == h for h in it) for n in needles)
