"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and the structured-output masks of constrained sequences (engine/grammar.py).

Logprobs are those of the model's own distribution (log-softmax of the raw
logits), as vLLM reports them, not of the temperature-adjusted one.
"""

from __future__ import annotations

import torch

from splitserve.core.logprobs import TokenLogprobs
from splitserve.engine.grammar import BatchMask, apply_mask
from splitserve.engine.logits_processors import apply_logits_processors
from splitserve.engine.sequence import Sequence


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p for one row [vocab]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = before > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def draw(processed: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> torch.Tensor:
    """One token per row of the processed logits, as a tensor on their device (no host
    read: the overlapped decode step keeps it there, engine/overlap.py)."""
    tokens = processed.argmax(dim=-1)
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row_logits = _filter_logits(processed[row] / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = row_logits.softmax(-1)
        gen = seq.generator if seq.generator is not None else default_generator
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, using one
        # generator per request, so a seeded request does not depend on its batch.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[row] = (probs / noise).argmax()
    return tokens


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator,
           eos_token_ids: set[int] = frozenset(), mask: BatchMask | None = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: float32 [len(seqs), vocab] -> one token per sequence (+ logprobs if asked).
    Penalties, logit_bias and min_tokens shape the choice, then the grammar's mask removes
    what the output may not hold; logprobs stay the model's own."""
    processed = apply_logits_processors(logits, seqs, eos_token_ids)
    if mask is not None:
        processed = apply_mask(processed, mask, copy=processed is logits)
    drawn = draw(processed, seqs, default_generator)
    tokens = drawn.tolist()
    parts = device_logprobs(logits, drawn, seqs)
    if all(p is None for p in parts):  # no request asked: no call per sequence
        return tokens, parts
    return tokens, [host_logprobs(part, token) for part, token in zip(parts, tokens, strict=True)]


def device_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list[tuple | None]:
    """Per sequence that asks for logprobs, (the drawn token's logprob, its top-N or None), as
    tensors on the logits' device (read later: the overlapped step, engine/overlap.py)."""
    if all(s.params.logprobs is None for s in seqs):
        return [None] * len(seqs)
    logprobs = torch.log_softmax(logits, dim=-1)
    out: list[tuple | None] = []
    for row, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            out.append(None)
            continue
        out.append((logprobs[row, tokens[row]], torch.topk(logprobs[row], n) if n else None))
    return out


def host_logprobs(part: tuple | None, token: int) -> TokenLogprobs | None:
    if part is None:
        return None
    chosen, top = part
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return TokenLogprobs(token, float(chosen), pairs)
