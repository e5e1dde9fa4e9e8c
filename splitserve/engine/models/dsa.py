"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): a lightning indexer scores every earlier
token for each query and MLA attends to the `index_topk` best only.

The indexer (as transformers' DeepseekV32Indexer, itself the bf16 form of DeepSeek's FP8
reference): per query, heads q_i = wq_b(q latent) and one key per token k = LayerNorm(wk(x)),
both rotated on their first qk_rope_head_dim dims (half-split rope: not MLA's interleaved one);
score(t) = sum_i w_i * relu(q_i . k_t) / sqrt(index_head_dim), w = weights_proj(x) / sqrt(heads);
the top index_topk tokens of the causal context are kept. The key is cached beside the MLA
row (engine/models/mla.py: [latent | rope key | index key]), so it travels wherever the KV goes
(transfers, prefix cache, tiers, migration) with no cache of its own.

Attention over the selection runs here in torch, one sequence at a time: the gathered rows
scored densely with the unselected ones masked, what transformers computes. Where no query of
a step has more than index_topk tokens of context (every prompt shorter than 2,048 tokens on
the released model) the selection is everything, and the paged kernels run instead. A
sparse paged kernel (FlashMLA's sparse decode) is not built: long contexts on a GPU go
through this torch path.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.parallel.linear import ColumnParallelLinear
from splitserve.kernels import ops


class DsaIndexer(nn.Module):
    """Replicated on every tensor-parallel rank: each picks the same tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.interleaved = cfg.index_rope_interleave  # GLM-5's pairs; dot products are the same de-interleaved
        self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = ColumnParallelLinear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = ColumnParallelLinear(cfg.hidden_size, self.heads, bias=False)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rope_dim
        q_r, k_r = q[..., :r], k[..., :r]
        if self.interleaved:
            q_r, k_r = (torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1) for t in (q_r, k_r))
        q_rot, k_rot = ops.apply_rotary(q_r.contiguous(), k_r.contiguous(), cos, sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)

    def queries_and_key(self, x: torch.Tensor, q_latent: torch.Tensor, cos, sin):
        """(index queries [n, heads, dim] float32, head weights [n, heads] float32, the key [n, 1, dim]
        that goes into the cache row)."""
        n = x.shape[0]
        q = self.wq_b(q_latent).view(n, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).view(n, 1, self.dim)
        q, k = self._rotate(q, k, cos, sin)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        return q.float(), weights, k


def context_exceeds(meta, topk: int) -> bool:
    """Whether some query of the step sees more than `topk` tokens (else DSA selects them all)."""
    lens = [t for t in (meta.prefill_seq_lens, meta.decode_seq_lens) if t is not None and t.numel()]
    return any(int(t.max()) > topk for t in lens)


def sequence_spans(meta, n: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """(first token, query tokens, context length, block table row) of each sequence in the step's
    first `n` tokens (the prefill chunks only with n = num_prefill_tokens; mla.py's expanded prefill)."""
    p, spans = meta.num_prefill_tokens, []
    if p:
        cu, lens, tables = meta.prefill_cu_seqlens_q.tolist(), meta.prefill_seq_lens.tolist(), meta.prefill_block_tables
        spans += [(cu[i], cu[i + 1] - cu[i], lens[i], tables[i]) for i in range(len(lens))]
    if p < n:
        lens, tables = meta.decode_seq_lens.tolist(), meta.decode_block_tables
        spans += [(p + j, 1, lens[j], tables[j]) for j in range(len(lens))]
    return spans


def sequence_rows(k_cache: torch.Tensor, table: torch.Tensor, length: int, k_scale: float) -> torch.Tensor:
    """The cache rows of a sequence's first `length` tokens, float32 [length, row]."""
    positions = torch.arange(length, device=k_cache.device)
    blocks = table.to(k_cache.device)[positions // k_cache.shape[1]].long()
    rows = k_cache[blocks, positions % k_cache.shape[1], 0].float()  # the cache is one KV head
    return rows * k_scale if k_cache.dtype == torch.float8_e4m3fn else rows


def select(index_q: torch.Tensor, index_w: torch.Tensor, k_cache: torch.Tensor, meta, k_scale: float,
           key_columns: slice, topk: int) -> list[torch.Tensor]:
    """Per sequence of the step, which tokens each of its queries attends to: bool [queries,
    context], the causal context's `topk` best by the indexer's score (all of it when shorter)."""
    allowed = []
    for first, count, length, table in sequence_spans(meta, index_q.shape[0]):
        keys = sequence_rows(k_cache, table, length, k_scale)[:, key_columns]
        positions = torch.arange(length, device=index_q.device)
        causal = positions[None, :] <= positions[length - count:, None]  # [count, length]
        scores = torch.relu(torch.matmul(index_q[first:first + count], keys.t()) * keys.shape[1] ** -0.5)
        index = torch.matmul(index_w[first:first + count].unsqueeze(1), scores).squeeze(1).masked_fill(
            ~causal, float("-inf"))
        chosen = torch.zeros_like(causal).scatter_(1, index.topk(min(topk, length), dim=-1).indices, True)
        allowed.append(causal & chosen)
    return allowed


def sparse_mla_attention(query: torch.Tensor, allowed: list[torch.Tensor], k_cache: torch.Tensor, meta,
                         scale: float, k_scale: float, qk_width: int) -> torch.Tensor:
    """Absorbed MLA (query [n, heads, qk_width] against the rows' first qk_width columns) over
    each query's `allowed` tokens (select()); [n, heads, qk_width] (the caller keeps the latent
    columns)."""
    out = torch.empty_like(query)
    for (first, count, length, table), mask in zip(sequence_spans(meta, query.shape[0]), allowed, strict=True):
        rows = sequence_rows(k_cache, table, length, k_scale)[:, :qk_width]
        logits = torch.matmul(query[first:first + count].float(), rows.t()) * scale
        probs = logits.masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1)
        out[first:first + count] = torch.matmul(probs, rows).to(out.dtype)
    return out
