"""Speculation keeps the tokens on every model family's quirks: Phi-3's longrope switch at 64
positions (crossed mid-generation: no draft spans it), Gemma 2's 32-token sliding window and
soft-capping, Qwen3's q/k norms, Mixtral's experts, and an fp8 KV cache."""

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_spec_decode_exact import NGRAM, accepted, copy_heavy

PROMPTS = [copy_heavy(1, 12, 4)[:50], copy_heavy(2, 20, 2)]  # 50 + 40 tokens crosses phi3's 64


@pytest.mark.parametrize("family, engine_kw", [("phi3", {}), ("gemma2", {}), ("qwen3", {}), ("mixtral", {}),
                                               ("llama", {"kv_cache_dtype": "fp8"})])
def test_greedy_tokens_equal_without_speculation(make_ckpt, family, engine_kw):
    path = str(make_ckpt(family))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM(path, num_kv_blocks=64, **engine_kw).generate(PROMPTS, params)]
    spec = LLM(path, num_kv_blocks=64, speculative_config=NGRAM, **engine_kw)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert accepted(spec) > 0
    assert spec.engine.num_free_blocks == 64
