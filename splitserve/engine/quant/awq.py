"""AWQ (AutoAWQ's GEMM layout), 4-bit:

  qweight int32 [K, N / 8]   codes packed along the output dim
  qzeros  int32 [G, N / 8]   zero points, packed the same way
  scales  f16   [G, N]

w[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]. The eight nibbles of a word are
interleaved: nibble i holds column 8j + AWQ_ORDER[i] (vLLM unpacks with the inverse,
[0, 4, 1, 5, 2, 6, 3, 7]). Zero points are stored as they are (no GPTQ minus one)."""

from __future__ import annotations

from splitserve.engine.quant.packing import integer_weight, unpack_int32
from splitserve.kernels.quant_weight import QuantizedWeight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_weight(qweight, qzeros, scales, group_size: int, name: str) -> QuantizedWeight:
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if group_size == -1:
        group_size = k
    groups = k // group_size if k % group_size == 0 else -1
    if groups < 1 or tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                         f"{tuple(scales.shape)} do not fit {k} inputs, {n} outputs, group_size {group_size}")
    codes = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER).T  # [N, K]
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER).T  # [N, G]
    return integer_weight(codes, scales.T, zeros, 4, group_size)
