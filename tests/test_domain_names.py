"""A VM named like another VM's domain id is refused, and nothing is touched.

virsh looks `--domain WORD` up by a running domain's id first, then by UUID,
then by name (tools/virsh-util.c, virshLookupDomainInternal; the simulator
does the same, pinned against real virsh in tests/towersim/
test_conformance_lookup.py). On a tower where the GPU node runs as id 1, a
gaming VM named `1` is, to virsh, the GPU node: the agent would report the
GPU node's state as the gaming VM's, and a stop of `1` would shut the GPU
node down (with the node's pods still on it: nobody drained it). So the agent
refuses such a configuration, and the entry cannot load; it says why.

Real parts: sshd forcing the real agent, the tower simulator, the Kubernetes
emulator with its kubelet stand-in.
"""

from __future__ import annotations

import json
from pathlib import Path

from homeassistant.config_entries import ConfigEntryState, ConfigSubentryData
from homeassistant.core import HomeAssistant
import pytest
from pytest_homeassistant_custom_component.common import MockConfigEntry

from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_KUBECONFIG,
    CONF_SCAN_INTERVAL,
    DOMAIN,
    SUBENTRY_GAMING_VM,
)
from custom_components.gpu_handoff.coordinator import tower_credentials
from custom_components.gpu_handoff.protocol import JobKind
from custom_components.gpu_handoff.tower.gpu_handoff import wire
from custom_components.gpu_handoff.tower_client import AgentCommandError, TowerClient
from tests.conftest import kubeconfig_text, tower_entry_data
from tests.k8semu import K8sEmulator
from tests.support.simtower import write_agent_config
from tests.support.sshd import Sshd
from tests.towersim import Tower
from tests.towersim.helpers import sim as virsh
from tests.towersim.tower import realistic_domains

PROBLEM = (
    "gaming[0]: virsh would look '1' up as a domain id first, and could act on "
    "another VM; rename the VM in libvirt (shut it off, then `virsh domrename "
    "OLD-NAME NEW-NAME`)"
)


@pytest.fixture
def agent_config(sim: Tower, tmp_path: Path) -> Path:
    """Gaming station 1 is the domain named `1`; the GPU node runs as id 1."""
    spec = next(s for s in realistic_domains() if s.name == "gaming-1")
    spec.name = "1"
    sim.define(spec)
    path = write_agent_config(sim, tmp_path / "agent", agent=3.0)
    config = json.loads(path.read_text(encoding="utf-8"))
    config["gaming"] = ["1", "gaming-2"]
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def _entry(hass: HomeAssistant, server: Sshd, cluster: K8sEmulator) -> MockConfigEntry:
    entry = MockConfigEntry(
        domain=DOMAIN,
        title="tower",
        unique_id=f"127.0.0.1:{server.port}",
        data=tower_entry_data(server) | {CONF_KUBECONFIG: kubeconfig_text(cluster)},
        options={
            CONF_SCAN_INTERVAL: 30,
            CONF_DRAIN_TIMEOUT: 2,
            CONF_AUTO_RETURN: True,
        },
        subentries_data=[
            ConfigSubentryData(
                data={CONF_DOMAIN_NAME: "1"},
                subentry_type=SUBENTRY_GAMING_VM,
                title="Gaming station 1",
                unique_id="1",
            )
        ],
    )
    entry.add_to_hass(hass)
    return entry


async def test_a_gaming_vm_named_like_the_gpu_nodes_id_is_refused(
    hass: HomeAssistant,
    sim: Tower,
    sim_sshd: Sshd,
    cluster: K8sEmulator,
    kubelet: None,
) -> None:
    """To virsh, `1` is the running GPU node (id 1), not the shut-off VM
    named 1. The agent refuses the configuration: the entry does not load
    and says why, a stop of `1` is refused, and the GPU node runs on."""
    assert sim.world().doms["gpu-node"].id == 1
    assert virsh(sim, "domstate", "--domain", "1").out == "running\n\n"
    assert sim.domstate("1") == "shut off (unknown)"

    entry = _entry(hass, sim_sshd, cluster)
    await hass.config_entries.async_setup(entry.entry_id)
    await hass.async_block_till_done()
    assert entry.state is ConfigEntryState.SETUP_RETRY
    assert entry.error_reason_translation_key == "agent_config_invalid"
    assert entry.error_reason_translation_placeholders is not None
    assert PROBLEM in entry.error_reason_translation_placeholders["error"]
    assert hass.states.async_all("switch") == []

    # What Home Assistant's switch would send: refused before anything runs.
    client = TowerClient(tower_credentials(entry))
    try:
        with pytest.raises(AgentCommandError) as caught:
            await client.submit(JobKind.STOP, "1", "domain-names-stop-1")
    finally:
        await client.close()
    assert caught.value.code == wire.ERR_CONFIG_INVALID
    assert PROBLEM in str(caught.value)

    sim.advance(1.0)
    assert sim.is_running("gpu-node")
    assert sim.calls("shutdown") == []
    assert sim.calls("qemu-agent-command") == []
    assert sim.unit_runs() == []
    await hass.config_entries.async_unload(entry.entry_id)
