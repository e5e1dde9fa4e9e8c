"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), over a paged cache of latents.

Each token caches one row per layer: its compressed latent c (kv_lora_rank, after
kv_a_layernorm) and its rope key k_pe (qk_rope_head_dim, rotated), shared by every query head,
not per-head K and V (engine/kv_cache.py: one part, one "KV head", kv_lora_rank +
qk_rope_head_dim wide). Per head h, transformers expands the latent:
    k_h = [W_UK_h c ; k_pe],   v_h = W_UV_h c        (kv_b_proj = [W_UK_h ; W_UV_h] per head)
    out_h = softmax(scale * q_h . k_h) v_h,  q_h = [q_nope_h ; q_pe_h]
and since q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, the engine attends in the latent
space ("absorbed"): the query [W_UK_h^T q_nope_h ; q_pe_h] against the cached rows, the
values being the rows themselves (their first kv_lora_rank columns), and W_UV_h applied to
the result. That is multi-query attention over one head of kv_lora_rank + qk_rope_head_dim,
which every paged attention kernel (Triton, CPU native, reference; fp8 caches included)
already runs: MLA needs no kernel of its own. The value pass also reads the rope columns
(the same tensor is passed as V); their outputs are dropped.

Absorbed everywhere, prefill included, for now: the expanded form saves attention FLOPs on
long prompts (q.k over nope + rope = 192 wide instead of 576 at DeepSeek-V3's sizes) but
decompresses every context token's K and V per step; which wins on a GPU is for the device
run to measure (bench/gpu).

DeepSeek's checkpoints lay the rope dims out in interleaved pairs (`rope_interleave`):
transformers rotates pair i = (x[2i], x[2i+1]) by frequency i and writes the result
de-interleaved [evens | odds]; de-interleaving first and applying neox rope is the same
arithmetic, so that is what this does.

Tensor parallelism splits the heads (q_b_proj / q_proj, kv_b_proj rows, o_proj columns:
parallel/sharding.py); the latent path is replicated, so every rank caches the same rows and
a KV transfer between different TP sizes needs no resharding.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.dsa import (
    DsaIndexer,
    context_exceeds,
    select,
    sequence_rows,
    sequence_spans,
    sparse_mla_attention,
)
from splitserve.engine.models.layers import AttentionMetadata, RMSNorm
from splitserve.engine.parallel.linear import ColumnParallelLinear, RowParallelLinear
from splitserve.engine.parallel.sharding import q_heads
from splitserve.engine.parallel.state import tp
from splitserve.kernels import ops

# Prefill chunks in the expanded form (True) or absorbed like decode (False); both exact, tested
# both ways. bench/experiments/mla_vs_gqa.py on this CPU: a 1,024-token prefill absorbed 2.57 s,
# expanded 3.13 s (docs/benchmarks.md), so absorbed; a GPU may choose otherwise (not measured).
EXPANDED_PREFILL = False


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads = q_heads(cfg, tp())[1]  # this rank's
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.lora = cfg.kv_lora_rank
        self.qk_dim = self.nope + self.rope_dim
        self.scale = cfg.attn_scale
        self.interleaved = cfg.rope_interleave
        self.rope_kind = cfg.layer_types[layer]
        self.k_scale = self.v_scale = 1.0  # an fp8 cache's per-tensor scale (one part: k_scale serves both)
        heads_q = self.num_heads * self.qk_dim
        if cfg.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.qkv_bias)  # replicated
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads_q, bias=False)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads_q, bias=False)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, self.lora + self.rope_dim,
                                                       bias=cfg.qkv_bias)  # replicated
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.lora, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.o_bias)
        # DSA (DeepSeek-V3.2, GLM-5): an indexer, or (GLM-5's shared layers) the choice of the last one
        self.dsa_topk, self.index_dim = cfg.index_topk, cfg.index_head_dim
        self.indexer = DsaIndexer(cfg) if cfg.index_topk and layer not in cfg.index_shared_layers else None
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.expanded_prefill = EXPANDED_PREFILL

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, lora], W_UV^T [heads, lora, v]) of kv_b_proj, made once at the
        first step. Read through kv_b_proj's own forward on the identity (it has no bias), so
        whatever form the loader left it in (oneDNN-packed, input-major, FP8 or INT4 decoded by
        its kernel) gives the weights it computes with; small: heads x (nope + v) x lora."""
        if self._absorbed is None:
            dtype = self.kv_a_layernorm.weight.dtype
            eye = torch.eye(self.lora, dtype=dtype, device=self.kv_a_layernorm.weight.device)
            w = self.kv_b_proj(eye).t().reshape(self.num_heads, self.nope + self.v_dim, self.lora)
            self._absorbed = (w[:, :self.nope].contiguous(), w[:, self.nope:].transpose(1, 2).contiguous())
        return self._absorbed

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...] (DeepSeek's rope layout)."""
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def forward(self, x, ropes, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        if hasattr(self, "q_b_proj"):
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        else:
            q = self.q_proj(x)
        q = q.view(n, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        cos, sin = ropes[self.rope_kind]
        q_pe, k_pe = ops.apply_rotary(self._deinterleave(q_pe).contiguous(),
                                      self._deinterleave(k_pe).reshape(n, 1, self.rope_dim).contiguous(), cos, sin)
        parts = [latent.view(n, 1, self.lora), k_pe]
        if self.indexer is not None:
            index_q, index_w, index_k = self.indexer.queries_and_key(x, q_latent, cos, sin)
            parts.append(index_k)
        elif self.dsa_topk:  # a layer sharing another's choice caches no key of its own: zeros keep the row's width
            parts.append(latent.new_zeros(n, 1, self.index_dim))
        row = torch.cat(parts, dim=-1)  # what the cache keeps
        ops.store_kv(row, row, k_cache, k_cache, meta.slot_mapping, self.k_scale, self.k_scale)
        w_uk, w_uv_t = self.absorbed_weights()
        query = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], dim=-1)  # [n, heads, lora + rope]
        width = self.lora + self.rope_dim
        if self.dsa_topk and context_exceeds(meta, self.dsa_topk):
            if self.indexer is not None:
                meta.dsa_allowed = select(index_q, index_w, k_cache, meta, self.k_scale,
                                          slice(width, width + self.index_dim), self.dsa_topk)
            out = sparse_mla_attention(query, meta.dsa_allowed, k_cache, meta, self.scale, self.k_scale, width)
            return self._output(out, w_uv_t, n)
        if self.dsa_topk:  # every token selected: the paged kernels, the index key columns zeroed out
            query = torch.cat([query, query.new_zeros(n, self.num_heads, self.index_dim)], dim=-1)
        p = meta.num_prefill_tokens
        opts = dict(k_scale=self.k_scale, v_scale=self.k_scale)
        values = []
        if p and self.expanded_prefill and not self.dsa_topk:
            values.append(self._expanded_prefill(q_nope[:p], q_pe[:p], k_cache, meta))
        elif p:
            values.append(self._values(ops.paged_prefill_attention(
                query[:p], k_cache, k_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens, self.scale, **opts), w_uv_t))
        if p < n:
            values.append(self._values(ops.paged_decode_attention(
                query[p:], k_cache, k_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, **opts), w_uv_t))
        out = values[0] if len(values) == 1 else torch.cat(values)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))

    def _values(self, out: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """W_UV on the attention's latent columns: [n, heads, v]."""
        return torch.bmm(out[..., :self.lora].transpose(0, 1), w_uv_t).transpose(0, 1)

    def _output(self, out: torch.Tensor, w_uv_t: torch.Tensor, n: int) -> torch.Tensor:
        return self.o_proj(self._values(out, w_uv_t).reshape(n, self.num_heads * self.v_dim))

    def _expanded_prefill(self, q_nope, q_pe, k_cache, meta) -> torch.Tensor:
        """The prefill chunks in transformers' form: each sequence's cached latents (this chunk's
        included) decompressed by kv_b_proj into per-head K and V, attended causally; [p, heads, v]."""
        out = []
        for first, count, length, table in sequence_spans(meta, meta.num_prefill_tokens):
            positions = torch.arange(length, device=q_nope.device)
            rows = sequence_rows(k_cache, table, length, self.k_scale).to(q_nope.dtype)
            kv = self.kv_b_proj(rows[:, :self.lora].to(q_nope.dtype)).view(length, self.num_heads, -1)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, rows[:, None, self.lora:self.lora + self.rope_dim].to(k_nope.dtype)
                           .expand(length, self.num_heads, self.rope_dim)], dim=-1)
            q = torch.cat([q_nope[first:first + count], q_pe[first:first + count]], dim=-1)
            causal = positions[None, :] <= positions[length - count:, None]  # [count, length]
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal, scale=self.scale)
            out.append(attn.transpose(0, 1))
        return out[0] if len(out) == 1 else torch.cat(out)
