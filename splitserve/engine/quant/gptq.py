"""GPTQ (AutoGPTQ / GPTQModel / optimum layout), 4-bit:

  qweight int32 [K / 8, N]   codes packed along the input dim, row k at bits 4 * (k % 8)
  qzeros  int32 [G, N / 8]   zero points packed along the output dim
  scales  f16   [G, N]
  g_idx   int32 [K]          the group of each input column (act-order permutes them)

w[n, k] = (q[k, n] - z[g, n]) * s[g, n] with g = g_idx[k]. The classic format (v1,
`checkpoint_format: gptq`) stores each zero point minus one; like vLLM's GPTQ kernels we
add the one back to the unpacked nibble (a stored 15 is a zero point of 16, not 0).
With act-order the codes' columns are sorted by group (a stable argsort of g_idx) so
that groups are contiguous, and the sort becomes QuantizedWeight.input_perm."""

from __future__ import annotations

from splitserve.engine.quant.packing import group_order, integer_weight, unpack_int32
from splitserve.kernels.quant_weight import QuantizedWeight


def gptq_weight(qweight, qzeros, scales, g_idx, group_size: int, zero_plus_one: bool, name: str) -> QuantizedWeight:
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if group_size == -1:
        group_size = k
    if k % group_size or groups != k // group_size or tuple(scales.shape) != (groups, n) \
            or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit {k} inputs, {n} outputs, group_size {group_size}")
    codes = unpack_int32(qweight, 4, dim=0).T  # [N, K]
    zeros = unpack_int32(qzeros, 4, dim=1).T.float() + (1 if zero_plus_one else 0)  # [N, G]
    perm = group_order(g_idx, k, group_size, name)
    if perm is not None:
        codes = codes[:, perm]
    return integer_weight(codes, scales.T, zeros, 4, group_size, perm)
