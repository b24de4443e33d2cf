"""Builders for realistic objects (what a kubelet, controllers or kubectl
would have written), used by the control API and the demo seed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final
import uuid

from .store import now_micro, now_rfc3339

# The pod condition a kubelet sets once the pod's sandbox runs with its
# network (pkg/kubelet/status/generate.go): PodHasNetwork in 1.25-1.27
# (feature gate), PodReadyToStartContainers from 1.28 (beta, on, from 1.29).
SANDBOX_CONDITION = "PodReadyToStartContainers"


def rfc3339_ago(seconds: float) -> str:
    """A metav1.Time ``seconds`` in the past."""
    moment = datetime.now(UTC) - timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_ago(seconds: float) -> str:
    """A metav1.MicroTime ``seconds`` in the past."""
    moment = datetime.now(UTC) - timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


JsonObj = dict[str, Any]

NODE_LEASE_NAMESPACE = "kube-node-lease"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
GPU = "nvidia.com/gpu"
# Where the pods make_pod binds run: the GPU node's address in the seed.
HOST_IP = "10.0.0.10"


@dataclass(frozen=True)
class DevicePlugin:
    """How the NVIDIA device plugin advertises each card of a node: its
    configuration, as NVIDIA/k8s-device-plugin reads it (README.md,
    "Configuration Option Details" and "Shared Access to GPUs").

    - Plain: one ``nvidia.com/gpu`` per card.
    - MIG strategy ``mixed`` (``mig``: the MIG devices each card is cut
      into): one ``nvidia.com/mig-<slices>g.<memory>gb`` per MIG device and
      no ``nvidia.com/gpu`` for a MIG card (internal/rm/rm.go
      AddDefaultResourcesToConfig names the resource "mig-" + the profile,
      "+" read as "."; internal/rm/nvml_manager.go registers no resource
      that has no device).
    - Time-slicing (``replicas``, at least 2 per api/config/v1/replicas.go):
      each device advertised ``replicas`` times, under ``<name>.shared``
      with ``renameByDefault`` (api/config/v1/consts.go
      DefaultSharedResourceNameSuffix), under its own name without.
    """

    replicas: int = 1
    rename_by_default: bool = False
    mig: tuple[str, ...] = ()

    def per_card(self) -> dict[str, int]:
        """The devices one card is advertised as, by resource name."""
        names = [f"mig-{p.replace('+', '.')}" for p in self.mig] or ["gpu"]
        suffix = ".shared" if self.replicas > 1 and self.rename_by_default else ""
        devices: dict[str, int] = {}
        for name in names:
            resource = f"nvidia.com/{name}{suffix}"
            devices[resource] = devices.get(resource, 0) + self.replicas
        return devices

    def resources(self, cards: int) -> dict[str, str]:
        """What ``cards`` cards are in a node's capacity or allocatable: each
        of its resource names, "0" for no card (a kubelet restored it from
        its checkpoint before the plugin registered again)."""
        return {name: str(n * cards) for name, n in self.per_card().items()}

    @property
    def resource(self) -> str:
        """The resource name a workload asks one device of (the first)."""
        return next(iter(self.per_card()))


# Each card one nvidia.com/gpu (no time-slicing, MIG off or strategy "none").
PLAIN = DevicePlugin()


def new_boot_id() -> str:
    """A fresh ``status.nodeInfo.bootID``: the kernel's
    /proc/sys/kernel/random/boot_id, a random UUID made at each boot."""
    return str(uuid.uuid4())


# The node conditions a kubelet posts; the node lifecycle controller turns
# all of them Unknown when the kubelet falls silent (tryUpdateNodeHealth;
# NetworkUnavailable is left alone, and k3s posts none).
KUBELET_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")


def kubelet_condition(kind: str, now: str) -> JsonObj:
    """A condition as a healthy kubelet posts it (pkg/kubelet/nodestatus
    setters.go: ReadyCondition, MemoryPressureCondition...): heartbeat now."""
    if kind == "Ready":
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
    label = kind  # MemoryPressure -> KubeletHasNoMemoryPressure
    return {
        "type": kind,
        "status": "False",
        "reason": f"KubeletHasNo{label}",
        "message": f"kubelet has no {label.lower()}",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def mark_unknown(condition: JsonObj, now: str) -> None:
    """The node lifecycle controller's change to a condition of a node whose
    kubelet stopped posting (tryUpdateNodeHealth): status Unknown, reason
    NodeStatusUnknown, transition now if it was not Unknown already; the
    heartbeat stays the kubelet's last."""
    if condition.get("status") != "Unknown":
        condition["status"] = "Unknown"
        condition["reason"] = "NodeStatusUnknown"
        condition["message"] = "Kubelet stopped posting node status."
        condition["lastTransitionTime"] = now


