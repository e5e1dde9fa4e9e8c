"""Build a model from a checkpoint directory: each checkpoint tensor goes where the model's
`weight_target` says: (parameter, None) for all of it, or (parameter, index) for the part
`param[index]` (rows of a fused projection, one expert of a stacked MoE weight). Every
parameter must be filled completely, each part once."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine.checkpoint import iter_weights
from splitserve.engine.models.registry import model_class


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(params) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    filled: dict[str, int] = {}  # elements written per parameter
    seen: set[tuple[str, str]] = set()

    for name, tensor in iter_weights(model_dir):
        target = model.weight_target(name)
        if target is None:
            continue
        param_name, index = target
        if param_name not in params:
            raise CheckpointError(f"{model_dir}: unexpected tensor '{name}' for {cfg.architecture}")
        key = (param_name, repr(index))
        if key in seen:
            raise CheckpointError(f"{model_dir}: tensor '{name}' fills '{param_name}' a second time")
        seen.add(key)
        dst = params[param_name].data if index is None else params[param_name].data[index]
        if dst.shape != tensor.shape:
            raise CheckpointError(
                f"{model_dir}: tensor '{name}' has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(dst.shape)} (check hidden_size, intermediate_size, num_attention_heads, "
                "num_key_value_heads, head_dim, vocab_size)")
        dst.copy_(tensor.to(dtype))
        filled[param_name] = filled.get(param_name, 0) + dst.numel()

    missing = sorted(p for p in expected if filled.get(p, 0) != params[p].numel())
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks tensors for {missing[:5]}"
                              f"{' and more' if len(missing) > 5 else ''}")
    model.eval()
    return model
