"""The resource types the emulator serves, with their discovery data."""

from __future__ import annotations

from dataclasses import dataclass

STANDARD_VERBS = (
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
)


@dataclass(frozen=True)
class ResourceType:
    """One served resource (a REST collection)."""

    group: str  # "" for the core group
    version: str
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        """The apiVersion of its objects."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``pods`` or ``daemonsets.apps``, as upstream prints it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


CORE_EVENTS = ResourceType("", "v1", "events", "event", "Event", True, ("ev",))
# The same Events again: pkg/registry/events/rest/storage_events.go serves
# them from the core registry's storage (pkg/registry/core/event/storage),
# one etcd key and one resourceVersion per Event, converted on the way in
# and out (pkg/apis/events/v1/conversion.go). See STORED_AS.
EVENTS_V1 = ResourceType(
    "events.k8s.io", "v1", "events", "event", "Event", True, ("ev",)
)

RESOURCES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "namespace", "Namespace", False, ("ns",)),
    ResourceType("", "v1", "nodes", "node", "Node", False, ("no",)),
    ResourceType("", "v1", "pods", "pod", "Pod", True, ("po",)),
    CORE_EVENTS,
    EVENTS_V1,
    ResourceType("apps", "v1", "daemonsets", "daemonset", "DaemonSet", True, ("ds",)),
    ResourceType(
        "apps", "v1", "replicasets", "replicaset", "ReplicaSet", True, ("rs",)
    ),
    ResourceType(
        "apps", "v1", "deployments", "deployment", "Deployment", True, ("deploy",)
    ),
    ResourceType(
        "apps", "v1", "statefulsets", "statefulset", "StatefulSet", True, ("sts",)
    ),
    ResourceType(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "poddisruptionbudget",
        "PodDisruptionBudget",
        True,
        ("pdb",),
    ),
    ResourceType("coordination.k8s.io", "v1", "leases", "lease", "Lease", True),
)

# Subresources: (parent plural, subresource) -> (kind, group, version, verbs)
SUBRESOURCES: dict[tuple[str, str], tuple[str, str, str, tuple[str, ...]]] = {
    ("nodes", "status"): ("Node", "", "v1", ("get", "patch", "update")),
    ("pods", "status"): ("Pod", "", "v1", ("get", "patch", "update")),
    ("pods", "eviction"): ("Eviction", "policy", "v1", ("create",)),
    ("poddisruptionbudgets", "status"): (
        "PodDisruptionBudget",
        "policy",
        "v1",
        ("get", "patch", "update"),
    ),
}

# In kube-apiserver's order, by group priority (pkg/controlplane/apiserver/
# aggregator.go DefaultGenericAPIServicePriorities and the kube-apiserver's
# additions: apps 17800, events.k8s.io 17750, policy 17600,
# coordination.k8s.io 16500).
GROUPS: tuple[tuple[str, str], ...] = (
    ("apps", "v1"),
    ("events.k8s.io", "v1"),
    ("policy", "v1"),
    ("coordination.k8s.io", "v1"),
)


# A resource served from another one's storage.
STORED_AS: dict[ResourceType, ResourceType] = {EVENTS_V1: CORE_EVENTS}


def stored_resource(rt: ResourceType) -> ResourceType:
    """The resource whose storage holds ``rt``'s objects (itself mostly)."""
    return STORED_AS.get(rt, rt)


def find_resource(group: str, version: str, plural: str) -> ResourceType | None:
    """The served resource type with this group, version and plural."""
    for rt in RESOURCES:
        if rt.group == group and rt.version == version and rt.plural == plural:
            return rt
    return None


def resource_for_kind(kind: str) -> ResourceType:
    """The resource type of a kind (``Pod`` -> pods)."""
    for rt in RESOURCES:
        if rt.kind == kind:
            return rt
    raise KeyError(kind)


def api_resource_list(group: str, version: str) -> dict[str, object]:
    """The APIResourceList served at /api/v1 or /apis/GROUP/VERSION."""
    resources: list[dict[str, object]] = []
    for rt in RESOURCES:
        if rt.group != group or rt.version != version:
            continue
        entry: dict[str, object] = {
            "name": rt.plural,
            "singularName": rt.singular,
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": list(STANDARD_VERBS),
        }
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        resources.append(entry)
        for (parent, sub), (
            kind,
            sub_group,
            sub_version,
            verbs,
        ) in SUBRESOURCES.items():
            if parent != rt.plural:
                continue
            sub_entry: dict[str, object] = {
                "name": f"{parent}/{sub}",
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": kind,
                "verbs": list(verbs),
            }
            if sub_group != group:
                sub_entry["group"] = sub_group
                sub_entry["version"] = sub_version
            resources.append(sub_entry)
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def api_group(name: str, version: str) -> dict[str, object]:
    """One APIGroup entry."""
    gv = {"groupVersion": f"{name}/{version}", "version": version}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


def api_group_list() -> dict[str, object]:
    """The APIGroupList served at /apis."""
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [api_group(name, version) for name, version in GROUPS],
    }
