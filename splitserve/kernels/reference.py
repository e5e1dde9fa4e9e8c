"""Torch reference twins of the kernels: exact semantics, CPU-friendly, the oracle in tests.

Shapes (see splitserve/engine/kv_cache.py for the pool layout):
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim] (strided views are fine)
  block_tables     : [batch, max_blocks] int32, padded with any valid id
  seq_lens         : [batch] int32, tokens in the cache per sequence (including new ones)

Attention options (both attention kernels): `window` > 0 is sliding-window attention, a
query at position p sees keys p - window + 1 .. p (transformers' `kv_idx > q_idx - window`);
`softcap` > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma 2);
`sinks` (None or float32 [num_heads]) is gpt-oss's attention sink: one learned logit per
query head, in the scaled (and capped) domain, appended as an extra column before the
softmax and dropped after it (transformers' eager_attention_forward: the max is taken over
the scores and the sink together). It adds exp(sink) to the denominator and no value.

An fp8 (float8_e4m3fn) cache is read as its codes' plain values, converted exactly to the
query's dtype; the per-layer scales are folded in by kernels/ops.py. store_kv divides by the
scale and saturates at +-448 before the cast (torch's own cast also saturates on CPU).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

# Reused gather buffers, one per (thread, purpose, dtype, device). A fresh multi-MB tensor
# per call costs more in page faults than the copy itself (measured 10x on CPU); results
# that live in a workspace are consumed before the next call with the same purpose.
# Per thread: two engines in one process (a prefill and a decode worker) run on two threads.
_local = threading.local()


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, purpose: str) -> torch.Tensor:
    """cache[block_ids] ([*block_ids.shape, block_size, kv_heads, head_dim]) into a workspace."""
    rows = cache.flatten(1)  # a view: each block's rows are contiguous even in the block-major pool
    n, width = block_ids.numel(), rows.shape[1]
    # A buffer made under torch.inference_mode (the engine) cannot be written outside it.
    key = (purpose, cache.dtype, cache.device, torch.is_inference_mode_enabled())
    workspaces = _local.__dict__.setdefault("buffers", {})
    buf = workspaces.get(key)
    if buf is None or buf.numel() < n * width:
        buf = torch.empty(int(n * width * 1.25) + width, dtype=cache.dtype, device=cache.device)
        workspaces[key] = buf
    out = buf[: n * width].view(n, width)
    torch.index_select(rows, 0, block_ids.reshape(-1).long(), out=out)
    return out.view(*block_ids.shape, *cache.shape[1:])


def _gather_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int, purpose: str) -> torch.Tensor:
    """[length, kv_heads, head_dim] for one sequence, read through its block table."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    blocks = _gather_blocks(cache, block_row[:n_blocks], purpose)
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def _attend(q, k, v, mask, scale: float, softcap: float, sinks=None) -> torch.Tensor:
    """softmax(scores) @ v with q [b, heads, n, d], k/v [b, kv_heads, T, d], mask [b|1, 1, n, T];
    mask None: plain causal over a square n == T (SDPA then skips the blocks above the
    diagonal: bit for bit the masked result, half the work for a long prompt)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    sink = sinks.to(device=q.device, dtype=torch.float32).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's column dropped
    return torch.matmul(probs, v.float()).to(q.dtype)


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
    """One new query token per sequence attending to its whole paged context.

    q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim].
    `num_splits` only changes how the Triton kernel partitions work; the result is the same.
    """
    batch = q.shape[0]
    if batch <= DECODE_GROUP:
        return _decode_group(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)
    # Sequences padded to the longest context waste reads; attend in groups of similar length.
    order = torch.argsort(seq_lens.to(torch.int64))
    out = torch.empty_like(q)
    for start in range(0, batch, DECODE_GROUP):
        idx = order[start : start + DECODE_GROUP].to(q.device)
        out[idx] = _decode_group(q[idx], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale, window, softcap,
                                 sinks)
    return out


DECODE_GROUP = 16


def _decode_group(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    bt = block_tables[:, :n_blocks]
    k = _gather_blocks(k_cache, bt, "k").reshape(batch, n_blocks * block_size, num_kv_heads, head_dim).to(q.dtype)
    v = _gather_blocks(v_cache, bt, "v").reshape(batch, n_blocks * block_size, num_kv_heads, head_dim).to(q.dtype)
    positions = torch.arange(n_blocks * block_size, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    mask = positions[None, :] < lens  # [batch, T]
    if window:
        mask &= positions[None, :] >= lens - window
    out = _attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale, softcap,
                  sinks)
    return out.squeeze(2)  # [batch, heads, 1, dim] -> [batch, heads, dim]


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
    """New tokens of several sequences attending to a paged cached prefix plus themselves.

    q: [total_new_tokens, num_heads, head_dim], sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1]. The new tokens' K/V must already be in the
    cache (store_kv first). Query i of a sequence with n new tokens and seq_len L
    sits at position L-n+i: it sees the whole prefix and is causal over the new tokens.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, length in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        k = _gather_kv(k_cache, block_tables[b], length, "k").to(q.dtype)
        v = _gather_kv(v_cache, block_tables[b], length, "v").to(q.dtype)
        mask = None  # a whole prompt at once, no window: SDPA's own causal mask (or _attend's)
        if n != length or window:
            q_pos = torch.arange(length - n, length, device=q.device)
            keys = torch.arange(length, device=q.device)[None, :]
            mask = keys <= q_pos[:, None]  # [n, L]
            if window:
                mask &= keys > q_pos[:, None] - window
            mask = mask[None, None]
        o = _attend(q[s:e].transpose(0, 1).unsqueeze(0),  # [1, heads, n, dim]
                    k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, scale, softcap, sinks)
        out[s:e] = o[0].transpose(0, 1)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V rows [n, kv_heads, head_dim] to slots (block_id * block_size + offset);
    into an fp8 cache as quantize_fp8(x, scale), else converted (the scales unused)."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    if k_cache.dtype == FP8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


FP8 = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3 codes: divided in x's dtype, saturated at +-448, round to nearest even."""
    return x.div(scale).clamp(-448.0, 448.0).to(FP8)


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gather blocks (all layers) into one contiguous buffer [n, layers, 2, block_size, kv_heads, dim]."""
    return pool.index_select(0, block_ids.long().to(pool.device)).contiguous()


def unpack_blocks(buffer: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a packed buffer into destination blocks of the pool."""
    buffer = buffer.to(pool.dtype)
    if pool.dtype == FP8:  # torch's index_copy_ has no fp8 kernel: the same bytes as uint8
        pool, buffer = pool.view(torch.uint8), buffer.view(torch.uint8)
    pool.index_copy_(0, block_ids.long().to(pool.device), buffer.view(-1, *pool.shape[1:]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Mistral/Qwen2 define it: statistics in float32, scale in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding. q [n, heads, dim], k [n, kv_heads, dim], cos/sin [n, dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
