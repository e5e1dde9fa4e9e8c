"""Quantized experts of a mixture-of-experts layer (Mixtral, Qwen3-MoE): the experts of a
quantized checkpoint stay quantized, each expert's projections one QuantizedLinear:
`w13[e]` its gate rows then its up rows (the float block's w13[e], [2 * I, hidden]) and
`w2[e]` its down projection ([hidden, I]). So every format the dense linears read (FP8
block-wise or per-tensor, GPTQ, AWQ, compressed-tensors) serves experts too, exactly.

The forward groups the (token, k) rows by expert as the float CPU path does
(kernels/moe_reference.grouped_by_expert) and runs each chosen expert's two quantized
matmuls on its rows (ops.quantized_linear: the native CPU kernel or the Triton one).
Experts no token chose cost nothing. Unlike the float GPU path there is no fused grouped
kernel: one launch per projection per chosen expert, and the expert counts are read on
the host (one device sync per MoE layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.kernels.moe_reference import grouped_by_expert


class QuantizedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.w13 = nn.ModuleList(QuantizedLinear(hidden_size, 2 * intermediate) for _ in range(num_experts))
        self.w2 = nn.ModuleList(QuantizedLinear(intermediate, hidden_size) for _ in range(num_experts))

    def part(self, stack: str, index: tuple) -> tuple[QuantizedLinear, slice | None]:
        """The linear and rows that `index` into the float stack `stack` ('w13' or 'w2') names:
        (expert, rows) or (expert,) for all of that expert's rows."""
        if stack not in ("w13", "w2") or not isinstance(index, tuple) or not 1 <= len(index) <= 2:
            raise ValueError(f"{stack}{index!r} is not one expert's projection")
        linear = getattr(self, stack)[index[0]]
        return linear, index[1] if len(index) == 2 else None

    def linears(self) -> dict[str, QuantizedLinear]:
        """'w13[e]' / 'w2[e]' -> linear, for every expert."""
        return {f"{stack}[{e}]": linear for stack in ("w13", "w2") for e, linear in enumerate(getattr(self, stack))}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self.w13[expert](rows).split(self.intermediate, dim=-1)
            return self.w2[expert](F.silu(gate) * up)

        return grouped_by_expert(x, topk_weights, topk_ids, len(self.w13), expert_mlp)


def has_quantized_experts(model: nn.Module) -> bool:
    """Whether the model's forward reads expert counts on the host (QuantizedExperts, or experts
    saying `reads_counts_on_host`, as gpt-oss's): its decode steps cannot be captured in a CUDA
    graph, so they run eagerly."""
    return any(isinstance(m, QuantizedExperts) or getattr(m, "reads_counts_on_host", False) for m in model.modules())
