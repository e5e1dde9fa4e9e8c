"""Quantized checkpoints through the normal loader and engine, token for token against
transformers (float32) holding the same dequantised weights: every supported safetensors
layout, on Llama and on Qwen2 (q/k/v bias, tied embeddings) and Qwen3 (q/k norms).
All paths are weight-only, so greedy tokens must be equal, not close."""

from __future__ import annotations

import random

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.quant_linear import QuantizedLinear
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
    "fp8-block-qwen2": ("qwen2", dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=320), "fp8-block", {}),
    "ct-float-channel-qwen3": ("qwen3", {}, "ct-float", {"strategy": "channel"}),
    "ct-float-tensor-llama": ("llama", ODD, "ct-float", {"strategy": "tensor"}),
    "ct-pack-g128-asym-llama": ("llama", BIG, "ct-pack", {}),
    "ct-pack-channel-sym-qwen2": ("qwen2", {}, "ct-pack", {"strategy": "channel", "sym": True}),
    "ct-pack-8bit-g128-llama": ("llama", BIG, "ct-pack", {"bits": 8, "sym": True}),
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
    assert type(model.lm_head).__name__ == "Linear"  # not quantized in these checkpoints: stays float
    rng = random.Random(3)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 40, 75)]  # 75: a chunked prefill
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)} tokens"
