"""The Llama-shaped decoder: Llama (incl. Llama-3 rope scaling), Mistral (sliding window),
Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Phi-3/Phi-4 (fused projections in the checkpoint,
longrope, partial rotary).

They differ only in what ModelConfig says, and in how the checkpoint names tensors:
`weight_target` maps a Hugging Face name to our (fused) parameter and the rows it fills.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.layers import Attention, AttentionMetadata, GatedMLP, RMSNorm
from splitserve.engine.parallel.linear import ParallelLMHead, VocabParallelEmbedding
from splitserve.engine.parallel.state import tp

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# separate projections in the checkpoint -> (our fused parameter, which part of it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# rotary tables some checkpoints save; an fp8 KV cache's scales (engine/kv_scales.py reads them)
IGNORED = re.compile(r"rotary_emb\.inv_freq$|\.self_attn\.(?:k_scale|v_scale|kv_scale|[kv]_proj\.output_scale)$")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module, attention: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer) if attention is None else attention  # MLA brings its own
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ropes, k_cache, v_cache, meta, pending=None):
        """x is the residual stream; `pending` the previous layer's MLP output, not yet added
        to it. Returns (x, this layer's MLP output): each residual add is fused with the norm
        that reads the sum (one kernel on the GPU instead of two)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        attn = self.self_attn(h, ropes, k_cache, v_cache, meta)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    # the MTP drafter (engine/spec/mtp.py) turns this on: forward keeps every row's hidden state
    # before the final norm in `hidden_states`
    keep_hidden_states = False
    hidden_states: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """One decoder layer (MoE families give it their sparse MLP)."""
        return DecoderLayer(cfg, layer, GatedMLP(cfg))

    def forward(self, input_ids, ropes, kv_pool, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        """Logits (float32) of the tokens at `logits_indices` only: sampling needs no more."""
        x, pending = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_pool.layer(i)
            x, pending = layer(x, ropes, k_cache, v_cache, meta, pending)
        if self.keep_hidden_states:
            self.hidden_states = x + pending
        _, x = self.norm.add_and_norm(x[logits_indices], pending[logits_indices])
        return self.lm_head(x).float()

    # ---- checkpoint names -------------------------------------------------------------
    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        """(our parameter, the index of the part it fills or None for all of it) for a
        checkpoint tensor; None to skip the tensor."""
        if IGNORED.search(name):
            return None
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else ("lm_head.weight", None)
        m = _LAYER.match(name)
        if not m:
            return name.removeprefix("model."), None
        layer, rest = m.group(1), m.group(2)
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            fused, part = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", slice(*self.part_rows(fused)[part])
        return f"layers.{layer}.{rest}", None

    def part_rows(self, fused: str) -> list[tuple[int, int]]:
        """Row ranges of the parts of a fused projection, in this rank's slice of it."""
        attention = self.layers[0].self_attn
        if fused.endswith("qkv_proj"):
            q, kv = attention.q_size, attention.kv_size
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        i = self.cfg.intermediate_size // tp().size
        return [(0, i), (i, 2 * i)]
