"""compressed-tensors integer formats (llm-compressor's W4A16 / W8A16 / W8A8 releases):

  pack-quantized   weight_packed int32 [N, K * bits / 32]: codes packed along the input
                   dim, element k at bit (k % (32 / bits)) * bits, stored as unsigned
                   code = q + 2^(bits-1); weight_shape [N, K]; weight_scale [N, G];
                   asymmetric schemes add weight_zero_point, packed the same way along
                   the OUTPUT dim ([N * bits / 32, G]) and offset by 2^(bits-1) too
  naive-quantized  weight int8 [N, K], weight_scale [N, G], optional int8 weight_zero_point

w = (q - zero) * scale. Channel strategy: G = 1. Older W4A16 releases with actorder 'group'
add weight_g_idx [K], the group of each input column (as GPTQ's g_idx)."""

from __future__ import annotations

import torch

from splitserve.engine.quant.packing import group_order, integer_weight, unpack_int32
from splitserve.kernels.quant_weight import QuantizedWeight


def _group(k: int, scale: torch.Tensor, name: str) -> int:
    groups = scale.shape[-1]
    if k % groups:
        raise ValueError(f"{name}: weight_scale's {groups} groups do not divide the {k} input columns")
    return k // groups


def pack_quantized_weight(packed, scale, shape, zero_point, bits: int, name: str, g_idx=None) -> QuantizedWeight:
    """`g_idx` (actorder 'group'): the group of each input column, as GPTQ's."""
    n, k = (int(v) for v in shape.tolist())
    if bits not in (4, 8) or tuple(packed.shape) != (n, -(-k * bits // 32)) or scale.shape[0] != n:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do "
                         f"not fit weight_shape {[n, k]} at {bits} bits")
    offset = 1 << (bits - 1)
    codes = unpack_int32(packed, bits, dim=1)[:, :k]
    if zero_point is None:
        zeros = torch.full(tuple(scale.shape), float(offset))
    else:
        zeros = unpack_int32(zero_point, bits, dim=0)[:n].float()
    group = _group(k, scale, name)
    perm = group_order(g_idx, k, group, name)
    if perm is not None:
        codes = codes[:, perm]
    return integer_weight(codes, scale, zeros, bits, group, perm)


def naive_quantized_weight(weight, scale, zero_point, name: str) -> QuantizedWeight:
    if weight.dtype != torch.int8 or weight.dim() != 2 or scale.shape[0] != weight.shape[0]:
        raise ValueError(f"{name}: expected an int8 [N, K] weight with weight_scale [N, G], got {weight.dtype} "
                         f"{tuple(weight.shape)} and {tuple(scale.shape)}")
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)  # unsigned: the offset moves into the zero point
    zeros = 128 + (torch.zeros(tuple(scale.shape)) if zero_point is None else zero_point.float().reshape(scale.shape))
    return integer_weight(codes, scale, zeros, 8, _group(weight.shape[1], scale, name))
