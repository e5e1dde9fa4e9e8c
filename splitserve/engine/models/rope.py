"""Rotary position embedding tables (default, linear and Llama-3 frequency scaling)."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {kind!r}")


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


def rope_tables(head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim], computed in float32 then cast."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)
