"""The DeepSeek-style MoE block (GLM-4.5 now; DeepSeek-V3 with MLA is meant to reuse it
unchanged): a float32 router choosing experts by grouped top-k with a correction bias
(engine/models/moe_routing.py), the routed experts (the float stacks or QuantizedExperts,
as in engine/models/moe.py), and `n_shared_experts` experts every token goes through (one
GatedMLP of n_shared * I rows), added after the routed sum.

The router's weight and `e_score_correction_bias` stay float32 whatever the model's dtype,
as transformers (`_keep_in_fp32_modules_strict`) and vLLM keep them: a bf16 bias would
change which experts win close calls. Checkpoint names: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.moe import SparseMoeBlock
from splitserve.engine.models.moe_routing import GroupedRouting, grouped_topk

_SHARED = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


class Float32Router(nn.Module):
    """Logits in float32 from a float32 weight, then grouped_topk: (weights, ids)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.routing = GroupedRouting.of(cfg)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """model.to(dtype) (the loader's, before it fills the weights) leaves these float32."""
        super()._apply(fn, recurse)
        for p in (self.weight, self.e_score_correction_bias):
            p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(F.linear(x.float(), self.weight), self.e_score_correction_bias, self.routing)


class DeepseekMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)  # the expert stacks w13 / w2 (this rank's slice) and quantize_experts()
        self.gate = Float32Router(cfg)
        self.shared_experts = GatedMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.routed(x, weights, ids)  # whole on every rank (the shared experts reduce their own)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    def shared_expert_target(self, rest: str) -> tuple[str, slice | None] | None:
        """(our parameter relative to the layer, its rows) for a shared expert's tensor named
        `rest` inside the layer (gate and up fill the fused gate_up_proj), else None."""
        m = _SHARED.match(rest)
        if not m or self.shared_experts is None:
            return None
        if m.group(1) == "down_proj":
            return "mlp.shared_experts.down_proj.weight", None
        rows = self.shared_experts.intermediate  # this rank's slice
        return "mlp.shared_experts.gate_up_proj.weight", slice(0, rows) if m.group(1) == "gate_proj" \
            else slice(rows, 2 * rows)
