"""When each session is released: fixed rate, Poisson, or gamma with burstiness.

As in vLLM, inter-arrival gaps follow Gamma(shape=burstiness, scale=1/(rate *
burstiness)): the mean gap stays 1/rate whatever the burstiness, burstiness 1 is a
Poisson process, below 1 is burstier (coefficient of variation 1/sqrt(burstiness)),
above 1 is smoother. `constant` sends exactly every 1/rate seconds. An infinite rate
releases everything at once. The first session goes out at offset 0.
"""

from __future__ import annotations

import math

import numpy as np

ARRIVAL_KINDS = ("poisson", "constant")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, kind: str = "poisson",
                    seed: int | None = None) -> list[float]:
    """Release times in seconds from the benchmark start, non-decreasing."""
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not rate > 0:  # also rejects NaN
        raise ValueError(f"request rate must be > 0 (or inf for all at once), got {rate}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"unknown arrival process {kind!r}; use one of {', '.join(ARRIVAL_KINDS)}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if kind == "constant":
        if burstiness != 1.0:
            raise ValueError("burstiness only shapes Poisson/gamma arrivals; "
                             "leave it at 1 with --arrival constant")
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def describe(rate: float, burstiness: float, kind: str) -> str:
    if math.isinf(rate):
        return "all at once (rate inf)"
    if kind == "constant":
        return f"fixed rate {rate:g} req/s"
    if burstiness == 1.0:
        return f"Poisson, {rate:g} req/s"
    return f"gamma arrivals, {rate:g} req/s, burstiness {burstiness:g}"
