"""Paged decode attention (one query token per sequence) with split-KV "flash decoding".

Grid: (sequence, kv_head, split). A program takes *all* query heads that share one KV
head (grouped-query attention), so every K/V byte is read once per step, not once per
query head. The context of a sequence is cut into `num_splits` token ranges handled by
separate programs, which keeps the GPU busy at batch 1; each writes a partial output
normalised by its own softmax sum plus its log-sum-exp, and a second kernel merges the
partials exactly. With one split the first kernel writes the final output directly.

Attention sinks (gpt-oss: one logit per query head, a softmax column with no value) enter
once, where the softmax is completed: in the merge, as one more partial whose log-sum-exp
is the sink and whose output is zero; with one split, in the first kernel's epilogue. The
max is over the scores and the sink together, as transformers takes it.

Offsets into the cache are int64: block_id * block_stride passes 2**31 elements
quickly in the block-major pool (block ids above 32767 with a 64 Ki-element stride).
Nothing here reads tensor values on the host, so a launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.triton_common import (
    check_paged_kv,
    check_sinks,
    cuda_sm_count,
    dot_precision,
    kernel,
    pow2,
    softcap_tanh,
    upcast_dot,
)

TILE_N = 64  # cache tokens per inner-loop step
# one tile: where the batch leaves SMs idle (batch 1), a program's time is its chain of tile
# loads, so more one-tile splits finish sooner than fewer longer ones (issue 20; was 128)
MIN_TOKENS_PER_SPLIT = TILE_N
MAX_SPLITS = 32
LOG2E = 1.4426950408889634


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Splits per sequence: enough programs for about two waves over the SMs, but never
    splits shorter than MIN_TOKENS_PER_SPLIT. `max_tokens` is the block-table capacity
    (host-known), not the actual longest sequence, so no device sync is needed."""
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms, programs)
    by_length = triton.cdiv(max(1, max_tokens), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@kernel(do_not_specialize=["tokens_per_split", "num_splits", "window", "stride_btb"],
        do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "sinks_ptr"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr,
    scale_log2e, tokens_per_split, num_splits, window, softcap_log2e,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DIRECT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if window > 0:  # sliding window: only the last `window` tokens are visible
        start = tl.maximum(start, seq_len - window)

    rows = tl.arange(0, GROUP_PAD)  # query heads of this KV head (padded for tl.dot)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not KV_FP8:  # an fp8 cache is widened to the query's dtype instead (its values are exact there)
        q = q.to(k_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_btb
    for tile_start in range(start, end, TILE):
        toks = tile_start + tl.arange(0, TILE)
        tok_ok = toks < end
        block_ids = tl.load(table + toks // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        in_block = toks % BLOCK_SIZE
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [GROUP_PAD, TILE]
        if SOFTCAP:
            scores = softcap_tanh(scores, softcap_log2e)
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q_ptr.dtype.element_ty)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_tokens = l_i > 0  # an empty split (more splits than tokens) contributes nothing
    l_safe = tl.where(has_tokens, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT and SINKS:  # the whole softmax is here: the sink's column joins it (log2 domain)
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        c = tl.exp2(m_i - top)
        out = acc * (c / (l_i * c + tl.exp2(sink - top)))[:, None]
    if DIRECT:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@kernel(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["sinks_ptr"])
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:  # one more partial: log-sum-exp the sink (log2 domain), output zero
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no tokens at all: every weight is 0
    weights = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    total = tl.sum(weights, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention (`sinks` float32 contiguous
    [num_heads], on q's device: CUDA graphs capture its address). Block ids and lengths are
    trusted (checking them would sync the GPU): every sequence must fit in its row of
    `block_tables`, and `block_tables` should be trimmed to the batch's longest sequence
    because its width sizes the splits."""
    what = "paged_decode_attention"
    batch, num_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
    check_paged_kv(what, q, k_cache, v_cache, block_tables, seq_lens, batch)
    check_sinks(what, sinks, num_heads)
    tensors = (q, k_cache, v_cache, block_tables, seq_lens) + (() if sinks is None else (sinks,))
    launch = _decode_split_kernel.for_tensors(what, *tensors)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"{what}: num_splits must be a positive int or None, got {num_splits!r}")
    out = torch.empty_like(q)
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0 or num_heads == 0:
        return out
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, cuda_sm_count(q.device))
    tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, num_splits), TILE_N) * TILE_N
    group = num_heads // num_kv_heads
    head_dim_pad = pow2(head_dim, 16)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused placeholders
    else:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    launch[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, q if sinks is None else sinks,
        scale * LOG2E, tokens_per_split, num_splits, int(window or 0), float(softcap or 0.0) * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), *out.stride(),
        GROUP=group, GROUP_PAD=pow2(group, 16), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE=TILE_N, DIRECT=direct,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype, q.device), SOFTCAP=bool(softcap),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, SINKS=sinks is not None,
        num_warps=4,
    )
    if not direct:
        _decode_merge_kernel.for_tensors(what, out)[(batch, num_heads)](
            part_out, part_lse, out, q if sinks is None else sinks, num_splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=pow2(num_splits, MAX_SPLITS),  # one variant
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out
