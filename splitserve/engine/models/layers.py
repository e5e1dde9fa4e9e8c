"""Layers the model families share: RMSNorm (Llama and Gemma forms), attention over the
paged KV pool (GQA, q/k norms, sliding windows, soft-capping, partial rotary), the gated
MLP. Tokens of all sequences in a step are one flattened [num_tokens, hidden] batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.parallel.linear import ColumnParallelLinear, RowParallelLinear
from splitserve.engine.parallel.sharding import kv_heads, q_heads
from splitserve.engine.parallel.state import tp
from splitserve.kernels import ops
from splitserve.kernels.cpu_decode_step import PreparedDecodeAttention


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
    dsa_allowed: list | None = None  # DSA: this step's choice, left by an indexer layer for the layers sharing it
    recurrent: object | None = None  # hybrid models: the step's RecurrentStep (engine/recurrent_state.py)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (statistics in float32, scaled in the input dtype); with `gemma`,
    Gemma's: x * (1 + w), all in float32, then cast."""

    def __init__(self, size: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, gemma=self.gemma)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)); one kernel on the GPU."""
        return ops.add_rms_norm(x, delta, self.weight, self.eps, gemma=self.gemma)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        # this rank's heads (all of them at tp=1; parallel/sharding.py)
        self.num_heads, self.num_kv_heads = q_heads(cfg, tp())[1], kv_heads(cfg, tp())[1]
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.window = cfg.layer_window(layer)
        self.softcap = cfg.attn_softcap
        self.rope_kind = cfg.layer_types[layer]  # which rope table this layer reads
        # per-tensor scales of an fp8 KV cache (engine/kv_cache.py): 1.0 unless the checkpoint
        # ships self_attn.k_scale / v_scale (engine/kv_scales.py; the model runner sets them)
        self.k_scale = self.v_scale = 1.0
        # q, k and v as one matmul; the loader fills the three row ranges.
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms)
        self.prepared_decode: PreparedDecodeAttention | None = None  # CPU decode steps (kernels/cpu_decode_step.py)
        self.sinks: torch.Tensor | None = None  # gpt-oss: a float32 [this rank's heads] logit per head

    def forward(self, x, ropes, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if not meta.num_prefill_tokens and not hasattr(self, "q_norm") and qkv.is_cpu:
            cos, sin = ropes[self.rope_kind]
            prepared = self.prepared_decode
            if prepared is None or not prepared.fits(qkv, cos, sin, k_cache, meta):
                prepared = self.prepared_decode = PreparedDecodeAttention.prepare(self, qkv, cos, sin, k_cache,
                                                                                  v_cache, meta)
            if prepared is not None:
                return self.o_proj(prepared(qkv, cos, sin, meta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.norm_qk(q, k)
        q = ops.rotary_and_store_kv(q, k, v, *ropes[self.rope_kind], k_cache, v_cache, meta.slot_mapping,
                                    self.k_scale, self.v_scale)
        p = meta.num_prefill_tokens
        opts = dict(window=self.window, softcap=self.softcap, k_scale=self.k_scale, v_scale=self.v_scale)
        if self.sinks is not None:  # one more logit in every softmax (models/gpt_oss.py)
            opts["sinks"] = self.sinks
        if p:
            prefill = ops.paged_prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables,
                                                  meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale,
                                                  **opts)
        if p < n:
            decode = ops.paged_decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables,
                                                meta.decode_seq_lens, self.scale, **opts)
        out = prefill if p == n else decode if p == 0 else torch.cat([prefill, decode])
        return self.o_proj(out.reshape(n, self.q_size))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k normalised per head (MiniMax-M2: over all heads)."""
        return self.q_norm(q), self.k_norm(k)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one matmul (SwiGLU; GeGLU for Gemma)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate = (intermediate_size or cfg.intermediate_size) // tp().size  # this rank's slice
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.act_and_mul(self.gate_up_proj(x), gelu=self.gelu))
