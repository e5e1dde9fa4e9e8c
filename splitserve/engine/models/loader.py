"""Build a model from a checkpoint directory: each checkpoint tensor goes where the model's
`weight_target` says: (parameter, None) for all of it, or (parameter, index) for the part
`param[index]` (rows of a fused projection, one expert of a stacked MoE weight). Every
parameter must be filled completely, each part once.

A weight source may yield QuantizedWeights (engine/quant/ for quantized safetensors, the
GGUF reader): the loader learns a linear is quantized when its first quantized part
arrives and swaps it for a QuantizedLinear then. So that no float copy of a quantized
linear is ever allocated (a 7B GGUF would need 28 GB of float32 for nothing), every
Linear's weight stays on the meta device until its first float part arrives. A quantized
linear keeps float rows that came before its first quantized part as a float part; a
quantized embedding is dequantised (its lookup reads float rows).

A quantized expert tensor of a mixture-of-experts layer (index (expert, rows) into the
float stacks w13 / w2) swaps the whole block's stacks for QuantizedExperts
(engine/models/quant_moe.py): one QuantizedLinear per expert projection, filled part by
part like any other; the expert stacks, too, stay on the meta device until a float part
arrives. gpt-oss's experts module (stacks gate_up_proj / down_proj) is replaced whole, by
QuantizedGptOssExperts (engine/models/gpt_oss_quant.py: MXFP4 as shipped)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.core.quantization import quantization_from_config
from splitserve.engine.checkpoint import iter_weights
from splitserve.engine.models.gpt_oss_quant import quantize_experts
from splitserve.engine.models.quant_linear import QuantizedLinear, move_weight
from splitserve.engine.models.registry import model_class
from splitserve.engine.parallel.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    quantized_replacement,
)
from splitserve.engine.parallel.sharding import ShardOf, checkpoint_shard, sharded
from splitserve.engine.parallel.state import tp
from splitserve.engine.quant import iter_quantized_weights
from splitserve.kernels import cpu_linear, ops
from splitserve.kernels.quant_weight import QuantizedWeight

log = logging.getLogger(__name__)
Weights = Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]]


def checkpoint_weights(model_dir: str | Path, cfg: ModelConfig, quantization: str | None = None,
                       shard_of: ShardOf | None = None) -> Weights:
    """The directory's (name, tensor or QuantizedWeight) stream, by its quantization_config
    (`quantization`: --quantization, which must match it); with `shard_of` (tensor
    parallelism), each tensor narrowed to this rank's part."""
    spec = quantization_from_config(cfg.raw, f"{model_dir}/config.json", quantization)
    if spec is None:
        return iter_weights(model_dir, shard_of)
    weights = iter_quantized_weights(model_dir, spec)
    return weights if shard_of is None else sharded(weights, shard_of, str(model_dir))


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device,
               quantization: str | None = None, weights: Weights | None = None,
               fp8_min_rows: int | None = None, model_cls: type[nn.Module] | None = None) -> nn.Module:
    """`weights`: another source of (name, tensor or QuantizedWeight) than the directory's.
    `model_cls`: another class than the family's (an MTP layer's, engine/spec/mtp_model.py).
    `fp8_min_rows`: FP8 weights with a scale per row multiply FP8 activations
    (kernels/fp8_scaled_mm.py) in matmuls of at least that many rows, instead of being
    decoded to the model's dtype; None: never."""
    # tensor parallelism: this rank loads its part of each tensor (engine/parallel/sharding.py)
    shard_of = (lambda name: checkpoint_shard(name, cfg, tp())) if tp().size > 1 else None
    if weights is None:
        weights = checkpoint_weights(model_dir, cfg, quantization, shard_of)
    elif shard_of is not None:
        weights = sharded(weights, shard_of, str(model_dir))
    with torch.device("meta"):
        model = (model_cls or model_class(cfg))(cfg)
    deferred = {n: m.weight for n, m in linear_weights(model).items()} | expert_stacks(model)
    for name in deferred:
        set_param(model, name, None)  # kept out of to_empty(): allocated on first use
    model = model.to_empty(device=device).to(dtype)
    for name, meta in deferred.items():
        set_param(model, name, nn.Parameter(torch.empty(meta.shape, dtype=dtype, device="meta")))
    if cfg.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(params) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    quantized: dict[str, QuantizedLinear] = {}
    expert_blocks: dict[str, nn.Module] = {}  # a MoE block's path -> its QuantizedExperts (or gpt-oss's)
    filled: dict[str, int] = {}  # elements written per parameter
    seen: dict[str, list] = {}  # parameter -> the indexes filled

    for name, tensor in weights:
        target = model.weight_target(name)
        if target is None:
            continue
        param_name, index = target
        is_quantized = isinstance(tensor, QuantizedWeight)
        if not is_quantized and (not tensor.is_floating_point() or tensor.element_size() == 1):
            raise CheckpointError(f"{model_dir}: tensor '{name}' is {tensor.dtype}, quantized codes that no "
                                  "quantization_config describes (or that lack their scales)")
        block, _, stack = param_name.rpartition(".")
        if is_quantized and isinstance(index, tuple) and block not in expert_blocks and param_name in params:
            # the first quantized expert tensor of a MoE block: its experts stay quantized
            expert_blocks[block] = swap_experts(model, block, params, seen, filled)
        if block in expert_blocks and stack in getattr(expert_blocks[block], "stacks", ("w13", "w2")):
            try:
                linear, rows = expert_blocks[block].part(stack, index)
                linear.set_part(rows, move_weight(tensor, device, dtype))
            except ValueError as exc:
                raise CheckpointError(f"{model_dir}: tensor '{name}': {exc}") from exc
            continue
        if param_name not in params and param_name not in quantized:
            raise CheckpointError(f"{model_dir}: unexpected tensor '{name}' for {cfg.architecture}")
        if is_quantized and param_name not in quantized and not is_embedding(model, param_name):
            # the first quantized part of a linear: swap it, keeping the float rows filled so far
            linear = swap_linear(model, param_name, model_dir)
            for done in seen.pop(param_name, []):
                linear.set_part(done, params[param_name].data if done is None else params[param_name].data[done])
            quantized[param_name] = linear
            del params[param_name]
        if param_name in quantized:
            try:
                quantized[param_name].set_part(index, move_weight(tensor, device, dtype))
            except ValueError as exc:
                raise CheckpointError(f"{model_dir}: tensor '{name}': {exc}") from exc
            continue
        if is_quantized:
            tensor = tensor.dequantize()  # an embedding: its lookup reads float rows
        if repr(index) in map(repr, seen.get(param_name, [])):
            raise CheckpointError(f"{model_dir}: tensor '{name}' fills '{param_name}' a second time")
        seen.setdefault(param_name, []).append(index)
        if params[param_name].is_meta:  # a deferred Linear weight: float after all
            params[param_name] = nn.Parameter(torch.empty_like(params[param_name], device=device))
            set_param(model, param_name, params[param_name])
        dst = params[param_name].data if index is None else params[param_name].data[index]
        if dst.shape != tensor.shape:
            raise CheckpointError(
                f"{model_dir}: tensor '{name}' has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(dst.shape)} (check hidden_size, intermediate_size, num_attention_heads, "
                "num_key_value_heads, head_dim, vocab_size)")
        dst.copy_(tensor.to(dst.dtype))  # the model's dtype, or float32 where a module keeps it (a router)
        filled[param_name] = filled.get(param_name, 0) + dst.numel()

    missing = sorted(p for p in expected if p in params and filled.get(p, 0) != params[p].numel())
    missing += sorted(p for p, m in quantized.items() if m.missing_rows())
    missing += [f"{block}.{n}" for block, experts in expert_blocks.items()
                for n, m in experts.linears().items() if m.missing_rows()]
    if missing:
        raise CheckpointError(f"{model_dir}: checkpoint lacks tensors for {missing[:5]}"
                              f"{' and more' if len(missing) > 5 else ''}")
    fp8_parts = 0
    expert_linears = [m for experts in expert_blocks.values() for m in experts.linears().values()]
    for linear in [*quantized.values(), *expert_linears]:
        linear.finish()
        if fp8_min_rows is not None:
            fp8_parts += linear.use_fp8_activations(fp8_min_rows)
    if fp8_parts:
        log.info("%s: %d FP8 matmuls take FP8 activations quantized per token (torch._scaled_mm) with %s; "
                 "--fp8-activations off: weight-only", model_dir, fp8_parts,
                 "every batch" if fp8_min_rows == 1 else f"{fp8_min_rows}+ rows (prefill)")
    model.eval()
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        pack_linear_weights(model)
        store_linear_weights_input_major(model)  # what stayed dense
    return model


