"""gpt-oss's experts kept quantized (MXFP4 as shipped: engine/quant/mxfp4.py), in place of
GptOssExperts (engine/models/gpt_oss_moe.py), with the same call and numerics: each expert's
gate_up and down projections one QuantizedLinear ([2I, H] and [H, I], the checkpoint's rows:
gate and up stay interleaved, as clamped_swiglu reads them), plus the float biases, which
remain the replaced module's own Parameters (the loader fills them under the same names).

The loader swaps a GptOssExperts for this when the first quantized expert weight arrives
(loader.swap_experts); the reader yields one QuantizedWeight per expert and projection,
`model.layers.L.mlp.experts.<e>.<gate_up_proj|down_proj>.weight`, which GptOssForCausalLM's
weight_target maps to (`layers.L.mlp.experts.<proj>`, (e,)). The forward is QuantizedExperts':
(token, k) rows grouped by expert, the chosen experts' quantized matmuls (native CPU or
Triton), a float32 weighted sum."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.models.gpt_oss_moe import GptOssExperts, clamped_swiglu
from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.kernels.moe_reference import grouped_by_expert


class QuantizedGptOssExperts(nn.Module):
    reads_counts_on_host = True  # grouped_by_expert: no CUDA graph capture (quant_moe.has_quantized_experts)
    stacks = ("gate_up_proj", "down_proj")  # the float stacks this replaces (loader.swap_experts)

    def __init__(self, experts: GptOssExperts):
        super().__init__()
        count, hidden, two_inter = experts.gate_up_proj.shape
        self.num_experts, self.limit, self.alpha = count, experts.limit, experts.alpha
        self.add_down_bias = experts.add_down_bias
        self.gate_up_proj_bias, self.down_proj_bias = experts.gate_up_proj_bias, experts.down_proj_bias
        self.gate_up = nn.ModuleList(QuantizedLinear(hidden, two_inter) for _ in range(count))
        self.down = nn.ModuleList(QuantizedLinear(two_inter // 2, hidden) for _ in range(count))

    def part(self, stack: str, index: tuple | None) -> tuple[QuantizedLinear, None]:
        """The linear of one expert's projection: `index` (expert,) into the float stack `stack`."""
        if stack not in self.stacks or not isinstance(index, tuple) or len(index) != 1:
            raise ValueError(f"{stack}{index!r} is not one expert's projection (a stack partly float and partly "
                             "mxfp4 is not supported)")
        return (self.gate_up if stack == "gate_up_proj" else self.down)[index[0]], None

    def linears(self) -> dict[str, QuantizedLinear]:
        return {f"{stack}[{e}]": linear for stack, linears in (("gate_up_proj", self.gate_up), ("down_proj", self.down))
                for e, linear in enumerate(linears)}

    def expert_mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up[e](rows) + self.gate_up_proj_bias[e]
        out = self.down[e](clamped_swiglu(gate_up, self.limit, self.alpha))
        return out + self.down_proj_bias[e] if self.add_down_bias else out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_by_expert(x, weights, ids, self.num_experts, self.expert_mlp)


def quantize_experts(model: nn.Module, path: str) -> QuantizedGptOssExperts | None:
    """Replace the GptOssExperts at `path` by QuantizedGptOssExperts and return it; None when
    `path` is not a GptOssExperts."""
    experts = model.get_submodule(path)
    if not isinstance(experts, GptOssExperts):
        return None
    parent, _, child = path.rpartition(".")
    quantized = QuantizedGptOssExperts(experts)
    setattr(model.get_submodule(parent), child, quantized)
    return quantized
