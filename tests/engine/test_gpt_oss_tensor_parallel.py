"""gpt-oss over two tensor-parallel ranks: each rank holds two of the four query heads and
their sinks, one of the two KV heads, and half of every expert's intermediate pairs (a
contiguous run of the interleaved gate_up columns); the router is whole, and o_proj's and
the experts' down_proj biases count once (rank 0 adds them). Greedy tokens equal
transformers' (float32) with chunked prefill past the 8-token window, and so under expert
parallelism (4 of the 8 experts whole on each rank, each adding its own experts' biases)."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_gpt_oss import NEW_TOKENS, prompts, write_gpt_oss
from tests.helpers.reference import hf_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss_tp") / "float")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_greedy_tokens_equal_transformers(ckpt, expert_parallel):
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel) as llm:
        cfg = llm.engine.model_config
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == ((4, 64, 64) if expert_parallel else (8, 64, 32))
        assert llm.engine.runner.model.layers[0].self_attn.sinks.shape == (2,)
        ps = prompts(cfg.vocab_size)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
