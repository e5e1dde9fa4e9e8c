"""Quantized mixture-of-experts checkpoints (Qwen3-MoE, Mixtral): every expert projection
quantized in the dense formats' layouts (FP8 block-wise with partial 128x128 blocks, FP8
per-tensor, GPTQ with act-order, AWQ, compressed-tensors pack-quantized and float-
quantized), the router and lm_head float. The experts stay quantized (QuantizedExperts,
no float expert stack is allocated); each MoE layer computes what the float layer holding
the dequantised weights computes, and greedy tokens equal transformers' (float32) on that
dequantised checkpoint."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.core.model_dir import checkpoint_problem
from splitserve.core.quantization import quantization_from_config, tensor_parallel_split_problem
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.quant_moe import QuantizedExperts, has_quantized_experts
from splitserve.engine.parallel.state import tp
from splitserve.engine.quant import iter_quantized_weights
from splitserve.kernels.quant_weight import QuantizedWeight
from tests.engine.test_quant_formats import LINEARS, quantize_checkpoint
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 16
MIXTRAL_LINEARS = LINEARS + ("w1", "w2", "w3")
GROUP_128 = dict(moe_intermediate_size=128, intermediate_size=256)  # every input width a multiple of 128

# name: (family, checkpoint overrides, layout, writer options)
MODELS = {
    # experts 160x128 (gate+up) and 128x80 (down): partial blocks in both directions
    "fp8-block-qwen3_moe": ("qwen3_moe", {}, "fp8-block", {}),
    "fp8-per-tensor-qwen3_moe": ("qwen3_moe", {}, "fp8-tensor", {}),
    "fp8-block-mixtral": ("mixtral", {}, "fp8-block", {}),
    "gptq-g16-asym-act-order-qwen3_moe": ("qwen3_moe", {}, "gptq", {"group": 16, "sym": False, "act_order": True}),
    "awq-g128-qwen3_moe": ("qwen3_moe", GROUP_128, "awq", {}),
    "ct-pack-g128-qwen3_moe": ("qwen3_moe", GROUP_128, "ct-pack", {}),
    "ct-float-channel-mixtral": ("mixtral", {}, "ct-float", {"strategy": "channel"}),
}


def quantized_moe(make_ckpt, tmp_path, name):
    family, shape, layout, opts = MODELS[name]
    return quantize_checkpoint(make_ckpt(family, **shape), tmp_path, layout, linears=MIXTRAL_LINEARS, **opts)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 75)]  # 75: a chunked prefill


def assert_layers_match_float(model, rdir, cfg: ModelConfig) -> None:
    """Every MoE block of `model` computes what the float block of the dequantised checkpoint does."""
    float_model = load_model(rdir, ModelConfig.from_dir(rdir), torch.float32, "cpu")
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in cfg.moe_layers:
        with torch.inference_mode():
            got, want = model.layers[layer].mlp(x), float_model.layers[layer].mlp(x)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"layer {layer}")


@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_experts_match_transformers_on_the_dequantised_weights(make_ckpt, tmp_path, name):
    qdir, rdir = quantized_moe(make_ckpt, tmp_path, name)
    assert checkpoint_problem(str(qdir)) is None  # serve's torch-free check lets it through
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64)
    cfg, model = llm.engine.model_config, llm.engine.runner.model
    for layer in cfg.moe_layers:
        experts = model.layers[layer].mlp.experts
        assert isinstance(experts, QuantizedExperts) and len(experts.w13) == cfg.num_experts
        # gate and up rows of one expert: one quantized matmul after the load-end merge
        assert all(len(m.parts) == 1 and isinstance(m.parts[0], QuantizedWeight) for m in experts.linears().values())
    assert not [n for n, _ in model.named_parameters() if n.endswith((".w13", ".w2"))]  # no float expert stack
    assert isinstance(model.layers[0].mlp.gate, torch.nn.Linear)  # the router stays float
    assert has_quantized_experts(model)  # (on CUDA: decode steps run without graph capture)
    assert_layers_match_float(model, rdir, cfg)
    ps = prompts(cfg.vocab_size)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)} tokens"


def test_the_padded_decode_step_with_quantized_experts_gives_the_same_tokens(make_ckpt, tmp_path):
    """Async scheduling's padded static-buffer decode step (eager: what CUDA runs instead
    of a captured graph with quantized experts) routes its padding rows harmlessly."""
    qdir, _ = quantized_moe(make_ckpt, tmp_path, "gptq-g16-asym-act-order-qwen3_moe")
    ps = prompts(1000) + [list(range(10, 22))]  # 3 decodes: a bucket of 4, one padding row
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    padded = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64, async_scheduling=True).generate(ps, params)
    plain = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64).generate(ps, params)
    assert [o.token_ids for o in padded] == [o.token_ids for o in plain]


def test_float_expert_parts_before_the_first_quantized_one_are_kept(make_ckpt, tmp_path):
    """A mixed source (the GGUF way): layer 0's expert 0 down_proj arrives as float before
    any quantized expert tensor of that block, expert 3's gate_proj as float after; both
    stay float parts of their expert's linear."""
    qdir, rdir = quantized_moe(make_ckpt, tmp_path, "fp8-block-qwen3_moe")
    reference = load_file(str(rdir / "model.safetensors"))
    as_float = ("model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.experts.3.gate_proj.weight")
    spec = quantization_from_config(ModelConfig.from_dir(qdir).raw)
    stream = list(iter_quantized_weights(qdir, spec))
    stream = [(n, reference[n] if n in as_float else v) for n, v in stream]
    stream.sort(key=lambda item: item[0] != as_float[0])  # the float part first
    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, torch.float32, "cpu", weights=iter(stream))
    experts = model.layers[0].mlp.experts
    assert [type(p).__name__ for p in experts.w2[0].parts] == ["Tensor"]
    assert [type(p).__name__ for p in experts.w13[3].parts] == ["Tensor", "QuantizedWeight"]
    assert_layers_match_float(model, rdir, cfg)


