"""GPUs under other names: a GPU node whose NVIDIA device plugin shares its
cards by time-slicing (renamed by default: ``nvidia.com/gpu.shared``, each
card ``replicas`` times) or cuts them with MIG in the mixed strategy
(``nvidia.com/mig-<slices>g.<memory>gb``, several per card). The rig
advertises both as the plugin does (tests/k8semu/test_device_plugin_names.py
pins the names to NVIDIA/k8s-device-plugin's README and sources).

Against such a node a return ends when the device plugin registered the
cards again, "GPUs missing" is raised only while devices really are missing
(none registered, or some reported unhealthy), and the pods asking for
those resources count as GPUs in use.

Real parts: sshd forcing the real agent on the tower simulator, the
Kubernetes emulator with the kubelet stand-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from homeassistant.core import Event, HomeAssistant, callback
from homeassistant.helpers import issue_registry as ir
from kubernetes_asyncio.client import (
    V1Container,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
)
import pytest
from pytest_homeassistant_custom_component.common import (
    MockConfigEntry,
    async_capture_events,
)

from custom_components.gpu_handoff import health
from custom_components.gpu_handoff.cluster_client import _pod_gpu_request
from custom_components.gpu_handoff.const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_RETURN_UNHEALTHY,
)
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.k8semu.objects import DevicePlugin
from tests.support.kubelet import Kubelet
from tests.support.stories import (
    BOUND,
    HANDOFF,
    SWITCH_1,
    cordoned,
    idle,
    play,
    setup_entry,
    switch,
    until,
)
from tests.towersim import Tower

HEALTH = "binary_sensor.gpu_node_health"
GPUS_IN_USE = "sensor.gpu_node_gpus_in_use"
CARDS = 3  # the cards of the simulated tower, all the GPU node's when it serves

# Time-slicing with renameByDefault, 4 replicas: 12 nvidia.com/gpu.shared.
SHARED = DevicePlugin(replicas=4, rename_by_default=True)
# MIG, mixed strategy: each card cut into 3g.20gb + 2g.10gb + 2 x 1g.5gb.
MIG_MIXED = DevicePlugin(mig=("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"))
FORMS = pytest.mark.parametrize(
    "device_plugin", [SHARED, MIG_MIXED], ids=["time_slicing_shared", "mig_mixed"]
)


def _advertised(cluster: K8sEmulator, field: str) -> dict[str, str]:
    status = cluster.get("Node", GPU_NODE, "")["status"]
    return {k: v for k, v in status[field].items() if k.startswith("nvidia.com/")}


def _issue(hass: HomeAssistant, entry: MockConfigEntry) -> ir.IssueEntry | None:
    return ir.async_get(hass).async_get_issue(DOMAIN, f"node_health_{entry.entry_id}")


async def _refresh(hass: HomeAssistant, entry: MockConfigEntry) -> None:
    await entry.runtime_data.coordinator.async_refresh()
    await hass.async_block_till_done()


async def _refresh_until(
    hass: HomeAssistant, entry: MockConfigEntry, what: Callable[[], bool]
) -> None:
    """Refresh (as the poll would, only faster) until ``what`` holds."""

    async with asyncio.timeout(BOUND):
        while True:
            await _refresh(hass, entry)
            if what():
                return
            await asyncio.sleep(0.2)


@FORMS
async def test_a_return_ends_when_the_device_plugin_registered(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
    device_plugin: DevicePlugin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU node serves its three cards under the plugin's names; its two
    GPU workloads ask for them. A player takes a card and gives it back: the
    GPU node boots, its kubelet posts Ready with every name at 0, and the
    plugin registers the devices a moment later. The return ends then: the
    cards are reported back, no return is called unhealthy, the Health
    sensor never sees GPUs short."""
    monkeypatch.setattr(health, "GPUS_BOUND", 10.0)
    returned: list[tuple[str, dict[str, str]]] = []

    @callback
    def at_return(_event: Event) -> None:
        status = cluster.get("Node", GPU_NODE, "")["status"]
        returned.append(
            (status["nodeInfo"]["bootID"], _advertised(cluster, "allocatable"))
        )

    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    await setup_entry(hass, entry)
    entry.async_on_unload(hass.bus.async_listen(EVENT_CARDS_RETURNED, at_return))
    serving = hass.states.get(HANDOFF).attributes["gpus_allocatable"]
    in_use = hass.states.get(GPUS_IN_USE).state
    short_since = entry.runtime_data.coordinator.data.health.gpus_short_since
    boots = len(kubelet.boot_ids)

    await play(hass, entry, sim, 1)
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(returned or unhealthy))
    await until(lambda: idle(entry))

    assert [e.data["gpus_allocatable"] for e in unhealthy] == []
    # Reported back with the devices the new boot's plugin registered.
    assert len(kubelet.boot_ids) == boots + 1
    assert returned == [(kubelet.boot_ids[-1], device_plugin.resources(CARDS))]
    assert not cordoned(cluster)
    await _refresh(hass, entry)
    assert hass.states.get(HANDOFF).state == "serving"
    assert hass.states.get(HEALTH).state == "off"
    assert entry.runtime_data.coordinator.data.health.gpus_short_since is None
    assert _issue(hass, entry) is None
    # Before the handoff: every device counted, never short, and both GPU
    # workloads (one device each) counted as GPUs in use.
    assert serving == sum(int(n) for n in device_plugin.resources(CARDS).values())
    assert short_since is None
    assert in_use == "2"


