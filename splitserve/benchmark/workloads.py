"""Synthetic workloads, deterministic for a seed. Each returns sessions; single-shot
workloads make sessions of one turn.

- random: input and output lengths drawn uniformly from inclusive ranges.
- prefix-repetition: N shared prefixes x M distinct suffixes, shuffled, so a
  prefix-aware router can reuse cached KV (the prefix is exactly shared, token for
  token with `ids`, word for word with `text`).
- multi-turn: chat sessions; each turn is a new user message and is sent after the
  previous answer, which the runner appends to the conversation.
- long-context: a fraction of requests with a long prompt (`context_len`), the rest
  short (`input_len`), shuffled: the long/short mix of disaggregation experiments.

Prompts are random token ids (sent as `prompt: [ids]` to /v1/completions) or random
words (chat, or text completions). Lengths are tokens either way: a text prompt is fitted
to its length with the served model's tokenizer (prompt_tokens.py), counting the whole
prompt as the server does (BOS, chat template). A multi-turn session fits each user
message as a first turn; later turns also carry the history, which the server's usage
report counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.benchmark.prompt_tokens import PromptFitter
from splitserve.benchmark.request import Session, Turn

WORKLOADS = ("random", "prefix-repetition", "multi-turn", "long-context")

# Short common words: most tokenizers encode " word" as a single token.
WORDS = (
    "the of and to in is for on that with as was at by it from be this are or an have not "
    "they which one you were all we can her has there been if more when will would who so "
    "no out up into do time two may only new some could these its like than other then "
    "first any my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three"
).split()


@dataclass
class WorkloadConfig:
    kind: str = "random"
    num_prompts: int = 100  # sessions; prefix-repetition uses num_prefixes x suffixes_per_prefix
    input_len: tuple[int, int] = (128, 128)  # inclusive range; suffix length for prefix-repetition
    output_len: tuple[int, int] = (64, 64)  # max_tokens range
    prompt_format: str = "ids"  # "ids" or "text"
    token_id_range: tuple[int, int] = (100, 1000)  # random ids are drawn from [lo, hi)
    num_prefixes: int = 4
    prefix_len: int = 256
    suffixes_per_prefix: int = 8
    turns: int = 3
    context_len: tuple[int, int] = (3072, 3072)  # + output must fit the model's context
    long_fraction: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; use one of {', '.join(WORKLOADS)}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt format must be 'ids' or 'text', got {self.prompt_format!r}")
        if self.kind == "multi-turn" and self.prompt_format != "text":
            raise ValueError("multi-turn sessions carry the answers as text: use prompt format 'text'")
        for name in ("input_len", "output_len", "context_len", "token_id_range"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must satisfy 1 <= low <= high, got {lo}:{hi}")
        if self.token_id_range[1] == self.token_id_range[0]:
            raise ValueError("token_id_range is [low, high): high must exceed low")
        for name in ("num_prompts", "num_prefixes", "prefix_len", "suffixes_per_prefix", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be within [0, 1], got {self.long_fraction}")


class _PromptMaker:
    def __init__(self, cfg: WorkloadConfig, rng: np.random.Generator, fitter: PromptFitter | None):
        self.cfg, self.rng, self.fitter = cfg, rng, fitter

    def length(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    def body(self, n: int, head: list[int] | str = "", head_len: int = 0) -> list[int] | str:
        """A prompt of n tokens, or `head` (head_len tokens) followed by n more. Text is
        fitted to the whole prompt as the server counts it. The draw does not depend on the
        tokenizer, so a seed gives the same words whatever the model."""
        if self.cfg.prompt_format == "ids":
            lo, hi = self.cfg.token_id_range
            return list(head) + self.rng.integers(lo, hi, size=n).tolist()
        words = [WORDS[i] for i in self.rng.integers(0, len(WORDS), size=n)]  # enough: a word is >= 1 token
        return self.fitter.fit(words, head_len + n, head)

    def turn(self, request_id: str, prompt: list[int] | str, n: int,
             group: int | None = None) -> Turn:
        return Turn(request_id, prompt, n, self.length(self.cfg.output_len), group)


def _single(i: int, turn: Turn) -> Session:
    return Session(f"s{i}", [turn])


def build_workload(cfg: WorkloadConfig, fitter: PromptFitter | None = None) -> list[Session]:
    """`fitter` sizes text prompts (prompt_tokens.py); ids need none."""
    cfg.validate()
    if cfg.prompt_format == "text" and fitter is None:
        raise ValueError("text prompts are sized in tokens: give a PromptFitter over the served model's tokenizer")
    make = _PromptMaker(cfg, np.random.default_rng(cfg.seed), fitter)
    if cfg.kind == "random":
        sessions = []
        for i in range(cfg.num_prompts):
            n = make.length(cfg.input_len)
            sessions.append(_single(i, make.turn(f"req-{i}", make.body(n), n)))
        return sessions
    if cfg.kind == "prefix-repetition":
        prefixes = [make.body(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
        pairs = [(g, k) for g in range(cfg.num_prefixes) for k in range(cfg.suffixes_per_prefix)]
        sessions = []
        for i, idx in enumerate(make.rng.permutation(len(pairs))):
            group, k = pairs[int(idx)]
            n = make.length(cfg.input_len)
            prompt = make.body(n, head=prefixes[group], head_len=cfg.prefix_len)
            turn = make.turn(f"req-{i}-p{group}s{k}", prompt, cfg.prefix_len + n, group)
            sessions.append(_single(i, turn))
        return sessions
    if cfg.kind == "multi-turn":
        sessions = []
        for i in range(cfg.num_prompts):
            turns = []
            for t in range(cfg.turns):
                n = make.length(cfg.input_len)
                turns.append(make.turn(f"req-{i}-t{t}", make.body(n), n))
            sessions.append(Session(f"s{i}", turns))
        return sessions
    # long-context: an exact number of long prompts, then shuffled, so a small run
    # still has the requested mix.
    n_long = round(cfg.num_prompts * cfg.long_fraction)
    is_long = [True] * n_long + [False] * (cfg.num_prompts - n_long)
    is_long = [is_long[int(j)] for j in make.rng.permutation(cfg.num_prompts)]
    sessions = []
    for i, long_ in enumerate(is_long):
        n = make.length(cfg.context_len if long_ else cfg.input_len)
        tag = "long" if long_ else "short"
        sessions.append(_single(i, make.turn(f"req-{i}-{tag}", make.body(n), n)))
    return sessions


def total_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
