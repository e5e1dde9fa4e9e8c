"""Weight-only quantized linear layers on CPU, native (cpu_quant_linear.cpp, built with the
other kernels by cpu_native.py).

y = x @ dequantize(qw).T (+ bias) for every QuantizedWeight layout (4-bit nibbles, 5..8-bit
bytes, fp8 e4m3), accumulated in float32 and returned in x's dtype:
  - up to GEMV_MAX_ROWS rows of x (decode): the C gemv reads each weight byte once for all
    rows, dequantising in registers;
  - more rows (prefill): tiles of TILE_FLOATS dequantised weights, each handed to torch's
    GEMM (MKL), which beats a hand-written micro-kernel there; the dequantising is one pass
    per tile against M multiply-adds per weight.
With several torch threads both split the weight rows over cpu_native's thread pool.
"""

from __future__ import annotations

import torch

from splitserve.kernels import cpu_native
from splitserve.kernels.quant_weight import QuantizedWeight

# Measured on this machine's AVX-512 core (bench/experiments/quant_linear_cpu.py, "crossover"):
# the gemv beats dequantise-then-GEMM up to 64 rows at SmolLM2's and 4096 x 4096 shapes.
GEMV_MAX_ROWS = 64
TILE_FLOATS = 1 << 18  # 1 MiB of float32 weights per tile: stays in L2 while the GEMM reads it


def supports(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """CPU, float32 or bfloat16 x, groups a multiple of 16 columns, contiguous codes and scales, and
    the library built."""
    return (x.device.type == "cpu" and qw.codes.device.type == "cpu" and x.dtype in cpu_native.DTYPE_CODES
            and qw.group_size % 16 == 0 and all(t is None or t.is_contiguous() for t in (qw.codes, qw.scales, qw.offsets))
            and cpu_native.library() is not None)


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as quant_weight.quantized_linear_reference; call supports() first."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the quantized weight expects {qw.in_features}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, qw.in_features)
    if qw.input_perm is not None:
        rows = rows.index_select(1, qw.input_perm)  # once per call: the codes' column order
    rows = rows.float()
    if qw.bits == 4:  # each 16 columns as the kernels read packed nibbles: the 8 even, then the 8 odd
        rows = rows.reshape(rows.shape[0], -1, 8, 2).transpose(2, 3).reshape(rows.shape[0], -1)
    rows = rows.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    if rows.shape[0] <= GEMV_MAX_ROWS:
        out = _gemv(rows, qw, bias)
    else:
        out = _tiled_gemm(rows, qw, bias)
    return out.to(x.dtype).reshape(*lead, qw.out_features)


def _gemv(rows: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = rows.shape
    n = qw.out_features
    out = torch.empty(m, n)
    fn = cpu_native.library().splitserve_quant_gemv
    args = (rows.data_ptr(), m, k, qw.codes.data_ptr(), qw.bits, qw.scales.data_ptr(), _ptr(qw.offsets),
            qw.group_size, _ptr(bias), out.data_ptr(), n)
    _sliced(lambda first, end: fn(*args, first, end), n)
    return out


def _tiled_gemm(rows: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = qw.out_features, qw.in_features
    tile = max(16, TILE_FLOATS // k)
    weights = torch.empty(min(tile, n), k)
    out = torch.empty(rows.shape[0], n)
    fn = cpu_native.library().splitserve_quant_dequantize
    args = (qw.codes.data_ptr(), qw.bits, qw.scales.data_ptr(), _ptr(qw.offsets), qw.group_size, k)
    for first in range(0, n, tile):
        end = min(first + tile, n)
        _sliced(lambda a, b, first=first: fn(*args, weights[a - first:].data_ptr(), a, b), end - first, first)
        out[:, first:end] = rows @ weights[:end - first].T
    if bias is not None:
        out += bias
    return out


def _sliced(run, rows: int, first: int = 0) -> None:
    """run(a, b) over weight rows [first, first + rows), split over torch's threads."""
    if torch.get_num_threads() == 1:  # the engine's usual case: no slicing to pay for
        code = run(first, first + rows)
        if code:
            raise ValueError(f"native quantized linear refused its input: {cpu_native.ERRORS.get(code, code)}")
        return
    cpu_native._run_sliced(lambda a, b: run(first + a, first + b), torch.ones(rows, dtype=torch.int64),
                           "quantized linear")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
