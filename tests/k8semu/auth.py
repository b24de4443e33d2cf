"""Bearer tokens and RBAC-like rules (PolicyRule semantics)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """Like rbac/v1 PolicyRule: api groups, resources (``pods/eviction``), verbs."""

    verbs: frozenset[str]
    resources: frozenset[str]
    api_groups: frozenset[str] = frozenset({""})
    resource_names: frozenset[str] = frozenset()

    def allows(self, verb: str, group: str, resource: str, name: str | None) -> bool:
        """Whether the rule grants this request (resource includes the subresource)."""
        if "*" not in self.verbs and verb not in self.verbs:
            return False
        if "*" not in self.api_groups and group not in self.api_groups:
            return False
        if "*" not in self.resources and resource not in self.resources:
            _base, _, sub = resource.partition("/")
            if not sub or f"*/{sub}" not in self.resources:
                return False
        return not self.resource_names or (
            name is not None and name in self.resource_names
        )


def rule(
    verbs: Iterable[str],
    resources: Iterable[str],
    api_groups: Iterable[str] = ("",),
    resource_names: Iterable[str] = (),
) -> Rule:
    """Build a Rule from plain iterables."""
    return Rule(
        frozenset(verbs),
        frozenset(resources),
        frozenset(api_groups),
        frozenset(resource_names),
    )


# What the GPU Handoff integration's ServiceAccount is granted: nothing more
# (docs/cluster-setup.md's ClusterRole; tests/test_docs.py compares them).
PRODUCT_RULES: tuple[Rule, ...] = (
    rule(["get", "list", "watch", "patch"], ["nodes"]),
    rule(["get", "list"], ["pods"]),
    rule(["create"], ["pods/eviction"]),
    rule(["get"], ["daemonsets"], ["apps"]),
    rule(["get"], ["leases"], ["coordination.k8s.io"]),
    rule(["list"], ["events"]),
    rule(["list"], ["poddisruptionbudgets"], ["policy"]),
    rule(["create", "patch"], ["events"], ["events.k8s.io"]),
)

ALL_RULES: tuple[Rule, ...] = (rule(["*"], ["*"], ["*"]),)


@dataclass
class User:
    """An authenticated identity and what it may do."""

    name: str
    rules: tuple[Rule, ...]

    def can(self, verb: str, group: str, resource: str, name: str | None) -> bool:
        """Whether any rule allows the request."""
        return any(r.allows(verb, group, resource, name) for r in self.rules)


def forbidden_message(
    *,
    user: str,
    verb: str,
    group: str,
    resource: str,
    subresource: str | None,
    namespace: str | None,
    name: str | None,
) -> str:
    """The apiserver's Forbidden message, word for word."""
    full = f"{resource}/{subresource}" if subresource else resource
    qualified = f"{resource}.{group}" if group else resource
    if namespace:
        why = f'User "{user}" cannot {verb} resource "{full}" in API group "{group}" in the namespace "{namespace}"'
    else:
        why = f'User "{user}" cannot {verb} resource "{full}" in API group "{group}" at the cluster scope'
    if name:
        return f'{qualified} "{name}" is forbidden: {why}'
    return f"{qualified} is forbidden: {why}"
