"""GLM-4.5 (`Glm4MoeForCausalLM`) against transformers (float32, CPU): DeepSeek-style
routing equal to transformers' router (sigmoid scores, correction bias for the choice only,
grouped top-k, renormalised and scaled weights), the config as transformers reads it, and
greedy tokens (and top-5 logprobs within 1e-4) through LLM on a tiny random checkpoint whose routing is non-trivial: 4 groups
of 2 experts with 2 kept, a nonzero correction bias, a dense first layer, q/k norms, partial
rotary 0.5, q/k/v bias; prompts longer than a block (16) and than a chunk (32), a prefix-cache
hit, and the FP8 block-wise checkpoint of the same model. Tensor parallelism:
test_glm4_moe_tensor_parallel.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.moe_routing import GroupedRouting, grouped_topk
from splitserve.engine.models.quant_moe import QuantizedExperts
from tests.engine.test_quant_formats import quantize_checkpoint
from tests.helpers.reference import (
    assert_greedy_and_top_logprobs_equal,
    assert_prefix_hit_equals_transformers,
    hf_greedy,
)

NEW_TOKENS = 40
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
              n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
              max_position_embeddings=512)


def write_glm4_moe(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny GLM-4.5 saved by transformers; weights wider than its 0.02 init (so tokens are
    not one repeated id) and a router sharp enough that groups and bias decide choices."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = Glm4MoeConfig(vocab_size=tok.get_vocab_size(), architectures=["Glm4MoeForCausalLM"],
                        bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_glm4_moe(tmp_path_factory.mktemp("glm4_moe") / "float")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 45)]  # 45: three blocks, two chunks


def test_grouped_topk_equals_transformers_router_and_groups_and_bias_decide():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(1)
    hf_cfg = Glm4MoeConfig(**{**CONFIG, "hidden_size": 16})
    router = Glm4MoeTopkRouter(hf_cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(8))
    x = torch.randn(200, 16)
    logits, want_w, want_ids = router(x)
    r = GroupedRouting(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, renormalize=True, scaling=2.5)
    got_w, got_ids = grouped_topk(logits, router.e_score_correction_bias, r)
    order_got, order_want = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=0, atol=1e-6)
    # what each part decides: dropping the group limit, or the bias, changes some tokens' experts
    ungrouped = grouped_topk(logits, router.e_score_correction_bias, GroupedRouting(3, "sigmoid", 1, 1, True, 2.5))[1]
    unbiased = grouped_topk(logits, None, r)[1]
    assert not torch.equal(ungrouped.sort(dim=-1).values, order_got.values)
    assert not torch.equal(unbiased.sort(dim=-1).values, order_got.values)
    # the weights are the uncorrected scores, renormalised, then scaled
    scores = logits.sigmoid().gather(1, got_ids)
    torch.testing.assert_close(got_w, 2.5 * scores / scores.sum(-1, keepdim=True))


def test_config_reads_what_transformers_builds(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("glm4_moe", (1, 2), 8, 3)
    assert (cfg.moe_scoring, cfg.moe_n_group, cfg.moe_topk_group, cfg.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (cfg.n_shared_experts, cfg.norm_topk_prob, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (1, True, True,
                                                                                                   True, False)
    assert cfg.rope.rotary_dim == 16  # partial_rotary_factor 0.5 of head_dim 32
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["rope_parameters"]["partial_rotary_factor"]  # absent: transformers' default 0.5
    assert ModelConfig.from_dict(raw).rope.rotary_dim == 16


def test_router_weight_and_correction_bias_stay_float32_in_a_bf16_model(ckpt):
    from safetensors.torch import load_file

    from splitserve.engine.models.loader import load_model

    model = load_model(ckpt, ModelConfig.from_dir(ckpt), torch.bfloat16, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    gate = model.layers[2].mlp.gate
    assert torch.equal(gate.weight, saved["model.layers.2.mlp.gate.weight"])  # float32, not rounded
    assert torch.equal(gate.e_score_correction_bias, saved["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert model.layers[2].mlp.shared_experts.gate_up_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("fields,why", [
    ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\) into groups of at least 2, and topk_group "
                     r"\(2\) be between 1 and n_group$"),
    ({"topk_group": 5}, r"n_group \(4\) must divide .*, and topk_group \(5\) be between 1 and n_group$"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok is 5; it must be between 1 and the experts of the topk_group "
                                 r"kept groups \(4\)$"),
])
def test_impossible_routing_is_refused_in_one_line(ckpt, fields, why):
    raw = {**json.loads((ckpt / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=r"^x.json: " + why):
        ModelConfig.from_dict(raw, source="x.json")


def test_greedy_tokens_equal_transformers_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    assert_greedy_and_top_logprobs_equal(ckpt, ps, llm.generate(ps, params), NEW_TOKENS)
    assert_prefix_hit_equals_transformers(llm, ckpt, ps[1][:40] + [9, 10, 11], NEW_TOKENS, min_cached=32)
    # the multi-token-prediction layer after the last one (num_nextn_predict_layers) is not read
    model = llm.engine.runner.model
    assert model.weight_target("model.layers.3.eh_proj.weight") is None
    assert model.weight_target("model.layers.3.mlp.experts.0.up_proj.weight") is None
    assert model.weight_target("model.layers.2.mlp.gate.e_score_correction_bias") == (
        "layers.2.mlp.gate.e_score_correction_bias", None)
    # the shared expert's gate and up rows of the fused gate_up_proj (what a LoRA on it reads too)
    assert model.weight_target("model.layers.1.mlp.shared_experts.up_proj.weight") == (
        "layers.1.mlp.shared_experts.gate_up_proj.weight", slice(32, 64))
    assert model.part_rows("mlp.shared_experts.gate_up_proj") == [(0, 32), (32, 64)]
    assert model.part_rows("mlp.gate_up_proj") == [(0, 96), (96, 192)]  # the dense first layer


def test_without_qk_norm_as_glm_4_5_ships_decode_takes_the_prepared_cpu_path_and_stays_exact(tmp_path):
    """GLM-4.5's own configs say use_qk_norm false: CPU decode steps then run the prepared
    attention (kernels/cpu_decode_step.py) with partial rotary and q/k/v bias."""
    path = write_glm4_moe(tmp_path / "no_qk_norm", seed=1, use_qk_norm=False)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32)
    assert not llm.engine.model_config.qk_norm
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert llm.engine.runner.model.layers[1].self_attn.prepared_decode is not None


def test_fp8_block_checkpoint_keeps_experts_quantized_and_equals_transformers_dequantised(ckpt, tmp_path):
    qdir, rdir = quantize_checkpoint(ckpt, tmp_path, "fp8-block")  # experts and shared experts too
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    assert all(isinstance(model.layers[i].mlp.experts, QuantizedExperts) for i in (1, 2))
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
