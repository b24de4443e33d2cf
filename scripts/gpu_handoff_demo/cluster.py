"""The cluster: the Kubernetes API emulator (tests/k8semu) seeded as a small
k3s cluster with one GPU node per tower, their workloads, and a
PodDisruptionBudget the drain respects."""

from __future__ import annotations

from typing import Any

from tests.k8semu import GPU, GPU_NODE, K8sEmulator, seed_demo

PRODUCT = "NVIDIA-GeForce-RTX-3050"
# The fresh tower's GPU node (``--guided``): a node of its own, so that the
# guided install's node step offers it beside the simulated towers' nodes.
FRESH_NODE = "fresh-gpu-node"
# The cards the fresh tower's GPU node holds (tests/tower/nodes.py).
FRESH_CARDS = 2


def node_name(index: int) -> str:
    """Tower ``index``'s GPU node in the cluster."""
    return GPU_NODE if index == 1 else f"{GPU_NODE}-{index}"


def seed(emu: K8sEmulator, towers: int) -> None:
    """The demo cluster (tests/k8semu's seed) plus a GPU node and a workload
    for every further tower."""
    seed_demo(emu)
    label_cards(emu, GPU_NODE)
    relax_pdb(emu)
    plugin = emu.get("DaemonSet", "nvidia-device-plugin-daemonset", "kube-system")
    for index in range(2, towers + 1):
        node = node_name(index)
        emu.add_node(node, gpus=3, gpu_product=PRODUCT, address=f"10.0.0.{9 + index}")
        if plugin is not None:
            emu.add_pod(
                f"nvidia-device-plugin-daemonset-{node}",
                "kube-system",
                node=node,
                labels=dict(plugin["spec"]["selector"]["matchLabels"]),
                owner=emu.owner_ref(plugin),
                image="nvcr.io/nvidia/k8s-device-plugin:v0.17.0",
                container_name="nvidia-device-plugin-ctr",
            )
        labels = {"app": f"embeddings-{index}", "pod-template-hash": "8f7e6d5c4"}
        owner = emu.add_replicaset(
            f"embeddings-{index}-8f7e6d5c4",
            "ai",
            labels=labels,
            image="ghcr.io/huggingface/text-embeddings-inference:1.8",
            gpu_request=1,
        )
        emu.add_pod(
            f"embeddings-{index}-8f7e6d5c4-k3v7r",
            "ai",
            node=node,
            labels=labels,
            owner=emu.owner_ref(owner),
            image="ghcr.io/huggingface/text-embeddings-inference:1.8",
            gpu_request=1,
        )


def add_fresh_node(emu: K8sEmulator) -> None:
    """A Ready node for the fresh tower's GPU node, advertising a GPU per
    card it holds (fewer would be a Health problem after five minutes), with
    no workloads: nothing is drained on that tower."""
    emu.add_node(FRESH_NODE, gpus=FRESH_CARDS, address="10.0.0.20")


def label_cards(emu: K8sEmulator, node: str) -> None:
    """The node's GPU product label as NVIDIA's feature discovery would set it
    for this tower (it names the most common card)."""

    def mutate(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("labels", {})["nvidia.com/gpu.product"] = PRODUCT

    emu.modify("Node", node, "", mutate=mutate)


def relax_pdb(emu: K8sEmulator) -> None:
    """The seeded trainer PDB refuses every eviction; the demo's allows one
    disruption, so the drain shows it respected and still finishes."""
    pdb = emu.get("PodDisruptionBudget", "trainer", "ai")
    if pdb is None:
        return
    labels = pdb["spec"]["selector"]["matchLabels"]
    emu.delete("PodDisruptionBudget", "trainer", "ai")
    emu.add_pdb("trainer", "ai", match_labels=labels, max_unavailable=1)


def cordoned(emu: K8sEmulator, node: str) -> bool:
    """Whether ``node`` is cordoned."""
    obj = emu.get("Node", node, "")
    return bool(obj and obj["spec"].get("unschedulable"))


def gpus_requested(emu: K8sEmulator, node: str) -> int:
    """The GPUs the pods on ``node`` request (not those being deleted)."""
    return sum(
        int(container.get("resources", {}).get("requests", {}).get(GPU, 0))
        for pod in emu.list_objects("Pod")
        if pod["spec"].get("nodeName") == node
        and not pod["metadata"].get("deletionTimestamp")
        for container in pod["spec"]["containers"]
    )
