"""The matmul of a small decode batch on a GPU: y [M, N] = x [M, K] @ W [N, K].T (+ bias)
for M <= GEMV_MAX_ROWS, reading W once.

A decode step of one sequence is a chain of matrix-vector products, and its speed is how
fast the weights stream from HBM (issue 37's MBU). cuBLAS's kernels for M = 1 reached
1.44-2.70 TB/s on an H100 at the Llama-3-8B shapes, against a 3.03 TB/s read ceiling; this
plain split-N kernel (each program owns BLOCK_N = 8 weight rows and walks K in 1,024-column
tiles, 8 warps: the best of six tiles tried) reached 1.63-3.04 TB/s on the same shapes, 4-14%
faster on every one (`bench/gpu/gemv_probe.py`, `bench/results/gemv_probe_nvidia_h100.json`).

Each program keeps one float32 accumulator per (x row, weight row) and loads each weight tile
once for all M rows, so M = 2..4 costs little more than M = 1. A row's dot product is summed
in the same order whatever M is: a sequence gets the same bits at batch 1, 3 or 4 (the CUDA
graphs' padded buckets rely on nothing else). Float32 accumulation, then x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import kernel

GEMV_MAX_ROWS = 4
BLOCK_N, BLOCK_K, NUM_WARPS = 8, 1024, 8  # the H100 probe's best tile (module docstring)


@kernel(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_x, stride_w, stride_out,
                 M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        tile = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        x0 = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc0 += tl.sum(tile * x0[None, :], axis=1)
        if M > 1:
            x1 = tl.load(x_ptr + stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc1 += tl.sum(tile * x1[None, :], axis=1)
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc2 += tl.sum(tile * x2[None, :], axis=1)
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc3 += tl.sum(tile * x3[None, :], axis=1)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc0 += b
        acc1 += b
        acc2 += b
        acc3 += b
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows, acc0.to(out_ty), mask=row_ok)
    if M > 1:
        tl.store(out_ptr + stride_out + rows, acc1.to(out_ty), mask=row_ok)
    if M > 2:
        tl.store(out_ptr + 2 * stride_out + rows, acc2.to(out_ty), mask=row_ok)
    if M > 3:
        tl.store(out_ptr + 3 * stride_out + rows, acc3.to(out_ty), mask=row_ok)


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A 16-bit decode-sized matmul this kernel computes (ops.linear asks on CUDA)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1] and 0 < x.numel() // x.shape[-1]
            <= GEMV_MAX_ROWS)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) for at most GEMV_MAX_ROWS rows of x, in x's dtype."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if not 0 < m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tensors = (x2, weight, out) if bias is None else (x2, weight, out, bias)
    _gemv_kernel.for_tensors("gemv", *tensors)[(triton.cdiv(n, BLOCK_N),)](
        x2, weight, bias if bias is not None else out, out, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        M=m, HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out.reshape(*lead, n)
