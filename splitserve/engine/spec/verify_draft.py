"""Verification of a draft model's drafts for a sampled request: Leviathan et al.'s rejection
sampling with the draft distribution q (a greedy request's q is a point mass at the draft
model's argmax, and verify.py's rule, exact token for token, applies instead).

Row i's target distribution p is the request's sampling distribution at that row, built as
the sampler builds it (penalties over the tokens before the row, the grammar's mask at the
row's state, temperature, top-k/p, min-p). Draft d is kept with probability min(1, p(d) /
q(d)); on rejection the token is drawn from norm(max(p - q, 0)) and the run ends; after k
kept drafts the last row gives a bonus token from p. The output follows the target's
distribution exactly; a seeded request is reproducible (its generator drew the drafts and
draws here, in a fixed order), but, unlike n-gram, not the same tokens as without
speculation.
"""

from __future__ import annotations

import torch

from splitserve.core.logprobs import TokenLogprobs
from splitserve.engine.grammar import apply_mask
from splitserve.engine.logits_processors import apply_logits_processors
from splitserve.engine.sampler import _filter_logits
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.verify import _row_mask, _with_tokens


def verify_with_draft_probs(logits: torch.Tensor, seq: Sequence, drafts: list[int], q: torch.Tensor,
                            generator: torch.Generator, eos_token_ids: set[int], mask_words: int
                            ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [1 + k, vocab], q [k, vocab] -> the tokens `seq` gains and their logprobs."""
    p_params = seq.params
    gen = seq.generator if seq.generator is not None else generator
    grammar = seq.grammar
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    consumed = 0
    try:
        for row in range(len(drafts) + 1):
            chunk = logits[row : row + 1]
            processed = apply_logits_processors(chunk, [_with_tokens(seq, drafts[:row])], eos_token_ids)
            if grammar is not None:  # (a copy: the logprobs below are the model's own)
                processed = apply_mask(processed, _row_mask(grammar, mask_words), copy=processed is chunk)
            p = _filter_logits(processed[0] / p_params.temperature, p_params.top_k, p_params.top_p,
                               p_params.min_p).softmax(-1)
            if row == len(drafts):
                token = _draw(p, gen)
            else:
                d = drafts[row]
                kept = float(torch.rand(1, generator=gen, device=p.device)) * float(q[row, d]) < float(p[d])
                if kept:
                    token = d
                else:
                    residual = (p - q[row].to(p.device)).clamp_min(0)
                    token = _draw(residual / residual.sum() if float(residual.sum()) > 0 else p, gen)
            tokens.append(token)
            logprobs.append(_logprobs(logits[row], token, p_params.logprobs))
            if row == len(drafts) or token != drafts[row]:
                break
            if grammar is not None:
                if not grammar.consume_token(token):
                    break
                consumed += 1
                if grammar.is_stopped():
                    break
    finally:
        if consumed:
            grammar.rollback(consumed)
    return tokens, logprobs


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """A draw from `probs` (the exponential race, as the sampler draws)."""
    return int((probs / torch.empty_like(probs).exponential_(generator=gen)).argmax())


def _logprobs(row: torch.Tensor, token: int, n: int | None) -> TokenLogprobs | None:
    """The model's own logprobs (not the sampling distribution's), as sampler.py reports them."""
    if n is None:
        return None
    logprobs = torch.log_softmax(row, dim=-1)
    top = []
    if n:
        values, ids = torch.topk(logprobs, n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(logprobs[token]), top)
