"""Seeds: ready-made clusters."""

from __future__ import annotations

from collections.abc import Callable

from .emulator import K8sEmulator
from .objects import MIRROR_ANNOTATION, PLAIN, DevicePlugin

GPU_NODE = "gpu-node"
CONTROL_PLANE_NODE = "control-plane"


def seed_demo(emu: K8sEmulator, device_plugin: DevicePlugin = PLAIN) -> None:
    """A k3s cluster with a control-plane node and ``gpu-node`` (3 GPUs,
    advertised as ``device_plugin`` says; the GPU workloads ask for its
    first resource).

    On gpu-node: the NVIDIA device plugin (DaemonSet pod, on the host
    network: the chart's ``devicePlugin.enableHostNetwork``, so it starts
    even where the pod network does not), a ReplicaSet-owned workload
    requesting 1 GPU, a pod guarded by a PDB with minAvailable equal to its
    replicas (its eviction is refused with 429), and a mirror pod (on the
    pod network).
    """
    emu.add_node(CONTROL_PLANE_NODE, control_plane=True, address="10.0.0.2")
    gpu_node = emu.add_node(
        GPU_NODE,
        gpus=3,
        gpu_product="NVIDIA-GeForce-RTX-4090",
        address="10.0.0.10",
        device_plugin=device_plugin,
    )
    gpu = device_plugin.resource

    plugin_labels = {"name": "nvidia-device-plugin-ds"}
    plugin = emu.add_daemonset(
        "nvidia-device-plugin-daemonset",
        "kube-system",
        labels=plugin_labels,
        image="nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
    )
    emu.add_pod(
        "nvidia-device-plugin-daemonset-x7k2p",
        "kube-system",
        node=GPU_NODE,
        labels={**plugin_labels, "controller-revision-hash": "6b8f9d7c5"},
        owner=emu.owner_ref(plugin),
        image="nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
        container_name="nvidia-device-plugin-ctr",
        # NVIDIA/k8s-device-plugin deployments/helm/nvidia-device-plugin/
        # templates/daemonset-device-plugin.yml: hostNetwork true (and
        # dnsPolicy ClusterFirstWithHostNet) with devicePlugin.enableHostNetwork.
        host_network=True,
    )

    llm_labels = {"app": "llm-inference", "pod-template-hash": "5d9c8b7f6"}
    llm = emu.add_replicaset(
        "llm-inference-5d9c8b7f6",
        "ai",
        labels=llm_labels,
        image="vllm/vllm-openai:v0.11.0",
        gpu_request=1,
        gpu_resource=gpu,
    )
    emu.add_pod(
        "llm-inference-5d9c8b7f6-q4w8z",
        "ai",
        node=GPU_NODE,
        labels=llm_labels,
        owner=emu.owner_ref(llm),
        image="vllm/vllm-openai:v0.11.0",
        gpu_request=1,
        gpu_resource=gpu,
    )

    trainer_labels = {"app": "trainer", "pod-template-hash": "7c6d5e4f3"}
    trainer = emu.add_replicaset(
        "trainer-7c6d5e4f3",
        "ai",
        labels=trainer_labels,
        image="pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime",
        replicas=1,
        gpu_request=1,
        gpu_resource=gpu,
    )
    emu.add_pod(
        "trainer-7c6d5e4f3-m2n9v",
        "ai",
        node=GPU_NODE,
        labels=trainer_labels,
        owner=emu.owner_ref(trainer),
        image="pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime",
        gpu_request=1,
        gpu_resource=gpu,
    )
    emu.add_pdb("trainer", "ai", match_labels={"app": "trainer"}, min_available=1)

    emu.add_pod(
        f"gpu-exporter-{GPU_NODE}",
        "kube-system",
        node=GPU_NODE,
        labels={"component": "gpu-exporter", "tier": "node"},
        annotations={
            MIRROR_ANNOTATION: "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
            "kubernetes.io/config.source": "file",
            "kubernetes.io/config.hash": "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
        },
        owner={
            "apiVersion": "v1",
            "kind": "Node",
            "name": GPU_NODE,
            "uid": gpu_node["metadata"]["uid"],
            "controller": True,
        },
        image="nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04",
        # a static pod's usual: it stays through any NoExecute taint
        tolerations=[{"operator": "Exists", "effect": "NoExecute"}],
    )

    coredns_labels = {"k8s-app": "kube-dns", "pod-template-hash": "ccb96694c"}
    coredns = emu.add_replicaset(
        "coredns-ccb96694c",
        "kube-system",
        labels=coredns_labels,
        image="rancher/mirrored-coredns-coredns:1.12.3",
    )
    emu.add_pod(
        "coredns-ccb96694c-8xq2l",
        "kube-system",
        node=CONTROL_PLANE_NODE,
        labels=coredns_labels,
        owner=emu.owner_ref(coredns),
        image="rancher/mirrored-coredns-coredns:1.12.3",
    )


def seed_empty(emu: K8sEmulator) -> None:
    """No nodes, no pods (the namespaces only)."""
    del emu


SEEDS: dict[str, Callable[[K8sEmulator], None]] = {
    "demo": seed_demo,
    "empty": seed_empty,
}
