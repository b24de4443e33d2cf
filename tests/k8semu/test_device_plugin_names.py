"""The names a node's GPUs go by, as the NVIDIA device plugin advertises them,
and the same names around a stop and a boot of the node's VM.

Upstream (NVIDIA/k8s-device-plugin):

- README.md, "Shared Access to GPUs", "With CUDA Time-Slicing": each
  resource listed under ``sharing.timeSlicing.resources`` is advertised
  ``replicas`` times per GPU ("If this configuration were applied to a node
  with 8 GPUs on it, the plugin would now advertise 80 ``nvidia.com/gpu``
  resources"), and "If ``renameByDefault=true``, then each resource will be
  advertised under the name ``<resource-name>.shared``" (then 80
  ``nvidia.com/gpu.shared``, no ``nvidia.com/gpu``). Resources that can be
  time-sliced: ``nvidia.com/gpu`` and those of the mixed MIG strategy.
  api/config/v1/consts.go: ``DefaultSharedResourceNameSuffix = ".shared"``;
  api/config/v1/replicas.go: "number of replicas must be >= 2".
- README.md, "Configuration Option Details", ``MIG_STRATEGY``: "With a
  ``MIG_STRATEGY`` of mixed, you will have additional resources available to
  you of the form ``nvidia.com/mig-<slice_count>g.<memory_size>gb``".
  internal/rm/rm.go, AddDefaultResourcesToConfig: the resource of a MIG
  profile is ``strings.ReplaceAll("mig-"+p.String(), "+", ".")``;
  internal/rm/nvml_manager.go, NewNVMLResourceManagers: a resource without
  devices is not registered (a node whose cards are all MIG-enabled
  advertises no ``nvidia.com/gpu``).

After a kubelet restart every resource of the device manager's checkpoint
shows 0 until the plugin registers again (kubernetes/kubernetes
pkg/kubelet/cm/devicemanager/manager.go GetCapacity, pinned for
``nvidia.com/gpu`` in test_node_lifecycle.py): the same for these names.
"""

from __future__ import annotations

from kubernetes_asyncio import client
import pytest

from tests.support.kubelet import Kubelet
from tests.towersim import Tower

from . import GPU_NODE, K8sEmulator
from .nodelog import NodeLog
from .objects import DevicePlugin

# An A100 40GB cut as the README's MIG example lists its profiles.
A100_MIXED = DevicePlugin(mig=("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"))
SHARED_4 = DevicePlugin(replicas=4, rename_by_default=True)
FORMS = {"shared": SHARED_4, "mig-mixed": A100_MIXED}


def test_time_slicing_advertises_each_card_replicas_times() -> None:
    """The README's example: 8 GPUs, 10 replicas, 80 devices, under
    ``nvidia.com/gpu`` or, renamed by default, ``nvidia.com/gpu.shared``."""
    assert DevicePlugin(replicas=10).resources(8) == {"nvidia.com/gpu": "80"}
    assert DevicePlugin(replicas=10, rename_by_default=True).resources(8) == {
        "nvidia.com/gpu.shared": "80"
    }
    assert DevicePlugin().resources(8) == {"nvidia.com/gpu": "8"}


def test_mig_mixed_advertises_each_profile_under_its_own_name() -> None:
    """mig-<slices>g.<memory>gb per MIG device, "+" read as "."; time-sliced
    MIG devices renamed by default get ".shared" too; no nvidia.com/gpu."""
    assert A100_MIXED.resources(2) == {
        "nvidia.com/mig-3g.20gb": "2",
        "nvidia.com/mig-2g.10gb": "2",
        "nvidia.com/mig-1g.5gb": "4",
    }
    assert DevicePlugin(mig=("1g.5gb+me",)).resource == "nvidia.com/mig-1g.5gb.me"
    shared_mig = DevicePlugin(mig=("1g.5gb",) * 7, replicas=2, rename_by_default=True)
    assert shared_mig.resources(1) == {"nvidia.com/mig-1g.5gb.shared": "14"}


@pytest.fixture(params=sorted(FORMS))
def device_plugin(request: pytest.FixtureRequest) -> DevicePlugin:
    """The demo cluster's GPU node with its cards shared or cut."""
    return FORMS[request.param]


def _gpu_resources(status: dict[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (status or {}).items() if k.startswith("nvidia.com/")}


async def test_a_node_advertises_its_cards_under_the_plugins_names(
    emulator: K8sEmulator, api: client.ApiClient, device_plugin: DevicePlugin
) -> None:
    """Read through the API as a client sees it: the three cards of the
    demo's GPU node under the form's names only, and its GPU workloads
    asking for the form's resource."""
    node = await client.CoreV1Api(api).read_node(GPU_NODE)
    expected = device_plugin.resources(3)
    assert _gpu_resources(node.status.capacity) == expected
    assert _gpu_resources(node.status.allocatable) == expected
    assert "nvidia.com/gpu" not in node.status.capacity
    pods = await client.CoreV1Api(api).list_namespaced_pod("ai")
    for pod in pods.items:
        limits = pod.spec.containers[0].resources.limits
        assert _gpu_resources(limits) == {device_plugin.resource: "1"}


async def test_a_boot_advertises_zero_then_the_devices_of_each_card(
    sim: Tower, emulator: K8sEmulator, kubelet: Kubelet, log: NodeLog
) -> None:
    """The VM stops and boots again: the new kubelet's first post shows each
    of the form's resources at 0, plugin_delay later the devices of the
    cards the VM runs with; a card unhealthy counts all its devices out of
    allocatable."""
    plugin = emulator.device_plugin(GPU_NODE)
    sim.guest_shutdown("gpu-node")
    sim.advance(60)
    await log.until(lambda: log.last.ready == "Unknown")
    sim.start_live("gpu-node", sim.defined_hostdevs("gpu-node"))
    await log.until(lambda: log.last.ready == "True")
    first = log.last.node["status"]
    assert _gpu_resources(first["capacity"]) == plugin.resources(0)
    assert _gpu_resources(first["allocatable"]) == plugin.resources(0)

    await log.until(
        lambda: (
            _gpu_resources(log.last.node["status"]["allocatable"])
            != plugin.resources(0)
        )
    )
    registered = log.last.node["status"]
    assert _gpu_resources(registered["capacity"]) == plugin.resources(3)
    assert _gpu_resources(registered["allocatable"]) == plugin.resources(3)

    emulator.set_node_gpus(GPU_NODE, 2, unhealthy=1)
    status = emulator.get("Node", GPU_NODE, "")["status"]
    assert _gpu_resources(status["capacity"]) == plugin.resources(3)
    assert _gpu_resources(status["allocatable"]) == plugin.resources(2)