def linear_weights(model: nn.Module) -> dict[str, nn.Linear]:
    """parameter name -> Linear, for every Linear weight not tied to an embedding."""
    tied = {id(p) for name, p in model.named_parameters() if "embed" in name}
    return {f"{n}.weight": m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) not in tied}


def expert_stacks(model: nn.Module) -> dict[str, nn.Parameter]:
    """parameter name -> the float expert stacks (w13, w2) of every MoE block."""
    return {n: p for n, p in model.named_parameters()
            if n.endswith((".mlp.w13", ".mlp.w2", ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))}


def swap_experts(model: nn.Module, block: str, params: dict, seen: dict, filled: dict) -> nn.Module:
    """Replace MoE block `block`'s float expert stacks with QuantizedExperts (gpt-oss: its
    experts module `block` with QuantizedGptOssExperts), keeping the float parts filled so far
    as float parts of the expert linears."""
    experts = quantize_experts(model, block) or model.get_submodule(block).quantize_experts()
    stacks = {stack: params.pop(f"{block}.{stack}") for stack in getattr(experts, "stacks", ("w13", "w2"))}
    for stack, param in stacks.items():
        filled.pop(f"{block}.{stack}", None)
        for done in seen.pop(f"{block}.{stack}", []):
            # a whole stacked tensor (index None) fills every expert
            for index in [(e,) for e in range(param.shape[0])] if done is None else [done]:
                linear, rows = experts.part(stack, index)
                linear.set_part(rows, param.data[index])
    return experts


