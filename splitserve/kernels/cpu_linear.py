"""float32 linears on a CPU: oneDNN for steps of several rows, a native gemv for one row (issue 30).

Measured on the development machine's AMD EPYC, one thread (docs/benchmarks.md, "SmolLM2
against vLLM's CPU backend"): MKL's float32 GEMM, what `F.linear` runs, stops at ~107
GFLOP/s at every prefill shape, half of what oneDNN reaches on the same core, and a
SmolLM2 prefill is 99% GEMM. vLLM's CPU backend runs its linears through oneDNN and served
1.7-1.9x our tokens on SmolLM2. `torch.ops.mkldnn._linear_pointwise` calls oneDNN on plain
dense tensors (no to_mkldnn / to_dense conversions, which cost ~37 us a call, and no
second copy of the weight) and reads our input-major weights as they are
(models/loader.py): 1.4-2.6x faster than MKL from 2 rows up.

The loader goes one step further where it can (`pack`): each decoder linear's weight is
reordered once into oneDNN's blocked layout (an opaque mkldnn tensor that replaces the dense
one, so no second copy), which every step then reads in place. Measured on SmolLM2's 30
layers, cold weights, one thread, thread time: prefill rows 900 227 -> 252 GFLOP/s, decode
batch 8 18.8 -> 22.7 GB/s, but batch 1 5-18% slower than the gemv below, per shape. In the
engine, SmolLM2 (thread time, same tokens): prefill of 900 tokens -6%, a decode step at batch 8
-12%, at batch 1 +3.5%, a request of 900 + 47 tokens -1%. Weights under PACK_MIN_BYTES stay
dense. Packed weights run on oneDNN whatever the kernel backend (nothing else reads them).

One row (a decode step of one sequence) is a pass over the weight at two flops per float
read: what counts is the rate the weight streams from memory, and there MKL's gemv (17-23
GB/s on this machine's EPYC, one thread) and oneDNN (22-24 GB/s) leave a third of the
core's bandwidth unused. `splitserve_dense_gemv` (cpu_dense_gemv.cpp, built with the other
native kernels) reads either layout in address order with eight streams in flight, 29-32
GB/s on decoder linears and 38 GB/s on SmolLM2's tied LM head (MKL: 17). The results agree
with MKL's to float32 rounding.

Used for float32 CPU tensors on the native backend (the `auto` default on CPU); the
reference backend, other dtypes and devices keep `F.linear`. A torch build without oneDNN
(or whose op refuses the call) falls back to `F.linear` for the rest of the process; without
the native library (no compiler) one row goes to `F.linear` too.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_native

log = logging.getLogger(__name__)
MIN_ROWS = 2  # from here oneDNN; one row: the native gemv (or MKL)
PACK_BATCH_HINT = 1024  # rows oneDNN tunes a packed layout for (64..2048 measured alike from 1 to 900 rows)
# Smaller weights stay dense: oneDNN's per-call cost ate the packed layout's gain there (a
# demo-model decode step at batch 1 took 1.1-1.3 ms packed, 0.9 ms dense; prefill alike).
PACK_MIN_BYTES = 2 << 20
_available: bool | None = None


def available() -> bool:
    global _available
    if _available is None:
        _available = bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _available


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Several rows of float32 on a CPU, with oneDNN there."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() >= MIN_ROWS * x.shape[-1] and available())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ([out, in], float32, CPU) reordered into oneDNN's blocked layout, for
    `packed_linear`; None for a small weight or where this torch build cannot (the caller
    keeps the dense weight)."""
    if not available() or weight.numel() * weight.element_size() < PACK_MIN_BYTES:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    except RuntimeError as exc:
        log.warning("oneDNN cannot pack linear weights (%s); they stay dense", exc)
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for a weight `pack` made: any number of rows, oneDNN."""
    rows = x.reshape(-1, x.shape[-1])
    y = _onednn_linear(rows, packed, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One float32 row on a CPU, a weight in either dense layout, and the native library built."""
    n, k = weight.shape
    dense = weight.stride() in ((1, n), (k, 1))
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() == x.shape[-1] and dense and cpu_native.library() is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for one row through the native gemv (callers check `gemv_eligible`)."""
    n, k = weight.shape
    row = x.reshape(k).contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    y = torch.empty(n)
    input_major = int(weight.stride() == (1, n) and n > 1)
    fn = cpu_native.library().splitserve_dense_gemv
    args = (row.data_ptr(), k, weight.data_ptr(), input_major, None if bias is None else bias.data_ptr(),
            y.data_ptr(), n)
    if torch.get_num_threads() == 1:  # the engine's usual case: no slicing to pay for
        fn(*args, 0, n)
    else:  # output columns split over the native kernels' thread pool
        cpu_native._run_sliced(lambda first, end: fn(*args, first, end), torch.ones(n, dtype=torch.int64), "gemv")
    return y.reshape(*x.shape[:-1], n)


def _onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN (callers check `eligible` first)."""
    global _available
    rows = x.reshape(-1, x.shape[-1])
    try:
        y = _onednn_linear(rows, weight, bias)
    except RuntimeError as exc:  # a build whose oneDNN cannot take the call: MKL from now on
        log.warning("oneDNN linear unavailable (%s); float32 CPU linears use MKL", exc)
        _available = False
        return F.linear(x, weight, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
