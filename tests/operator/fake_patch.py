"""The patch formats the fake API server applies: JSON merge patch (RFC 7386) and
JSON patch (RFC 6902, the operations kopf sends)."""

from __future__ import annotations

import copy


def merge(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch."""
    out = copy.deepcopy(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict):  # into a missing or non-object target too: nulls never stored
            out[k] = merge(out[k] if isinstance(out.get(k), dict) else {}, v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class PatchConflict(Exception):
    pass


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 JSON patch: add, replace, remove, test (what kopf sends)."""
    out = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent = out
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        if op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise PatchConflict(f"test failed at {op['path']}")
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"]) \
                    if op["op"] == "add" else parent.__setitem__(int(last), op["value"])
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            parent.pop(int(last) if isinstance(parent, list) else last)
    return out
