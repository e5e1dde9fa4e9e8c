"""Sampled outputs with speculation follow the distribution of sampling without it: a
chi-square two-sample test over many seeds, on a small support (top-k 2: at most 8 sequences), at the positions
where drafts are verified. The two runs use disjoint seeds, so they agree only in
distribution, not by sharing random numbers."""

import math
from collections import Counter

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.spec.ngram import propose_ngram
from tests.engine.test_spec_decode_exact import NGRAM, accepted, copy_heavy

N = 600  # samples per side
LENGTH = 3  # tokens per sample: the first comes from the prefill, the next two are verified


def chi_square_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty: the chi-square quantile whose normal score is `z`."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi_square(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """(statistic, degrees of freedom) for two equal-size samples; rare cells pooled."""
    cells = [c for c in set(a) | set(b) if a[c] + b[c] >= min_count]
    rest_a = sum(a.values()) - sum(a[c] for c in cells)
    rest_b = sum(b.values()) - sum(b[c] for c in cells)
    pairs = [(a[c], b[c]) for c in cells] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    return sum((x - y) ** 2 / (x + y) for x, y in pairs), len(pairs) - 1


@pytest.fixture(scope="module")
def setup(make_ckpt):
    path = str(make_ckpt("llama"))
    base = LLM(path, num_kv_blocks=512, max_num_seqs=128)
    # the model's own greedy loop as the prompt: sampled continuations often follow it, so
    # the n-gram drafts are accepted at a useful rate
    start = copy_heavy(21, 16, 2)
    loop = base.generate(start, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    return base, LLM(path, num_kv_blocks=512, max_num_seqs=128, speculative_config=NGRAM), start + loop


def samples(llm, prompt, seeds) -> Counter:
    params = [SamplingParams(temperature=1.0, top_k=2, seed=s, max_tokens=LENGTH, ignore_eos=True) for s in seeds]
    return Counter(tuple(o.token_ids) for o in llm.generate([prompt] * len(params), params))


def test_sampled_sequences_follow_the_same_distribution(setup):
    base, spec, prompt = setup
    assert propose_ngram(prompt, 4, 1, 3)  # the prompt's tail recurs: drafts exist
    before = accepted(spec)
    plain = samples(base, prompt, range(N))
    speculative = samples(spec, prompt, range(10_000, 10_000 + N))
    stats = spec.engine.speculator.stats
    assert accepted(spec) - before > N // 8  # drafts were accepted, and ...
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # ... some rejected: both branches ran
    statistic, df = two_sample_chi_square(plain, speculative)
    assert df >= 4
    assert statistic < chi_square_quantile(df, 3.09), (statistic, df, plain.most_common(5),
                                                       speculative.most_common(5))  # p = 0.001


def test_the_test_tells_different_distributions_apart(setup):
    """The same check rejects sampling at another temperature (so it has the power to fail)."""
    base, _, prompt = setup
    plain = samples(base, prompt, range(N))
    params = [SamplingParams(temperature=0.1, top_k=2, seed=s, max_tokens=LENGTH, ignore_eos=True)
              for s in range(20_000, 20_000 + N)]
    cooler = Counter(tuple(o.token_ids) for o in base.generate([prompt] * N, params))
    statistic, df = two_sample_chi_square(plain, cooler)
    assert statistic > chi_square_quantile(df, 3.09)


def test_a_seeded_request_is_reproducible_and_equals_sampling_without_speculation(setup):
    base, spec, prompt = setup
    seeds = range(40)
    assert samples(spec, prompt, seeds) == samples(spec, prompt, seeds) == samples(base, prompt, seeds)
