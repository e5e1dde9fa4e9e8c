"""Rotary position embedding tables for every rope type transformers defines for the
supported families: default, linear, llama3, yarn, longrope and dynamic (NTK).

Numerics follow transformers' `modeling_rope_utils`: inverse frequencies in float32,
cos/sin computed in float32, scaled by the type's attention factor, then cast.

Two types change with the sequence length in transformers:
- dynamic recomputes its base only beyond `max_position_embeddings`, a length this engine
  never serves (max_model_len <= max_position_embeddings), so within it it is default rope;
- longrope uses its short factors while a sequence is at most
  `original_max_position_embeddings` long and its long factors beyond; when a sequence
  grows past that length, transformers' generate recomputes all of its KV with the long
  factors (Phi-3's prepare_inputs_for_generation drops the cache). The engine does the
  same: a prompt longer than that is computed with the long factors, and a sequence that
  grows past it is recomputed (Scheduler.recompute_with_long_rope). The table holds both
  sets (long rows after short ones); the model runner picks per sequence. Its KV blocks
  hash under a salt (Sequence.hash_salt), so the prefix cache never mixes the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.core.rope_config import RopeSpec


@dataclass
class RopeTable:
    cos: torch.Tensor  # [rows, rotary_dim]
    sin: torch.Tensor
    rotary_dim: int
    long_after: int | None = None  # longrope: long-factor rows start at `long_offset`
    long_offset: int = 0


def inverse_frequencies(spec: RopeSpec, dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor the cos/sin are scaled by)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (spec.theta**exponents)
    p, kind = spec.params, spec.kind
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if kind == "llama3":
        return _llama3_scaled(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(spec, dim)
    if kind == "longrope":
        return _longrope(spec, dim, long)
    raise ValueError(f"unsupported rope type {kind!r}")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~short_wave & ~long_wave
    return torch.where(medium, blended, scaled)


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between."""
    p, base = spec.params, spec.theta
    original = float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or spec.max_position_embeddings / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(spec: RopeSpec, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    p = spec.params
    original = spec.original_max_position_embeddings
    factor = float(p.get("factor") or spec.max_position_embeddings / original)
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * spec.theta**shape), float(attention)


def _cos_sin(inv_freq: torch.Tensor, attention: float, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


def rope_table(spec: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype, device) -> RopeTable:
    """cos/sin for positions 0..max_positions-1 (then the long-factor rows, for longrope)."""
    dim = spec.rotary_dim or head_dim
    cos, sin = _cos_sin(*inverse_frequencies(spec, dim), max_positions)
    long_after = spec.long_after
    if long_after is not None and long_after < max_positions:
        long_cos, long_sin = _cos_sin(*inverse_frequencies(spec, dim, long=True), max_positions)
        cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
    else:
        long_after = None  # never reached: short factors only
    return RopeTable(cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device), dim,
                     long_after, max_positions)
