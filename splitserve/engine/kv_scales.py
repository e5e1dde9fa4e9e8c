"""Per-layer scales of an fp8 KV cache, read from the checkpoint when it ships them.

Checkpoints quantized for an fp8 KV cache (llm-compressor / compressed-tensors
`kv_cache_scheme`, and the older fp8 exports vLLM reads) carry one scalar per attention layer
for K and one for V, under one of these names (vLLM accepts the same):

    model.layers.N.self_attn.k_scale / v_scale
    model.layers.N.self_attn.k_proj.output_scale / v_proj.output_scale
    model.layers.N.self_attn.kv_scale            (one scale for both)

A stored code is worth code * scale (engine/kv_cache.py). The model loader skips these
tensors (models/llama.py IGNORED); with `--kv-cache-dtype fp8` the model runner sets them on
each layer's attention; with a float KV cache they describe nothing we store and are unused.
Without them every scale is 1.0, as in vLLM.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from safetensors import safe_open

from splitserve.core.gguf_model import gguf_source
from splitserve.core.model_config import CheckpointError

KV_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale|(kv)_scale)$")


def read_kv_scales(model_dir: str | Path, num_layers: int) -> dict[int, tuple[float, float]]:
    """layer -> (k_scale, v_scale) for the layers the checkpoint gives scales; {} without any.
    A scale that is not one positive finite number, or a layer with only one of the two, is a
    CheckpointError naming the tensor."""
    if gguf_source(model_dir) is not None:
        return {}
    from splitserve.engine.checkpoint import weight_files

    found: dict[int, dict[str, float]] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = KV_SCALE_NAME.match(name)
                if not m:
                    continue
                layer, which = int(m.group(1)), m.group(2) or m.group(3) or m.group(4)
                tensor = f.get_tensor(name)
                value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
                if not (layer < num_layers and math.isfinite(value) and value > 0):
                    raise CheckpointError(f"{path}: KV cache scale '{name}' must be one positive number for one "
                                          f"of the {num_layers} layers, got shape {tuple(tensor.shape)}"
                                          f"{'' if math.isnan(value) else f' value {value}'}")
                for key in ("k", "v") if which == "kv" else (which,):
                    found.setdefault(layer, {})[key] = value
    incomplete = sorted(layer for layer, s in found.items() if len(s) != 2)
    if incomplete:
        raise CheckpointError(f"{model_dir}: the checkpoint gives a KV cache scale for K or V alone in layers "
                              f"{incomplete[:5]}; it needs both (k_scale and v_scale) or neither")
    return {layer: (s["k"], s["v"]) for layer, s in found.items()}
