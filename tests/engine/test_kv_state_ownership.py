"""The block manager (engine/block_manager.py) is the one owner of KV block state: no other
module of splitserve/ reaches into its private fields or transitions. Before this held, the
offload load-back, the peer prefix pull and the overlapped decode each edited the free list,
the ref counts and the hash map themselves (three copies of "publish a block and emit its
stored event"), so a change of one rule had to be found in four places."""

import ast
from pathlib import Path

import splitserve
from splitserve.engine.block_manager import BlockManager

PACKAGE = Path(splitserve.__file__).parent
OWNER = PACKAGE / "engine" / "block_manager.py"


def private_names() -> set[str]:
    """The manager's private fields and methods, read from a live instance and its class."""
    names = set(vars(BlockManager(4, 2))) | set(vars(BlockManager))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reaching_in(source: str, names: set[str]) -> list[str]:
    """`x._name` / `getattr(x, "_name")` for a manager-private `_name` on anything but `self`:
    each as 'line: text'. (A class's own `self._events` is its own field, not the manager's.)"""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                hits.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            hits.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(hits)]


def test_no_module_but_the_manager_touches_its_state():
    names = private_names()
    assert {"_free", "_ref_counts", "_hash_to_block", "_block_hash", "_events", "_take_free",
            "_take_cached", "_publish"} <= names  # (the scan looks for these)
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != OWNER:
            hits = reaching_in(path.read_text(), names)
            if hits:
                offenders[str(path.relative_to(PACKAGE.parent))] = hits
    assert offenders == {}, "KV block state changes only through BlockManager's public methods"


def test_the_scan_catches_the_old_load_back():
    """What engine/kv_offload/load_back.py did before the manager owned every transition."""
    old = """
def load_from_tiers(bm, seq, hits, usable):
    b = bm._take_free()
    bm._ref_counts[b] = 0
    bm._free.move_to_end(b, last=False)
    getattr(bm, "_hash_to_block")[h] = b
    self._events.append(None)
"""
    assert reaching_in(old, private_names()) == [
        "3: bm._take_free", "4: bm._ref_counts", "5: bm._free", "6: getattr(bm, '_hash_to_block')"]
