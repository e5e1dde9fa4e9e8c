"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: multi-head latent attention + DeepSeek-style MoE)
against transformers (float32, CPU) on tiny random checkpoints: the config as transformers
reads it (MLA dims, the cache row, YaRN's mscale in the softmax scale), the KV bytes per token
(one latent row, not per-head K and V), and greedy tokens (top-5 logprobs within 1e-4)
through LLM with prompts longer than a block (16) and a chunk (32), a prefix-cache hit, with
and without q_lora_rank, with YaRN, with an fp8 latent cache's bytes, and an FP8 block-wise
checkpoint against its dequantised reference. Tensor parallelism and `serve`:
test_deepseek_v3_tensor_parallel.py, tests/e2e/test_model_families_serve.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig, kv_bytes_per_token
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.quant_moe import QuantizedExperts
from tests.engine.test_quant_formats import LINEARS, quantize_checkpoint
from tests.helpers.reference import (
    assert_greedy_and_top_logprobs_equal,
    hf_greedy,
)

NEW_TOKENS = 40
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
              n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def write_deepseek_v3(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V3 saved by transformers; weights wider than its 0.02 init (so tokens
    are not one repeated id) and a router sharp enough that groups and bias decide choices."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = DeepseekV3Config(vocab_size=tok.get_vocab_size(), architectures=["DeepseekV3ForCausalLM"],
                           bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3") / "float")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 45)]  # 45: three blocks, two chunks


def assert_equal_to_transformers(llm: LLM, ckpt: Path, logprobs: bool = False) -> None:
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5 if logprobs else None)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        if not logprobs:
            assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
            continue
        assert_greedy_and_top_logprobs_equal(ckpt, [prompt], [out], NEW_TOKENS)


def test_config_reads_mla_dims_and_the_cache_row(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.moe_layers, cfg.num_experts, cfg.routed_scaling_factor) == ("deepseek_v3", (1, 2), 8, 2.5)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        32, 24, 16, 8, 16)
    # the cache row: one latent (32) plus one rope key (8), one part, shared by all 4 heads
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_parts) == (1, 40, 1)
    assert cfg.rope.rotary_dim == 8 and cfg.rope_interleave
    assert cfg.attn_scale == pytest.approx((16 + 8) ** -0.5)
    # DeepSeek-V3's own defaults where a saved config leaves a field out (transformers' diff save)
    raw = {k: v for k, v in json.loads((ckpt / "config.json").read_text()).items()
           if k not in ("n_group", "topk_group", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank")}
    raw.update(n_routed_experts=256, num_hidden_layers=4)
    d = ModelConfig.from_dict(raw)
    assert (d.moe_n_group, d.moe_topk_group, d.moe_layers, d.kv_lora_rank, d.q_lora_rank) == (8, 4, (3,), 512, 1536)


def test_yarn_mscale_squared_enters_the_softmax_scale_as_in_transformers(tmp_path):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    path = write_deepseek_v3(tmp_path / "yarn", rope_parameters=YARN)
    want = DeepseekV3Attention(DeepseekV3Config(**{**CONFIG, "rope_parameters": YARN}), 0).scaling
    assert ModelConfig.from_dir(path).attn_scale == pytest.approx(want, rel=1e-12)
    assert want != pytest.approx((16 + 8) ** -0.5)  # the test checks something: mscale is not 1
    assert_equal_to_transformers(LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32), path)


@pytest.mark.parametrize("fields,why", [
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim \(7\) must be even \(rope pairs\)$"),
    ({"kv_lora_rank": 0}, r"field 'kv_lora_rank' is 0; it must be an integer from 1 to 65536$"),
    ({"q_lora_rank": "big"}, r"field 'q_lora_rank' is 'big'; it must be null or an integer from 1 to 65536$"),
])
def test_impossible_mla_dims_are_refused_in_one_line(ckpt, fields, why):
    raw = {**json.loads((ckpt / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=r"^x.json: " + why):
        ModelConfig.from_dict(raw, source="x.json")


def test_kv_bytes_per_token_are_one_latent_row_per_layer(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, kv_cache_dtype="auto")
    spec = llm.engine.runner.kv_pool.spec
    assert spec.block_shape == (3, 1, 16, 1, 40)
    assert spec.block_nbytes // spec.block_size == (32 + 8) * 3 * 4  # (kv_lora_rank + rope) x layers x float32
    assert kv_bytes_per_token(ModelConfig.from_dir(ckpt), 2, 4) == (32 + 8) * 3 * 4  # what start-up says; TP: the same
    k, v = llm.engine.runner.kv_pool.layer(0)
    assert k.data_ptr() == v.data_ptr()  # one part: the same row serves as key and value
    fp8 = LLM(str(ckpt), num_kv_blocks=64, kv_cache_dtype="fp8").engine.runner.kv_pool.spec
    assert fp8.block_nbytes // fp8.block_size == (32 + 8) * 3  # one byte an element


def test_greedy_tokens_equal_transformers_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    assert_equal_to_transformers(llm, ckpt, logprobs=True)
    ps = prompts(llm.engine.model_config.vocab_size)
    again = ps[1][:40] + [9, 10, 11]
    hit = llm.generate([again], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert hit.num_cached_tokens >= 32, hit.num_cached_tokens
    assert hit.token_ids == hf_greedy(ckpt, again, NEW_TOKENS)
    model = llm.engine.runner.model
    assert model.weight_target("model.layers.3.self_attn.kv_b_proj.weight") is None  # an MTP layer: not read
    assert model.weight_target("model.layers.1.self_attn.kv_b_proj.weight") == ("layers.1.self_attn.kv_b_proj.weight",
                                                                                None)


def test_without_q_lora_rank_q_proj_reads_the_hidden_state(tmp_path):
    path = write_deepseek_v3(tmp_path / "no_q_lora", seed=1, q_lora_rank=None)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.model_config.q_lora_rank == 0
    assert hasattr(llm.engine.runner.model.layers[0].self_attn, "q_proj")
    assert_equal_to_transformers(llm, path)


def test_fp8_block_checkpoint_equals_transformers_dequantised(ckpt, tmp_path):
    mla = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # as DeepSeek's FP8 release
    qdir, rdir = quantize_checkpoint(ckpt, tmp_path, "fp8-block", linears=(*LINEARS, *mla))
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    assert all(isinstance(model.layers[i].mlp.experts, QuantizedExperts) for i in (1, 2))
    assert all(type(getattr(model.layers[0].self_attn, m)).__name__ == "QuantizedLinear" for m in mla)
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_a_lora_on_mla_o_proj_equals_peft_and_latent_projections_are_refused(ckpt, tmp_path):
    from splitserve.engine.lora.adapter import LoRAAdapterError
    from splitserve.engine.lora.request import LoRARequest
    from tests.helpers.lora_adapters import make_adapter, peft_greedy

    adapter = make_adapter(ckpt, tmp_path / "o", seed=3, r=8, alpha=8, targets=("o_proj",))
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, enable_lora=True, max_lora_rank=8)
    prompt = prompts(llm.engine.model_config.vocab_size)[1]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params, lora_request=LoRARequest("o", 1, str(adapter)))[0]
    want = peft_greedy(ckpt, adapter, prompt, NEW_TOKENS)
    assert out.token_ids == want and want != hf_greedy(ckpt, prompt, NEW_TOKENS)  # the adapter changes them
    latent = make_adapter(ckpt, tmp_path / "latent", seed=4, r=8, alpha=8, targets=("q_a_proj", "kv_b_proj"))
    with pytest.raises(LoRAAdapterError, match=r"the latent projections of multi-head latent attention are not "
                                               r"supported \(o_proj and the MLP projections are\)$"):
        llm.generate([prompt], params, lora_request=LoRARequest("latent", 2, str(latent)))


@pytest.mark.parametrize("expanded", [True, False])
def test_both_prefill_forms_equal_transformers_over_chunks_and_a_cached_prefix(ckpt, expanded):
    """Prefill in the expanded form (cached latents decompressed per head) or absorbed like
    decode: both exact, whichever mla.EXPANDED_PREFILL picks (chunks of 32 read the earlier
    chunks' latents back from the cache)."""
    from splitserve.engine.models.mla import MlaAttention

    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MlaAttention)]
    for m in layers:
        m.expanded_prefill = expanded
    assert_equal_to_transformers(llm, ckpt)
    prompt = prompts(llm.engine.model_config.vocab_size)[1][:40] + [7, 8, 9]
    hit = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert hit.num_cached_tokens >= 32 and hit.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS)


