"""Continuous batching under a per-step token budget.

Each step first advances every running sequence (one token for a decode, the next
chunk for a prompt still being prefilled), then admits waiting sequences with
whatever budget is left, so prefill chunks and decode steps share one forward
pass. When blocks run out, the most recently admitted sequence is preempted: its
blocks are released and it is recomputed later (its prefix may still be cached).

The scheduler owns the block manager: every allocation, publication to the prefix
cache and release goes through it, including the disaggregated paths (a prompt
reserved for a prefill worker to fill, the held blocks of a prompt pushed elsewhere).

Drafts (speculative decoding) are proposed in a phase of their own before `schedule`
(`Speculator.propose_drafts`, engine/spec/speculator.py): `draft_rooms` tells it how many each
running decode may carry, by the walk `schedule` then makes; `schedule` only accounts for the
drafts attached to the sequences.

(About 350 lines: the overlapped mode, `schedule_ahead` and `landed`, is here because it
calls `schedule()` itself rather than restating its rules, and `draft_rooms` because it is
`schedule`'s own walk, made without changing anything.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences to compute this step, prefill chunks (several tokens) first."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def entries(self) -> list[tuple[Sequence, int]]:
        return self.prefills + [(s, 1) for s in self.decodes]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 decoding_step_tokens: int | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the budget while a running sequence decodes: a prefill chunk in its step holds its next
        # token for as long as the chunk takes (a lone prompt gets the whole budget)
        self.decoding_step_tokens = decoding_step_tokens or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Counters for metrics: preemptions, and prefix-cache lookups/hits in tokens.
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens_computed = 0  # prefill tokens run so far (a prefill worker's rate)
        # may this waiting sequence join the live ones? (LoRA: at most --max-loras adapters live)
        self.admits: Callable[[Sequence], bool] = lambda seq: True

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _step_budget(self) -> int:
        if self.decoding_step_tokens < self.max_num_batched_tokens and any(
                s.num_tokens - s.num_computed_tokens <= 1 for s in self.running):
            return self.decoding_step_tokens
        return self.max_num_batched_tokens

    def schedule(self) -> ScheduledBatch:
        """This step's batch. A running decode runs with the drafts the propose phase attached
        to it (`draft_rooms` sized them); other sequences carry none."""
        batch = ScheduledBatch()
        budget = self._step_budget()
        i = 0
        bm, bs = self.bm, self.bm.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.token_ids[-1] < 0 and ends_by_length(seq):  # its token in flight ends it: nothing to run
                i += 1
                continue
            computed = seq.num_computed_tokens
            n = min(len(seq.token_ids) - computed, budget)
            if seq.draft_token_ids:  # a decode and its drafts, verified in the same pass
                n = self._with_drafts(seq, budget)
            need = max(0, -(-(computed + n) // bs) - len(seq.block_table))  # bm.blocks_needed, inlined (per seq)
            while need > bm.num_free_blocks:
                victim = self.running.pop()  # never one scheduled earlier this step (index < i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            if need:  # (a decode mostly writes into its last block: nothing to allocate)
                bm.grow(seq, n)
            if n == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
            budget -= n
            i += 1
        # Admit new work only when nothing had to be preempted this step.
        passed_over: list[Sequence] = []  # LoRA: adapters with no free slot wait; the rest go ahead
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if not self.admits(seq):
                passed_over.append(self.waiting.popleft())
                continue
            cached = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
            if not self.bm.can_admit(seq, cached, n):
                break
            self.waiting.popleft()
            self._admit(seq, cached, n)
            if seq.first_scheduled_time is None:  # its queue time ends here (a metric)
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(passed_over))  # back at the front, in their order
        return batch

    def _admit(self, seq: Sequence, cached: list[int], n: int) -> None:
        """Give `seq` its cached prefix blocks and room for `n` more tokens."""
        self.bm.admit(seq, cached)
        if seq.num_cached_tokens < 0:  # first admission (not a recompute)
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens
        self.bm.grow(seq, n)

    def computed(self, batch: ScheduledBatch) -> None:
        """The batch's forward pass ran: its KV is in the pool, full blocks join the cache
        (of drafts, only what reject_drafts keeps counts afterwards)."""
        self.prompt_tokens_computed += sum(n for s, n in batch.prefills if not s.draft_token_ids)
        publish, bs = self.bm.publish_full_blocks, self.bm.block_size
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            publish(seq)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            if seq.num_computed_tokens // bs > seq.num_registered_blocks:  # (publish's own first check, inlined)
                publish(seq)

    # ---- overlapped decode (--async-scheduling, engine/overlap.py) ---------------------------
    def schedule_ahead(self, eligible: Callable[[Sequence], bool], max_seqs: int,
                       max_blocks: int) -> ScheduledBatch | None:
        """The next step scheduled before the step in flight returns its tokens (vLLM's async
        scheduling): the running sequences' last tokens may be placeholders (`launched_ahead`).
        `schedule` makes it, when it is certain to make a decode step of `eligible` sequences
        only, at most `max_seqs` of them and `max_blocks` blocks each: nothing waiting to be
        admitted, every running sequence one token to decode and room for all (no preemption;
        no drafts: `eligible` rules out a sequence that may have some, and one with its token in
        flight gets none). Otherwise None, and nothing has changed."""
        if self.waiting:
            return None
        rows = [seq for seq in self.running if not (seq.token_ids[-1] < 0 and ends_by_length(seq))]
        if not rows or len(rows) > min(max_seqs, self.max_num_batched_tokens, self.decoding_step_tokens):
            return None
        need = 0
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not eligible(seq):
                return None
        for seq in rows:
            n = self.bm.blocks_needed(seq, 1)
            if len(seq.block_table) + n > max_blocks:
                return None
            need += n
        if need > self.bm.num_free_blocks:
            return None
        batch = self.schedule()
        assert batch.decodes == rows and not batch.prefills and not batch.preempted, "schedule_ahead misjudged"
        return batch

    def launched_ahead(self, batch: ScheduledBatch) -> None:
        """`batch` was launched and the tokens of the step before it have landed: each row's
        token is in flight, a placeholder -(row + 1) (row j of the step's sampled tokens)
        counted as computed. Its blocks are published when it lands (`landed`)."""
        for row, seq in enumerate(batch.decodes):
            if not seq.is_finished:  # (finished by the token that landed: its row's token is void)
                seq.num_computed_tokens += 1
                seq.token_ids.append(-(row + 1))

    def landed(self, seq: Sequence, token: int) -> None:
        """`seq`'s token in flight arrived: it replaces the placeholder, and the step that
        wrote its KV has completed, so its full blocks may join the prefix cache."""
        seq.token_ids[-1] = token
        self.bm.publish_full_blocks(seq)

    # ---- speculative decoding (engine/spec/) ----------------------------------------------
    def draft_rooms(self) -> Iterator[tuple[Sequence, int]]:
        """For the propose phase (Speculator.propose_drafts): the running decodes `schedule`
        will step, in its order, each with the drafts the budget and free blocks leave it after
        one token for each sequence after it (drafts never preempt or starve one). `schedule`'s
        walk, changing nothing; set each one's drafts before taking the next (they use its
        room). It stops where `schedule` will preempt (the pool is short: no drafts from there)."""
        budget, free, bs = self._step_budget(), self.bm.num_free_blocks, self.bm.block_size
        for i, seq in enumerate(self.running):
            if budget <= 0:
                return
            if seq.token_ids[-1] < 0 and ends_by_length(seq):  # (skipped by schedule too)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.bm.blocks_needed(seq, n)
            if need > free:
                return
            if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1 and seq.token_ids[-1] >= 0:
                later = len(self.running) - i - 1
                slots = (len(seq.block_table) + need + max(free - need - later, 0)) * bs
                yield seq, min(budget - 1 - later, slots - seq.num_tokens)
                n += len(seq.draft_token_ids)
                need = self.bm.blocks_needed(seq, n)
            free -= need
            budget -= n

    def _with_drafts(self, seq: Sequence, budget: int) -> int:
        """1 + `seq`'s drafts: its decode step. `draft_rooms` sized them to fit; were the budget
        or the pool to differ now, they are cut, never a reason to preempt."""
        drafts = seq.draft_token_ids
        del drafts[max(budget - 1, 0):]
        if self.bm.blocks_needed(seq, 1 + len(drafts)) > self.bm.num_free_blocks:
            drafts.clear()
        return 1 + len(drafts)

    def reject_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """Verification kept `num_accepted` of `seq`'s drafts: the KV of the others is void.
        Their slots are simply overwritten by later steps; blocks past the next token's go
        back to the pool. None of them was published: publish_full_blocks covers only
        tokens the sequence holds, so the prefix cache never sees a rejected token."""
        seq.num_computed_tokens -= len(seq.draft_token_ids) - num_accepted
        seq.draft_token_ids = []
        self.bm.shrink(seq, -(-(seq.num_computed_tokens + 1) // self.bm.block_size))

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        if n == 1:
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, n))

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def recompute_with_long_rope(self, seq: Sequence) -> None:
        """A longrope sequence just passed its original length: transformers recomputes all
        of its KV with the long factors, so it goes back to the queue's front to be
        prefilled again (its short-factor blocks stay cached for short sequences)."""
        self.bm.free_sequence(seq)
        seq.long_rope = True
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if free_blocks:
            self.bm.free_sequence(seq)

    # ---- disaggregation ---------------------------------------------------------------
    def reserve(self, seq: Sequence) -> bool:
        """Blocks for all of `seq`'s prompt (its cached prefix reused), to be filled by a
        prefill worker; the sequence is not scheduled until `join_computed`. False when
        the pool cannot hold the prompt now (or its LoRA adapter cannot join now)."""
        if not self.admits(seq):
            return False
        cached = self.bm.match_prefix(seq)
        n = seq.num_tokens - len(cached) * self.bm.block_size
        if not self.bm.can_admit(seq, cached, n):
            return False
        self._admit(seq, cached, n)
        return True

    def join_computed(self, seq: Sequence) -> None:
        """A reserved sequence whose prompt KV arrived joins the running batch."""
        seq.num_computed_tokens = seq.num_tokens
        self.bm.publish_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def prompt_blocks(self, seq: Sequence, skip_blocks: int) -> tuple[list[int], list[int]]:
        """(block ids, chained hashes of the full ones) of the prompt from `skip_blocks` on."""
        bs = self.bm.block_size
        full = seq.num_prompt_tokens // bs
        self.bm.ensure_hashes(seq, full)
        return seq.block_table[skip_blocks : -(-seq.num_prompt_tokens // bs)], seq.block_hashes[skip_blocks:full]

    def free(self, seq: Sequence) -> None:
        """Release the blocks of a sequence outside the batch (held or reserved)."""
        self.bm.free_sequence(seq)

    # ---- block state (the engine thread only) -----------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks

    def cached_block_hashes(self) -> list[int]:
        return self.bm.cached_hashes()

    def drain_block_events(self):
        return self.bm.drain_events()

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                self.finish(seq, "abort")
                return seq
        return None


def ends_by_length(seq: Sequence) -> bool:
    """Its last token (maybe still in flight) reaches max_tokens or the context."""
    p = seq.params
    return (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
        or seq.num_tokens >= seq.max_total_tokens
