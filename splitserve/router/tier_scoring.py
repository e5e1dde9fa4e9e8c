"""How much of a prompt each worker could serve without recomputing it, by KV tier.

A worker reports the blocks of its device pool under its own id and the blocks of its
offload tiers (host memory, disk: engine/kv_offload/) under `tier_holder(worker)` in the
same radix index, so one `RadixIndex.match` answers both. A device block is served as is;
a tier block is loaded back (cheaper than a prefill, dearer than a device hit). Pure
functions: the policy turns these into routing credit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

TIER_SUFFIX = "@offload"


def tier_holder(worker_id: str) -> str:
    """The index holder standing for `worker_id`'s offload tiers."""
    return worker_id + TIER_SUFFIX


def is_tier_holder(holder: str) -> bool:
    return holder.endswith(TIER_SUFFIX)


def reachable_blocks(matched: Mapping[str, int], worker_id: str) -> int:
    """Leading prompt blocks `worker_id` holds on device or in a tier (a tier run is
    reported from the first block: a block freed from the device was written down)."""
    return max(matched.get(worker_id, 0), matched.get(worker_id + TIER_SUFFIX, 0))


def prefix_scores(matched: Mapping[str, int], workers: Iterable[str], tier_credit: float,
                  peer_credit: float = 0.0) -> dict[str, float]:
    """Per worker, its cached prefix in device-block equivalents: a device block counts 1,
    a block only in its tiers `tier_credit`, a block only a peer holds (it can be pulled)
    `peer_credit`, a miss 0 (credits in 0..1, peer below tier)."""
    workers = list(workers)
    reach = {w: reachable_blocks(matched, w) for w in workers}
    best = max(reach.values(), default=0)
    scores = {}
    for w in workers:
        device = matched.get(w, 0)
        scores[w] = device + tier_credit * (reach[w] - device) + peer_credit * (best - reach[w])
    return scores


def pull_source(matched: Mapping[str, int], chosen: str, peers: Iterable[str],
                min_blocks: int) -> tuple[str, int] | None:
    """(peer, blocks) to pull the prompt's prefix from: the peer reaching the most leading
    blocks (device blocks first on a tie, then by id), when that is at least `min_blocks`
    more than `chosen` reaches itself; None otherwise."""
    own = reachable_blocks(matched, chosen)
    candidates = [(reachable_blocks(matched, w), matched.get(w, 0), w) for w in sorted(peers) if w != chosen]
    best = max(candidates, key=lambda c: (c[0], c[1]), default=None)
    if best is None or best[0] - own < max(min_blocks, 1):
        return None
    return best[2], best[0]
