"""Weight-only quantized linear layers on CPU, native (cpu_quant_linear.cpp, built with the
other kernels by cpu_native.py).

y = x @ dequantize(qw).T (+ bias) for every QuantizedWeight layout (4-bit nibbles, fp4 e2m1 nibbles, 5..8-bit
bytes, fp8 e4m3), accumulated in float32 and returned in x's dtype. One C kernel serves
every number of rows: it dequantises each weight row's codes in registers and multiplies them
into up to 8 rows of x at a time, reading the codes once per ~256 KB block of x. For decode
that reads 1/8 to 1/4 of float32's weight bytes; for prefill it was measured faster than
dequantising tiles into torch's GEMM at every M (bench/experiments/quant_linear_cpu.py). With
several torch threads the weight rows are split over cpu_native's thread pool.
"""

from __future__ import annotations

import torch

from splitserve.kernels import cpu_native
from splitserve.kernels.quant_weight import QuantizedWeight


def supports(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """CPU, float32 or bfloat16 x, groups a multiple of 16 columns, contiguous codes and scales, and
    the library built."""
    contiguous = all(t is None or t.is_contiguous() for t in (qw.codes, qw.scales, qw.offsets))
    return (x.device.type == "cpu" and qw.codes.device.type == "cpu" and x.dtype in cpu_native.DTYPE_CODES
            and qw.group_size % 16 == 0 and contiguous and cpu_native.library() is not None)


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as quant_weight.quantized_linear_reference; call supports() first."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the quantized weight expects {qw.in_features}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, qw.in_features)
    if qw.input_perm is not None:
        rows = rows.index_select(1, qw.input_perm)  # once per call: the codes' column order
    rows = rows.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    m, k, n = rows.shape[0], qw.in_features, qw.out_features
    out = torch.empty(m, n)
    fn = cpu_native.library().splitserve_quant_gemv
    args = (rows.data_ptr(), m, k, qw.codes.data_ptr(), qw.bits, qw.scales.data_ptr(), _ptr(qw.offsets),
            qw.group_size, _ptr(bias), out.data_ptr(), n)
    _sliced(lambda first, end: fn(*args, first, end), n)
    return out.to(x.dtype).reshape(*lead, n)


def _sliced(run, rows: int) -> None:
    """run(first, end) over weight rows [0, rows), split over torch's threads."""
    if torch.get_num_threads() == 1:  # the engine's usual case: no slicing to pay for
        code = run(0, rows)
        if code:
            raise ValueError(f"native quantized linear refused its input: {cpu_native.ERRORS.get(code, code)}")
        return
    cpu_native._run_sliced(run, torch.ones(rows, dtype=torch.int64), "quantized linear")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
