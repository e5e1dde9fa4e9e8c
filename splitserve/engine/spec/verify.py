"""Verification of one sequence's drafts from the logits of its 1 + k rows (the last accepted
token, then the k drafts, computed in one forward pass).

Row i is the model's distribution for the token after the i-th draft. Each row is sampled
exactly as a step without speculation samples it (sampler.py: penalties over the tokens
before that row, the grammar's mask at that row's state, then greedy or the exponential
race with the request's generator), one draw per row, rows in order, until a row's token
differs from its draft: that token is the correction; if every draft matches, the last
row's token is a bonus. So:

- greedy: the output is the output without speculation, token for token;
- sampling: with n-gram drafts q is a point mass at the draft d, and this is Leviathan et
  al.'s rejection rule for it: d is kept with probability p(d) (the race picks d), and on
  rejection the token comes from p with d removed, renormalised = norm(max(p - q, 0)). The
  generator makes one draw per emitted token, as without speculation, so a seeded request
  gives the same tokens with and without speculation, and a migrated one resumes exactly.
  A draft model's sampled drafts come from the very noise these rows draw (draft_model.py),
  so they are kept whenever its race picks what the target's picks; the tokens emitted
  are, again, those of sampling without speculation.

The grammar matcher consumes accepted drafts to mask the next row and is rolled back before
returning: it only advances as tokens join (TokenOutput.append, engine/token_output.py).
"""

from __future__ import annotations

import copy

import torch

from splitserve.core.logprobs import TokenLogprobs
from splitserve.engine.grammar import BatchMask
from splitserve.engine.sampler import sample
from splitserve.engine.sequence import Sequence


def verify(logits: torch.Tensor, seq: Sequence, drafts: list[int], generator: torch.Generator,
           eos_token_ids: set[int], mask_words: int) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [1 + len(drafts), vocab] -> the tokens `seq` gains (the accepted drafts and one
    more; fewer when the grammar completes on an accepted draft) and their logprobs."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    grammar = seq.grammar
    consumed = 0
    try:
        for row in range(len(drafts) + 1):
            view = _with_tokens(seq, drafts[:row])
            mask = _row_mask(grammar, mask_words) if grammar is not None else None
            [token], [lp] = sample(logits[row : row + 1], [view], generator, eos_token_ids, mask)
            tokens.append(token)
            logprobs.append(lp)
            if row == len(drafts) or token != drafts[row]:
                break
            if grammar is not None:
                if not grammar.consume_token(token):
                    break
                consumed += 1
                if grammar.is_stopped():  # complete: the engine ends the sequence on this token
                    break
    finally:
        if consumed:
            grammar.rollback(consumed)
    return tokens, logprobs


def _with_tokens(seq: Sequence, extra: list[int]) -> Sequence:
    """`seq` as the sampler sees it once `extra` has joined (penalties and min_tokens count them)."""
    if not extra or not seq.params.processes_logits:
        return seq
    view = copy.copy(seq)
    view.token_ids = seq.token_ids + extra
    return view


def _row_mask(matcher, words: int) -> BatchMask:
    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
    return BatchMask([0], bitmask)
