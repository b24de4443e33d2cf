"""`--domain WORD` names a domain as virsh finds it: by id, by UUID, by name.

libvirt's rules (tools/virsh-util.c, virshLookupDomainInternal, with the flags
VIRSH_BYID | VIRSH_BYUUID | VIRSH_BYNAME of virshCommandOptDomain):

1. if ``virStrToLong_i(WORD, NULL, 10, &id) == 0 && id >= 0`` (src/util/
   virstring.c: g_ascii_strtoll, so C whitespace and a sign may come first,
   nothing may follow the digits, the value must fit an int), the RUNNING
   domain of that id (virDomainLookupByID finds active domains only);
2. else, if ``strlen(WORD) == VIR_UUID_STRING_BUFLEN-1`` (36 bytes) and
   virUUIDParse reads it (src/util/viruuid.c: g_ascii_isspace around, 16 pairs
   of hex digits, any '-' or ' ' between the pairs), the domain of that UUID;
3. else the domain of that name; else ``failed to get domain 'WORD'``.

``start`` passes VIRSH_BYNAME | VIRSH_BYUUID (cmdStart in
tools/virsh-domain.c: a shut-off domain has no id), so ``start --domain 1``
starts the domain NAMED 1. ``shutdown`` and ``destroy`` print the word they
were given (``Domain '1' is being shutdown``), ``start`` the domain's name.
The same commands against real virsh: test_conformance_lookup.py.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.towersim import DomainSpec, Tower
from tests.towersim.helpers import LineReader, sim
from tests.towersim.virsh import domain_id, domain_uuid

UUID = "11111111-2222-3333-4444-555555555555"
RAW = bytes.fromhex(UUID.replace("-", ""))


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("1", 1),
        ("01", 1),
        ("+1", 1),
        (" 1", 1),
        ("\t\v\n1", 1),  # strtoll's isspace has \v
        ("-0", 0),
        ("0", 0),
        ("2147483647", 2**31 - 1),
        ("0000000000002", 2),
        ("2147483648", None),  # not an int
        ("4294967297", None),
        ("-1", None),  # negative: never an id
        ("1 ", None),  # something after the digits
        ("1_", None),
        ("0x1", None),
        ("", None),
        ("+", None),
        (" ", None),
        ("\u0661", None),  # ARABIC-INDIC DIGIT ONE: digits are ASCII digits
        ("gaming-1", None),
    ],
)
def test_which_words_virsh_reads_as_an_id(word: str, expected: int | None) -> None:
    assert domain_id(word) == expected


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        (UUID, RAW),
        (UUID.upper(), RAW),
        (" " + UUID.replace("-", "") + "   ", RAW),  # 36 bytes with blanks
        ("11111111 22 22 33334444555555555555 ", RAW),
        ("\t-" + UUID.replace("-", "")[:-2] + "-55 ", RAW),  # '-' between pairs
        ("-" + UUID.replace("-", "") + "\t\r-", None),  # '-' after the last pair
        (UUID.replace("-", "") + "\v\v\v\v", None),  # g_ascii_isspace has no \v
        (UUID.replace("-", "") + "\t\t\t\t", RAW),
        ("1-111111-2222-3333-4444-55555555555", None),  # '-' inside a pair
        ("1111-1111-2222-3333-4444-555555555555", None),  # 37 bytes
        ("g1111111-2222-3333-4444-555555555555", None),
        ("é111111-2222-3333-4444-555555555555", None),  # 36 characters, 37 bytes
        ("gaming-1", None),
    ],
)
def test_which_words_virsh_reads_as_a_uuid(word: str, expected: bytes | None) -> None:
    assert domain_uuid(word) == expected


def _named_like_ids(tower: Tower) -> str:
    """Domains named `1`, `2` and the GPU node's UUID; the GPU node runs as
    id 1. Returns the GPU node's UUID."""
    gpu_node_uuid = str(DomainSpec(name="gpu-node").as_json()["uuid"])
    for name in ("1", "2", gpu_node_uuid):
        tower.define(DomainSpec(name=name, agent_delay=0.0))
    assert tower.world().doms["gpu-node"].id == 1
    return gpu_node_uuid


