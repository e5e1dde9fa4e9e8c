"""Expert parallelism over two gloo ranks (--enable-expert-parallel): greedy tokens over 40
new tokens equal transformers' (float32) and one process's for Mixtral, Qwen3-MoE and GLM-4.5
tiny random checkpoints, rank 0 holding its E/2 experts whole (the shared expert of GLM-4.5
stays tensor-parallel); prompts longer than a block and than a step's 32-token chunk. DeepSeek-V3
and MiniMax-M2 (the same block): equal to one process's."""

from __future__ import annotations

import random

import pytest

from splitserve.core.model_config import ModelConfig
from splitserve.engine import LLM, SamplingParams
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 40
LENGTHS = (5, 23, 40)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


def generate(path, tp_size: int, **engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=tp_size, **engine) as llm:
        cfg, model = llm.engine.model_config, llm.engine.runner.model
        if engine.get("enable_expert_parallel"):  # rank 0 holds its E/2 experts, each whole
            mlp = model.layers[cfg.moe_layers[0]].mlp
            assert mlp.w13.shape == (cfg.num_experts // 2, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
        outs = [o.token_ids for o in llm.generate(prompts(cfg.vocab_size), params)]
        # rank 0 counts every token's experts, not only its share's (splitserve_moe_expert_tokens_total)
        ran = sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
        counts = llm.engine.runner.expert_tokens.read()
        assert [layer for layer, _ in counts] == list(cfg.moe_layers)
        assert all(sum(per_expert) == cfg.num_experts_per_tok * ran for _, per_expert in counts)
        return outs


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ep2_greedy_tokens_equal_transformers_and_tp1(make_ckpt, family):
    path = make_ckpt(family)
    ep = generate(path, 2, enable_expert_parallel=True)
    assert ep == [hf_greedy(path, p, NEW_TOKENS) for p in prompts(ModelConfig.from_dir(path).vocab_size)]
    assert ep == generate(path, 1)


def test_glm4_moe_ep2_greedy_tokens_equal_transformers_and_tp1(tmp_path):
    """Routed experts whole per rank, the shared expert still tensor-parallel."""
    from tests.engine.test_glm4_moe import write_glm4_moe

    path = write_glm4_moe(tmp_path / "glm4_moe")
    ep = generate(path, 2, enable_expert_parallel=True)
    assert ep == [hf_greedy(path, p, NEW_TOKENS) for p in prompts(ModelConfig.from_dir(path).vocab_size)]
    assert ep == generate(path, 1)


def test_ep2_one_sequence_leaves_rank_1_an_empty_share(make_ckpt):
    """Decode steps of one token: rank 0's share is the token, rank 1's is empty (it still
    takes part in every all-to-all and the all-gather, with zero rows); tokens equal TP 1's."""
    path = make_ckpt("mixtral")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = []
    for engine in (dict(tensor_parallel_size=2, enable_expert_parallel=True), {}):
        with LLM(str(path), num_kv_blocks=32, **engine) as llm:
            outs.append(llm.generate([[5, 6, 7]], params)[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == NEW_TOKENS


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_ep2_of_the_other_deepseek_style_families_equals_tp1(tmp_path, family):
    """DeepSeek-V3 (MLA attention, shared expert) and MiniMax-M2 reuse the DeepSeek-style block:
    their routed experts spread the same way; tokens equal TP 1's (each family's own tests
    hold TP 1 to transformers)."""
    if family == "deepseek_v3":
        from tests.engine.test_deepseek_v3 import write_deepseek_v3 as write
    else:
        from tests.engine.test_minimax_m2 import write_minimax_m2 as write
    path = write(tmp_path / family)
    assert generate(path, 2, enable_expert_parallel=True) == generate(path, 1)
