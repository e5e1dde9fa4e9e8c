"""gpt-oss (`GptOssForCausalLM`) against transformers (float32, CPU): the MoE block (biased
router, top-k of logits softmaxed over k, biased experts with gate/up interleaved and the
clamped SwiGLU, the clamp reached) equal to transformers' GptOssMLP, the config as
transformers reads it (also a config.json in the shipped form: rope_scaling, no head_dim),
tensor-parallel shards, and greedy tokens (top-5 logprobs within 1e-4) through LLM on a tiny
random checkpoint: random non-zero sinks (transformers initialises them near zero), an 8-token
window on the sliding layers (prompt + output far past it), YaRN x32, 8 experts top-4 with
random biases; prompts longer than a block (16) and a chunk (32), a prefix-cache hit; n-gram
speculation (also over an fp8 KV cache), async scheduling, a LoRA adapter on attention equal
to PEFT's, and MTP refused.
Tensor and expert parallelism: test_gpt_oss_tensor_parallel.py; `serve` and a migration:
tests/e2e/test_model_families_serve.py, tests/e2e/test_families_migration.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import SLIDING, CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.gpt_oss_moe import GptOssMoeBlock
from splitserve.engine.models.quant_moe import has_quantized_experts
from splitserve.engine.parallel.sharding import Shard, checkpoint_shard
from splitserve.engine.parallel.state import TPState
from tests.helpers.reference import (
    assert_greedy_and_top_logprobs_equal,
    assert_prefix_hit_equals_transformers,
    hf_greedy,
)

NEW_TOKENS = 40
CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=8, max_position_embeddings=512,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})


def write_gpt_oss(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny gpt-oss saved by transformers; weights wider than its 0.02 init (so tokens are
    not one repeated id), every bias random, sinks N(0, 1) (their init is N(0, 0.02))."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = GptOssConfig(vocab_size=tok.get_vocab_size(), architectures=["GptOssForCausalLM"], bos_token_id=0,
                       eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.mlp.router.weight.normal_(0, 0.3)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "float")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 45)]  # 45: three blocks, two chunks


def test_moe_block_equals_transformers_and_the_clamp_bites():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_cfg = GptOssConfig(**{**CONFIG, "vocab_size": 32})
    torch.manual_seed(3)
    hf = GptOssMLP(hf_cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
    ours = GptOssMoeBlock(ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}))
    ours.gate.load_state_dict(hf.router.state_dict())
    ours.experts.load_state_dict(hf.experts.state_dict())
    x = 2.0 * torch.randn(1, 50, 64)
    with torch.no_grad():
        want, _ = hf(x)
        got = ours(x[0])
        gate_up = x[0] @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    torch.testing.assert_close(got, want[0], rtol=0, atol=2e-5)
    assert (gate_up[:, ::2] > 7.0).any() and (gate_up[:, 1::2].abs() > 7.0).any()  # both clamps reached


def test_config_reads_what_transformers_builds(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", (0, 1, 2), 8, 4)
    assert (cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.qkv_bias, cfg.o_bias) == (32, 0, True, True)
    assert (cfg.attention_sinks, cfg.swiglu_limit, cfg.swiglu_alpha, cfg.rms_norm_eps) == (True, 7.0, 1.702, 1e-5)
    assert cfg.layer_types == (SLIDING, "full_attention", SLIDING) and cfg.sliding_window == 8
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.params["factor"], cfg.rope.params["truncate"]) == (
        "yarn", 150000.0, 32.0, False)
    # the shipped config.json's form: rope_scaling and rope_theta, no head_dim / window / layer_types
    raw = json.loads((ckpt / "config.json").read_text())
    for name in ("rope_parameters", "head_dim", "sliding_window", "layer_types", "attention_bias", "rms_norm_eps"):
        del raw[name]
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}
    shipped = ModelConfig.from_dict(raw)
    assert (shipped.head_dim, shipped.sliding_window, shipped.qkv_bias, shipped.rms_norm_eps) == (64, 128, True, 1e-5)
    assert shipped.layer_types == (SLIDING, "full_attention", SLIDING)
    assert (shipped.rope.kind, shipped.rope.theta, shipped.rope.original_max_position_embeddings) == (
        "yarn", 150000.0, 4096)
    del raw["rope_scaling"]  # transformers' default rope
    assert ModelConfig.from_dict(raw).rope == shipped.rope


@pytest.mark.parametrize("fields,why", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok is 9; it must be between 1 and the number of experts \(8\)$"),
    ({"swiglu_limit": 0}, r"swiglu_limit \(0.0\) and swiglu_alpha \(1.702\) must be positive numbers$"),
])
def test_bad_expert_fields_are_refused_in_one_line(ckpt, fields, why):
    raw = {**json.loads((ckpt / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=r"^x.json: " + why):
        ModelConfig.from_dict(raw, source="x.json")


def test_tensor_parallel_shards(ckpt):
    """Rank 1 of 2: q heads 2-3's sinks; the 16-pair slice of gate_up_proj is 32 contiguous
    interleaved columns; down_proj's bias whole (rank 0 adds it); expert parallelism: 4 experts."""
    cfg = ModelConfig.from_dir(ckpt)
    tp, ep, layer = TPState(1, 2), TPState(1, 2, expert_parallel=True), "model.layers.1."
    assert checkpoint_shard(layer + "self_attn.sinks", cfg, tp) == Shard(0, 2, 2)
    assert checkpoint_shard(layer + "mlp.experts.gate_up_proj", cfg, tp) == Shard(2, 32, 32)
    assert checkpoint_shard(layer + "mlp.experts.gate_up_proj_bias", cfg, tp) == Shard(1, 32, 32)
    assert checkpoint_shard(layer + "mlp.experts.down_proj", cfg, tp) == Shard(1, 16, 16)
    assert checkpoint_shard(layer + "mlp.experts.down_proj_bias", cfg, tp) is None
    assert checkpoint_shard(layer + "mlp.router.weight", cfg, tp) is None
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert checkpoint_shard(layer + "mlp.experts." + name, cfg, ep) == Shard(0, 4, 4)
    assert checkpoint_shard(layer + "self_attn.sinks", cfg, ep) == Shard(0, 2, 2)


