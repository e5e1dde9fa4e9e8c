"""Cost models fitted from `splitserve profile` measurements.

One engine step is one forward pass over a mixed batch (prefill chunks and decodes,
as the scheduler builds it), so one model prices every step, prefill or decode:

    step_s = c_step + c_token * new_tokens + c_seq * sequences + c_attn * attention
             + c_ctx * decode_context

where `attention` = sum over the prefill chunks of new_i * (cached_i + (new_i + 1) / 2),
the query x key pairs a causal prefill computes, and `decode_context` = the keys the
batch's decodes read (each its context + 1). The two attentions are different kernels
(prefill over a paged prefix; paged decode, which gathers every block), so each has its
own price. The
coefficients are fitted by least squares on *relative* error (each row divided by
its measured time), so a 5 ms decode step counts as much as a 1 s prefill; a
coefficient that comes out negative is dropped and the rest refitted (a cost cannot
be negative). KV transfer is affine in bytes; routing is a constant per request.

`serving` holds what the engine alone does not see, measured through a real
`splitserve serve` with one request in flight: the fixed time a request spends in
router, gRPC and SSE before its first token, and the extra time per streamed token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

STEP_FEATURES = ("c_step", "c_token", "c_seq", "c_attn", "c_ctx")


def attention_work(new: float, cached: float) -> float:
    return new * (cached + (new + 1) / 2)


def fit_nonnegative(x: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """Least squares x @ c ≈ y with c >= 0 (active set: drop the most negative
    coefficient and refit until none is negative). `relative` minimizes the error
    relative to y, which must then be positive."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"fit: {x.shape[0] if x.ndim == 2 else '?'} feature rows for {y.shape[0]} measurements")
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"fit: need at least {x.shape[1]} measurements, got {x.shape[0]}")
    if relative and np.any(y <= 0):
        raise ValueError("fit: relative least squares needs positive measurements")
    w = 1.0 / y if relative else np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass(frozen=True)
class StepCost:
    c_step: float = 0.0  # seconds per step
    c_token: float = 0.0  # seconds per new token
    c_seq: float = 0.0  # seconds per sequence in the batch
    c_attn: float = 0.0  # seconds per prefill query x key pair
    c_ctx: float = 0.0  # seconds per key a decode reads

    def time(self, new_tokens: float, sequences: float, attention: float, decode_context: float = 0.0) -> float:
        return (self.c_step + self.c_token * new_tokens + self.c_seq * sequences + self.c_attn * attention
                + self.c_ctx * decode_context)

    def prefill(self, new: int, cached: int = 0) -> float:
        """One sequence prefilled in one step."""
        return self.time(new, 1, attention_work(new, cached))

    def decode(self, batch: int, context_sum: float) -> float:
        """A pure decode step of `batch` sequences holding `context_sum` tokens in all."""
        return self.time(batch, batch, 0.0, context_sum + batch)

    @classmethod
    def fit(cls, rows: list[dict]) -> StepCost:
        """rows: {"new_tokens", "sequences", "attention", "decode_context", "seconds"} per
        measured step."""
        x = np.array([[1.0, r["new_tokens"], r["sequences"], r["attention"], r.get("decode_context", 0.0)]
                      for r in rows])
        y = np.array([r["seconds"] for r in rows])
        return cls(*map(float, fit_nonnegative(x, y)))


@dataclass(frozen=True)
class AffineCost:
    fixed: float = 0.0  # seconds
    per_unit: float = 0.0  # seconds per unit (byte)

    def time(self, units: float) -> float:
        return self.fixed + self.per_unit * units

    @classmethod
    def fit(cls, units: list[float], seconds: list[float]) -> AffineCost:
        x = np.column_stack([np.ones(len(units)), np.asarray(units, dtype=float)])
        return cls(*map(float, fit_nonnegative(x, np.asarray(seconds, dtype=float))))


@dataclass(frozen=True)
class ServingOverhead:
    first_token_s: float = 0.0  # router + gRPC + SSE before the first token
    per_token_s: float = 0.0  # added to each streamed token's gap
    frontend_load: float = 0.0  # CPU cores the router and the client use while streaming


@dataclass(frozen=True)
class CostModel:
    step: StepCost = field(default_factory=StepCost)
    transfer: AffineCost = field(default_factory=AffineCost)  # KV push, by bytes
    routing_s: float = 0.0  # router decision per request
    serving: ServingOverhead = field(default_factory=ServingOverhead)
    kv_bytes_per_token: int = 0  # all layers, K and V
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        try:
            return cls(step=StepCost(**d["step"]), transfer=AffineCost(**d["transfer"]),
                       routing_s=float(d["routing_s"]), serving=ServingOverhead(**d.get("serving", {})),
                       kv_bytes_per_token=int(d["kv_bytes_per_token"]), block_size=int(d["block_size"]),
                       max_num_batched_tokens=int(d["max_num_batched_tokens"]),
                       max_num_seqs=int(d["max_num_seqs"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost model is missing or has a malformed field ({exc}); "
                             "regenerate it with `splitserve profile`") from None


def load_costs(path: str | Path) -> CostModel:
    """The `costs` section of a profile JSON written by `splitserve profile`."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read profile {p}: {exc.strerror}; create it with `splitserve profile`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {p} is not valid JSON ({exc}); regenerate it with `splitserve profile`") from None
    if not isinstance(doc, dict) or "costs" not in doc:
        raise ValueError(f"profile {p} has no 'costs' section; regenerate it with `splitserve profile`")
    return CostModel.from_dict(doc["costs"])