def ready_condition(up: bool) -> JsonObj:
    """The node Ready condition as the kubelet / node lifecycle controller set it."""
    now = now_rfc3339()
    if up:
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
    return {
        "type": "Ready",
        "status": "Unknown",
        "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


UNREACHABLE_TAINTS = (
    {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
)


def make_node(
    name: str,
    *,
    gpus: int = 0,
    allocatable_gpus: int | None = None,
    control_plane: bool = False,
    up: bool = True,
    unschedulable: bool = False,
    labels: dict[str, str] | None = None,
    address: str = "10.0.0.10",
    gpu_product: str | None = None,
    device_plugin: DevicePlugin = PLAIN,
) -> JsonObj:
    """A Node as a k3s kubelet registers it (with the NVIDIA device plugin's
    GPUs: ``gpus`` cards, advertised as ``device_plugin`` says)."""
    now = now_rfc3339()
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": "amd64",
    }
    if control_plane:
        node_labels["node-role.kubernetes.io/control-plane"] = "true"
    capacity = {
        "cpu": "8",
        "memory": "32777404Ki",
        "pods": "110",
        "ephemeral-storage": "102626232Ki",
    }
    allocatable = dict(capacity)
    if gpus:
        capacity.update(device_plugin.resources(gpus))
        allocatable.update(
            device_plugin.resources(
                gpus if allocatable_gpus is None else allocatable_gpus
            )
        )
        if gpu_product:
            node_labels["nvidia.com/gpu.product"] = gpu_product
            node_labels["nvidia.com/gpu.count"] = str(gpus)
            node_labels["nvidia.com/gpu.present"] = "true"
    node_labels.update(labels or {})
    spec: JsonObj = {
        "podCIDR": "10.42.0.0/24",
        "podCIDRs": ["10.42.0.0/24"],
        "providerID": f"k3s://{name}",
    }
    if unschedulable:
        spec["unschedulable"] = True
        spec["taints"] = [
            {
                "key": "node.kubernetes.io/unschedulable",
                "effect": "NoSchedule",
                "timeAdded": now,
            }
        ]
    if not up:
        spec["taints"] = [
            *spec.get("taints", []),
            *({**t, "timeAdded": now} for t in UNREACHABLE_TAINTS),
        ]
    pressure = [
        kubelet_condition(kind, now)
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")
    ]
    if not up:
        for condition in pressure:
            mark_unknown(condition, now)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": node_labels,
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": spec,
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": [*pressure, ready_condition(up)],
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
                "bootID": new_boot_id(),
                "kernelVersion": "6.12.57+deb13-amd64",
                "osImage": "Debian GNU/Linux 13 (trixie)",
                "containerRuntimeVersion": "containerd://2.1.4-k3s1",
                "kubeletVersion": "v1.34.2+k3s1",
                "kubeProxyVersion": "v1.34.2+k3s1",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        },
    }


def make_lease(
    node_name: str, *, duration: int = 40, node_uid: str | None = None
) -> JsonObj:
    """The node's heartbeat Lease in kube-node-lease."""
    now = now_micro()
    meta: JsonObj = {"name": node_name, "namespace": NODE_LEASE_NAMESPACE}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
        ]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": duration,
            "renewTime": now,
            "acquireTime": now,
        },
    }


