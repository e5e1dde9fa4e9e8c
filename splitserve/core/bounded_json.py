"""JSON from strangers, parsed only when it is nested no deeper than any real request needs.

Python's json parser recurses once per level of nesting and stops with RecursionError at the
interpreter's limit (~1,000). Reaching that limit is itself the harm: a garbage collection that
happens at that depth runs other objects' finalizers with no stack left, they fail with
RecursionError ("Exception ignored in ..."), and whatever they were to clean up (a socket, a
stream) is not cleaned up. A body `[[[[...` 20,000 deep did exactly that in the router's
process (the HTTP fuzz test caught one). So the depth is measured first, without recursion,
and deeper text is refused before the parser sees it.

128 levels, as serde_json's default (which llguidance uses for schemas): an OpenAI request needs
a handful, a JSON schema with dozens of levels inside a tool still fits.

`load_file` is the same for the JSON files a checkpoint ships (config.json, tokenizer.json, the
shard index), read at start-up: it also refuses a file larger than `max_bytes` unread, so a
hostile checkpoint can neither crash the start-up check nor make it read gigabytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

MAX_DEPTH = 128
MAX_CONFIG_BYTES = 16 * 2**20  # config.json and the like: real ones are a few KB (Mixtral's: 1 KB)
MAX_TOKENIZER_BYTES = 256 * 2**20  # tokenizer.json: Gemma 3's is 33 MB, the largest shipped are under 100 MB

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int32)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_CHUNK = 1 << 20  # brackets per step of the running sum: deep text is refused after its first


class NestedTooDeeply(json.JSONDecodeError):
    """Deeper than `max_depth`; a JSONDecodeError, so that callers that refuse bad JSON refuse it."""

    def __init__(self, text: str | bytes, max_depth: int) -> None:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        super().__init__(f"nested deeper than the {max_depth} levels allowed", doc, 0)
        self.args = (self.msg,)  # no "line 1 column 1": the depth is the whole story


class FileTooLarge(json.JSONDecodeError):
    """A JSON file larger than allowed, refused unread; a JSONDecodeError, as NestedTooDeeply."""

    def __init__(self, path: str | os.PathLike, size: int, max_bytes: int) -> None:
        super().__init__(f"{size} bytes, more than the {max_bytes} allowed for this file", "", 0)
        self.args = (self.msg,)


def deepest(text: str | bytes, stop_above: int | None = None) -> int:
    """How deep arrays and objects nest in `text`, brackets inside strings not counted; with
    `stop_above`, any depth beyond it once found. Made for JSON; on text that is not, an upper
    bound up to where a parser would give up. All of it C loops (bytes methods, numpy): a 16 MB
    body costs tens of milliseconds at most."""
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    if b"\\" in raw:  # JSON escapes are a backslash and one character: drop \\ pairs, then \"
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(raw.split(b'"')[0::2])  # every other piece lies between quotes
    brackets = np.frombuffer(outside_strings.translate(None, _NOT_BRACKETS), np.uint8)
    depth, level = 0, 0
    for start in range(0, len(brackets), _CHUNK):
        running = np.cumsum(_STEP[brackets[start:start + _CHUNK]]) + level
        depth, level = max(depth, int(running.max())), int(running[-1])
        if stop_above is not None and depth > stop_above:
            break
    return depth


def too_deep(text: str | bytes, max_depth: int = MAX_DEPTH) -> bool:
    openers = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    return openers > max_depth and deepest(text, stop_above=max_depth) > max_depth  # fewer: it cannot be deeper


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, **kwargs):
    """`json.loads`, refusing text nested deeper than `max_depth` (NestedTooDeeply) unparsed."""
    if too_deep(text, max_depth):
        raise NestedTooDeeply(text, max_depth)
    return json.loads(text, **kwargs)


def load_file(path: str | os.PathLike, *, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_DEPTH):
    """The JSON value of the file at `path`: FileTooLarge over `max_bytes` (unread),
    NestedTooDeeply deeper than `max_depth` (unparsed), else as `json.loads` (OSError,
    UnicodeDecodeError and JSONDecodeError as it raises them)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise FileTooLarge(path, size, max_bytes)
    with path.open("rb") as f:
        raw = f.read(max_bytes + 1)  # the file may have grown since stat()
    if len(raw) > max_bytes:
        raise FileTooLarge(path, len(raw), max_bytes)
    return loads(raw.decode("utf-8"), max_depth=max_depth)
