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


def prefix_scores(matched: Mapping[str, int], workers: Iterable[str], tier_credit: float) -> dict[str, float]:
    """Per worker, its cached prefix in device-block equivalents: a device block counts 1,
    a block only in a tier `tier_credit` (0..1), a miss 0."""
    scores = {}
    for w in workers:
        device = matched.get(w, 0)
        scores[w] = device + tier_credit * (reachable_blocks(matched, w) - device)
    return scores
