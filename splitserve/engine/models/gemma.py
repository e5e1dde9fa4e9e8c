"""Gemma 2 and Gemma 3 (text) decoders.

What differs from the Llama shape: RMSNorms scale by (1 + w) in float32; four norms per
layer (before and after attention, before and after the MLP); embeddings scaled by
sqrt(hidden_size); GeGLU (tanh-approximated GELU); attention scaled by
query_pre_attn_scalar ** -0.5. Gemma 2 soft-caps attention scores and the final logits and
alternates sliding-window and global layers; Gemma 3 adds q/k norms, five sliding layers
per global one, and a separate rope base for the sliding layers. All of it is in
ModelConfig; the checkpoint names tensors as Llama does.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.layers import Attention, AttentionMetadata, GatedMLP, RMSNorm
from splitserve.engine.models.llama import LlamaForCausalLM


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(cfg)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(size, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(size, eps, gemma=True)

    def forward(self, x, ropes, k_cache, v_cache, meta):
        h = self.self_attn(self.input_layernorm(x), ropes, k_cache, v_cache, meta)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GemmaDecoderLayer(cfg, layer)

    def forward(self, input_ids, ropes, kv_pool, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as Gemma does
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_pool.layer(i)
            x = layer(x, ropes, k_cache, v_cache, meta)
        logits = self.lm_head(self.norm(x[logits_indices])).float()
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
