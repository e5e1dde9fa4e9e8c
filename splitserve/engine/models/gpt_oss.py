"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): the Llama-shaped decoder with

- q/k/v and o projections with biases (`attention_bias`, true by default);
- attention sinks: one learned logit per query head (`self_attn.sinks`) joins every softmax's
  denominator and is dropped from its output (transformers' eager_attention_forward), passed
  to every paged attention kernel as `sinks` (float32, this rank's heads);
- `layer_types` alternating sliding_attention (window `sliding_window`, 128) and
  full_attention, from layer 0 sliding; YaRN rope (theta 150,000, x32 from 4,096), neox halves;
- every layer's MLP a mixture of experts with a biased router and biased, clamped-SwiGLU
  experts (engine/models/gpt_oss_moe.py), no shared expert.

Checkpoint names are transformers' (`mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj`,
`..._bias`, `down_proj`, `..._bias`, `self_attn.sinks`); q/k/v fill the fused qkv_proj as in
llama.py. The shipped checkpoints store the experts as MXFP4 (`*_blocks` / `*_scales`).
Tensor parallelism splits the heads (and the sinks with them), each expert's intermediate
dimension, or under expert parallelism the experts whole (engine/parallel/sharding.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.models.gpt_oss_moe import GptOssMoeBlock
from splitserve.engine.models.layers import Attention
from splitserve.engine.models.llama import DecoderLayer, LlamaForCausalLM
from splitserve.engine.models.moe import local_target
from splitserve.engine.parallel.expert_parallel import local_experts
from splitserve.engine.parallel.state import tp

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OWN = re.compile(r"^(?:self_attn\.sinks|mlp\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?)$")
# one expert's MXFP4 projection, as engine/quant/reader.py yields the shipped `_blocks` / `_scales`
_QUANTIZED_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


class GptOssAttention(Attention):
    """Attention (layers.py) with a sink logit per query head of this rank; the sinks stay
    float32 in a bf16 model (what the kernels read; a bf16 checkpoint's values convert exactly)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """model.to(dtype) (the loader's, before it fills the weights) leaves the sinks float32."""
        super()._apply(fn, recurse)
        self.sinks.data = self.sinks.data.float()
        return self


class GptOssForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer, GptOssMoeBlock(cfg), GptOssAttention(cfg, layer))

    def weight_target(self, name: str) -> tuple[str, slice | tuple | None] | None:
        m = _LAYER.match(name)
        if m and _OWN.match(m.group(2)):
            return f"layers.{m.group(1)}.{m.group(2)}", None  # already this rank's part (sharding.py)
        if m and (q := _QUANTIZED_EXPERT.match(m.group(2))):  # into QuantizedGptOssExperts (gpt_oss_quant.py)
            # expert parallelism: this rank's experts renumbered from 0, another rank's skipped
            return local_target((f"layers.{m.group(1)}.mlp.experts.{q.group(2)}", (int(q.group(1)),)),
                                *local_experts(self.cfg, tp()))
        if m and m.group(2) in ("mlp.router.weight", "mlp.router.bias"):
            return f"layers.{m.group(1)}.mlp.gate.{m.group(2).rpartition('.')[2]}", None
        return super().weight_target(name)  # q/k/v into qkv_proj, o_proj, norms, embeddings, lm_head
