"""RMSNorm and neox-style rotary embedding: one pass over memory each, instead of the
handful of elementwise torch ops (and temporaries) the references use.

Numerics follow the references: RMSNorm takes its statistics in float32, rounds the
normalised row to the input dtype, then scales by the weight in the promoted dtype;
rotary computes in float32 and rounds once (the reference rounds after each op, so the
two differ by at most about one unit in the last place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import kernel, pow2


@kernel
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    h = x.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference's h.to(dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as reference.rms_norm: x [..., hidden], weight [hidden]."""
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must be [hidden={x.shape[-1] if x.dim() else '?'}], "
                         f"got {tuple(weight.shape)} for x {tuple(x.shape)}")
    launch = _rms_norm_kernel.for_tensors("rms_norm", x, weight)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.numel() and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.numel():
        launch[(rows.shape[0],)](
            rows, weight.contiguous(), out, hidden, eps, rows.stride(0), out.stride(0),
            BLOCK=pow2(hidden), num_warps=4 if hidden <= 4096 else 8,
        )
    return out.view(x.shape)


@triton.jit
def rotate_heads(x_ptr, out_ptr, cos_ptr, sin_ptr, tok, num_heads, stride_xt, stride_xh, stride_cos, stride_sin,
                 stride_ot, stride_oh, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Neox rotary of one token's heads (x * cos + [-x2, x1] * sin) in float32, stored at
    out_ptr + tok * stride_ot + head * stride_oh in out's dtype; heads >= num_heads are
    left alone. Shared with triton_fused's rotary + KV write, so the two round alike."""
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    cos1 = tl.load(cos_ptr + tok * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * stride_cos + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_sin + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_sin + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & col_ok[None, :]
    src = x_ptr + tok * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    dst = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@kernel
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads,
                   stride_xt, stride_xh, stride_cos, stride_sin, stride_ot, stride_oh,
                   HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    rotate_heads(x_ptr, out_ptr, cos_ptr, sin_ptr, tl.program_id(0).to(tl.int64), num_heads, stride_xt, stride_xh,
                 stride_cos, stride_sin, stride_ot, stride_oh, HEADS_PAD, HALF, HALF_PAD)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.apply_rotary: q [n, heads, dim], k [n, kv_heads, dim],
    cos/sin [n, dim]; returns new tensors in the promoted dtype."""
    what = "apply_rotary"
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"{what}: q must be [n, heads, dim] and k [n, kv_heads, dim], "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    n, _, dim = q.shape
    if cos.shape != (n, dim) or sin.shape != (n, dim):
        raise ValueError(f"{what}: cos and sin must be [n={n}, dim={dim}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if dim % 2:
        raise ValueError(f"{what}: rotary needs an even head dim, got {dim}")
    launch = _rotary_kernel.for_tensors(what, q, k, cos, sin)
    q, k, cos, sin = (_last_dim_contiguous(t) for t in (q, k, cos, sin))
    table_dtype = torch.promote_types(cos.dtype, sin.dtype)
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, table_dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, table_dtype), device=k.device)
    for x, out in ((q, q_out), (k, k_out)):  # two launches: q and k may differ in dtype
        if x.numel():
            launch[(n,)](
                x, cos, sin, out, x.shape[1], x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                out.stride(0), out.stride(1),
                HEADS_PAD=pow2(x.shape[1]), HALF=dim // 2, HALF_PAD=pow2(dim // 2), num_warps=4,
            )
    return q_out, k_out
