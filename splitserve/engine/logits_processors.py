"""Request-level changes to the logits before sampling, in vLLM's order:
logit_bias, min_tokens, then the repetition, frequency and presence penalties.

- logit_bias: the bias is added to the token's logit (OpenAI).
- min_tokens: EOS and the request's stop_token_ids get -inf until min_tokens tokens exist.
- repetition_penalty (HF / vLLM): every token in the prompt or the output so far has its
  logit divided by the penalty when positive, multiplied when negative.
- frequency_penalty and presence_penalty (OpenAI): logit -= frequency * count in the
  output + presence * (count > 0). "Output" is what this request generated, including
  tokens produced before a migration (they reach a new worker as part of its prompt).

Rows of requests that ask for none of these are not touched.
"""

from __future__ import annotations

import torch

from splitserve.engine.sequence import Sequence


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
    """logits [len(seqs), vocab] (float32) -> the processed logits (a copy only when needed)."""
    rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        seq, p, row = seqs[i], seqs[i].params, logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            keep = ids < vocab  # the router refuses ids outside the vocabulary; offline too (validate)
            row[ids[keep]] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)[keep]
        generated = seq.token_ids[seq.num_prompt_tokens - seq.num_resumed_tokens:]
        if seq.num_output_tokens < p.min_tokens:  # (a resumed request's min_tokens counts what is left)
            banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if t < vocab]
            row[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
            seen = seen[seen < vocab]
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and generated:
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long, device=row.device), minlength=vocab)
            counts = counts[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits
