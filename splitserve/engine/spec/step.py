"""The engine's step once the forward pass of a batch with drafts ran: sample the sequences
without drafts as any step does, verify the others (verify.py), hand the rejected drafts'
KV back to the scheduler, and append each sequence's new tokens through the engine's
TokenOutput (engine/token_output.py), stopping exactly where one ends it (EOS, a stop
string, max_tokens, a complete grammar)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.engine.grammar import BatchMask
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampler import sample
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.verify import verify

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


def speculative_step(engine: LLMEngine, logits: torch.Tensor, sampled: list[Sequence],
                     mask: BatchMask | None) -> list[RequestOutput]:
    """`logits` has 1 + k rows for each sequence with k drafts, one for the others; `mask`
    covers the draft-free sequences, in their order."""
    plain, rows, spans = [], [], []
    at = 0
    for seq in sampled:
        width = 1 + len(seq.draft_token_ids)
        if width == 1:
            plain.append(seq)
            rows.append(at)
        spans.append((at, width))
        at += width
    outputs = []
    out = engine.token_output
    if plain:
        tokens, logprobs = sample(logits[rows], plain, engine.generator, engine.eos_token_ids, mask)
        outputs = [out.append(seq, t, lp) for seq, t, lp in zip(plain, tokens, logprobs, strict=True)]
    words = (engine.grammars.vocab_size + 31) // 32
    stats = engine.speculator.stats
    for seq, (start, width) in zip(sampled, spans, strict=True):
        if width == 1:
            continue
        drafts = seq.draft_token_ids
        tokens, logprobs = verify(logits[start : start + width], seq, drafts, engine.generator,
                                  engine.eos_token_ids, words)
        stats.record(len(drafts), _num_matching(tokens, drafts))
        engine.scheduler.reject_drafts(seq, len(tokens) - 1)
        outputs.append(out.append_run(seq, tokens, logprobs))
    engine.speculator.release_finished()
    return outputs


def _num_matching(tokens: list[int], drafts: list[int]) -> int:
    n = 0
    while n < min(len(tokens), len(drafts)) and tokens[n] == drafts[n]:
        n += 1
    return n
