"""GLM-4.5 over two tensor-parallel ranks: each rank holds half of every routed expert's
and the shared expert's intermediate rows (engine/parallel/sharding.py), the router and its
correction bias whole; greedy tokens equal transformers' (float32) with chunked prefill."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_glm4_moe import NEW_TOKENS, prompts, write_glm4_moe
from tests.helpers.reference import hf_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_glm4_moe(tmp_path_factory.mktemp("glm4_moe_tp") / "float")


def test_tp2_greedy_tokens_equal_transformers(ckpt):
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2) as llm:
        ps = prompts(llm.engine.model_config.vocab_size)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
