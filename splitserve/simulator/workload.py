"""Request mixes for the simulator: a synthetic mix (rates and length distributions)
or a trace replayed from `splitserve bench --save-requests` results.

A trace is a set of numpy arrays, one entry per request, sorted by arrival: the
simulator never builds a Python object per request beyond what its queues hold.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARRIVALS = ("poisson", "gamma", "constant")


@dataclass
class RequestMix:
    num_requests: int = 1000
    rate: float = 1.0  # requests per second
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape (1: Poisson; < 1 burstier)
    prompt_len: tuple[int, int] = (128, 128)  # inclusive uniform range
    long_fraction: float = 0.0  # share of requests drawn from long_len instead
    long_len: tuple[int, int] = (2048, 2048)
    output_len: tuple[int, int] = (64, 64)
    num_prefixes: int = 0  # shared prefixes (0: none)
    prefix_len: int = 0  # tokens of each shared prefix, before the prompt_len part
    prefix_fraction: float = 1.0  # share of requests that start with a shared prefix
    seed: int = 0

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        for name in ("prompt_len", "long_len", "output_len"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must be LOW:HIGH with 1 <= LOW <= HIGH, got {lo}:{hi}")
        for name in ("long_fraction", "prefix_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")
        if self.num_prefixes < 0 or self.prefix_len < 0:
            raise ValueError("num_prefixes and prefix_len must be >= 0")
        if (self.num_prefixes > 0) != (self.prefix_len > 0):
            raise ValueError("give both num_prefixes and prefix_len (> 0), or neither")


@dataclass
class Trace:
    arrival: np.ndarray  # seconds, sorted
    prompt_len: np.ndarray  # tokens, including the shared prefix
    output_len: np.ndarray  # tokens generated (ignore_eos: exactly max_tokens)
    group: np.ndarray  # shared-prefix id, -1 for none
    prefix_len: np.ndarray  # tokens of the shared prefix (0 for none)

    def __len__(self) -> int:
        return len(self.arrival)

    def check(self) -> None:
        n = len(self.arrival)
        for name in ("prompt_len", "output_len", "group", "prefix_len"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trace: {name} has {len(getattr(self, name))} entries for {n} arrivals")
        if n == 0:
            raise ValueError("trace: no requests")
        if np.any(np.diff(self.arrival) < 0):
            raise ValueError("trace: arrivals must be sorted")
        if np.any(self.prompt_len < 1) or np.any(self.output_len < 1):
            raise ValueError("trace: every request needs >= 1 prompt token and >= 1 output token")
        if np.any(self.prefix_len >= self.prompt_len):
            raise ValueError("trace: a shared prefix must be shorter than its prompt")


def _gaps(mix: RequestMix, rng: np.random.Generator) -> np.ndarray:
    n = mix.num_requests
    if mix.arrival == "constant":
        return np.full(n, 1.0 / mix.rate)
    shape = 1.0 if mix.arrival == "poisson" else mix.burstiness
    return rng.gamma(shape, 1.0 / (mix.rate * shape), size=n)


def build_trace(mix: RequestMix) -> Trace:
    mix.validate()
    rng = np.random.default_rng(mix.seed)
    n = mix.num_requests
    arrival = np.cumsum(_gaps(mix, rng))
    arrival -= arrival[0]
    prompt = rng.integers(mix.prompt_len[0], mix.prompt_len[1] + 1, size=n)
    if mix.long_fraction > 0:
        is_long = rng.random(n) < mix.long_fraction
        prompt = np.where(is_long, rng.integers(mix.long_len[0], mix.long_len[1] + 1, size=n), prompt)
    output = rng.integers(mix.output_len[0], mix.output_len[1] + 1, size=n)
    group = np.full(n, -1, dtype=np.int64)
    prefix = np.zeros(n, dtype=np.int64)
    if mix.num_prefixes:
        shared = rng.random(n) < mix.prefix_fraction
        group = np.where(shared, rng.integers(0, mix.num_prefixes, size=n), -1)
        prefix = np.where(shared, mix.prefix_len, 0)
        prompt = prompt + prefix
    trace = Trace(arrival, prompt.astype(np.int64), output.astype(np.int64), group.astype(np.int64),
                  prefix.astype(np.int64))
    trace.check()
    return trace


_GROUP = re.compile(r"-p(\d+)s\d+$")


def trace_from_bench(path: str | Path, prefix_len: int = 0) -> Trace:
    """The requests of a `splitserve bench --save-requests` result (its first run):
    send times, prompt and output token counts; prefix-repetition request ids
    (`...-p<group>s<k>`) give the shared-prefix group, of `prefix_len` tokens."""
    p = Path(path)
    doc = json.loads(p.read_text())
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not runs or "requests" not in runs[0]:
        raise ValueError(f"{p}: no per-request records; rerun `splitserve bench` with --save-requests")
    rows = sorted((r for r in runs[0]["requests"] if r.get("success")), key=lambda r: r["send_offset_s"])
    if not rows:
        raise ValueError(f"{p}: no completed request to replay")
    groups = []
    for r in rows:
        m = _GROUP.search(r["request_id"])
        groups.append(int(m.group(1)) if m and prefix_len else -1)
    group = np.array(groups, dtype=np.int64)
    trace = Trace(np.array([r["send_offset_s"] for r in rows], dtype=float),
                  np.array([r["prompt_tokens"] for r in rows], dtype=np.int64),
                  np.array([r["output_tokens"] for r in rows], dtype=np.int64), group,
                  np.where(group >= 0, prefix_len, 0).astype(np.int64))
    trace.arrival -= trace.arrival[0]
    trace.check()
    return trace
