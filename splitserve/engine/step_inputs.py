"""One step's model inputs as plain lists: what the scheduler's batch means for the
forward pass (tokens, positions, KV slots, block tables). Built once by the rank that
schedules; under tensor parallelism it is the step description broadcast to the other
ranks, which run the same step on their slices (engine/parallel/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from splitserve.engine.lora.ranks import LoRAStepPlan


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # block_id * block_size + offset of each token
    logits_rows: list[int]  # the tokens whose logits are due (a sequence's last known token)
    prefill_lens: list[int]  # new tokens of each prefill sequence (they come first)
    prefill_seq_lens: list[int]
    prefill_block_tables: list[list[int]]
    decode_seq_lens: list[int]
    decode_block_tables: list[list[int]]
    long_rope: list[bool] | None  # per token: read the longrope long-factor rows (None: no sequence does)
    lora: LoRAStepPlan | None = None  # under tensor parallelism: the tokens' adapter slots (lora/ranks.py)
    # hybrid models, per sequence in token order: its recurrent-state slot, computed tokens before
    # the step (0: its state starts from zeros) and tokens this step (engine/recurrent_state.py)
    state_slots: list[int] | None = None
    state_starts: list[int] | None = None
    state_lens: list[int] | None = None


def step_inputs(batch: ScheduledBatch, block_size: int) -> tuple[StepInputs, list[Sequence]]:
    """The step's inputs, and the sequences that get a token from it, in order."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    long_rope: list[bool] = []
    sampled: list[Sequence] = []
    entries = batch.entries
    hybrid = bool(entries) and entries[0][0].state_slot >= 0
    for seq, n in entries:
        start = seq.num_computed_tokens
        known = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
        input_ids.extend(known[start : start + n])
        positions.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        long_rope.extend([seq.long_rope] * n)
        if start + n == len(known):  # logits at the last token, and at each draft (engine/spec/verify.py)
            logits_rows.extend(range(len(input_ids) - 1 - len(seq.draft_token_ids), len(input_ids)))
            sampled.append(seq)
    step = StepInputs(
        input_ids, positions, slots, logits_rows,
        prefill_lens=[n for _, n in batch.prefills],
        prefill_seq_lens=[s.num_computed_tokens + n for s, n in batch.prefills],
        prefill_block_tables=[list(s.block_table) for s, _ in batch.prefills],
        decode_seq_lens=[s.num_computed_tokens + 1 for s in batch.decodes],
        decode_block_tables=[list(s.block_table) for s in batch.decodes],
        long_rope=long_rope if any(long_rope) else None)
    if hybrid:
        step.state_slots = [s.state_slot for s, _ in entries]
        step.state_starts = [s.num_computed_tokens for s, _ in entries]
        step.state_lens = [n for _, n in entries]
    return step, sampled
