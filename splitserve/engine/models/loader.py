"""Build a model from a checkpoint directory: HF tensor names -> our (fused) parameters."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine.checkpoint import iter_weights
from splitserve.engine.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF projection -> (our fused parameter, which shard of it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _shard_ranges(cfg: ModelConfig, fused: str) -> list[tuple[int, int]]:
    if fused.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    i = cfg.intermediate_size
    return [(0, i), (i, 2 * i)]


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(params)
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    loaded: set[str] = set()

    def copy_into(target: str, tensor: torch.Tensor, rows: tuple[int, int] | None, source: str) -> None:
        param = params[target]
        dst = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dst.shape != tensor.shape:
            raise CheckpointError(
                f"{model_dir}: tensor '{source}' has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(dst.shape)} (check hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size)")
        dst.copy_(tensor.to(dtype))

    fused_parts: dict[str, set[int]] = {}
    for name, tensor in iter_weights(model_dir):
        if _IGNORED.search(name):
            continue
        local = name.removeprefix("model.")
        m = _LAYER.match(name)
        if m:
            layer, rest = m.group(1), m.group(2)
            module, _, kind = rest.rpartition(".")
            if module in _FUSED:
                fused_name, shard = _FUSED[module]
                target = f"layers.{layer}.{fused_name}.{kind}"
                if target not in params:
                    raise CheckpointError(f"{model_dir}: unexpected tensor '{name}' for {cfg.architecture}")
                copy_into(target, tensor, _shard_ranges(cfg, fused_name)[shard], name)
                fused_parts.setdefault(target, set()).add(shard)
                continue
            local = f"layers.{layer}.{rest}"
        if name == "lm_head.weight":
            local = "lm_head.weight"
            if cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
        if local not in params:
            raise CheckpointError(f"{model_dir}: unexpected tensor '{name}' for {cfg.architecture}")
        copy_into(local, tensor, None, name)
        loaded.add(local)

    for target, shards in fused_parts.items():
        if len(shards) == len(_shard_ranges(cfg, target.rsplit(".", 1)[0])):
            loaded.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks tensors {missing[:5]}"
                              f"{' and more' if len(missing) > 5 else ''}")
    model.eval()
    return model
