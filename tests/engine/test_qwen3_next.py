"""Qwen3-Next (`Qwen3NextForCausalLM`: Gated DeltaNet + gated attention 3:1, a MoE with a gated
shared expert) against transformers (float32, CPU) on a tiny random checkpoint: the config as
transformers reads it (which layers keep recurrent state, KV only for the attention layers),
greedy tokens through LLM for prompts batched together with different lengths (mixed prefill
and decode steps), chunked prefill at a 64-token budget carrying the state across chunks, a
small KV pool forcing preemption (the state rebuilt by recompute), the state slots the cache
manager hands out and takes back (finish, abort, admission without a free slot), and what a
hybrid refuses in one line (docs/architecture.md, "Hybrid models with recurrent state")."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig, kv_bytes_per_token
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.args import compatibility_problem
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.sequence import Sequence
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 40
CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
              num_experts_per_tok=2, norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
              decoder_sparse_step=1, mlp_only_layers=[1])


def write_qwen3_next(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen3-Next saved by transformers (layers: 3 Gated DeltaNet, then 1 attention; layer 1
    dense, the others MoE); weights wider than its 0.02 init so that tokens vary."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = Qwen3NextConfig(vocab_size=tok.get_vocab_size(), architectures=["Qwen3NextForCausalLM"],
                          bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # transformers' decay init: a state that forgets at realistic rates
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "float")


def prompts(vocab: int, lengths=(7, 45)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def assert_equal_to_transformers(llm: LLM, ckpt: Path, lengths) -> None:
    ps = prompts(llm.engine.model_config.vocab_size, lengths)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):  # batched together
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    state = llm.engine.scheduler.bm.state
    assert state.num_free == state.num_slots  # every slot back after the requests finished


def test_config_reads_the_recurrent_layers_and_kv_only_for_attention(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.family == "qwen3_next" and cfg.is_hybrid
    assert cfg.linear_layers == (0, 1, 2) and cfg.kv_layers == (3,)
    assert cfg.moe_layers == (0, 2, 3) and cfg.num_experts == 8 and cfg.norm_topk_prob
    assert cfg.rope.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    assert kv_bytes_per_token(cfg, element_size=4) == 1 * 2 * 2 * 16 * 4  # one attention layer's K and V
    llm = LLM(str(ckpt), num_kv_blocks=16, max_num_seqs=3)
    assert llm.engine.runner.kv_pool.spec.num_layers == 1
    pool = llm.engine.runner.state_pool
    assert pool.conv.shape == (3, 3, 2 * 2 * 16 + 4 * 8, 3) and pool.ssm.shape == (3, 3, 4, 16, 8)
    assert llm.engine.scheduler.bm.state.num_slots == 3
    assert not llm.engine.config.enable_prefix_caching  # turned off for a hybrid (logged)


@pytest.mark.parametrize("fields, why", [
    ({"layer_types": ["linear_attention"] * 4}, "has no 'full_attention' layer"),
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
     "must list 'linear_attention' or 'full_attention'"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads (3) is not a multiple of linear_num_key_heads (2)"),
    ({"linear_conv_kernel_dim": None}, "field 'linear_conv_kernel_dim' is None"),
])
def test_impossible_hybrid_configs_are_refused_in_one_line(ckpt, fields, why):
    raw = {**ModelConfig.from_dir(ckpt).raw, **fields}
    with pytest.raises(CheckpointError, match=None) as err:
        ModelConfig.from_dict(raw, source="config.json")
    assert why in str(err.value) and "\n" not in str(err.value)


def test_batched_prompts_of_different_lengths_equal_transformers(ckpt):
    assert_equal_to_transformers(LLM(str(ckpt), num_kv_blocks=64), ckpt, (7, 45, 23))


def test_chunked_prefill_carries_the_state_across_chunks(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=64)
    assert_equal_to_transformers(llm, ckpt, (7, 45, 150))  # 150: three steps of prefill, beside decodes


def test_preempted_sequences_recompute_their_state(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=8, max_num_batched_tokens=64)  # 128 tokens for 3 x (prompt + 40)
    assert_equal_to_transformers(llm, ckpt, (7, 45, 30))
    assert llm.engine.scheduler.num_preemptions > 0


def test_slots_are_taken_at_admission_and_given_back_at_abort(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=16, max_num_seqs=2)
    engine, state = llm.engine, llm.engine.scheduler.bm.state
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    a = engine.add_request("a", prompts(1000)[0], params)
    b = engine.add_request("b", prompts(1000)[1], params)
    engine.step()
    assert {a.state_slot, b.state_slot} == {0, 1} and state.num_free == 0
    stats = engine.stats()
    assert (stats.free_state_slots, stats.total_state_slots, stats.state_slot_usage) == (0, 2, 1.0)
    with pytest.raises(ValueError, match="a remote prefill ships no recurrent state yet"):
        engine.reserve_remote_prefill("c", prompts(1000)[0], params)
    assert engine.abort("a") and a.state_slot == -1 and state.num_free == 1
    assert engine.abort("b") and state.num_free == 2


def test_state_slots_that_leave_no_kv_memory_are_refused_in_one_line(ckpt):
    # a slot here: 3 layers x (conv 96 x 3 + delta state 4 x 16 x 8, float32) = 9,600 bytes; 64 of them
    with pytest.raises(ValueError, match=r"^64 recurrent-state slots \(max_num_seqs\) take 0\.6 MiB, leaving no room "
                                         r"for KV in the KV cache memory \(0\.6 MiB\): lower max_num_seqs or give "
                                         r"the KV cache more memory$"):
        LLM(str(ckpt), kv_cache_memory_bytes=64 * 9600)


def test_admission_needs_a_free_state_slot():
    bm = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=False, state_slots=1)
    first, second = (Sequence(r, list(range(5, 25)), 20, SamplingParams(), 512) for r in ("1", "2"))
    assert bm.can_admit(first, [], 20)
    bm.admit(first, [])
    bm.grow(first, 20)
    assert first.state_slot == 0 and not bm.can_admit(second, [], 20)  # blocks free, no slot
    bm.free_sequence(first)
    assert first.state_slot == -1 and bm.can_admit(second, [], 20)
    with pytest.raises(ValueError, match="prefix caching and KV offload must be off"):
        BlockManager(num_blocks=8, block_size=16, state_slots=1)


@pytest.mark.parametrize("settings, why", [
    (dict(tensor_parallel_size=2), "tensor parallelism (size > 1) yet: its recurrent-state heads are not sharded"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     "n-gram speculation yet: rejected drafts would need the recurrent state rolled back"),
    (dict(kv_offload_bytes=1 << 20), "the host KV offload tier yet: offloaded blocks are prefix-cache blocks"),
    (dict(async_scheduling=True), "async scheduling yet"),
    (dict(enable_lora=True), "LoRA adapters yet"),
    (dict(kv_cache_dtype="fp8"), "FP8 KV cache yet"),
])
def test_what_a_hybrid_cannot_run_yet_is_refused_in_one_line(ckpt, settings, why):
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(ckpt), **settings)
    line = str(err.value)
    assert line.startswith("Qwen3NextForCausalLM (a hybrid model with recurrent state) cannot run with ")
    assert why in line and "\n" not in line


def test_serve_refuses_prefill_workers_and_several_decode_workers_for_a_hybrid(ckpt):
    def args(**kw):
        return argparse.Namespace(model=str(ckpt), tensor_parallel_size=1, **kw)

    assert compatibility_problem(args(prefill_workers=0, decode_workers=1)) is None
    line = compatibility_problem(args(prefill_workers=1, decode_workers=1))
    assert "cannot be served disaggregated yet (prefill workers)" in line and "--prefill-workers 0" in line
    assert "prefill workers" in compatibility_problem(args(), prefill_role=True)  # prefill-worker, prefill-pool
    assert "runs on one decode worker for now" in compatibility_problem(args(prefill_workers=0, decode_workers=2))
