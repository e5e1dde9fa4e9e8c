"""Mixtral and Qwen3-MoE: the Llama-shaped decoder (Qwen3-MoE with its q/k RMSNorm, from
ModelConfig) whose MLP is, on the layers `cfg.moe_layers` names, a mixture of experts:
a router picks each token's top-k experts, their SwiGLU MLPs run as one fused call
(ops.fused_moe). Qwen3-MoE's other layers (`mlp_only_layers`, `decoder_sparse_step`)
keep the dense MLP.

The expert weights are stacked: `w13` [experts, 2 * I, hidden] (gate rows, then up
rows) and `w2` [experts, hidden, I]. Checkpoints come in two layouts, both mapped by
`expert_weight_target`: one tensor per expert and projection (what transformers saves:
Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`, Qwen3-MoE's
`mlp.experts.E.gate_proj/up_proj/down_proj`) and the stacked 3-D tensors transformers 5
holds in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
A stacked tensor of another shape (a transposed [E, H, 2I] layout) is refused by the
loader's shape check, which names both shapes.

A quantized checkpoint's experts stay quantized: the loader swaps the stacks for
QuantizedExperts (engine/models/quant_moe.py, one QuantizedLinear per expert projection)
when the block's first quantized expert tensor arrives.

Under expert parallelism (engine/parallel/expert_parallel.py) the stacks hold this rank's
E/N experts whole, and the checkpoint's expert ids are mapped to local ones (local_target).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.layers import GatedMLP
from splitserve.engine.models.llama import DecoderLayer, LlamaForCausalLM
from splitserve.engine.models.quant_moe import QuantizedExperts
from splitserve.engine.parallel.expert_parallel import (
    expert_intermediate,
    expert_parallel_moe,
    local_experts,
)
from splitserve.engine.parallel.state import all_reduce, tp
from splitserve.kernels import ops
from splitserve.kernels.moe_reference import select_experts

# Mixtral's checkpoints say `block_sparse_moe`, transformers 5 and Qwen3-MoE say `mlp`.
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PREFIX = r"(?:mlp|block_sparse_moe)"
_ROUTER = re.compile(rf"^{_PREFIX}\.gate\.weight$")
_PER_EXPERT = re.compile(rf"^{_PREFIX}\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(rf"^{_PREFIX}\.experts\.(gate_up_proj|down_proj)$")
_GATE, _UP = ("w1", "gate_proj"), ("w3", "up_proj")


class SparseMoeBlock(nn.Module):
    """Router (float32 softmax, top-k, renormalised when the model says so) + experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # tensor-parallel: a slice of every expert; expert-parallel: this rank's experts whole
        experts, inter = local_experts(cfg, tp())[1], expert_intermediate(cfg, tp())
        self.local_experts = experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # transformers' Qwen3-MoE rounds the routing weights to the activation dtype before
        # applying them; Mixtral applies them in float32 (identical in float32).
        self.round_weights = cfg.family == "qwen3_moe"
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # routes to all experts
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(experts, cfg.hidden_size, inter))
        self.experts: QuantizedExperts | None = None  # instead of w13 / w2: quantize_experts()
        self.expert_tokens: torch.Tensor | None = None  # [num_experts] counts (engine/expert_tokens.py)

    def quantize_experts(self) -> QuantizedExperts:
        """Replace the float stacks w13 and w2 by (empty) QuantizedExperts of the same shapes."""
        experts, two_inter, hidden = self.w13.shape
        self.experts = QuantizedExperts(experts, hidden, two_inter // 2)
        del self.w13, self.w2
        return self.experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        return self.routed(x, weights, ids)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output, whole on every rank."""
        if self.expert_tokens is not None:  # on the device: read at the stats interval
            chosen = ids.reshape(-1)
            self.expert_tokens.index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int64))
        if tp().expert_parallel:
            return expert_parallel_moe(x, weights, ids, self.local_experts, self.run_experts)
        return all_reduce(self.run_experts(x, weights, ids))  # partial sums at tp > 1

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            return self.experts(x, weights, ids)
        return ops.fused_moe(x, self.w13, self.w2, weights, ids)


def expert_weight_target(rest: str, intermediate: int) -> tuple[str, tuple | None] | None:
    """For a checkpoint name inside one layer (after `model.layers.N.`): the parameter of
    our SparseMoeBlock (relative to the layer) and the index of the part it fills, or
    None when the tensor is not a MoE tensor (attention, norms, a dense layer's MLP)."""
    if _ROUTER.match(rest):
        return "mlp.gate.weight", None
    m = _PER_EXPERT.match(rest)
    if m:
        expert, proj = int(m.group(1)), m.group(2)
        if proj in _GATE:
            return "mlp.w13", (expert, slice(0, intermediate))
        if proj in _UP:
            return "mlp.w13", (expert, slice(intermediate, 2 * intermediate))
        return "mlp.w2", (expert,)
    m = _STACKED.match(rest)
    if m:
        return ("mlp.w13" if m.group(1) == "gate_up_proj" else "mlp.w2"), None
    return None


class MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        mlp = SparseMoeBlock(cfg) if layer in cfg.moe_layers else GatedMLP(cfg)
        return DecoderLayer(cfg, layer, mlp)

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _LAYER.match(name)
        if m and int(m.group(1)) in self.cfg.moe_layers:
            target = expert_weight_target(m.group(2), expert_intermediate(self.cfg, tp()))
            if target is not None:
                target = local_target(target, *local_experts(self.cfg, tp()))
                return None if target is None else (f"layers.{m.group(1)}.{target[0]}", target[1])
        return super().weight_target(name)


def local_target(target: tuple[str, tuple | None], first: int, count: int) -> tuple[str, tuple | None] | None:
    """An expert's part with its id made this rank's (expert - first); None: another rank's
    expert (expert parallelism; the loader read nothing of it). A stacked tensor arrives as
    this rank's rows already (parallel/sharding.py)."""
    param, index = target
    if not isinstance(index, tuple):
        return target
    if not first <= index[0] < first + count:
        return None
    return param, (index[0] - first, *index[1:])
