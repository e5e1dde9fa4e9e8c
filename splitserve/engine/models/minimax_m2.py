"""MiniMax-M2 / M2.1 / M2.5 (`MiniMaxM2ForCausalLM`): the Llama-shaped decoder (GQA, no
biases, partial rotary from `rotary_dim`) with a mixture of experts on every layer, and
two differences from GLM-4.5 (engine/models/glm4_moe.py):

- the q and k RMSNorms span the whole projection (`q_norm` has num_heads * head_dim
  weights, `k_norm` num_kv_heads * head_dim), not each head: the mean square of a token's
  q is over all its heads. Under tensor parallelism a rank holds some heads only, so the
  ranks add up their per-token partial sums of squares (one all-reduce for q's and k's
  together) before normalising; the norm weights load whole, each rank reads its heads' part.
- routing is the DeepSeek-style block (engine/models/deepseek_moe.py) with what MiniMax
  sets: sigmoid scores, `e_score_correction_bias` for the choice only, a plain top-k (one
  group), renormalised, unscaled, no shared experts. The bias sits on the block in the
  checkpoint (`block_sparse_moe.e_score_correction_bias`; `mlp.` in transformers 5's names),
  on the router here. Experts are `block_sparse_moe.experts.E.w1/w3/w2` (or the stacked
  `mlp.experts.gate_up_proj` / `down_proj`), mapped by MoeForCausalLM. The router's weight
  and bias stay float32 (as vLLM runs MiniMax-M2); transformers 5.25 keeps MiniMax's router
  in the model's dtype, so a bf16 model may pick differently on close calls than it does.

The multi-token-prediction modules some checkpoints carry after the last layer
(`num_mtp_modules`, `model.layers.N` with N >= num_hidden_layers) are skipped: transformers
does not generate with them either.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.deepseek_moe import DeepseekMoeBlock
from splitserve.engine.models.layers import Attention
from splitserve.engine.models.llama import DecoderLayer
from splitserve.engine.models.moe import MoeForCausalLM
from splitserve.engine.parallel.sharding import kv_heads, q_heads
from splitserve.engine.parallel.state import all_reduce, tp
from splitserve.kernels import ops

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BIAS = re.compile(r"^(?:mlp|block_sparse_moe)\.e_score_correction_bias$")


class WholeProjectionRMSNorm(nn.Module):
    """RMSNorm over all `heads` heads of a projection at once (transformers' MiniMaxM2RMSNorm
    of heads * head_dim). The weight is the whole projection's on every rank; this rank's
    heads are `local` heads from head `first`."""

    def __init__(self, heads: int, head_dim: int, first: int, local: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.start, self.width = first * head_dim, local * head_dim
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] holding every head (tp = 1)."""
        return ops.rms_norm(x.reshape(x.shape[0], -1), self.weight, self.eps).view_as(x)

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """This rank's heads x normalised with `squares` [tokens, 1], the sum over ranks of
        squares(x). Every rank holds `width` values, a KV head replicated over r ranks is
        counted r times: that sum over size * width values is the whole projection's mean."""
        xf = x.reshape(x.shape[0], -1).float()
        normed = (xf * torch.rsqrt(squares / (tp().size * self.width) + self.eps)).to(x.dtype)
        return (self.weight[self.start:self.start + self.width] * normed).view_as(x)  # transformers' order


def squares(x: torch.Tensor) -> torch.Tensor:
    """Each token's sum of squares over its heads, float32 [tokens, 1]."""
    return x.reshape(x.shape[0], -1).float().pow(2).sum(-1, keepdim=True)


class MiniMaxM2Attention(Attention):
    """Attention (layers.py) whose q_norm / k_norm span all heads; the base class calls
    norm_qk before rope, and skips its CPU decode fast path (which knows no such norm)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)  # cfg.qk_norm is False: no per-head norms made there
        self.q_norm = WholeProjectionRMSNorm(cfg.num_heads, cfg.head_dim, *q_heads(cfg, tp()), cfg.rms_norm_eps)
        self.k_norm = WholeProjectionRMSNorm(cfg.num_kv_heads, cfg.head_dim, *kv_heads(cfg, tp()), cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tp().size == 1:
            return self.q_norm(q), self.k_norm(k)
        summed = all_reduce(torch.cat([squares(q), squares(k)], dim=-1))  # q's and k's in one all-reduce
        return self.q_norm.scale(q, summed[:, :1]), self.k_norm.scale(k, summed[:, 1:])


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer, DeepseekMoeBlock(cfg), MiniMaxM2Attention(cfg, layer))

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.cfg.num_layers:
            return None  # a multi-token-prediction module (num_mtp_modules): not served
        if m and _BIAS.match(m.group(2)):
            return f"layers.{m.group(1)}.mlp.gate.e_score_correction_bias", None
        return super().weight_target(name)  # router, experts (MoeForCausalLM), attention, norms
