"""Every supported family, token for token against transformers' generate (float32, CPU):
tiny random checkpoints saved by transformers, prompts shorter and longer than the
32-token sliding window (and than Phi-3's 64-token longrope switch), chunked prefill, a
prefix-cache hit, and top-5 logprobs within 1e-4. The rope scaling types ride on the
dense families: yarn on Qwen2, dynamic and linear on Llama."""

from __future__ import annotations

import random

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import WINDOW
from tests.helpers.reference import hf_generate_top_logprobs

NEW_TOKENS = 32
LENGTHS = (5, 30, 47, 90)  # around the window (32) and Phi-3's longrope switch (64)

FAMILIES = {
    "qwen3": ("qwen3", {}),
    "phi3-longrope-partial-rotary": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window-on-later-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                               "max_window_layers": 1}),
    "qwen2-yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 32}}),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                    "factor": 2.0}}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                   "factor": 4.0}}),
    "mixtral-window": ("mixtral", {"sliding_window": WINDOW}),
    "qwen3_moe-dense-middle-layer": ("qwen3_moe", {}),
    "qwen3_moe-renormalised-every-other-layer": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                               "mlp_only_layers": []}),
}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(make_ckpt, name):
    family, overrides = FAMILIES[name]
    path = make_ckpt(family, **overrides)
    llm = LLM(str(path), num_kv_blocks=96, max_num_batched_tokens=64)  # the 90-token prompt is chunked
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(ps, params)
    for prompt, out in zip(ps, outs, strict=True):
        want, ref = hf_generate_top_logprobs(path, prompt, NEW_TOKENS, 5)  # cached between runs
        assert out.token_ids == want, f"{name}: prompt of {len(prompt)} tokens"
        for step, lp in enumerate(out.logprobs):
            top_ids, top_values = ref[step]
            assert [t for t, _ in lp.top] == top_ids, (name, len(prompt), step)
            assert max(abs(v - r) for (_, v), r in zip(lp.top, top_values, strict=True)) < 1e-4

    # a prefix-cache hit: the 90-token prompt's first 80 tokens again, then new ones
    rng = random.Random(1)
    again = ps[3][:80] + [rng.randrange(5, 1000) for _ in range(9)]
    hit = llm.generate([again], params)[0]
    assert hit.num_cached_tokens >= 64, hit.num_cached_tokens
    assert hit.token_ids == hf_generate_top_logprobs(path, again, NEW_TOKENS, 5)[0]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_readme_lists_exactly_the_supported_architectures():
    from pathlib import Path

    from splitserve.core.architectures import markdown_table

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert markdown_table() in readme, "README's model table is stale: python -m splitserve.core.architectures"
