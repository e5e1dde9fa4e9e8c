"""Prompt lookup (vLLM's "ngram" method): the drafts are the tokens that followed an earlier
occurrence of the sequence's last n tokens. Copy-heavy output (an edited file that is in the
prompt, repeated JSON, quotes) continues such an occurrence, so the drafts are often right.

Longest n first (prompt_lookup_max down to prompt_lookup_min); among the occurrences of that
n-gram the latest one followed by k whole tokens, else the latest one (a periodic tail)."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens to follow `tokens` ([] when no n-gram of the tail recurs)."""
    if k <= 0:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = length - n  # candidate occurrences start at 0 .. length - n - 1 (a token must follow)
        hit = np.ones(starts, dtype=bool)
        for j in range(n):
            hit &= ids[j : j + starts] == ids[length - n + j]
        where = np.flatnonzero(hit)
        if len(where) == 0:
            continue
        whole = where[where + n + k <= length]
        start = int(whole[-1] if len(whole) else where[-1]) + n
        return ids[start : start + k].tolist()
    return []
