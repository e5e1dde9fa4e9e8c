"""DeepSeek-V3 / V3.1 / R1 and Kimi K2 (`DeepseekV3ForCausalLM`): GLM-4.5's decoder (the
DeepSeek-style MoE block on all but the first `first_k_dense_replace` layers: grouped sigmoid
routing with a correction bias, routed + shared experts, engine/models/deepseek_moe.py) with
multi-head latent attention in place of GQA (engine/models/mla.py: a compressed latent cached
per token).

Checkpoint names are transformers' own (`self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` or
`q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), each our parameter of
the same name: nothing is fused. The `num_nextn_predict_layers` multi-token-prediction layers
(`model.layers.N`, N >= num_hidden_layers) are skipped, as glm4_moe.py skips GLM's.
"""

from __future__ import annotations

import re

from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.deepseek_moe import DeepseekMoeBlock
from splitserve.engine.models.glm4_moe import Glm4MoeForCausalLM
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.llama import DecoderLayer
from splitserve.engine.models.mla import MlaAttention

_ATTENTION = re.compile(r"^model\.layers\.(\d+)\.(self_attn\..+)$")


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    """Also DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): the same model with an indexer in each
    attention (engine/models/dsa.py), named `self_attn.indexer.*` in its checkpoints."""

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        mlp = DeepseekMoeBlock(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)
        return DecoderLayer(cfg, layer, mlp, attention=MlaAttention(cfg, layer))

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _ATTENTION.match(name)
        if m and int(m.group(1)) < self.cfg.num_layers:
            return f"layers.{m.group(1)}.{m.group(2)}", None  # MLA's projections are not fused
        return super().weight_target(name)

    def part_rows(self, fused: str) -> list[tuple[int, int]]:
        if "self_attn" in fused:
            raise ValueError("multi-head latent attention has no fused q/k/v projection")
        return super().part_rows(fused)
