"""The log-probabilities of one generated token, as the engine samples them, the workers
stream them and the router turns them into OpenAI's logprobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token id, logprob), most likely first
