"""Block hashes: the one hash space shared by the router index and every worker.

For the full blocks of a token sequence:
    h[i] = xxh3_64( le64(h[i-1]) || le32(tokens of block i) )
with h[-1] a seed derived from the model id and an optional cache salt. Only
full blocks are hashed: a partial block can still change, so it is never shared.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

DEFAULT_BLOCK_SIZE = 16


def hash_seed(model_id: str, cache_salt: str | None = None) -> int:
    """h[-1]: different models (or tenants, via the salt) never share blocks."""
    material = b"splitserve-block-hash-v1\0" + model_id.encode() + b"\0" + (cache_salt or "").encode()
    return xxhash.xxh3_64_intdigest(material)


def _le32(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (array is ~2x faster than numpy here)."""
    a = array("I", tokens)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    return xxhash.xxh3_64_intdigest(int(parent).to_bytes(8, "little") + _le32(block_tokens))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    start_parent: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Chained hashes of every full block of `token_ids`.

    `start_block`/`start_parent` continue a chain that was already computed for
    the first `start_block` blocks (the parent is the last hash of that chain).
    """
    n_full = len(token_ids) // block_size
    if start_block >= n_full:
        return []
    raw = _le32(token_ids[: n_full * block_size])
    stride = 4 * block_size
    parent = seed if start_parent is None else start_parent
    out: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for i in range(start_block, n_full):
        parent = digest(parent.to_bytes(8, "little") + raw[i * stride : (i + 1) * stride])
        out.append(parent)
    return out
