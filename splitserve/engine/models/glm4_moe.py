"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): the Llama-shaped decoder (GQA with q/k/v
bias, partial rotary, q/k RMSNorm iff `use_qk_norm`, all from ModelConfig) whose first
`first_k_dense_replace` layers have a dense MLP and the others the DeepSeek-style MoE block
(engine/models/deepseek_moe.py: grouped sigmoid routing, routed + shared experts).

The checkpoint's `num_nextn_predict_layers` multi-token-prediction layers (`model.layers.N`
with N >= num_hidden_layers: GLM-4.5's layer 92, Air's 46) are skipped: transformers does not
generate with them either, and serving them as a draft model is not built.
"""

from __future__ import annotations

import re

from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.deepseek_moe import DeepseekMoeBlock
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.llama import DecoderLayer
from splitserve.engine.models.moe import MoeForCausalLM
from splitserve.engine.parallel.state import tp

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Glm4MoeForCausalLM(MoeForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        mlp = DeepseekMoeBlock(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)
        return DecoderLayer(cfg, layer, mlp)

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.cfg.num_layers:
            return None  # a multi-token-prediction layer (num_nextn_predict_layers): not served
        if m and int(m.group(1)) in self.cfg.moe_layers:
            layer, rest = m.group(1), m.group(2)
            if rest == "mlp.gate.e_score_correction_bias":
                return f"layers.{layer}.{rest}", None
            shared = self.layers[int(layer)].mlp.shared_expert_target(rest)
            if shared is not None:
                return f"layers.{layer}.{shared[0]}", shared[1]
        return super().weight_target(name)

    def part_rows(self, fused: str) -> list[tuple[int, int]]:
        """The shared experts' gate_up_proj has n_shared * moe_intermediate rows (LoRA reads this)."""
        if "shared_experts" in fused:
            i = self.cfg.moe_intermediate_size * self.cfg.n_shared_experts // tp().size
            return [(0, i), (i, 2 * i)]
        return super().part_rows(fused)