def test_a_missing_quantized_expert_projection_is_named(make_ckpt, tmp_path):
    qdir, _ = quantized_moe(make_ckpt, tmp_path, "fp8-block-mixtral")
    path = qdir / "model.safetensors"
    tensors = load_file(str(path))
    for suffix in ("weight", "weight_scale_inv"):
        del tensors[f"model.layers.1.block_sparse_moe.experts.5.w3.{suffix}"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"checkpoint lacks tensors for \['layers.1.mlp.w13\[5\]'\]$"):
        LLM(str(qdir), num_kv_blocks=16)


def test_tp2_splits_quantized_experts_and_matches_transformers(make_ckpt, tmp_path):
    """Each rank holds half of every expert's intermediate rows (gate/up by rows, down by
    whole 128-column blocks): hidden 256 (4 heads of 64), moe_intermediate 256."""
    src = make_ckpt("qwen3_moe", hidden_size=256, head_dim=64, moe_intermediate_size=256, intermediate_size=512)
    qdir, rdir = quantize_checkpoint(src, tmp_path, "fp8-block")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(qdir), num_kv_blocks=32, max_num_batched_tokens=64, tensor_parallel_size=2) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert (experts.w13[0].out_features, experts.w2[0].in_features) == (256, 128)  # rank 0's halves
        ps = prompts(llm.engine.model_config.vocab_size)
        outs = [o.token_ids for o in llm.generate(ps, params)]
    assert tp().size == 1
    assert outs == [hf_greedy(rdir, p, NEW_TOKENS) for p in ps]


def test_a_group_split_of_the_experts_down_projection_is_refused_before_start():
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 256,
                                 "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 64, "num_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 192})
    spec = quantization_from_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    assert tensor_parallel_split_problem(spec, cfg, 2) == (
        "its mlp.experts.N.down_proj has 192 input columns, 96 per rank, which is not whole quantization groups "
        "of 128 (gptq 4-bit, group 128, sym)")