@FORMS
async def test_devices_really_missing_are_still_reported(
    hass: HomeAssistant,
    entry: MockConfigEntry,
    sim: Tower,
    cluster: K8sEmulator,
    kubelet: Kubelet,
    no_pdb: None,
    device_plugin: DevicePlugin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device plugin does not come back after a return: the node shows
    each of its names at 0. The return waits the bound, gives the node back
    and reports it unhealthy; the Health sensor says GPUs are missing. The
    plugin registers with one card reported unhealthy (all of its devices):
    still missing. All healthy: the problem goes."""
    monkeypatch.setattr(health, "GPUS_BOUND", 1.0)
    unhealthy = async_capture_events(hass, EVENT_RETURN_UNHEALTHY)
    await setup_entry(hass, entry)
    await play(hass, entry, sim, 1)
    kubelet.plugin_delay = None  # the device plugin never registers again
    await switch(hass, "turn_off", SWITCH_1)
    await until(lambda: bool(unhealthy))
    await until(lambda: idle(entry))

    [event] = unhealthy
    assert (event.data["gpus_expected"], event.data["gpus_allocatable"]) == (CARDS, 0)
    assert _advertised(cluster, "allocatable") == device_plugin.resources(0)
    assert not cordoned(cluster)
    await _refresh_until(hass, entry, lambda: hass.states.get(HEALTH).state == "on")
    assert hass.states.get(HEALTH).attributes["reason"] == health.GPUS_MISSING

    cluster.set_node_gpus(GPU_NODE, CARDS - 1, unhealthy=1)
    await _refresh(hass, entry)
    assert hass.states.get(HEALTH).state == "on"
    assert _issue(hass, entry) is not None

    cluster.set_node_gpus(GPU_NODE, CARDS)
    await _refresh(hass, entry)
    assert hass.states.get(HEALTH).state == "off"
    assert _issue(hass, entry) is None


def test_gpus_in_use_count_every_name_and_nothing_else() -> None:
    """Requests under each of the device plugin's names count (a limit
    alone is the request); other NVIDIA resources (the network operator's
    ``nvidia.com/hostdev``) are no GPUs."""
    pod = V1Pod(
        spec=V1PodSpec(
            containers=[
                V1Container(
                    name="shared",
                    resources=V1ResourceRequirements(
                        requests={"nvidia.com/gpu.shared": "1"},
                        limits={"nvidia.com/gpu.shared": "1"},
                    ),
                ),
                V1Container(
                    name="mig",
                    resources=V1ResourceRequirements(
                        limits={"nvidia.com/mig-1g.5gb": "2", "nvidia.com/hostdev": "1"}
                    ),
                ),
            ]
        )
    )
    assert _pod_gpu_request(pod) == 3
