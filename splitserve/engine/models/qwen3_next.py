"""Qwen3-Next (`Qwen3NextForCausalLM`): a hybrid of Gated DeltaNet layers (recurrent state per
sequence: models/gated_delta_net.py) and gated full attention, 3:1 by `layer_types`.

- Full attention: GQA over the paged KV pool; q_proj gives each head's query and a gate of
  the same size, interleaved per head; q/k RMSNorm per head; rope on the first
  partial_rotary_factor of each head (0.25); the output times sigmoid(gate) before o_proj.
- Norms are (1 + w) RMSNorms in float32 (Gemma's form).
- The MLP is, on `moe_layers`, Qwen3-MoE's softmax top-k experts plus a shared expert whose
  output is scaled by sigmoid(shared_expert_gate(x)); dense elsewhere (`mlp_only_layers`).

Only the attention layers have KV: the pool holds `cfg.kv_layers` rows, in layer order; the
recurrent layers read and write their RecurrentStatePool row (engine/recurrent_state.py)."""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.gated_delta_net import GatedDeltaNet
from splitserve.engine.models.layers import Attention, AttentionMetadata, GatedMLP, RMSNorm
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.moe import SparseMoeBlock, expert_weight_target
from splitserve.engine.parallel.linear import ColumnParallelLinear
from splitserve.kernels import ops

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SHARED = re.compile(r"^mlp\.shared_expert\.(gate_proj|up_proj)\.weight$")


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, gemma=True)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, gemma=True)

    def forward(self, x, ropes, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(n, self.num_heads, 2 * hd)
        q, gate = self.q_norm(qg[..., :hd].contiguous()), qg[..., hd:].reshape(n, self.q_size)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, hd))
        v = v.reshape(n, self.num_kv_heads, hd)
        q = ops.rotary_and_store_kv(q, k, v, *ropes[self.rope_kind], k_cache, v_cache, meta.slot_mapping,
                                    self.k_scale, self.v_scale)
        p = meta.num_prefill_tokens
        opts = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        parts = []
        if p:
            parts.append(ops.paged_prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables,
                                                     meta.prefill_cu_seqlens_q, meta.prefill_seq_lens, self.scale,
                                                     **opts))
        if p < n:
            parts.append(ops.paged_decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables,
                                                    meta.decode_seq_lens, self.scale, **opts))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.o_proj(out.reshape(n, self.q_size) * torch.sigmoid(gate))


class SharedExpertMoe(SparseMoeBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.round_weights = True  # transformers casts the routing weights to the activations' dtype
        self.shared_expert = GatedMLP(cfg, int(cfg.raw["shared_expert_intermediate_size"]))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.kv_index = cfg.kv_layers.index(layer) if layer in cfg.kv_layers else -1
        if self.kv_index < 0:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layers.index(layer))
        else:
            self.self_attn = GatedAttention(cfg, layer)
        self.mlp = SharedExpertMoe(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)

    def forward(self, x, ropes, kv_pool, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kv_index < 0:
            h = self.linear_attn(h, meta.recurrent)
        else:
            h = self.self_attn(h, ropes, *kv_pool.layer(self.kv_index), meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return HybridLayer(cfg, layer)

    def forward(self, input_ids, ropes, kv_pool, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ropes, kv_pool, meta)
        return self.lm_head(self.norm(x[logits_indices])).float()

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _LAYER.match(name)
        if m and int(m.group(1)) in self.cfg.moe_layers:
            layer, rest = m.group(1), m.group(2)
            target = expert_weight_target(rest, self.cfg.moe_intermediate_size)
            if target is not None:
                return f"layers.{layer}.{target[0]}", target[1]
            shared = _SHARED.match(rest)
            if shared:
                i = int(self.cfg.raw["shared_expert_intermediate_size"])
                rows = slice(0, i) if shared.group(1) == "gate_proj" else slice(i, 2 * i)
                return f"layers.{layer}.mlp.shared_expert.gate_up_proj.weight", rows
        return super().weight_target(name)

    def part_rows(self, fused: str) -> list[tuple[int, int]]:
        if fused.endswith("qkv_proj"):  # each head's query and gate, then k, then v
            attention = self.layers[self.cfg.kv_layers[0]].self_attn
            q, kv = 2 * attention.q_size, attention.kv_size
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        i = self.cfg.intermediate_size  # a dense layer's gate_up_proj (the shared expert's: weight_target)
        return [(0, i), (i, 2 * i)]
