"""The batched LoRA matmul as one Triton kernel (Punica / S-LoRA's segmented gathered
matmul): a program per (segment, row tile, column tile) gathers its tokens' rows of x
through `perm`, multiplies them by its segment's slot of the stacked weights, and writes
(shrink: x @ A.T) or adds (expand: h @ B.T into the projection's output) the result.
Every token is in at most one segment, so the adds need no atomics. kernels/lora_reference.py
has the same operation in torch; tests/kernels run both under TRITON_INTERPRET=1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import dot_precision, kernel, pow2, upcast_dot


@kernel(do_not_specialize=("K", "N", "stride_xm", "stride_wl", "stride_wn", "stride_om"))
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, perm_ptr, seg_starts_ptr, seg_slots_ptr,
                 K, N, stride_xm, stride_wl, stride_wn, stride_om,
                 ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg, tile_m, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    idx = start + tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = idx < end
    tokens = tl.load(perm_ptr + idx, mask=row_ok, other=0).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + slot * stride_wl + cols[None, :] * stride_wn + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    ptrs = out_ptr + tokens[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, perm: torch.Tensor,
         seg_starts: list[int], seg_slots: list[int], accumulate: bool) -> torch.Tensor:
    """Same contract as kernels/lora_reference.sgmv; x, w, out contiguous in their last dim."""
    if not seg_slots:
        return out
    if x.dim() != 2 or w.dim() != 3 or out.dim() != 2 or w.shape[2] != x.shape[1] or w.shape[1] != out.shape[1]:
        raise ValueError(f"sgmv: x [n, k], w [slots, m, k], out [n, m] expected, got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(out.shape)}")
    x, w = x.contiguous(), w.contiguous()
    launch = _sgmv_kernel.for_tensors("sgmv", x, w, out, perm)
    starts = torch.tensor(seg_starts, dtype=torch.int32, device=x.device)
    slots = torch.tensor(seg_slots, dtype=torch.int32, device=x.device)
    longest = max(b - a for a, b in zip(seg_starts, seg_starts[1:], strict=False))
    k, n = x.shape[1], out.shape[1]
    block_m, block_n, block_k = 16, min(64, pow2(n, 16)), min(64, pow2(k, 16))
    grid = (len(seg_slots), triton.cdiv(longest, block_m), triton.cdiv(n, block_n))
    launch[grid](x, w, out, perm, starts, slots, k, n, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                 ACCUMULATE=accumulate, PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot(x.dtype, x.device),
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, perm: torch.Tensor,
               seg_starts: list[int], seg_slots: list[int]) -> torch.Tensor:
    """out[rows] += (x[rows] @ a[slot].T) @ b[slot].T: shrink into a float32 buffer, then expand."""
    h = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    sgmv(x, a, h, perm, seg_starts, seg_slots, accumulate=False)
    return sgmv(h.to(x.dtype), b, out, perm, seg_starts, seg_slots, accumulate=True)


@kernel(do_not_specialize=("K", "N", "stride_xm", "stride_wl", "stride_wn", "stride_om"))
def _bgmv_kernel(x_ptr, w_ptr, out_ptr, slots_ptr, K, N, stride_xm, stride_wl, stride_wn, stride_om,
                 ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program per (row, column tile): out[row, cols] (+)= w[slot(row), cols] . x[row],
    masked off entirely for a row whose slot is -1 (no adapter)."""
    row, tile_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    n_live = tl.where(slot >= 0, N, 0)  # a row without an adapter: every column masked off
    slot = tl.maximum(slot, 0)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_live
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(x_ptr + row * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + slot * stride_wl + cols[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    ptrs = out_ptr + row * stride_om + cols
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def bgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor,
         accumulate: bool) -> torch.Tensor:
    """x [n, k], w [slots, m, k], out [n, m], row_slots [n]: out[i] (+)= x[i] @ w[row_slots[i]].T,
    rows with slot -1 untouched. The grid depends on n and m only: a CUDA graph can hold it."""
    if x.dim() != 2 or w.dim() != 3 or out.dim() != 2 or w.shape[2] != x.shape[1] or w.shape[1] != out.shape[1] \
            or row_slots.shape != (x.shape[0],):
        raise ValueError(f"bgmv: x [n, k], w [slots, m, k], out [n, m], row_slots [n] expected, got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}, {tuple(row_slots.shape)}")
    x, w = x.contiguous(), w.contiguous()
    launch = _bgmv_kernel.for_tensors("bgmv", x, w, out, row_slots)
    k, n = x.shape[1], out.shape[1]
    block_n, block_k = min(64, pow2(n, 16)), min(128, pow2(k, 16))
    grid = (x.shape[0], triton.cdiv(n, block_n))
    launch[grid](x, w, out, row_slots, k, n, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                 ACCUMULATE=accumulate, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def lora_delta_by_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                      row_slots: torch.Tensor) -> torch.Tensor:
    """kernels/lora_reference.lora_delta_by_row's contract: shrink every live row into a float32
    buffer (x @ a[slot].T), then expand it into `out` (+= h @ b[slot].T)."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    bgmv(x, a, h, row_slots, accumulate=False)
    return bgmv(h.to(x.dtype), b, out, row_slots, accumulate=True)