def owner_ref(kind: str, name: str, uid: str, api_version: str = "apps/v1") -> JsonObj:
    """A controller ownerReference."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def make_pod(
    name: str,
    namespace: str = "default",
    *,
    node: str | None = None,
    phase: str = "Running",
    ready: bool | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    owner: JsonObj | None = None,
    gpu_request: int = 0,
    gpu_limit_only: bool = False,
    gpu_resource: str = GPU,
    empty_dir: bool = False,
    image: str = "registry.example/app:1.0",
    container_name: str = "main",
    waiting_reason: str | None = None,
    sandbox_ready: bool | None = None,
    sandbox_condition: str | None = SANDBOX_CONDITION,
    age: float = 0.0,
    tolerations: list[JsonObj] | None = None,
    host_network: bool = False,
) -> JsonObj:
    """A scheduled pod with kubelet-written status.

    ``phase`` Pending with ``waiting_reason`` (e.g. ContainerCreating) models a
    pod whose sandbox never starts; with ``sandbox_ready`` True too, one whose
    sandbox runs while an image is pulled (the kubelet pulls only once the
    sandbox is up). ``ready`` defaults to phase == Running.
    ``sandbox_condition``: the kubelet's name for that condition
    (``PodHasNetwork`` for 1.25-1.27, None for a kubelet that sets neither).
    ``age``: seconds since the pod was created and its kubelet wrote this
    status (every timestamp is that far in the past).
    ``tolerations``: its spec.tolerations as written (the emulator's
    admission adds DefaultTolerationSeconds' two on create).
    ``host_network``: spec.hostNetwork (with the dnsPolicy charts pair it
    with, ClusterFirstWithHostNet): its sandbox needs no network plugin, and
    its IP is the node's.
    """
    if ready is None:
        ready = phase == "Running"
    if sandbox_ready is None:
        sandbox_ready = phase != "Pending" or waiting_reason is None
    now = rfc3339_ago(age)
    resources: JsonObj = {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "256Mi"},
    }
    if gpu_request:
        resources["limits"][gpu_resource] = str(gpu_request)
        if not gpu_limit_only:
            resources["requests"][gpu_resource] = str(gpu_request)
    container: JsonObj = {
        "name": container_name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "resources": resources,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }
    volumes: list[JsonObj] = [
        {
            "name": f"kube-api-access-{name[:5]}",
            "projected": {
                "defaultMode": 420,
                "sources": [
                    {
                        "serviceAccountToken": {
                            "expirationSeconds": 3607,
                            "path": "token",
                        }
                    }
                ],
            },
        }
    ]
    if empty_dir:
        volumes.append({"name": "scratch", "emptyDir": {}})
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
    meta: JsonObj = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels or {}),
        "creationTimestamp": now,
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner:
        meta["ownerReferences"] = [owner]
    spec: JsonObj = {
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always" if phase in ("Running", "Pending") else "Never",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "schedulerName": "default-scheduler",
        "enableServiceLinks": True,
        "priority": 0,
    }
    if node:
        spec["nodeName"] = node
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"

    def cond(ctype: str, ok: bool, reason: str | None = None) -> JsonObj:
        c: JsonObj = {
            "type": ctype,
            "status": "True" if ok else "False",
            "lastProbeTime": None,
            "lastTransitionTime": now,
        }
        if reason:
            c["reason"] = reason
        return c

    started = phase == "Running"
    status: JsonObj = {"phase": phase, "qosClass": "Burstable", "startTime": now}
    if node:
        status["hostIP"] = HOST_IP
        status["conditions"] = [
            *(
                [cond(sandbox_condition, sandbox_ready)]
                if sandbox_condition is not None
                else []
            ),
            cond("Initialized", True),
            cond("Ready", ready, None if ready else "ContainersNotReady"),
            cond("ContainersReady", ready, None if ready else "ContainersNotReady"),
            cond("PodScheduled", True),
        ]
        if phase == "Running":
            ip = HOST_IP if host_network else "10.42.0.17"
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        state: JsonObj
        if started:
            state = {"running": {"startedAt": now}}
        elif phase in ("Succeeded", "Failed"):
            state = {
                "terminated": {
                    "exitCode": 0 if phase == "Succeeded" else 1,
                    "reason": "Completed" if phase == "Succeeded" else "Error",
                    "startedAt": now,
                    "finishedAt": now,
                }
            }
        else:
            state = {"waiting": {"reason": waiting_reason or "ContainerCreating"}}
        status["containerStatuses"] = [
            {
                "name": container_name,
                "image": image,
                "imageID": ""
                if phase == "Pending"
                else f"{image}@sha256:{uuid.uuid5(uuid.NAMESPACE_URL, image).hex * 2}",
                "ready": ready,
                "started": started,
                "restartCount": 0,
                "state": state,
            }
        ]
    else:
        status["conditions"] = [cond("PodScheduled", False, "Unschedulable")]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": spec,
        "status": status,
    }


def _pod_template(
    labels: dict[str, str], image: str, gpu_request: int = 0, gpu_resource: str = GPU
) -> JsonObj:
    resources: JsonObj = {}
    if gpu_request:
        resources = {
            "limits": {gpu_resource: str(gpu_request)},
            "requests": {gpu_resource: str(gpu_request)},
        }
    return {
        "metadata": {"labels": dict(labels)},
        "spec": {
            "containers": [{"name": "main", "image": image, "resources": resources}]
        },
    }


def make_daemonset(
    name: str, namespace: str, *, labels: dict[str, str], image: str, nodes: int = 1
) -> JsonObj:
    """A DaemonSet whose pods run on ``nodes`` nodes."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "template": _pod_template(labels, image),
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "revisionHistoryLimit": 10,
        },
        "status": {
            "currentNumberScheduled": nodes,
            "desiredNumberScheduled": nodes,
            "numberAvailable": nodes,
            "numberMisscheduled": 0,
            "numberReady": nodes,
            "observedGeneration": 1,
            "updatedNumberScheduled": nodes,
        },
    }


