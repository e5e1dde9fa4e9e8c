"""The "mtp" method: the target checkpoint's own multi-token-prediction layer drafts
(engine/spec/mtp_model.py: one decoder layer fed the next token's embedding and the target's
hidden state before its final norm).

The MTP layer attends over KV of its own, one row per position, kept as the draft_model
method keeps a draft model's (a pool of the same number of blocks, one table per sequence,
no prefix cache, blocks back when the sequence ends). Row p needs h_p, the target's hidden
state at p, and the token at p + 1, so it is written right after the target step that made
h_p and kept that token (`ran`: one batched MTP pass over every sequence of the step, with
the target's hidden states of the positions verification kept; the target's forward keeps
them when `keep_hidden_states` is on, engine/models/llama.py). The last row's logits are the
first draft's; the next drafts chain: draft j + 1 is read from the MTP layer run on draft j
with its own output as h, in scratch rows past the kept ones, overwritten when the target's
h for those positions arrives. k drafts reuse the one layer k times (as vLLM does).

A window, not always the whole sequence: the rows run from the first position whose h this
engine computed. Positions it did not compute (a prefix-cache hit, a prompt prefilled by a
prefill worker, a step overlapped without drafts) have no h, so the window starts after them
(rope uses the true positions, so relative distances stay right); a gap in the middle
(preempted past a cached prefix) starts a new window. A shorter window lowers acceptance
only: verification (verify.py) makes every token, so outputs are those without speculation.
vLLM instead keeps the MTP layer's KV as one more layer of the target's cache, which a prefix
hit and a KV transfer carry; that is not built here.

Drafts are drawn as the draft model's are (draft_model.py: the request's sampling transforms,
greedy argmax, the verification's own noise drawn ahead), through the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.state import alone
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.spec.draft_model import DraftModel
from splitserve.engine.spec.mtp_model import mtp_model_parts
from splitserve.engine.step_inputs import StepInputs


@dataclass
class _MtpKV:
    start: int  # the position of row 0
    done: int = 0  # rows 0..done-1 hold positions start.. from the target's hidden states
    block_table: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # the last kept row's: the first draft's distribution
    hidden: torch.Tensor | None = None  # the last kept row's output h: the second draft's input


@dataclass
class _Chunk:
    """Rows of one sequence for one MTP pass."""

    kv: _MtpKV
    tokens: list[int]  # the token at p + 1 of each position p
    first: int  # the first row's position
    hidden: torch.Tensor  # [rows, hidden]: h_p


class MtpDrafter(DraftModel):
    def __init__(self, config: EngineConfig, target_config: ModelConfig, target: nn.Module, num_blocks: int,
                 max_model_len: int, eos_token_ids: set[int]):
        model_config, model_cls = mtp_model_parts(target_config, config.model)
        # one process, eager: the MTP layer of the target's own checkpoint (quantized as it is)
        cfg = replace(config, num_kv_blocks=num_blocks, cuda_graphs=False, async_scheduling=False,
                      tensor_parallel_size=1, enable_expert_parallel=False, enable_lora=False, lora_modules={},
                      speculative_config=None, model_id=None)
        with alone():
            self.runner = ModelRunner(model_config, cfg, max_model_len, model_cls=model_cls)
        self.model = self.runner.model
        self.blocks = BlockManager(self.runner.kv_pool.num_blocks, cfg.block_size, enable_prefix_caching=False)
        self.block_size = cfg.block_size
        self.eos_token_ids = eos_token_ids
        self.kv: dict[Sequence, _MtpKV] = {}
        self.target = target
        target.keep_hidden_states = True

    # ---- after each target step ------------------------------------------------------
    def ran(self, entries: list[tuple[Sequence, int, int]]) -> None:
        """The target step over `entries` (each sequence, its first position, its rows, in the
        step's row order) is verified: write the MTP rows of the positions it kept."""
        hidden, self.target.hidden_states = self.target.hidden_states, None  # (read once: never a stale step's)
        self.release_finished()
        if hidden is None or hidden.shape[0] != sum(n for _, _, n in entries):
            return  # (the step kept none: its sequences start new windows at their next step)
        chunks: list[_Chunk] = []
        at = 0
        for seq, first, n in entries:
            rows, at = hidden[at:at + n], at + n
            if seq.status == SequenceStatus.FINISHED:
                continue
            kept = min(seq.num_computed_tokens - first, n)  # (drafts past the first rejected one: not kept)
            kv = self.kv.get(seq)
            if kv is None or first > kv.start + kv.done:  # no h for the positions between: a new window
                self._drop(seq)
                kv = self.kv[seq] = _MtpKV(start=first)
            skip = kv.start + kv.done - first  # positions recomputed after a preemption: rows already kept
            if kept - skip <= 0:
                continue
            tokens = seq.token_ids[first + skip + 1:first + kept + 1]
            if len(tokens) != kept - skip or not self._reserve(kv, first + kept - kv.start):
                self._drop(seq)  # (the pool is full: this sequence drafts again from a new window)
                continue
            chunks.append(_Chunk(kv, tokens, first + skip, rows[skip:kept]))
        if not chunks:
            return
        logits = self._forward(chunks)
        ends = torch.tensor([len(c.tokens) for c in chunks]).cumsum(0) - 1
        out = self.model.hidden_states[ends.to(self.model.hidden_states.device)]
        for i, chunk in enumerate(chunks):
            chunk.kv.done += len(chunk.tokens)
            chunk.kv.logits, chunk.kv.hidden = logits[i:i + 1], out[i:i + 1]

    # ---- the propose phase ---------------------------------------------------------
    def propose(self, seq: Sequence, k: int, generator: torch.Generator) -> list[int]:
        self.release_finished()
        kv = self.kv.get(seq)
        last = seq.num_tokens - 1  # the position of the last token, the step's first row
        if kv is None or kv.logits is None or kv.start + kv.done != last:
            return []  # no row for the position before it yet (a new window's first step)
        if not self._reserve(kv, last - kv.start + k - 1):
            return []
        hidden = kv.hidden

        def next_logits(token: int, i: int) -> torch.Tensor:
            nonlocal hidden
            logits = self._forward([_Chunk(kv, [token], last + i, hidden)])
            hidden = self.model.hidden_states[-1:]
            return logits

        return self.draw(seq, k, generator, kv.logits, next_logits)

    def draw(self, seq: Sequence, k: int, generator: torch.Generator, logits: torch.Tensor, next_logits) -> list[int]:
        """k drafts from the first draft's `logits`, `next_logits(token, i)` giving the next
        ones' (draft_model.py's draws: the request's transforms, the verification's noise)."""
        gen = None if seq.params.greedy else self._own_generator(seq, generator)
        ahead = gen.get_state() if gen is not None else None
        drafts: list[int] = []
        try:
            for i in range(k):
                q = self._distribution(logits, seq, drafts)
                token = int(q.argmax()) if gen is None else int(
                    (q / torch.empty_like(q).exponential_(generator=gen)).argmax())
                drafts.append(token)
                if i < k - 1:
                    logits = next_logits(token, i)
        finally:
            if gen is not None:  # verification draws the same noise again
                gen.set_state(ahead)
        return drafts

    # ---- the MTP pass --------------------------------------------------------------
    def _forward(self, chunks: list[_Chunk]) -> torch.Tensor:
        """One MTP pass over the chunks (each a prefill of its rows); logits [chunks, vocab] of
        each chunk's last row. The layer's outputs stay in self.model.hidden_states."""
        bs = self.block_size
        ids, positions, slots, logits_rows, firsts = [], [], [], [], []
        for chunk in chunks:
            table, rows = chunk.kv.block_table, range(chunk.first - chunk.kv.start, chunk.first - chunk.kv.start +
                                                     len(chunk.tokens))
            firsts += [len(ids)] if chunk.first == 0 else []
            ids += chunk.tokens
            positions += range(chunk.first, chunk.first + len(chunk.tokens))
            slots += [table[r // bs] * bs + r % bs for r in rows]
            logits_rows.append(len(ids) - 1)
        step = StepInputs(input_ids=ids, positions=positions, slots=slots, logits_rows=logits_rows,
                          prefill_lens=[len(c.tokens) for c in chunks],
                          prefill_seq_lens=[c.first - c.kv.start + len(c.tokens) for c in chunks],
                          prefill_block_tables=[list(c.kv.block_table) for c in chunks],
                          decode_seq_lens=[], decode_block_tables=[], long_rope=None)
        device = self.runner.device
        self.model.previous_hidden = torch.cat([c.hidden for c in chunks]).to(device)
        self.model.first_rows = torch.tensor(firsts, device=device) if firsts else None
        with alone():
            return self.runner.execute(step).float()

    def _reserve(self, kv: _MtpKV, rows: int) -> bool:
        """Blocks for `rows` rows; False when the pool is short."""
        needed = -(-rows // self.block_size) - len(kv.block_table)
        if needed > self.blocks.num_free_blocks:
            return False
        if needed > 0:
            kv.block_table += self.blocks.allocate_blocks(needed)
        return True

    def _drop(self, seq: Sequence) -> None:
        kv = self.kv.pop(seq, None)
        if kv is not None:
            self.blocks.release_blocks(kv.block_table)
