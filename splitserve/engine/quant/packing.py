"""Bit twiddling the quantized formats share: int32 words holding 32 // bits codes, and the
two-codes-a-byte layout of QuantizedWeight (column 2j low nibble, 2j + 1 high)."""

from __future__ import annotations

import torch

from splitserve.kernels.quant_weight import QuantizedWeight


def unpack_int32(words: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """uint8 codes from int32 words packed along `dim`, lowest bits first: word w holds
    elements w * (32 // bits) + i at bit i * bits. `order` (AWQ) says which element the
    i-th field holds instead: element w * (32 // bits) + order[i]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    w = words.to(torch.int32).movedim(dim, -1)
    fields = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order))]
    codes = fields.reshape(*w.shape[:-1], w.shape[-1] * per).to(torch.uint8)
    return codes.movedim(-1, dim)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes < 16 -> uint8 [N, K // 2], QuantizedWeight's 4-bit layout."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def group_order(g_idx: torch.Tensor | None, k: int, group_size: int, name: str) -> torch.Tensor | None:
    """The input permutation that makes act-order groups contiguous (a stable sort of g_idx,
    the group of each input column), or None when they already are."""
    natural = torch.arange(k) // group_size
    if g_idx is None or torch.equal(g_idx.long(), natural):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], natural):
        raise ValueError(f"{name}: g_idx does not give every group exactly {group_size} columns")
    return perm


def integer_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   input_perm: torch.Tensor | None = None) -> QuantizedWeight:
    """w = (code - zero) * scale per group, from unsigned codes [N, K] and per-group scales and
    zero points [N, G]: offsets = -zero * scale. Exact in float32: code * scale and
    zero * scale are exact for 16-bit scales, and so is their difference (code - zero) * scale."""
    n, k = codes.shape
    scales = scales.float().contiguous()
    return QuantizedWeight(codes=pack_nibbles(codes) if bits == 4 else codes.contiguous(), scales=scales,
                           offsets=(-zeros.float() * scales).contiguous(), bits=bits, group_size=group_size,
                           in_features=k, out_features=n, input_perm=input_perm)
