"""A quantized checkpoint's weights as the loader takes them: the stream of
engine/checkpoint.iter_weights with each quantized linear's tensors (qweight, qzeros,
scales, g_idx; weight + weight_scale_inv; weight_packed + weight_scale ...) gathered and
converted into one QuantizedWeight yielded under `<module>.weight`. Everything else
(embeddings, norms, biases, a float lm_head) passes through as it is. gpt-oss's MXFP4
expert stacks (`<stack>_blocks` / `<stack>_scales`, [E, ...]) become one QuantizedWeight per
expert, `<experts>.<e>.<proj>.weight` (as GGUF's stacked experts are yielded).

Which tensors belong to a quantized linear is read from the safetensors headers first,
so a linear is converted as soon as its last tensor arrives, whatever the shard order."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from splitserve.core.checkpoint_check import safetensors_header
from splitserve.core.model_config import CheckpointError
from splitserve.core.quantization import QuantSpec, split_name
from splitserve.core.quantization import quantized_linears as core_quantized_linears
from splitserve.engine.checkpoint import iter_weights, weight_files
from splitserve.engine.quant.awq import awq_weight
from splitserve.engine.quant.compressed import naive_quantized_weight, pack_quantized_weight
from splitserve.engine.quant.fp8 import fp8_weight
from splitserve.engine.quant.gptq import gptq_weight
from splitserve.engine.quant.mxfp4 import mxfp4_weights, nvfp4_weight
from splitserve.kernels.quant_weight import QuantizedWeight

log = logging.getLogger(__name__)

def quantized_linears(model_dir: str | Path, spec: QuantSpec) -> dict[str, set[str]]:
    """module name -> the suffixes of its tensors in the checkpoint, for each quantized linear."""
    headers: dict[str, dict] = {}
    for path in weight_files(model_dir):
        header, problem = safetensors_header(path)
        if problem:
            raise CheckpointError(problem)
        headers.update(header)
    return core_quantized_linears(spec, headers, str(model_dir))


def iter_quantized_weights(model_dir: str | Path, spec: QuantSpec) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    plan = quantized_linears(model_dir, spec)
    log.info("%s: %s, %d quantized linears; weight-only (FP8: unless --fp8-activations): activations stay in the model dtype%s", model_dir,
             spec.describe(), len(plan), f" (the checkpoint's {spec.activations} activation quantization is "
             "not applied)" if spec.activations else "")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_weights(model_dir):
        module, suffix = split_name(spec, name)
        if suffix not in plan.get(module, ()):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if len(parts) == len(plan[module]):
            del pending[module]
            try:
                if spec.format == "mxfp4":
                    yield from mxfp4_named(module, parts)
                else:
                    yield f"{module}.weight", convert(spec, module, parts)
            except ValueError as exc:
                raise CheckpointError(f"{model_dir}: {exc} ({spec.describe()})") from exc
    if pending:
        raise CheckpointError(f"{model_dir}: quantized linears {sorted(pending)[:3]} were not read completely")


def mxfp4_named(stack: str, t: dict[str, torch.Tensor]) -> Iterator[tuple[str, QuantizedWeight]]:
    """`model.layers.0.mlp.experts.gate_up_proj` [E, N, K / 32, 16] -> one weight per expert,
    `model.layers.0.mlp.experts.<e>.gate_up_proj.weight`; a 2-D stack -> `<stack>.weight`."""
    weights = mxfp4_weights(t["blocks"], t["scales"], stack)
    if t["blocks"].dim() == 3:
        yield f"{stack}.weight", weights[0]
        return
    parent, _, proj = stack.rpartition(".")
    for e, weight in enumerate(weights):
        yield f"{parent}.{e}.{proj}.weight", weight


def convert(spec: QuantSpec, module: str, t: dict[str, torch.Tensor]) -> QuantizedWeight:
    """One linear's checkpoint tensors -> its QuantizedWeight (input_scale, the static
    activation scale of W8A8 checkpoints, is not used: we run weight-only)."""
    fmt = spec.format
    if fmt == "fp8-block":
        return fp8_weight(t["weight"], t["weight_scale_inv"], spec.block, module)
    if fmt == "float-quantized":
        return fp8_weight(t["weight"], t["weight_scale"], spec.block, module)
    if fmt == "gptq":
        return gptq_weight(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), spec.group_size,
                           spec.zero_plus_one, module)
    if fmt == "awq":
        return awq_weight(t["qweight"], t["qzeros"], t["scales"], spec.group_size, module)
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return nvfp4_weight(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"), module)
    if fmt == "pack-quantized":
        if spec.desc_act and "weight_g_idx" not in t:
            raise ValueError(f"{module}: actorder 'group' without weight_g_idx")
        return pack_quantized_weight(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                     t.get("weight_zero_point"), spec.bits, module, t.get("weight_g_idx"))
    return naive_quantized_weight(t["weight"], t["weight_scale"], t.get("weight_zero_point"), module)
