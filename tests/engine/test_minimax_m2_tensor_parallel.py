"""MiniMax-M2 over two tensor-parallel ranks: each rank holds half of the query heads and of
every expert's intermediate rows, the one KV head on both (num_key_value_heads 1, so the k
norm's all-reduce counts it twice and must still be the one-rank mean), the router, its
correction bias and the whole-projection q/k norm weights whole; the q/k RMSNorm's statistics
span both ranks' heads. Greedy tokens equal transformers' (float32) with chunked prefill,
and so under expert parallelism."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_minimax_m2 import NEW_TOKENS, prompts, write_minimax_m2
from tests.helpers.reference import hf_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_minimax_m2(tmp_path_factory.mktemp("minimax_m2_tp") / "float", num_key_value_heads=1)


def test_tp2_greedy_tokens_equal_transformers(ckpt):
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2) as llm:
        ps = prompts(llm.engine.model_config.vocab_size)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_ep2_greedy_tokens_equal_transformers(ckpt):
    """Expert parallelism (--enable-expert-parallel) reaches MiniMax-M2 through the same MoE
    block: rank 0 holds 4 of the 8 experts whole; attention and its norms stay as above."""
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        cfg = llm.engine.model_config
        assert llm.engine.runner.model.layers[0].mlp.w13.shape == (4, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        ps = prompts(cfg.vocab_size)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