def test_an_id_finds_the_running_domain_of_that_id_first(tower: Tower) -> None:
    _named_like_ids(tower)
    assert sim(tower, "domstate", "--reason", "--domain", "1").out == (
        "running (booted)\n\n"
    )
    assert "<name>gpu-node</name>" in sim(tower, "dumpxml", "--domain", "1").out
    for word in ("01", "+1", " 1"):
        assert "<name>gpu-node</name>" in sim(tower, "dumpxml", "--domain", word).out
    # no running domain has id 2: the domain named 2
    assert sim(tower, "domstate", "--reason", "--domain", "2").out == (
        "shut off (unknown)\n\n"
    )
    # `1 ` is no id: a name, and no domain has it
    assert sim(tower, "domstate", "--domain", "1 ").err == (
        "error: failed to get domain '1 '\n"
    )


def test_a_uuid_finds_the_domain_of_that_uuid_before_a_name(tower: Tower) -> None:
    gpu_node_uuid = _named_like_ids(tower)
    got = sim(tower, "dumpxml", "--domain", gpu_node_uuid)
    assert "<name>gpu-node</name>" in got.out
    spaced = " " + gpu_node_uuid.replace("-", "").upper() + "   "
    assert "<name>gpu-node</name>" in sim(tower, "dumpxml", "--domain", spaced).out
    # a word that reads as a UUID no domain has is a name
    tower.define(DomainSpec(name=UUID))
    assert f"<name>{UUID}</name>" in sim(tower, "dumpxml", "--domain", UUID).out


def test_start_looks_up_by_uuid_and_name_only(tower: Tower) -> None:
    gpu_node_uuid = _named_like_ids(tower)
    got = sim(tower, "start", "--domain", "1")
    assert (got.rc, got.out, got.err) == (0, "Domain '1' started\n\n", "")
    assert tower.is_running("1")
    assert tower.world().doms["1"].id == 2
    # now id 2 is the domain named 1, and the domain named 2 is still found by name
    assert "<name>1</name>" in sim(tower, "dumpxml", "--domain", "2").out
    got = sim(tower, "start", "--domain", "2")
    assert (got.rc, got.out) == (0, "Domain '2' started\n\n")
    # the GPU node's UUID is the GPU node, running already
    got = sim(tower, "start", "--domain", gpu_node_uuid)
    assert (got.rc, got.err) == (1, "error: Domain is already active\n")


def test_a_shutdown_by_id_stops_the_domain_of_that_id(tower: Tower) -> None:
    """What made an agent that manages a VM named `1` stop the GPU node."""
    _named_like_ids(tower)
    got = sim(tower, "shutdown", "--mode", "agent", "--domain", "1")
    # virsh names the domain as it was given
    assert (got.rc, got.out) == (0, "Domain '1' is being shutdown\n\n")
    assert tower.calls("shutdown")
    tower.advance(1.0)
    assert not tower.is_running("gpu-node")
    assert tower.domstate("1") == "shut off (unknown)"
    got = sim(tower, "shutdown", "--domain", "1")
    assert got.err == (
        "error: Failed to shutdown domain '1'\n"
        "error: Requested operation is not valid: domain is not running\n"
    )


def test_events_of_a_domain_by_id_follow_that_domain(tower: Tower) -> None:
    """cmdEvent finds `--domain` once (virshCommandOptDomain) and reports
    that domain's events: id 1 is the GPU node, not the domain named 1."""
    _named_like_ids(tower)
    with subprocess.Popen(
        [
            str(tower.virsh),
            "-c",
            tower.uri,
            "event",
            "--loop",
            "--all",
            "--domain",
            "1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    ) as events:
        reader = LineReader(events)
        tower.wait_until(
            lambda: any(c.subscribed for c in tower.calls("event")),
            timeout=20,
            what="the listener",
        )
        assert sim(tower, "start", "--domain", "1").rc == 0  # by name: no event
        assert sim(tower, "shutdown", "--mode", "agent", "--domain", "gpu-node").rc == 0
        tower.wait_until(
            lambda: any("Stopped Shutdown" in line for line in reader.poll()),
            timeout=20,
            what="Stopped Shutdown",
        )
        events.send_signal(signal.SIGINT)
        tower.wait_until(
            lambda: reader.poll() and reader.closed, timeout=20, what="EOF"
        )
        assert events.wait(timeout=20) == 0
    assert {line.split("'")[3] for line in reader.lines if "for domain" in line} == {
        "gpu-node"
    }
    assert sim(tower, "event", "--domain", "nosuch", "--all").err == (
        "error: failed to get domain 'nosuch'\n"
    )
