"""gpt-oss's mixture of experts, as transformers' GptOssMLP computes it:

- router: a linear layer WITH a bias; the top-k of its logits, softmaxed over those k (the
  same weights as a softmax over all experts renormalised, computed transformers' way);
- experts with biases and a clamped SwiGLU: gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e],
  whose columns interleave gate and up (gate = [..., ::2], up = [..., 1::2]);
  gate clamped above at `limit`, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate),
  then out @ down_proj[e] + down_proj_bias[e]; no shared expert.

The expert tensors keep the checkpoint's names and layout (`mlp.experts.gate_up_proj` [E, H, 2I],
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]), so the loader copies
them as they are. A quantized form (MXFP4) replaces `GptOssMoeBlock.experts` by a module with the
same call: experts(x [T, H], weights [T, k] float, ids [T, k]) -> [T, H], the weighted sum.

Tensor parallelism slices every expert's intermediate dimension: because gate and up interleave,
rank r's I/n pairs are one contiguous run of 2I/n columns of gate_up_proj (parallel/sharding.py);
down_proj's bias is added by rank 0 alone, so it counts once after the all-reduce. Expert
parallelism holds E/n experts whole (the block's routed() does the exchange), each rank adding
its own experts' biases. The experts run grouped by expert (kernels/moe_reference.grouped_by_expert:
one sort, a matmul pair per chosen expert, float32 weighted sum in k order), which reads the
expert counts on the host: decode steps run eagerly, not as a CUDA graph (quant_moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.moe import SparseMoeBlock
from splitserve.engine.parallel.expert_parallel import expert_intermediate, local_experts
from splitserve.engine.parallel.state import tp
from splitserve.kernels.moe_reference import grouped_by_expert


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, ids int64 [T, k]): transformers' GptOssTopKRouter."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[rows, 2I] with gate and up interleaved -> [rows, I] (GptOssExperts._apply_gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """This rank's experts (all of them, or E/n under expert parallelism), each its slice of the
    intermediate dimension (all of it under expert parallelism)."""

    reads_counts_on_host = True  # grouped_by_expert: no CUDA graph capture (quant_moe.has_quantized_experts)

    def __init__(self, experts: int, hidden: int, inter: int, limit: float, alpha: float, add_down_bias: bool):
        super().__init__()
        self.num_experts, self.limit, self.alpha = experts, limit, alpha
        self.add_down_bias = add_down_bias  # False on ranks > 0 of tensor-parallel experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)

    def expert_mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        out = clamped_swiglu(gate_up, self.limit, self.alpha) @ self.down_proj[e]
        return out + self.down_proj_bias[e] if self.add_down_bias else out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_by_expert(x, weights, ids, self.num_experts, self.expert_mlp)


class GptOssRouter(nn.Linear):
    """The router (`mlp.router.weight` / `.bias` in the checkpoint), replicated on every rank."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.num_experts, bias=True)
        self.top_k = cfg.num_experts_per_tok

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.weight, self.bias), self.top_k)


class GptOssMoeBlock(SparseMoeBlock):
    """SparseMoeBlock's routing to the experts (routed(): the all-reduce of tensor-parallel
    partial sums, or expert parallelism's exchange; the expert-token counters) with gpt-oss's
    router and experts. `gate` is the router (the name the counters read)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # not SparseMoeBlock's float stacks w13 / w2
        t = tp()
        first, count = local_experts(cfg, t)
        self.local_experts = count
        self.gate = GptOssRouter(cfg)
        self.experts = GptOssExperts(count, cfg.hidden_size, expert_intermediate(cfg, t), cfg.swiglu_limit,
                                     cfg.swiglu_alpha, add_down_bias=t.expert_parallel or t.rank == 0)
        self.expert_tokens: torch.Tensor | None = None  # [num_experts] counts (engine/expert_tokens.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        return self.routed(x, weights, ids)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, weights, ids)
