"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): the Llama-shaped decoder (GQA with q/k/v
bias, partial rotary, optional q/k RMSNorm, all from ModelConfig) whose first
`first_k_dense_replace` layers have a dense MLP and the others a DeepSeek-style MoE:
grouped sigmoid routing (engine/models/moe_routing.py) over the routed experts, plus
`n_shared_experts` experts every token goes through (one GatedMLP of n_shared * I rows).
DeepSeek-V3 has the same block (with MLA attention) and is meant to reuse DeepseekMoeBlock.

Checkpoint names beyond Qwen3-MoE's: `mlp.gate.e_score_correction_bias` (the routing's
correction bias) and `mlp.shared_experts.{gate,up,down}_proj`. The checkpoint's
`num_nextn_predict_layers` multi-token-prediction layers (`model.layers.N` with N >=
num_hidden_layers) are skipped: transformers does not use them to generate either, and
serving them as a speculator is not built.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.llama import DecoderLayer
from splitserve.engine.models.moe import MoeForCausalLM, SparseMoeBlock
from splitserve.engine.models.moe_routing import GroupedRouting, grouped_topk
from splitserve.engine.parallel.state import all_reduce
from splitserve.kernels import ops

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.(weight)$")


class DeepseekMoeBlock(SparseMoeBlock):
    """Router (grouped top-k with a correction bias) + routed experts + shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.routing = GroupedRouting.of(cfg)
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
        self.shared_experts = GatedMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router in float32, as transformers keeps it
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.e_score_correction_bias, self.routing)
        if self.experts is not None:
            routed = self.experts(x, weights, ids)
        else:
            routed = ops.fused_moe(x, self.w13, self.w2, weights, ids)
        routed = all_reduce(routed)  # partial sums at tp > 1
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


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
                return f"layers.{layer}.mlp.e_score_correction_bias", None
            shared = _SHARED.match(rest)
            if shared:
                proj = shared.group(1)
                if proj == "down_proj":
                    return f"layers.{layer}.mlp.shared_experts.down_proj.weight", None
                rows = self.layers[int(layer)].mlp.shared_experts.intermediate  # this rank's slice
                part = slice(0, rows) if proj == "gate_proj" else slice(rows, 2 * rows)
                return f"layers.{layer}.mlp.shared_experts.gate_up_proj.weight", part
        return super().weight_target(name)