def set_param(model: nn.Module, name: str, value: nn.Parameter | None) -> None:
    module, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module), attr, value)


def is_embedding(model: nn.Module, param_name: str) -> bool:
    return isinstance(model.get_submodule(param_name.rpartition(".")[0]), nn.Embedding)


def swap_linear(model: nn.Module, param_name: str, model_dir) -> QuantizedLinear:
    """Replace the nn.Linear whose weight is `param_name` with a QuantizedLinear (same bias)."""
    path, _, attr = param_name.rpartition(".")
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    linear = getattr(parent, child, None)
    if attr != "weight" or not isinstance(linear, nn.Linear):
        raise CheckpointError(f"{model_dir}: a quantized tensor for '{param_name}', which is not a linear layer's "
                              "weight")
    quantized = quantized_replacement(linear)  # keeps a sharded layer's all-reduce or gather
    setattr(parent, child, quantized)
    return quantized


TIED_HEAD_COPY_MAX = 0.25  # of the model's weight bytes (pack_tied_lm_head)


def pack_linear_weights(model: nn.Module) -> None:
    """Replace each float32 linear weight of ours (not one tied to the embedding; plain
    nn.Linear layers, as a MoE router, call F.linear and stay dense) by its oneDNN-packed
    form where it is large enough to gain (kernels/cpu_linear.py: 10% faster prefill GEMMs,
    20% faster decode at batch 8); the dense tensor is dropped, so the model holds one copy.
    Nothing changes when the native kernel backend is not the one in use or this torch build
    cannot pack.
    The packed weight is a plain attribute, not a Parameter: nothing trains or saves it."""
    if ops.backend_for(torch.empty(0)) != "native":
        return
    tied = {id(p) for name, p in model.named_parameters() if "embed" in name}
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # (before packing takes some away)
    ours = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)  # those computing through ops.linear
    for module in [m for m in model.modules() if isinstance(m, ours) and id(m.weight) not in tied]:
        packed = cpu_linear.pack(module.weight.data)
        if packed is None:  # small, or this build cannot: it stays dense
            continue
        del module._parameters["weight"]
        module.weight = packed
    pack_tied_lm_head(model, tied, total)


def pack_tied_lm_head(model: nn.Module, tied: set[int], total: int) -> None:
    """An LM head tied to the embedding stays dense (the embedding looks rows up in it); it
    gets a packed copy beside it for steps of several rows when that copy costs at most
    TIED_HEAD_COPY_MAX of the weights' bytes. Why: on the dense tensor oneDNN takes 5.7 ms
    for SmolLM2's head at 2 rows and 8.0 at 8, packed 3.2 and 4.5, and one row stays on the
    native gemv (3.0 ms, faster than either): a batch-8 decode step or a verification of
    drafts saves 2.5-3.5 ms for 113 MB more memory (21% of SmolLM2's weights; Gemma 3's
    262k-row head is 63% of its model and is not copied)."""
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(module.weight) in tied:
            head = module.weight.numel() * module.weight.element_size()
            if head <= TIED_HEAD_COPY_MAX * total:
                module.packed_weight = cpu_linear.pack(module.weight.data)


def store_linear_weights_input_major(model: nn.Module) -> None:
    """Keep each Linear's weight in memory as [in, out] rows (still the [out, in] tensor, with
    swapped strides), so F.linear's x @ W.T is a plain, non-transposed GEMM.

    Why: on a CPU, MKL's float32 GEMM with few rows (a decode step's batch) runs 1.3-2x faster
    on this layout (gate_up at 8 rows: 52 -> 36 us; a demo-model decode step -7% at batch 32,
    -9% at 8) and as fast for a prefill's hundreds of rows; bf16 was slower, so it stays as is.
    Steps of two rows or more go through oneDNN (kernels/cpu_linear.py), which reads this
    layout as it is, faster still.
    A weight tied to the embedding keeps its layout: the lookup reads its rows."""
    tied = {id(p) for name, p in model.named_parameters() if "embed" in name}
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in tied and not module.weight.is_mkldnn:
            module.weight.data = module.weight.data.t().contiguous().t()