def test_greedy_tokens_equal_transformers_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    assert_greedy_and_top_logprobs_equal(ckpt, ps, llm.generate(ps, params), NEW_TOKENS)
    assert_prefix_hit_equals_transformers(llm, ckpt, ps[1][:40] + [9, 10, 11], NEW_TOKENS, min_cached=32)
    model = llm.engine.runner.model
    attention = model.layers[0].self_attn
    assert attention.sinks.dtype == torch.float32 and attention.sinks.abs().min() > 0
    assert (attention.window, model.layers[1].self_attn.window) == (8, 0)
    assert has_quantized_experts(model)  # the experts read their counts on the host: no CUDA graph capture
    assert model.weight_target("model.layers.2.mlp.router.bias") == ("layers.2.mlp.gate.bias", None)
    assert model.weight_target("model.layers.2.mlp.experts.gate_up_proj_bias") == (
        "layers.2.mlp.experts.gate_up_proj_bias", None)
    assert model.weight_target("model.layers.0.self_attn.sinks") == ("layers.0.self_attn.sinks", None)
    assert model.weight_target("model.layers.0.self_attn.k_proj.bias") == ("layers.0.self_attn.qkv_proj.bias",
                                                                           slice(64, 96))


@pytest.mark.parametrize("engine_kw", [{}, {"kv_cache_dtype": "fp8"}])
def test_ngram_speculation_keeps_the_tokens(ckpt, engine_kw):
    """Drafts are verified as several-token decode rows through the prefill kernels, with the
    sinks and the window: greedy tokens equal transformers', and with an fp8
    KV cache equal to the same cache without speculation."""
    from tests.engine.test_spec_decode_exact import NGRAM, accepted, copy_heavy

    ps = [copy_heavy(1, 12, 4)[:50], copy_heavy(2, 20, 2)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = LLM(str(ckpt), num_kv_blocks=64, speculative_config=NGRAM, **engine_kw)
    got = [o.token_ids for o in spec.generate(ps, params)]
    if engine_kw:
        want = [o.token_ids for o in LLM(str(ckpt), num_kv_blocks=64, **engine_kw).generate(ps, params)]
    else:
        want = [hf_greedy(ckpt, p, NEW_TOKENS) for p in ps]
    assert got == want
    assert accepted(spec) > 0


def test_lora_on_attention_equals_peft_and_on_experts_is_refused(ckpt, tmp_path):
    """An adapter on q/k/v/o (biased projections, sinks around them) gives PEFT's greedy tokens;
    one on the experts is refused in one line, as for every MoE family."""
    from splitserve.engine import LoRARequest
    from splitserve.engine.lora import LoRAAdapterError
    from tests.helpers.lora_adapters import make_adapter, peft_greedy

    adapter = make_adapter(ckpt, tmp_path / "attn", seed=1, r=8, alpha=16,
                           targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    llm = LLM(str(ckpt), num_kv_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompt = prompts(llm.engine.model_config.vocab_size)[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       lora_request=LoRARequest("attn", 1, str(adapter)))[0]
    assert out.token_ids == peft_greedy(ckpt, adapter, prompt, NEW_TOKENS)
    assert out.token_ids != hf_greedy(ckpt, prompt, NEW_TOKENS)
    with pytest.raises(LoRAAdapterError, match=r"mlp\.experts\.0\.gate_up_proj: MoE experts are not supported$"):
        _refused_expert_adapter(llm, tmp_path)


def _refused_expert_adapter(llm: LLM, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "experts"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["gate_up_proj"]}))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_up_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 4)},
              str(path / "adapter_model.safetensors"))
    llm.engine.loras.add("experts", str(path))


def test_async_scheduling_keeps_the_tokens_and_mtp_is_refused(ckpt):
    """The padded decode step (async scheduling's) runs the sinks and the experts eagerly; gpt-oss
    has no MTP layers, so MTP speculation is refused in one line."""
    from splitserve.core.speculative import SpeculativeConfigError

    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, async_scheduling=True)
    ps = prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ckpt, p, NEW_TOKENS) for p in ps]
    with pytest.raises(SpeculativeConfigError, match=r"^method mtp: the model's config.json needs "
                                                     r"num_nextn_predict_layers >= 1 \(its MTP layers\), got None$"):
        LLM(str(ckpt), num_kv_blocks=16, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
