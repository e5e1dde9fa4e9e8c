"""Speculative decoding (n-gram) changes no token: greedy outputs with speculation equal the
outputs without it, token for token, on the demo model and a random Llama checkpoint, with
chunked prefill and plain decodes in the same steps, stops in the middle of an accepted run,
logprobs, n > 1, preemption, prefix-cache hits on generated blocks. Every test asserts that
drafts were accepted, so none can pass with speculation doing nothing."""

import random

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def copy_heavy(seed: int, length: int = 24, times: int = 3) -> list[int]:
    """A random run of tokens repeated: the model's continuation often copies it."""
    rng = random.Random(seed)
    run = [rng.randrange(5, 500) for _ in range(length)]
    return run * times + run[: length // 2]


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(length)]


PROMPTS = [copy_heavy(1), random_prompt(2, 100), copy_heavy(3, 16, 4), random_prompt(4, 7), copy_heavy(5, 40, 2)]


@pytest.fixture(scope="module", params=["demo", "llama"])
def engines(request, make_ckpt):
    path = str(ensure_demo_checkpoint() if request.param == "demo" else make_ckpt("llama"))
    # a 64-token step budget chunks the 100-token prompt while the others decode and verify
    kw = dict(num_kv_blocks=128, max_num_batched_tokens=64)
    return LLM(path, **kw), LLM(path, speculative_config=NGRAM, **kw)


def accepted(llm) -> int:
    return llm.engine.speculator.stats.num_accepted_tokens


def both(engines, prompts, params):
    base, spec = engines
    before = accepted(spec)
    return base.generate(prompts, params), spec.generate(prompts, params), accepted(spec) - before


def test_greedy_outputs_equal_without_speculation_token_for_token(engines):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain, spec, gained = both(engines, PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert gained > 10  # drafts were accepted: the comparison is not vacuous
    stats = engines[1].engine.speculator.stats
    assert stats.num_draft_tokens >= stats.num_accepted_tokens and stats.mean_accepted_length > 1.0
    assert engines[1].engine.num_free_blocks == engines[1].engine.num_total_blocks  # every block back


@pytest.mark.parametrize("k", [1, 2, 7])
def test_any_number_of_drafts_keeps_the_tokens(engines, k):
    base, spec = engines
    other = LLM(spec.engine.config.model, num_kv_blocks=128, max_num_batched_tokens=64,
                speculative_config={**NGRAM, "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in base.generate(PROMPTS[:3], params)]
    assert [o.token_ids for o in other.generate(PROMPTS[:3], params)] == want
    assert accepted(other) > 0
    assert max(len(o) for o in want) == 40


def test_max_tokens_eos_and_stop_ids_cut_an_accepted_run_exactly(engines):
    base, _ = engines
    full = base.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].token_ids
    for max_tokens in (1, 2, 5, 6, 7, 13, 30):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        plain, spec, _ = both(engines, PROMPTS[:1], params)
        assert spec[0].token_ids == plain[0].token_ids == full[:max_tokens]
        assert spec[0].finish_reason == "length"
    stop_at = full[9]  # a token inside the output: generation ends on its first occurrence
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[stop_at])
    plain, spec, _ = both(engines, PROMPTS[:1], params)
    assert spec[0].token_ids == plain[0].token_ids == full[: full.index(stop_at) + 1]
    assert spec[0].finish_reason == "stop"


def test_stop_strings_cut_the_same_text(engines):
    base, _ = engines
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    texts = [o.text for o in base.generate(PROMPTS[:3], params)]
    for text in texts:
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
        plain, spec, _ = both(engines, [PROMPTS[texts.index(text)]], p)
        assert spec[0].text == plain[0].text and spec[0].token_ids == plain[0].token_ids
        assert spec[0].finish_reason == "stop" and stop not in spec[0].text


def test_logprobs_of_accepted_tokens_are_the_model_s(engines):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    plain, spec, gained = both(engines, PROMPTS[:3], params)
    assert gained > 0
    for a, b in zip(plain, spec, strict=True):
        assert [lp.token_id for lp in b.logprobs] == b.token_ids == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_seeded_sampling_and_n_choices_equal_without_speculation(engines):
    """One draw per emitted token (spec/verify.py): a seed gives the same tokens either way."""
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=40, ignore_eos=True, seed=11, n=3)
    plain, spec, gained = both(engines, PROMPTS[:3], params)
    assert gained > 0
    for a, b in zip(plain, spec, strict=True):
        assert [c.token_ids for c in b.choices] == [c.token_ids for c in a.choices]
        assert len({tuple(c.token_ids) for c in b.choices}) > 1


def test_penalties_see_the_accepted_drafts(engines):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.2, min_tokens=5)
    plain, spec, _ = both(engines, PROMPTS[:3], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_preemption_under_a_small_pool_keeps_the_tokens(make_ckpt):
    path = str(make_ckpt("llama"))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [copy_heavy(s, 20, 2) for s in range(6)]
    want = [o.token_ids for o in LLM(path, num_kv_blocks=128).generate(prompts, params)]
    tight = LLM(path, num_kv_blocks=24, speculative_config=NGRAM)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.num_preemptions > 0 and accepted(tight) > 0
    assert tight.engine.num_free_blocks == 24


def test_blocks_holding_rejected_drafts_never_reach_the_prefix_cache(engines):
    """A later prompt made of an earlier prompt and its output hits the blocks the output
    filled; if a block were published with a rejected draft's KV, its tokens would differ."""
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first = spec.generate(PROMPTS[2], params)[0]
    again = PROMPTS[2] + first.token_ids[:50]
    want = base.generate(again, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    got = spec.generate(again, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert got.num_cached_tokens > len(PROMPTS[2])  # blocks of generated tokens were reused
    assert got.token_ids == want.token_ids
