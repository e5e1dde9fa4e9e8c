"""Workload generators and arrival processes: deterministic for a seed, with the
shapes and statistics they promise."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from splitserve.benchmark.arrivals import arrival_offsets
from splitserve.benchmark.prompt_tokens import PromptFitter
from splitserve.benchmark.workloads import WorkloadConfig, build_workload, total_requests


def words_and_bos(text: str) -> int:
    """A toy tokenizer's count: a BOS and one token per word (tests/benchmark/test_prompt_tokens.py
    fits real tokenizers)."""
    return 1 + len(text.split())


FITTER = PromptFitter(words_and_bos)


def prompts(cfg: WorkloadConfig):
    return [(t.request_id, t.prompt, t.max_tokens) for s in build_workload(cfg, FITTER) for t in s.turns]


@pytest.mark.parametrize("kind,fmt", [("random", "ids"), ("random", "text"),
                                      ("prefix-repetition", "ids"), ("multi-turn", "text"),
                                      ("long-context", "ids")])
def test_same_seed_same_workload_other_seed_other_workload(kind, fmt):
    cfg = WorkloadConfig(kind=kind, prompt_format=fmt, num_prompts=6, input_len=(4, 30),
                         output_len=(2, 9), context_len=(50, 80), long_fraction=0.5, seed=3)
    assert prompts(cfg) == prompts(cfg)
    assert prompts(cfg) != prompts(WorkloadConfig(**{**vars(cfg), "seed": 4}))


def test_random_lengths_stay_in_their_ranges_and_ids_in_the_id_range():
    cfg = WorkloadConfig(num_prompts=200, input_len=(10, 20), output_len=(3, 5),
                         token_id_range=(100, 110), seed=1)
    sessions = build_workload(cfg)
    turns = [s.turns[0] for s in sessions]
    assert len(sessions) == 200 and all(len(s.turns) == 1 for s in sessions)
    assert {len(t.prompt) for t in turns} == set(range(10, 21))  # every length is reachable
    assert all(t.prompt_len == len(t.prompt) for t in turns)
    assert {t.max_tokens for t in turns} == {3, 4, 5}
    assert {i for t in turns for i in t.prompt} == set(range(100, 110))


def test_text_prompts_have_their_length_in_tokens():
    cfg = WorkloadConfig(num_prompts=20, input_len=(5, 9), prompt_format="text")
    turns = [s.turns[0] for s in build_workload(cfg, FITTER)]
    assert {t.prompt_len for t in turns} == set(range(5, 10))
    assert all(isinstance(t.prompt, str) and words_and_bos(t.prompt) == t.prompt_len for t in turns)


def test_text_prompts_need_a_tokenizer():
    with pytest.raises(ValueError, match="text prompts are sized in tokens"):
        build_workload(WorkloadConfig(prompt_format="text"))


@pytest.mark.parametrize("fmt", ["ids", "text"])
def test_prefix_repetition_really_shares_prefixes(fmt):
    cfg = WorkloadConfig(kind="prefix-repetition", num_prefixes=3, suffixes_per_prefix=5,
                         prefix_len=32, input_len=(8, 8), prompt_format=fmt, seed=11)
    turns = [s.turns[0] for s in build_workload(cfg, FITTER)]
    assert len(turns) == 15
    # the toy tokenizer's BOS is no word of the text: 31 words make the 32-token prefix
    split, prefix = ((lambda p: p), 32) if fmt == "ids" else ((lambda p: ["<bos>", *p.split()]), 32)
    groups: dict[int, list] = defaultdict(list)
    for t in turns:
        tokens = split(t.prompt)
        assert len(tokens) == t.prompt_len == 40
        groups[t.prefix_group].append(tokens)
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 5 for g in groups.values())
    prefixes = set()
    for members in groups.values():
        shared = {tuple(m[:prefix]) for m in members}
        assert len(shared) == 1  # every member starts with the same 32 tokens
        assert len({tuple(m[prefix:]) for m in members}) == 5  # and has its own suffix
        prefixes |= shared
    assert len(prefixes) == 3  # distinct prefixes per group
    order = [t.prefix_group for t in turns]
    assert order != sorted(order)  # shuffled, not group after group


def test_multi_turn_sessions_have_the_requested_turns():
    cfg = WorkloadConfig(kind="multi-turn", prompt_format="text", num_prompts=4, turns=3)
    sessions = build_workload(cfg, FITTER)
    assert [len(s.turns) for s in sessions] == [3, 3, 3, 3]
    assert total_requests(sessions) == 12
    assert sessions[1].turns[2].request_id == "req-1-t2"


def test_long_context_mixes_an_exact_share_of_long_prompts():
    cfg = WorkloadConfig(kind="long-context", num_prompts=40, long_fraction=0.25,
                         context_len=(500, 600), input_len=(10, 20), seed=5)
    turns = [s.turns[0] for s in build_workload(cfg)]
    long_ = [t for t in turns if t.request_id.endswith("-long")]
    assert len(long_) == 10
    assert all(500 <= len(t.prompt) <= 600 for t in long_)
    assert all(10 <= len(t.prompt) <= 20 for t in turns if t not in long_)
    assert [t in long_ for t in turns] != [True] * 10 + [False] * 30  # shuffled


@pytest.mark.parametrize("bad,match", [
    ({"kind": "sharegpt"}, "unknown workload"),
    ({"input_len": (5, 2)}, "input_len"),
    ({"kind": "multi-turn", "prompt_format": "ids"}, "text"),
    ({"long_fraction": 1.5}, "long_fraction"),
    ({"token_id_range": (7, 7)}, "high must exceed low"),
])
def test_bad_workload_config_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        build_workload(WorkloadConfig(**bad))


def _gaps(offsets):
    return np.diff(np.asarray(offsets))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_have_cv_one_over_sqrt_burstiness(burstiness):
    offsets = arrival_offsets(20001, rate=10.0, burstiness=burstiness, seed=123)
    gaps = _gaps(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert offsets == arrival_offsets(20001, 10.0, burstiness, seed=123)
    assert offsets != arrival_offsets(20001, 10.0, burstiness, seed=124)


def test_constant_and_infinite_rates():
    assert arrival_offsets(4, 5.0, kind="constant") == pytest.approx([0.0, 0.2, 0.4, 0.6])
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 1.0) == []


@pytest.mark.parametrize("kwargs,match", [
    ({"rate": 0.0}, "rate must be > 0"),
    ({"rate": 1.0, "burstiness": 0.0}, "burstiness"),
    ({"rate": 1.0, "kind": "uniform"}, "unknown arrival"),
    ({"rate": 1.0, "kind": "constant", "burstiness": 2.0}, "burstiness only"),
])
def test_bad_arrival_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        arrival_offsets(5, **kwargs)
