"""Patch flavours and selector parsing, without HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from .patch import PatchError, json_merge_patch, json_patch, strategic_merge_patch
from .selectors import (
    SelectorError,
    label_selector_object_matches,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)

NODE: dict[str, Any] = {
    "metadata": {"name": "n", "finalizers": ["a"], "labels": {"x": "1"}},
    "status": {
        "conditions": [
            {"type": "MemoryPressure", "status": "False"},
            {"type": "Ready", "status": "True"},
        ]
    },
}


def test_strategic_merge_by_key_delete_and_replace() -> None:
    """Conditions merge by type, $patch delete removes one, finalizers union."""
    patched = strategic_merge_patch(
        NODE,
        {
            "metadata": {"finalizers": ["b", "a"]},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False"},
                    {"type": "MemoryPressure", "$patch": "delete"},
                    {"type": "DiskPressure", "status": "False"},
                ]
            },
        },
    )
    assert patched["metadata"]["finalizers"] == ["a", "b"]
    assert patched["status"]["conditions"] == [
        {"type": "Ready", "status": "False"},
        {"type": "DiskPressure", "status": "False"},
    ]
    replaced = strategic_merge_patch(
        NODE, {"metadata": {"labels": {"$patch": "replace", "y": "2"}}}
    )
    assert replaced["metadata"]["labels"] == {"y": "2"}
    removed = strategic_merge_patch(
        NODE, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}}
    )
    assert removed["metadata"]["finalizers"] == []
    with pytest.raises(PatchError):
        strategic_merge_patch(NODE, {"status": {"conditions": [{"status": "True"}]}})
    assert (
        NODE["status"]["conditions"][0]["type"] == "MemoryPressure"
    )  # input untouched


def test_merge_patch_replaces_lists() -> None:
    """RFC 7386: lists are replaced whole, null deletes."""
    patched = json_merge_patch(
        NODE,
        {"status": {"conditions": [{"type": "Ready"}]}, "metadata": {"labels": None}},
    )
    assert patched["status"]["conditions"] == [{"type": "Ready"}]
    assert "labels" not in patched["metadata"]


def test_json_patch_operations() -> None:
    """move, copy, test, array index and append."""
    doc = json_patch(
        NODE,
        [
            {"op": "copy", "from": "/metadata/labels/x", "path": "/metadata/labels/z"},
            {"op": "move", "from": "/metadata/labels/x", "path": "/metadata/labels/w"},
            {"op": "add", "path": "/metadata/finalizers/-", "value": "c"},
            {"op": "add", "path": "/metadata/finalizers/0", "value": "0"},
            {"op": "test", "path": "/status/conditions/1/type", "value": "Ready"},
        ],
    )
    assert doc["metadata"]["labels"] == {"z": "1", "w": "1"}
    assert doc["metadata"]["finalizers"] == ["0", "a", "c"]
    with pytest.raises(PatchError):
        json_patch(NODE, [{"op": "remove", "path": "/metadata/nope"}])
    with pytest.raises(PatchError):
        json_patch(NODE, {"op": "add"})


@pytest.mark.parametrize(
    ("text", "labels", "expected"),
    [
        ("", {}, True),
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("a in (b, c)", {"a": "c"}, True),
        ("a notin (b,c),d", {"a": "x", "d": ""}, True),
        ("a notin (b,c),d", {"a": "x"}, False),
        ("!a", {"a": "1"}, False),
        ("example.com/role=gpu", {"example.com/role": "gpu"}, True),
    ],
)
def test_label_selector(text: str, labels: dict[str, str], expected: bool) -> None:
    """The operators of upstream's label selector grammar."""
    assert labels_match(parse_label_selector(text), labels) is expected


@pytest.mark.parametrize("text", ["a in (b", "a=b=c d", "=b", "a,,b"])
def test_bad_label_selectors(text: str) -> None:
    """Malformed requirements are rejected."""
    with pytest.raises(SelectorError):
        parse_label_selector(text)


def test_field_selector_and_selector_objects() -> None:
    """Field selector operators; LabelSelector objects: null matches nothing, {} everything."""
    reqs = parse_field_selector(
        "spec.nodeName=n,status.phase!=Running,metadata.name==x"
    )
    assert [(r.field, r.operator, r.value) for r in reqs] == [
        ("spec.nodeName", "=", "n"),
        ("status.phase", "!=", "Running"),
        ("metadata.name", "=", "x"),
    ]
    with pytest.raises(SelectorError):
        parse_field_selector("spec.nodeName")
    assert label_selector_object_matches(None, {"a": "b"}) is False
    assert label_selector_object_matches({}, {"a": "b"}) is True
    selector = {
        "matchLabels": {"app": "web"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["front"]},
            {"key": "canary", "operator": "DoesNotExist"},
        ],
    }
    assert (
        label_selector_object_matches(selector, {"app": "web", "tier": "front"}) is True
    )
    assert (
        label_selector_object_matches(
            selector, {"app": "web", "tier": "front", "canary": "1"}
        )
        is False
    )
