"""The propose phase of an engine step, and the counters of what verification kept.

Before the step is scheduled, the speculator proposes drafts for the running decodes the
scheduler will step (`propose_drafts`), each within the extra tokens the step's budget and
the free KV blocks allow it (`Scheduler.draft_rooms`), capped by what the request may still
produce (max_tokens, the context, a longrope switch) and by the batch size past which
speculation is off (disable_by_batch_size). The drafts are attached to the sequences;
`Scheduler.schedule` then accounts for them, and no model runs inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.core.speculative import SpeculativeConfig
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.draft_model import DraftModel
from splitserve.engine.spec.mtp import MtpDrafter
from splitserve.engine.spec.ngram import propose_ngram

if TYPE_CHECKING:
    from splitserve.engine.scheduler import Scheduler


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: verified sequences-steps (drafts), draft tokens proposed
    and accepted, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified sequence gains per step: the accepted drafts and one more."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))


class Speculator:
    def __init__(self, config: SpeculativeConfig, long_rope_after: int | None = None,
                 draft: DraftModel | None = None, generator: torch.Generator | None = None):
        self.config = config
        self.long_rope_after = long_rope_after
        self.draft = draft  # draft_model: the second model and its KV pool; mtp: the MTP layer (spec/mtp.py)
        self.generator = generator  # the engine's, for unseeded sampled drafts
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose_drafts(self, scheduler: Scheduler) -> None:
        """The step's propose phase, before `scheduler.schedule()`: drafts attached to each
        running decode it will step (a draft model's forward passes run here), within the
        room its budget walk leaves each; any other sequence carries none."""
        batch_size = len(scheduler.running)
        for seq in scheduler.running:
            if seq.draft_token_ids:
                seq.draft_token_ids = []
        cap = self.config.disable_by_batch_size
        if cap is not None and batch_size > cap:  # (propose would give none: no walk at a large batch)
            return
        for seq, room in scheduler.draft_rooms():
            seq.draft_token_ids = self.propose(seq, room, batch_size)

    def propose(self, seq: Sequence, room: int, batch_size: int) -> list[int]:
        """Drafts for `seq`'s next step, at most `room` (what the step's budget and KV allow)."""
        limit = min(room, self._limit(seq))
        cap = self.config.disable_by_batch_size
        if limit <= 0 or (cap is not None and batch_size > cap):
            return []
        if self.draft is not None:
            return self.draft.propose(seq, limit, self.generator)
        return propose_ngram(seq.token_ids, limit, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def drafts_ahead(self, seq: Sequence, batch_size: int) -> bool:
        """May `seq`'s next step have drafts? Asked before an overlapped decode step
        (engine/overlap.py), which runs only when no sequence does: drafts are verified on the
        host, and the step after depends on how many were kept. Judged from the tokens on the
        host; a token still in flight (a placeholder, last) is left out, so a tail that recurs
        before it says yes (the lookup the synchronous step then makes has the token).
        Exact where no token is in flight: False means `propose` gives no drafts. A draft
        model proposes whenever the request may take drafts: its steps overlap only past
        disable_by_batch_size, for a held prefill request, and in a request's last tokens."""
        cap = self.config.disable_by_batch_size
        if self._limit(seq) <= 0 or (cap is not None and batch_size > cap):
            return False
        if self.draft is not None:
            return True
        tokens = seq.token_ids[:-1] if seq.token_ids[-1] < 0 else seq.token_ids
        return bool(propose_ngram(tokens, 1, self.config.prompt_lookup_min, self.config.prompt_lookup_max))

    def step_rows(self, batch) -> list[tuple[Sequence, int, int]] | None:
        """Before the target runs `batch`: each sequence, its first position and its rows, for
        `ran` after it (the MTP layer's input); None unless the method is mtp."""
        if not isinstance(self.draft, MtpDrafter):
            return None
        return [(seq, seq.num_computed_tokens, n) for seq, n in batch.entries]

    def ran(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """The step of `step_rows` is verified: the MTP layer writes the rows it kept."""
        self.draft.ran(rows)

    def release_finished(self) -> None:
        """The draft model's KV of sequences that ended goes back to its pool."""
        if self.draft is not None:
            self.draft.release_finished()

    def _limit(self, seq: Sequence) -> int:
        """Drafts this sequence can use: it gains at most 1 + k tokens, never past max_tokens,
        the context or (longrope, short factors) the switch to the long ones."""
        if seq.hold_kv:  # a prefill worker's request: one token, then pushed
            return 0
        p = seq.params
        limit = min(self.config.num_speculative_tokens, seq.max_total_tokens - seq.num_tokens - 1)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_output_tokens - 1)
        if self.long_rope_after is not None and not seq.long_rope:
            limit = min(limit, self.long_rope_after - seq.num_tokens)
        return limit


def build_speculator(engine) -> Speculator:
    """The engine's speculator for its --speculative-config (draft_model: loads the draft model,
    with a KV pool of as many blocks as the target's, on rank 0's device: unsharded under
    tensor parallelism, spec/draft_model.py; mtp: the checkpoint's MTP layer, spec/mtp.py)."""
    config = engine.config.speculative_config
    draft = None
    if config.method == "draft_model":
        draft = DraftModel(engine.runner.cfg, config.model, engine.runner.kv_pool.num_blocks,
                           int(engine.max_model_len), engine.eos_token_ids)
    elif config.method == "mtp":
        draft = MtpDrafter(engine.runner.cfg, engine.model_config, engine.runner.model,
                           engine.runner.kv_pool.num_blocks, int(engine.max_model_len), engine.eos_token_ids)
    return Speculator(config, engine.long_rope_after, draft, engine.generator)
