"""A checkpoint's multi-token-prediction (MTP) layer as a model the engine can load and run:
DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers` layers, `model.layers.L` with
L = num_hidden_layers (the first one; k drafts reuse it k times, as vLLM does).

For the token t+1 and h_t, the previous model's hidden state at position t before its final
norm (the target's for the first draft, this layer's own output for the next ones):
    x = eh_proj([enorm(embed(t+1)) ; hnorm(h_t)])      (the embedding zeroed at position 0)
    h = x + attention + MLP                             (one decoder layer of the model's kind)
    logits = shared_head.head(shared_head.norm(h))
as vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py compute it. The decoder layer is the
target family's own (`make_layer`: MLA for DeepSeek-V3, GQA for GLM; the MoE block when layer
L is past first_k_dense_replace), so its checkpoint names map through the family's
`weight_target` as layer 0 of a one-layer model.

Checkpoint names under `model.layers.L.`: enorm.weight, hnorm.weight, eh_proj.weight
[hidden, 2 * hidden], shared_head.norm.weight, shared_head.head.weight and embed_tokens.weight
(each of the last two optional: the main model's lm_head / embed_tokens when absent), and the
decoder layer's self_attn.*, mlp.*, input_layernorm, post_attention_layernorm. The loader
reads them from the target's own files (engine/models/loader.py, quantized ones included).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from splitserve.core.model_config import ModelConfig
from splitserve.engine.checkpoint import weight_files
from splitserve.engine.models.layers import RMSNorm
from splitserve.engine.models.registry import model_class
from splitserve.engine.parallel.linear import ColumnParallelLinear

_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "lm_head.weight",
        "embed_tokens.weight": "embed_tokens.weight"}


def mtp_model_config(target: ModelConfig) -> ModelConfig:
    """The one-layer config of the MTP layer: layer L's kind (dense or MoE) as the target's
    config would give it with L + 1 layers."""
    layer = target.num_layers
    extended = ModelConfig.from_dict({**target.raw, "num_hidden_layers": layer + 1})
    return replace(extended, num_layers=1, layer_types=(extended.layer_types[layer],),
                   moe_layers=(0,) if layer in extended.moe_layers else ())


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Every tensor name in the checkpoint's safetensors files (their headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def mtp_model_class(target: ModelConfig, names: set[str]) -> type[nn.Module]:
    """The target family's class, reduced to its MTP layer (`names`: the checkpoint's tensors,
    which say whether the layer has its own embedding and head)."""
    layer = target.num_layers
    prefix = f"model.layers.{layer}."
    own_embed, own_head = prefix + "embed_tokens.weight" in names, prefix + "shared_head.head.weight" in names
    if prefix + "eh_proj.weight" not in names:
        raise ValueError(f"method mtp: the checkpoint has no MTP layer {layer} ({prefix}eh_proj.weight is missing)")
    base = model_class(target)
    layer_name = re.compile(rf"^{re.escape(prefix)}(.+)$")

    class MtpLayerModel(base):
        def __init__(self, cfg: ModelConfig):
            super().__init__(cfg)  # embed_tokens, one decoder layer, norm (shared_head.norm), lm_head
            self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
            self.previous_hidden: torch.Tensor | None = None  # h_t of each row, set before each forward
            self.first_rows: torch.Tensor | None = None  # rows at position 0 (their embedding is zeroed)
            self.hidden_states: torch.Tensor | None = None  # this layer's output h (the next draft's input)

        def forward(self, input_ids, ropes, kv_pool, meta, logits_indices) -> torch.Tensor:
            embedded = self.embed_tokens(input_ids)
            if self.first_rows is not None:
                embedded = embedded.index_fill(0, self.first_rows, 0.0)
            x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(self.previous_hidden)], dim=-1))
            k_cache, v_cache = kv_pool.layer(0)
            x, mlp_out = self.layers[0](x, ropes, k_cache, v_cache, meta)
            self.hidden_states = x + mlp_out
            return self.lm_head(self.norm(self.hidden_states[logits_indices])).float()

        def weight_target(self, name: str):
            m = layer_name.match(name)
            if m:
                rest = m.group(1)
                if rest in _OWN:
                    return _OWN[rest], None
                return super().weight_target(f"model.layers.0.{rest}")
            if name == "model.embed_tokens.weight" and not own_embed:
                return "embed_tokens.weight", None
            if name == "lm_head.weight" and not own_head and not self.cfg.tie_word_embeddings:
                return "lm_head.weight", None
            return None  # the main model's layers, norm, and what the MTP layer has its own of

    MtpLayerModel.__name__ = MtpLayerModel.__qualname__ = f"Mtp{base.__name__}"
    return MtpLayerModel


def mtp_model_parts(target: ModelConfig, model_dir: str | Path) -> tuple[ModelConfig, type[nn.Module]]:
    """(config, class) of the checkpoint's MTP layer; with its own head it is never tied."""
    names = checkpoint_names(model_dir)
    cfg = mtp_model_config(target)
    if f"model.layers.{target.num_layers}.shared_head.head.weight" in names:
        cfg = replace(cfg, tie_word_embeddings=False)
    return cfg, mtp_model_class(target, names)
