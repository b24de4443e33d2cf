"""Label and field selectors with the upstream syntax and matching rules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
import re
from typing import Any

JsonObj = dict[str, Any]


class SelectorError(ValueError):
    """A selector that the API server would reject with 400 BadRequest."""


@dataclass(frozen=True)
class Requirement:
    """One label requirement: key, operator and values."""

    key: str
    operator: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether the labels satisfy this requirement."""
        present = self.key in labels
        value = labels.get(self.key)
        match self.operator:
            case "=" | "in":
                return present and value in self.values
            case "!=" | "notin":
                return not present or value not in self.values
            case "exists":
                return present
            case "!":
                return not present
        raise AssertionError(self.operator)


_KEY_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _check_key(key: str, text: str) -> str:
    if not _KEY_RE.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise SelectorError(
            f"unable to parse requirement: invalid label key {key!r} in {text!r}"
        )
    return key


def _check_value(value: str, text: str) -> str:
    if not _VALUE_RE.match(value) or len(value) > 63:
        raise SelectorError(
            f"unable to parse requirement: invalid label value {value!r} in {text!r}"
        )
    return value


_SET_RE = re.compile(r"^\s*(\S+)\s+(in|notin)\s*\((.*)\)\s*$")


def parse_label_selector(text: str) -> list[Requirement]:
    """Parse a labelSelector query parameter (an empty text selects all)."""
    requirements: list[Requirement] = []
    if not text.strip():
        return requirements
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise SelectorError(
                f"unable to parse requirement: empty requirement in {text!r}"
            )
        if set_match := _SET_RE.match(part):
            key, op, values = set_match.groups()
            vals = tuple(_check_value(v.strip(), text) for v in values.split(","))
            requirements.append(Requirement(_check_key(key, text), op, vals))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            requirements.append(
                Requirement(
                    _check_key(key.strip(), text),
                    "!=",
                    (_check_value(value.strip(), text),),
                )
            )
        elif "=" in part:
            key, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            requirements.append(
                Requirement(
                    _check_key(key.strip(), text),
                    "=",
                    (_check_value(value.strip(), text),),
                )
            )
        elif part.startswith("!"):
            requirements.append(Requirement(_check_key(part[1:].strip(), text), "!"))
        else:
            requirements.append(Requirement(_check_key(part, text), "exists"))
    return requirements


def labels_match(
    requirements: list[Requirement], labels: Mapping[str, str] | None
) -> bool:
    """Whether every requirement matches the labels."""
    labels = labels or {}
    return all(req.matches(labels) for req in requirements)


def label_selector_object_matches(
    selector: JsonObj | None, labels: Mapping[str, str] | None
) -> bool:
    """Match a metav1.LabelSelector object (matchLabels + matchExpressions).

    As upstream: a null selector matches nothing, an empty one matches everything.
    """
    if selector is None:
        return False
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        op = expr["operator"]
        values = tuple(expr.get("values") or ())
        operator = {
            "In": "in",
            "NotIn": "notin",
            "Exists": "exists",
            "DoesNotExist": "!",
        }[op]
        if not Requirement(expr["key"], operator, values).matches(labels):
            return False
    return True


@dataclass(frozen=True)
class FieldRequirement:
    """One field requirement: field, "=" or "!=", value."""

    field: str
    operator: str
    value: str


def parse_field_selector(text: str) -> list[FieldRequirement]:
    """Parse a fieldSelector query parameter (=, ==, != joined by commas)."""
    requirements: list[FieldRequirement] = []
    if not text.strip():
        return requirements
    for raw in text.split(","):
        part = raw.strip()
        if "!=" in part:
            field, value = part.split("!=", 1)
            operator = "!="
        elif "==" in part:
            field, value = part.split("==", 1)
            operator = "="
        elif "=" in part:
            field, value = part.split("=", 1)
            operator = "="
        else:
            raise SelectorError(
                f"invalid selector: '{text}'; can't understand '{part}'"
            )
        requirements.append(FieldRequirement(field.strip(), operator, value.strip()))
    return requirements


FieldGetter = Callable[[JsonObj], str]


def _nested(path: str, default: str = "") -> FieldGetter:
    keys = path.split(".")

    def get(obj: JsonObj) -> str:
        value: Any = obj
        for key in keys:
            if not isinstance(value, dict) or key not in value or value[key] is None:
                return default
            value = value[key]
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return get


# The field labels each resource supports upstream (the rest is 400).
_COMMON: dict[str, FieldGetter] = {
    "metadata.name": _nested("metadata.name"),
    "metadata.namespace": _nested("metadata.namespace"),
}
FIELD_LABELS: dict[str, dict[str, FieldGetter]] = {
    "pods": {
        **_COMMON,
        "spec.nodeName": _nested("spec.nodeName"),
        "spec.restartPolicy": _nested("spec.restartPolicy"),
        "spec.schedulerName": _nested("spec.schedulerName"),
        "spec.serviceAccountName": _nested("spec.serviceAccountName"),
        "spec.hostNetwork": _nested("spec.hostNetwork", "false"),
        "status.phase": _nested("status.phase"),
        "status.podIP": _nested("status.podIP"),
        "status.nominatedNodeName": _nested("status.nominatedNodeName"),
    },
    "nodes": {**_COMMON, "spec.unschedulable": _nested("spec.unschedulable", "false")},
    "events": {
        **_COMMON,
        "involvedObject.kind": _nested("involvedObject.kind"),
        "involvedObject.namespace": _nested("involvedObject.namespace"),
        "involvedObject.name": _nested("involvedObject.name"),
        "involvedObject.uid": _nested("involvedObject.uid"),
        "involvedObject.apiVersion": _nested("involvedObject.apiVersion"),
        "involvedObject.resourceVersion": _nested("involvedObject.resourceVersion"),
        "involvedObject.fieldPath": _nested("involvedObject.fieldPath"),
        "reason": _nested("reason"),
        "reportingComponent": _nested("reportingComponent"),
        "source": _nested("source.component"),
        "type": _nested("type"),
    },
    "namespaces": {**_COMMON, "status.phase": _nested("status.phase")},
}


def check_field_selector(resource: str, requirements: list[FieldRequirement]) -> None:
    """Reject field labels the resource does not support, like upstream."""
    supported = FIELD_LABELS.get(resource, _COMMON)
    for req in requirements:
        if req.field not in supported:
            raise SelectorError(
                f"field label not supported: {req.field}"
                if resource in FIELD_LABELS
                else f'"{req.field}" is not a known field selector: only "metadata.name", "metadata.namespace"'
            )


def fields_match(
    resource: str, requirements: list[FieldRequirement], obj: JsonObj
) -> bool:
    """Whether the object satisfies every field requirement."""
    supported = FIELD_LABELS.get(resource, _COMMON)
    for req in requirements:
        value = supported[req.field](obj)
        if (value == req.value) != (req.operator == "="):
            return False
    return True
