"""DeepSeek-V3 over two tensor-parallel ranks: each rank holds half of the heads (q_b_proj and
kv_b_proj rows, o_proj columns) and the whole latent path, so both ranks cache the same latent
rows (engine/models/mla.py); greedy tokens equal transformers' (float32) with chunked prefill
and a prefix-cache hit."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_deepseek_v3 import NEW_TOKENS, prompts, write_deepseek_v3
from tests.engine.test_deepseek_v32 import write_deepseek_v32
from tests.engine.test_glm_moe_dsa import write_glm_moe_dsa
from tests.helpers.reference import hf_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_deepseek_v3(tmp_path_factory.mktemp("deepseek_v3_tp") / "float")


def test_tp2_greedy_tokens_equal_transformers_and_a_prefix_hit(ckpt):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2) as llm:
        ps = prompts(llm.engine.model_config.vocab_size)
        outs = llm.generate(ps, params)
        again = ps[1][:40] + [9, 10, 11]
        hit = llm.generate([again], params)[0]
        pool = llm.engine.runner.kv_pool
        assert pool.spec.block_shape == (3, 1, 16, 1, 40)  # each rank: the whole latent row, not half of it
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert hit.num_cached_tokens >= 32 and hit.token_ids == hf_greedy(ckpt, again, NEW_TOKENS)


def test_tp2_with_expert_parallelism_greedy_tokens_equal_transformers(ckpt):
    """--enable-expert-parallel: rank 0 holds 4 of the 8 routed experts whole (the shared expert
    and MLA stay tensor-parallel as above)."""
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        cfg = llm.engine.model_config
        assert llm.engine.runner.model.layers[1].mlp.w13.shape == (4, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        ps = prompts(cfg.vocab_size)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.fixture(scope="module")
def dsa_ckpt(tmp_path_factory):
    return write_deepseek_v32(tmp_path_factory.mktemp("deepseek_v32_tp") / "float")


@pytest.fixture(scope="module")
def glm5_ckpt(tmp_path_factory):
    return write_glm_moe_dsa(tmp_path_factory.mktemp("glm_moe_dsa_tp") / "float")


@pytest.mark.parametrize("family,expert_parallel", [("deepseek_v32", False), ("deepseek_v32", True),
                                                    ("glm_moe_dsa", False), ("glm_moe_dsa", True)])
def test_dsa_tp2_and_expert_parallel_greedy_tokens_equal_transformers_past_the_top_k(request, family,
                                                                                     expert_parallel):
    """DeepSeek-V3.2 and GLM-5: the indexer replicated on both ranks picks the same 16 tokens for
    each query (GLM-5's shared layer reusing it), alone and with the experts spread whole."""
    ckpt = request.getfixturevalue("dsa_ckpt" if family == "deepseek_v32" else "glm5_ckpt")
    with LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel) as llm:
        ps = prompts(llm.engine.model_config.vocab_size)[1:]  # 45 tokens: past the top-k and a chunk
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(ps, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
