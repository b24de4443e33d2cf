"""Conformance: `--domain WORD` finds the same domain in the simulator as in
real virsh (libvirt's test driver in a private libvirtd): a running domain's
id first, then a UUID, then a name (the rules and their sources:
test_lookup.py). Domains are named like ids and like another domain's UUID,
and each step's rc, stdout and stderr must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.libvirtd import LibvirtTestDriver, require_libvirtd
from tests.towersim import DomainSpec, Tower, realistic_domains
from tests.towersim.helpers import real, sim

pytestmark = pytest.mark.system

# A UUID no domain has: a domain may be named so.
FREE_UUID = "11111111-2222-3333-4444-555555555556"


def _specs() -> list[DomainSpec]:
    """The GPU node, and domains named `2`, `3`, `-0`, `02`, the GPU node's
    UUID and an unused UUID, all test-driver domains, all shut off."""
    (gpu_node,) = realistic_domains(
        gaming=0, gpu_node_running=False, agent_delay=0.0, shutdown_duration=0.0
    )
    gpu_node_uuid = str(gpu_node.as_json()["uuid"])
    names = ("2", "3", "-0", "02", gpu_node_uuid, FREE_UUID)
    specs = [gpu_node, *(DomainSpec(name=n, agent_delay=0.0) for n in names)]
    for spec in specs:
        spec.domain_type = "test"
        spec.ignore_acpi = False
        spec.shutdown_duration = 0.0
    return specs


def test_domain_lookup_matches_real_virsh(tmp_path: Path) -> None:
    require_libvirtd()
    (tmp_path / "libvirtd").mkdir()
    specs = _specs()
    gpu_node_uuid = str(specs[0].as_json()["uuid"])
    spaced = " " + gpu_node_uuid.replace("-", "").upper() + "   "
    with LibvirtTestDriver(tmp_path / "libvirtd") as daemon:
        # the test driver's own `test` domain had id 1: started domains count on
        tower = Tower.create(tmp_path / "tower", first_id=2)
        for spec in specs:
            daemon.define(spec.define_xml("test"))
            tower.define(spec)
        steps: list[list[str]] = [
            # nothing runs: every word is a name
            ["domstate", "--reason", "--domain", "2"],
            ["domstate", "--reason", "--domain", "-0"],
            ["domstate", "--reason", "--domain", "02"],
            ["domstate", "--reason", "--domain", "+2"],
            ["domstate", "--reason", "--domain", FREE_UUID],
            # a UUID (also spaced, upper case) finds its domain before a name
            ["dumpxml", "--domain", gpu_node_uuid],
            ["dumpxml", "--domain", spaced],
            # the GPU node runs as id 2: `2`, `02`, `+2` and ` 2` are the GPU node
            ["start", "--domain", "gpu-node"],
            ["list", "--all"],
            ["domstate", "--reason", "--domain", "2"],
            ["domstate", "--reason", "--domain", "02"],
            ["domstate", "--reason", "--domain", "+2"],
            ["domstate", "--reason", "--domain", " 2"],
            ["domstate", "--reason", "--domain", "2 "],
            ["dumpxml", "--domain", "2"],
            # start looks up by UUID and name: the domain NAMED 2 starts (id 3)
            ["start", "--domain", "2"],
            ["start", "--domain", "02"],
            ["start", "--domain", gpu_node_uuid],
            ["list", "--all"],
            ["dumpxml", "--domain", "3"],
            ["domstate", "--reason", "--domain", "3"],
            # a shutdown by id stops the domain of that id, named as given
            ["shutdown", "--domain", "2"],
            ["domstate", "--reason", "--domain", "gpu-node"],
            # id 2 is free again: `2` is the domain named 2 (running as id 3)
            ["shutdown", "--domain", "2"],
            ["domstate", "--reason", "--domain", gpu_node_uuid],
            ["list", "--all"],
        ]
        mismatches = []
        for args in steps:
            want, got = real(daemon.test_uri, *args), sim(tower, *args)
            if want != got:
                mismatches.append(f"virsh {args}:\n  real: {want}\n  sim:  {got}")
        tower.close()
    assert not mismatches, "\n".join(mismatches)
