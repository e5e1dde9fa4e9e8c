"""Fused mixture-of-experts: the (token, k) rows grouped by expert, then one grouped GEMM
kernel launched twice - gate_up with SiLU-and-mul, then down with the routing weights.

`moe_align` sorts the tokens*top_k rows by expert and pads each expert's run to a
multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted order belongs to exactly one
expert (`block_experts`); padding rows hold the out-of-range id `tokens*top_k` and are
masked. The grid is sized from the shapes alone (at most min(experts, rows) runs can need
padding), and tiles past the padded total return at once: no value is read on the host,
so nothing synchronises with the GPU.

Stage 1 reads row r's token (r // top_k) and writes silu(x W1[e]^T) * (x W3[e]^T) to an
intermediate [rows, I] in the activation dtype; stage 2 writes that times W2[e]^T, scaled
by the row's routing weight, to a float32 [tokens, top_k, hidden], summed over k at the
end. Rounding follows splitserve/kernels/moe_reference.py: projections rounded to the
activation dtype, routing weight and top-k sum in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.moe_reference import check_fused_moe_args
from splitserve.kernels.triton_common import dot_precision, kernel, upcast_dot


@kernel(do_not_specialize=["num_rows"],
        do_not_specialize_on_alignment=["weights_ptr", "sorted_rows_ptr", "block_experts_ptr", "num_padded_ptr"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_rows_ptr, block_experts_ptr, num_padded_ptr,
    N, K, num_rows, a_row_divisor,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr, ROUTED_WEIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """C[r, n] for the BLOCK_M sorted rows r of one expert e and BLOCK_N output columns:
    SILU_MUL: silu(A[r] . B[e, n]) * (A[r] . B[e, N + n]); else A[r] . B[e, n], times
    weights[r] when ROUTED_WEIGHT. A's row for r is r // a_row_divisor."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + (rows // a_row_divisor) * stride_am
    b_cols = b_ptr + expert * stride_be + cols.to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_cols[None, :] + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if SILU_MUL:  # the up rows sit N rows below the gate rows
            b_up = tl.load(b_cols[None, :] + N * stride_bn + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)

    dtype = a_ptr.dtype.element_ty  # the activation dtype: round where the reference rounds
    out = acc.to(dtype).to(tl.float32)
    if SILU_MUL:
        up = acc_up.to(dtype).to(tl.float32)
        out = (out * tl.sigmoid(out)).to(dtype).to(tl.float32) * up
    if ROUTED_WEIGHT:
        out = out * tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, out.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The tokens*top_k rows (row = token * top_k + k) sorted by expert, stable within one.

    Returns (sorted_rows int32 [capacity], block_experts int32 [capacity // block_m],
    num_padded int64 [1]): expert e's rows fill sorted_rows from a multiple of block_m and
    its run is padded with tokens*top_k up to the next multiple; block_experts[i] is the
    expert of tile i; tiles at or past num_padded are unused (their expert is clamped)."""
    flat = topk_ids.reshape(-1).long()
    rows = flat.numel()
    device = topk_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(rows, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    capacity = triton.cdiv(rows + min(num_experts, rows) * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((capacity,), rows, dtype=torch.int32, device=device)
    sorted_rows[(padded_end - padded)[expert_of_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_rows, block_experts.to(torch.int32), padded_end[-1:]


def choose_block_m(rows: int, num_experts: int) -> int:
    """Rows per tile: 16 when experts average few rows (decode: padding dominates), else 64."""
    return 16 if rows <= 8 * num_experts else 64


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as moe_reference.fused_moe. Expert ids are trusted to be in range."""
    what = "fused_moe"
    check_fused_moe_args(what, hidden, w13, w2, topk_weights, topk_ids)
    launch = _moe_gemm_kernel.for_tensors(what, hidden, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    num_experts, hidden_size, intermediate = w2.shape
    rows = tokens * top_k
    if rows == 0:
        return torch.zeros_like(hidden)
    block_m = choose_block_m(rows, num_experts)
    sorted_rows, block_experts, num_padded = moe_align(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty((rows, intermediate), dtype=hidden.dtype, device=hidden.device)
    partial = torch.empty((rows, hidden_size), dtype=torch.float32, device=hidden.device)
    tiles = block_experts.shape[0]
    common = dict(BLOCK_M=block_m, BLOCK_K=32 if hidden.dtype == torch.float32 else 64,
                  PRECISION=dot_precision(hidden.dtype), UPCAST=upcast_dot(hidden.dtype, hidden.device),
                  num_warps=4 if block_m == 16 else 8)
    block_n = 64
    launch[(tiles, triton.cdiv(intermediate, block_n))](
        hidden, w13, act, weights, sorted_rows, block_experts, num_padded,
        intermediate, hidden_size, rows, top_k,
        *hidden.stride(), *w13.stride(), *act.stride(),
        BLOCK_N=block_n, SILU_MUL=True, ROUTED_WEIGHT=False, **common,
    )
    launch[(tiles, triton.cdiv(hidden_size, block_n))](
        act, w2, partial, weights, sorted_rows, block_experts, num_padded,
        hidden_size, intermediate, rows, 1,
        *act.stride(), *w2.stride(), *partial.stride(),
        BLOCK_N=block_n, SILU_MUL=False, ROUTED_WEIGHT=True, **common,
    )
    return partial.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
