"""Prefill attention: variable-length new tokens of several sequences over a paged prefix.

The new tokens' K/V are already in the cache (store_kv runs first), so one loop over the
sequence's blocks covers both the cached prefix (fully visible) and the new tokens
(causal). Query i of a sequence with n new tokens and length L sits at position
L - n + i and sees keys 0..L-n+i.

Grid: (query tile slot, kv_head). A tile is BLOCK_Q consecutive new tokens of one
sequence times all query heads sharing the KV head (GQA rows are token-major, head-minor),
so each K/V tile loaded serves BLOCK_Q * group query rows. Tiles never straddle two
sequences: sequence b owns slots cu_seqlens[b] // BLOCK_Q + b onward, which bounds the
grid by total_tokens // BLOCK_Q + batch with no host-side look at the lengths; a
program finds its sequence by counting the slot starts at or below its id.

Attention sinks (gpt-oss), where given, join each row's softmax once, in the epilogue: with
the row's final max m and sum l, M = max(m, sink), out = acc 2^(m-M) / (l 2^(m-M) + 2^(sink-M))
(log2 domain), the max over the scores and the sink together as transformers takes it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from splitserve.kernels.triton_common import (
    check_paged_kv,
    check_sinks,
    dot_precision,
    kernel,
    pow2,
    softcap_tanh,
    upcast_dot,
)

TILE_N = 64  # keys per inner-loop step
# Query rows (tokens x grouped heads) per program, by element size: 128 rows over 8 warps
# for 16-bit inputs (the usual flash-attention tile); float32 (no tensor cores, twice the
# registers) spills with more than 32 rows. Checked with tests/kernels/compile_for_cuda.py.
ROWS = {2: 128, 4: 32}
LOG2E = 1.4426950408889634


@kernel(do_not_specialize=["num_seqs", "window", "stride_btb"],
        do_not_specialize_on_alignment=["block_tables_ptr", "cu_seqlens_ptr", "seq_lens_ptr", "sinks_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, sinks_ptr,
    scale_log2e, num_seqs, window, softcap_log2e,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_btb, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, SEQS_PAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, SINKS: tl.constexpr,
):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_ids = tl.arange(0, SEQS_PAD)
    seq_ok = seq_ids < num_seqs
    starts = tl.load(cu_seqlens_ptr + seq_ids, mask=seq_ok, other=0).to(tl.int32)
    first_slots = starts // BLOCK_Q + seq_ids
    seq = tl.sum((seq_ok & (first_slots <= slot)).to(tl.int32), 0) - 1
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - (q_end - q_start)
    tok0 = q_start + (slot - (q_start // BLOCK_Q + seq)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_tok = tok0 + rows // GROUP_PAD  # row of q / out
    in_group = rows % GROUP_PAD
    heads = kv_head * GROUP + in_group
    row_ok = (q_tok < q_end) & (in_group < GROUP)
    q_pos = prefix_len + (q_tok - q_start)  # position of the query in its sequence
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = q_tok.to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if not KV_FP8:  # an fp8 cache is widened to the query's dtype instead (its values are exact there)
        q = q.to(k_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    # keys up to what the tile's last query may see; none for an unused slot
    kv_end = tl.minimum(seq_len, prefix_len + (tok0 - q_start) + BLOCK_Q)
    kv_end = tl.where(tok0 < q_end, kv_end, 0)
    kv_start = 0
    if window > 0:  # sliding window: nothing before what the tile's first query may see
        kv_start = tl.maximum(prefix_len + (tok0 - q_start) - window + 1, 0)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for key0 in range(kv_start, kv_end, TILE):
        keys = key0 + tl.arange(0, TILE)
        key_ok = keys < kv_end
        block_ids = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k_rows = block_ids * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        if SOFTCAP:
            scores = softcap_tanh(scores, softcap_log2e)
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # a row may see nothing in a tile yet (causal or window): keep its max finite
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block_ids * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q_ptr.dtype.element_ty)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        c = tl.exp2(m_i - top)
        out = acc * (c / (l_i * c + tl.exp2(sink - top)))[:, None]
    o_rows = q_tok.to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention (`sinks` as in
    triton_decode_attention.paged_decode_attention). Lengths and block ids are
    trusted, not read on the host: cu_seqlens_q[-1] <= total tokens, n_new <= seq_len, and
    every sequence fits in its row of block_tables."""
    what = "paged_prefill_attention"
    if seq_lens.dim() != 1:
        raise ValueError(f"{what}: seq_lens must be [batch], got shape {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    check_paged_kv(what, q, k_cache, v_cache, block_tables, seq_lens, batch)
    if cu_seqlens_q.shape != (batch + 1,) or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what}: cu_seqlens_q must be int32 [batch+1={batch + 1}], "
            f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}"
        )
    check_sinks(what, sinks, q.shape[1])
    tensors = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens) + (() if sinks is None else (sinks,))
    launch = _prefill_kernel.for_tensors(what, *tensors)
    out = torch.empty_like(q)
    total_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0 or total_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = pow2(group)
    block_q = max(1, ROWS.get(q.element_size(), 32) // group_pad)
    grid = (total_tokens // block_q + batch, num_kv_heads)
    launch[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, q if sinks is None else sinks,
        scale * LOG2E, batch, int(window or 0), float(softcap or 0.0) * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim, 16),
        # at least 64: one compiled variant for every batch up to 64 (a pow2 per batch size
        # compiled anew in the middle of traffic); a 64-wide search of cu_seqlens costs nothing
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, TILE=TILE_N, SEQS_PAD=pow2(batch, 64),
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype, q.device), SOFTCAP=bool(softcap),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, SINKS=sinks is not None,
        num_warps=8,
    )
    return out
