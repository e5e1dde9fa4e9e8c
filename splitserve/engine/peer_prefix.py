"""The engine's side of a peer prefix pull (LLMEngine mixes it in): a decode worker that
lacks a prompt's prefix asks a peer holding it to push those blocks over the KV transfer
instead of recomputing them (decode_worker/peer_pull.py drives both ends).

Requester: `reserve_pull` holds fresh blocks for the part of the prefix not cached here,
`adopt_pulled` publishes them in the prefix cache once the transfer verified them (the
request is then admitted as usual and finds them there), `drop_pulled` frees them unread.
Peer: `pin_prefix` holds the blocks it has for the prefix (device pool, or loaded back from
its offload tiers) so they cannot be evicted while they are read, `unpin` lets them go.
Base-model prompts only: an adapter (LoRA) or longrope salts the hashes per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from splitserve.engine.scheduler import Scheduler


class PeerPrefix:
    """Needs LLMEngine's scheduler, max_total_tokens and long_rope_after."""

    scheduler: Scheduler

    def _prefix_sequence(self, prefix: list[int]) -> Sequence | None:
        """A throwaway sequence whose reusable blocks are exactly `prefix`'s whole blocks."""
        bs = self.scheduler.bm.block_size
        if self.long_rope_after is not None or not prefix or len(prefix) % bs:
            return None
        # one token more: match_prefix never reuses the block holding the last token
        return Sequence("peer-prefix", list(prefix) + [0], len(prefix) + 1, SamplingParams(), self.max_total_tokens)

    def reserve_pull(self, prefix: list[int]) -> tuple[list[int], list[int], int | None, int] | None:
        """Requester: (fresh block ids, their hashes, the hash before them, leading blocks
        already cached here) for `prefix` (whole blocks); the fresh blocks are held. None:
        nothing to pull, or no room."""
        seq = self._prefix_sequence(prefix)
        if seq is None:
            return None
        bm = self.scheduler.bm
        cached = bm.match_prefix(seq)
        want = len(prefix) // bm.block_size - len(cached)
        ids = bm.allocate_behind(cached, want) if want > 0 else None  # never evicts the cached part
        if ids is None:
            return None
        have = len(cached)
        return ids, seq.block_hashes[have:have + want], seq.block_hashes[have - 1] if have else None, have

    def adopt_pulled(self, block_ids: list[int], hashes: list[int], parent: int | None) -> None:
        """Requester: the pulled blocks arrived verified; they join the prefix cache (idle)."""
        self.scheduler.bm.adopt(block_ids, hashes, parent)  # a copy computed here meanwhile stays

    def drop_pulled(self, block_ids: list[int]) -> None:
        """Requester: the pull failed; the blocks hold nothing."""
        self.scheduler.bm.release_blocks(block_ids)

    def pin_prefix(self, prefix: list[int], skip_blocks: int) -> tuple[list[int], list[int]]:
        """Peer: (block ids, hashes) of `prefix`'s blocks from `skip_blocks` on that it holds
        (leading run only), each held until `unpin`."""
        seq = self._prefix_sequence(prefix)
        if seq is None:
            return [], []
        bm = self.scheduler.bm
        cached = bm.match_prefix(seq)[skip_blocks:]
        bm.pin(cached)
        return cached, seq.block_hashes[skip_blocks:skip_blocks + len(cached)]

    def unpin(self, block_ids: list[int]) -> None:
        self.scheduler.bm.release_blocks(block_ids)
