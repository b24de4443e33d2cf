"""The three PATCH flavours the API server accepts for built-in types.

- JSON merge patch (RFC 7386): maps merge, ``null`` deletes, lists replace.
- Strategic merge patch: like merge patch, but lists that upstream declares with
  ``patchStrategy: merge`` merge by their ``patchMergeKey`` (conditions by
  ``type``, containers by ``name``...), primitive lists with that strategy
  (finalizers) merge as sets, and the ``$patch`` (replace / delete / merge)
  and ``$deleteFromPrimitiveList/<field>`` directives work.
- JSON patch (RFC 6902): add, remove, replace, move, copy, test.
"""

from __future__ import annotations

import copy
from typing import Any

JsonObj = dict[str, Any]


class PatchError(ValueError):
    """A patch that cannot be applied (422 Invalid / 400 BadRequest upstream)."""


# Upstream's patchMergeKey for list fields with patchStrategy "merge", keyed by
# the field name (good enough for the kinds served here).
MERGE_KEYS: dict[str, str | None] = {
    "conditions": "type",
    "addresses": "type",
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "tolerations": None,  # atomic upstream
    "finalizers": "",  # primitive list merged as a set
}


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: JsonObj = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch for the fields of built-in types."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result: JsonObj = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key == "$patch" or key.startswith("$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
            continue
        if key.startswith("$setElementOrder/"):
            continue
        if value is None:
            result.pop(key, None)
        elif (
            isinstance(value, list)
            and key in MERGE_KEYS
            and MERGE_KEYS[key] is not None
        ):
            result[key] = _merge_list(
                result.get(key) or [], value, MERGE_KEYS[key] or ""
            )
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(target: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    if not merge_key:  # primitive list: union, keeping order
        merged = list(target)
        merged.extend(v for v in patch if v not in merged)
        return merged
    if any(
        isinstance(item, dict) and item.get("$patch") == "replace" for item in patch
    ):
        return [
            copy.deepcopy(i)
            for i in patch
            if not (isinstance(i, dict) and "$patch" in i)
        ]
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(
                f"map: {item!r} does not contain declared merge key: {merge_key}"
            )
        index = next(
            (
                i
                for i, old in enumerate(result)
                if isinstance(old, dict) and old.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(
                {k: copy.deepcopy(v) for k, v in item.items() if k != "$patch"}
            )
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise PatchError(f"doc is missing path: {path!r}")
    return node


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise PatchError(f"doc is missing path: {path!r}")


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    parent = _parent(doc, tokens, path)
    last = tokens[-1] if tokens else ""
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise PatchError(f"Unable to remove nonexistent key: {last}: missing value")


def _add(doc: Any, path: str, value: Any, *, replace: bool) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise PatchError(
                f"replace operation does not apply: doc is missing key: {path}"
            )
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(last)] = value
            else:
                parent.insert(int(last), value)
        else:
            raise PatchError(
                f"add operation does not apply: doc is missing path: {path!r}"
            )
    else:
        raise PatchError(f"doc is missing path: {path!r}")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902."""
    if not isinstance(operations, list):
        raise PatchError(
            "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
        )
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid JSON patch operation: {op!r}")
        path = op["path"]
        match op["op"]:
            case "add":
                doc = _add(doc, path, copy.deepcopy(op.get("value")), replace=False)
            case "replace":
                doc = _add(doc, path, copy.deepcopy(op.get("value")), replace=True)
            case "remove":
                _remove(doc, path)
            case "move":
                value = _remove(doc, op["from"])
                doc = _add(doc, path, value, replace=False)
            case "copy":
                doc = _add(
                    doc, path, copy.deepcopy(_get(doc, op["from"])), replace=False
                )
            case "test":
                if _get(doc, path) != op.get("value"):
                    raise PatchError(f"testing value {path} failed: test failed")
            case other:
                raise PatchError(f"Unexpected kind: {other}")
    return doc
