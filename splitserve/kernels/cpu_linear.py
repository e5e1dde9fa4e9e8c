"""float32 linears on a CPU: oneDNN for steps of several rows, MKL for one row (issue 30).

Measured on the development machine's AMD EPYC, one thread (docs/benchmarks.md, "SmolLM2
against vLLM's CPU backend"): MKL's float32 GEMM, what `F.linear` runs, stops at ~107
GFLOP/s at every prefill shape, half of what oneDNN reaches on the same core, and a
SmolLM2 prefill is 99% GEMM. vLLM's CPU backend runs its linears through oneDNN and served
1.7-1.9x our tokens on SmolLM2. `torch.ops.mkldnn._linear_pointwise` calls oneDNN on plain
dense tensors (no to_mkldnn / to_dense conversions, which cost ~37 us a call, and no
second copy of the weight) and reads our input-major weights as they are
(models/loader.py): 1.4-2.6x faster than MKL from 2 rows up. At one row MKL on the
input-major weight stays faster (0.042 against 0.060 ms for 576 -> 1536), so a decode step
of one sequence keeps it. The results agree with MKL's to float32 rounding.

Used for float32 CPU tensors on the native backend (the `auto` default on CPU); the
reference backend, other dtypes and devices keep `F.linear`. A torch build without oneDNN
(or whose op refuses the call) falls back to `F.linear` for the rest of the process.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
MIN_ROWS = 2  # below: MKL on the input-major weight is faster (one decode sequence)
_available: bool | None = None


def available() -> bool:
    global _available
    if _available is None:
        _available = bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _available


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() >= MIN_ROWS * x.shape[-1] and available())


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
