"""The engine's step once the forward pass of a batch with drafts ran: sample the sequences
without drafts as any step does, verify the others (verify.py), hand the rejected drafts'
KV back to the scheduler, and append each sequence's new tokens, stopping exactly where
one ends it (EOS, a stop string, max_tokens, a complete grammar)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.core.logprobs import TokenLogprobs
from splitserve.engine.grammar import BatchMask
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampler import sample
from splitserve.engine.sequence import Sequence, SequenceStatus
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
    if plain:
        tokens, logprobs = sample(logits[rows], plain, engine.generator, engine.eos_token_ids, mask)
        outputs = [engine._append(seq, t, lp) for seq, t, lp in zip(plain, tokens, logprobs, strict=True)]
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
        outputs.append(append_run(engine, seq, tokens, logprobs))
    engine.speculator.release_finished()
    return outputs


def _num_matching(tokens: list[int], drafts: list[int]) -> int:
    n = 0
    while n < min(len(tokens), len(drafts)) and tokens[n] == drafts[n]:
        n += 1
    return n


def append_run(engine: LLMEngine, seq: Sequence, tokens: list[int],
               logprobs: list[TokenLogprobs | None]) -> RequestOutput:
    """Several tokens join `seq` as one output; the first that ends it is the last taken."""
    taken: list[int] = []
    text = ""
    for token, lp in zip(tokens, logprobs, strict=True):
        out = engine._append(seq, token, lp)
        taken.append(token)
        text += out.new_text
        if seq.status != SequenceStatus.RUNNING:  # finished, or back to the queue (longrope)
            break
    new_lps = [lp for lp in logprobs[: len(taken)] if lp is not None]
    return engine._output(seq, taken, new_lps, text)
