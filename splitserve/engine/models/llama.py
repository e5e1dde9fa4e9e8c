"""Decoder for the Llama family: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2.

The three differ only in configuration (q/k/v bias, head_dim, tied embeddings),
which ModelConfig captures. Tokens of all sequences in a step are flattened
into one [num_tokens, hidden] batch; attention reads and writes the paged pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.kernels import ops


@dataclass
class AttentionMetadata:
    """Where each token of the step lives in the KV pool and which sequence it belongs to.

    The first `num_prefill_tokens` tokens belong to sequences computing several
    tokens this step (prefill chunks); the rest are single-token (decode) sequences.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None
    prefill_cu_seqlens_q: torch.Tensor | None
    prefill_seq_lens: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, o_bias: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v as one matmul; the loader fills the three row ranges.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = ops.apply_rotary(q, k, cos, sin)
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        p = meta.num_prefill_tokens
        if p == n:
            out = ops.paged_prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                              meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale)
        elif p == 0:
            out = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_seq_lens, self.scale)
        else:
            out = torch.cat([
                ops.paged_prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables,
                                            meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale),
                ops.paged_decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables,
                                           meta.decode_seq_lens, self.scale),
            ])
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Llama's o_proj follows attention_bias; Qwen2 biases only q/k/v.
        o_bias = cfg.qkv_bias and cfg.architecture == "LlamaForCausalLM"
        self.self_attn = Attention(cfg, o_bias=o_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, cos, sin, kv_pool, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        """Logits (float32) of the tokens at `logits_indices` only: sampling needs no more."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_pool.layer(i)
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()