def make_replicaset(
    name: str,
    namespace: str,
    *,
    labels: dict[str, str],
    image: str,
    replicas: int = 1,
    gpu_request: int = 0,
    gpu_resource: str = GPU,
) -> JsonObj:
    """A ReplicaSet (as a Deployment would own it)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": _pod_template(labels, image, gpu_request, gpu_resource),
        },
        "status": {
            "replicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
            "fullyLabeledReplicas": replicas,
            "observedGeneration": 1,
        },
    }


def make_pdb(
    name: str,
    namespace: str,
    *,
    match_labels: dict[str, str] | None = None,
    selector: JsonObj | None = None,
    min_available: int | str | None = None,
    max_unavailable: int | str | None = None,
) -> JsonObj:
    """A policy/v1 PodDisruptionBudget."""
    spec: JsonObj = {
        "selector": selector
        if selector is not None
        else {"matchLabels": dict(match_labels or {})}
    }
    if min_available is not None:
        spec["minAvailable"] = min_available
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def make_event(
    name: str,
    namespace: str,
    *,
    involved: JsonObj,
    reason: str,
    message: str,
    event_type: str = "Normal",
    component: str = "kubelet",
    host: str | None = None,
    count: int = 1,
    series: bool = False,
    age: float = 0.0,
) -> JsonObj:
    """A core/v1 Event about ``involved`` (a full object), as the legacy
    recorder (client-go tools/record) writes it: firstTimestamp,
    lastTimestamp, count and source. With ``series``, as an events.k8s.io/v1
    recorder writes it (client-go tools/events), read through core/v1:
    eventTime, series (count, lastObservedTime) once it repeated, the
    reporting controller and instance, no first/lastTimestamp, no count.
    ``age``: seconds since it was first seen."""
    if series:
        event: JsonObj = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": _reference(involved),
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {},
            "firstTimestamp": None,
            "lastTimestamp": None,
            "eventTime": micro_ago(age),
            "reportingComponent": component,
            "reportingInstance": host or "",
            "action": reason,
        }
        if count > 1:
            event["series"] = {"count": count, "lastObservedTime": now_micro()}
        return event
    first = rfc3339_ago(age)
    source: JsonObj = {"component": component}
    if host:
        source["host"] = host
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": _reference(involved),
        "reason": reason,
        "message": message,
        "type": event_type,
        "source": source,
        "reportingComponent": component,
        "reportingInstance": host or "",
        "firstTimestamp": first,
        "lastTimestamp": first if count == 1 else now_rfc3339(),
        "count": count,
    }


def _reference(involved: JsonObj) -> JsonObj:
    """An ObjectReference to a full object."""
    meta = involved.get("metadata") or {}
    return {
        "apiVersion": involved.get("apiVersion", "v1"),
        "kind": involved.get("kind", "Pod"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }


def make_namespace(name: str) -> JsonObj:
    """An active Namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }


# The taint kube-controller-manager's node lifecycle controller keeps on a
# cordoned node (spec.unschedulable), and what the scheduler's
# NodeUnschedulable filter checks a pod's tolerations against.
UNREACHABLE_NO_EXECUTE: Final[JsonObj] = {
    "key": "node.kubernetes.io/unreachable",
    "effect": "NoExecute",
}
UNSCHEDULABLE_TAINT: Final[JsonObj] = {
    "key": "node.kubernetes.io/unschedulable",
    "effect": "NoSchedule",
}


def tolerates(tolerations: list[JsonObj] | None, taint: JsonObj) -> bool:
    """Whether any toleration tolerates ``taint``: k8s.io/api core/v1
    toleration.go, ToleratesTaint (an empty effect or key matches all; the
    operator Exists matches any value, Equal or empty the same value)."""
    for toleration in tolerations or []:
        effect = toleration.get("effect") or ""
        key = toleration.get("key") or ""
        if effect and effect != taint.get("effect"):
            continue
        if key and key != taint.get("key"):
            continue
        operator = toleration.get("operator") or "Equal"
        if operator == "Exists" or (
            operator == "Equal"
            and (toleration.get("value") or "") == (taint.get("value") or "")
        ):
            return True
    return False
