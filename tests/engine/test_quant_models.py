"""Quantized checkpoints through the normal loader and engine, token for token against
transformers (float32) holding the same dequantised weights: every supported safetensors
layout, on Llama and on Qwen2 (q/k/v bias, tied embeddings) and Qwen3 (q/k norms).
All paths are weight-only, so greedy tokens must be equal, not close."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.core.quantization import quantization_from_config
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.engine.quant import iter_quantized_weights
from splitserve.engine.quant.fp8 import fp8_weight
from splitserve.kernels.quant_weight import QuantizedWeight
from tests.engine.test_quant_formats import quantize_checkpoint
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 24
BIG = dict(hidden_size=256, intermediate_size=384)  # group 128 divides every input width
ODD = dict(hidden_size=192, intermediate_size=320)  # FP8 blocks of 128 are partial here

MODELS = {
    "gptq-g128-sym-llama": ("llama", BIG, "gptq", {}),
    "gptq-g128-asym-act-order-qwen2": ("qwen2", dict(intermediate_size=384), "gptq",
                                       {"sym": False, "act_order": True}),
    "gptq-channel-qwen3": ("qwen3", dict(intermediate_size=384), "gptq", {"group": -1}),
    "awq-g128-llama": ("llama", BIG, "awq", {}),
    "fp8-block-llama": ("llama", ODD, "fp8-block", {}),
    "fp8-per-tensor-llama": ("llama", {}, "fp8-tensor", {}),
    "fp8-block-qwen2": ("qwen2", dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=320), "fp8-block", {}),
    "ct-float-channel-qwen3": ("qwen3", {}, "ct-float", {"strategy": "channel"}),
    "ct-float-tensor-llama": ("llama", ODD, "ct-float", {"strategy": "tensor"}),
    "ct-pack-g128-asym-llama": ("llama", BIG, "ct-pack", {}),
    "ct-pack-channel-sym-qwen2": ("qwen2", {}, "ct-pack", {"strategy": "channel", "sym": True}),
    "ct-pack-8bit-g128-llama": ("llama", BIG, "ct-pack", {"bits": 8, "sym": True}),
    "ct-pack-g128-actorder-group-qwen2": ("qwen2", dict(intermediate_size=384), "ct-pack", {"actorder": True}),
    # a W8A8 checkpoint runs weight-only: int8 weights, activations in float
    "ct-int8-w8a8-llama": ("llama", {}, "ct-int8", {"w8a8": True}),
    "ct-naive-int8-asym-qwen3": ("qwen3", {}, "ct-int8", {"sym": False}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_checkpoint_matches_transformers_on_its_dequantised_weights(make_ckpt, tmp_path, name):
    family, shape, layout, opts = MODELS[name]
    qdir, rdir = quantize_checkpoint(make_ckpt(family, **shape), tmp_path, layout, **opts)
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    # q, k and v are one quantized matmul after the load-end merge (the same format, and with
    # act-order the same input permutation: they share their input)
    assert isinstance(qkv, QuantizedLinear) and len(qkv.parts) == 1 and isinstance(qkv.parts[0], QuantizedWeight)
    assert len(model.layers[1].mlp.gate_up_proj.parts) == 1
    assert isinstance(model.lm_head, torch.nn.Linear)  # not quantized in these checkpoints: stays float
    rng = random.Random(3)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 40, 75)]  # 75: a chunked prefill
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)} tokens"


def test_a_quantized_linear_split_across_shards_loads(make_ckpt, tmp_path):
    """Each linear's qweight and its scales in different shards (the reader gathers them
    from the headers, whatever the order the shards come in)."""
    qdir, rdir = quantize_checkpoint(make_ckpt("llama", **BIG), tmp_path, "gptq", sym=False, act_order=True)
    tensors = load_file(str(qdir / "model.safetensors"))
    (qdir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[1::2], "model-00002-of-00002.safetensors": names[0::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(qdir / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (qdir / "model.safetensors.index.json").write_text(json.dumps(index))
    llm = LLM(str(qdir), num_kv_blocks=32)
    prompt = list(range(10, 30))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS)


def fp8_of(w: torch.Tensor) -> QuantizedWeight:
    scale = (w.abs().amax(1) / 448).clamp(min=1e-6)
    return fp8_weight((w / scale[:, None]).to(torch.float8_e4m3fn), scale, None, "test")


def shuffled_within_groups(qw: QuantizedWeight, seed: int = 0) -> QuantizedWeight:
    """The same weight with another input permutation: columns reordered inside each group."""
    g, k = qw.group_size, qw.in_features
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([i * g + torch.randperm(g, generator=gen) for i in range(k // g)])
    codes = qw.unpacked_codes().to(torch.uint8)[:, order]
    return QuantizedWeight(codes=codes[:, 0::2] | (codes[:, 1::2] << 4), scales=qw.scales, offsets=qw.offsets,
                           bits=4, group_size=g, in_features=k, out_features=qw.out_features,
                           input_perm=qw.input_perm[order])


def test_a_per_tensor_source_mixing_formats_in_fused_projections(make_ckpt, tmp_path):
    """The GGUF way: the loader learns a linear is quantized when its first quantized part
    arrives. Layer 0's k_proj comes as float (first: a swap must keep its rows), q_proj as
    GPTQ, v_proj as FP8: three parts. Layer 1's up_proj has another act-order permutation
    than gate_proj: two parts. Everything else merges into one part per layer. A quantized
    embedding is dequantised. Each layer computes what its float equivalent computes."""
    qdir, rdir = quantize_checkpoint(make_ckpt("llama", **BIG), tmp_path, "gptq", act_order=True)
    spec = quantization_from_config(json.loads((qdir / "config.json").read_text()))
    reference = load_file(str(rdir / "model.safetensors"))

    def stream():
        for name, value in iter_quantized_weights(qdir, spec):
            if name == "model.layers.0.self_attn.k_proj.weight":
                value = reference[name]
            elif name in ("model.layers.0.self_attn.v_proj.weight", "model.embed_tokens.weight"):
                value = fp8_of(value if isinstance(value, torch.Tensor) else value.dequantize())
                reference[name] = value.dequantize()
            elif name == "model.layers.1.mlp.up_proj.weight":
                value = shuffled_within_groups(value)
            yield name, value

    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, torch.float32, "cpu", weights=stream())
    save_file(reference, str(rdir / "model.safetensors"), metadata={"format": "pt"})
    float_model = load_model(rdir, ModelConfig.from_dir(rdir), torch.float32, "cpu")

    qkv0 = model.layers[0].self_attn.qkv_proj
    assert [type(p).__name__ for p in qkv0.parts] == ["QuantizedWeight", "Tensor", "QuantizedWeight"]
    assert [p.bits for p in (qkv0.parts[0], qkv0.parts[2])] == [4, 0]
    assert len(model.layers[1].mlp.gate_up_proj.parts) == 2
    assert len(model.layers[0].mlp.gate_up_proj.parts) == len(model.layers[1].self_attn.qkv_proj.parts) == 1
    assert torch.equal(model.embed_tokens.weight, float_model.embed_tokens.weight)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            want = float_model.get_submodule(name)
            xin = x if module.in_features == cfg.hidden_size else torch.randn(5, module.in_features)
            torch.testing.assert_close(module(xin), want(xin), atol=1e-5, rtol=1e-5, msg=name)


def test_missing_or_repeated_parts_are_refused(make_ckpt, tmp_path):
    qdir, _ = quantize_checkpoint(make_ckpt("llama", **BIG), tmp_path, "awq")
    spec = quantization_from_config(json.loads((qdir / "config.json").read_text()))
    cfg = ModelConfig.from_dir(qdir)
    v0 = "model.layers.0.self_attn.v_proj.weight"
    without_v = ((n, v) for n, v in iter_quantized_weights(qdir, spec) if n != v0)
    with pytest.raises(CheckpointError, match=r"lacks tensors for \['layers.0.self_attn.qkv_proj.weight'\]"):
        load_model(qdir, cfg, torch.float32, "cpu", weights=without_v)

    def twice():
        for name, value in iter_quantized_weights(qdir, spec):
            yield name, value
            if name == v0:
                yield name, value

    with pytest.raises(CheckpointError, match=f"tensor '{v0}': rows 384:512 filled a second time$"):
        load_model(qdir, cfg, torch.float32, "cpu", weights=twice())