def test_latent_blocks_go_down_to_the_host_and_disk_tiers_and_come_back(ckpt, tmp_path):
    """The offload tiers move whole blocks: an MLA block (one latent row a token a layer, 7,680
    bytes here) evicted from the 12-block device pool comes back from the host tier, and from
    disk once the host is full, with the tokens transformers gives."""
    from splitserve.engine.kv_offload.block_file import HEADER

    nb = 16 * (32 + 8) * 3 * 4
    prefix = [(i * 37 + 11) % 900 + 5 for i in range(100)]  # 6 full blocks are reusable
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = hf_greedy(ckpt, prefix, 6)
    for host_blocks, disk in ((64, None), (4, tmp_path / "disk")):
        with LLM(str(ckpt), num_kv_blocks=12, kv_offload_bytes=host_blocks * nb,
                 kv_offload_dir=str(disk) if disk else None,
                 kv_offload_dir_bytes=64 * (nb + HEADER.size) if disk else 0) as llm:
            assert llm.engine.runner.kv_pool.spec.block_nbytes == nb
            assert llm.generate(prefix, params)[0].token_ids == want
            for seed in (1, 2):  # two prompts of 10 blocks each: nothing of the prefix stays on device
                llm.generate([(i * 53 + seed * 101) % 900 + 5 for i in range(150)], params)
                assert llm.engine.offloader.wait_idle()
            again = llm.generate(prefix, params)[0]
            loaded = llm.engine.offloader.stats().counters.loaded_blocks
            assert again.token_ids == want and again.num_cached_tokens == 6 * 16
            assert loaded == ({"host": 6, "disk": 0} if disk is None else {"host": loaded["host"],
                                                                          "disk": 6 - loaded["host"]})
            assert disk is None or loaded["disk"] > 0
