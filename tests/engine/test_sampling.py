"""Sampling: seeds reproduce, stops end at the right token, logprobs match transformers."""

import math
import random

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.sampler import _filter_logits
from tests.helpers.reference import hf_greedy, hf_logprobs


@pytest.fixture(scope="module")
def llm_and_path(make_ckpt):
    path = make_ckpt("llama")
    return LLM(str(path), num_kv_blocks=128), path


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def test_same_seed_same_tokens_regardless_of_batch(llm_and_path):
    llm, _ = llm_and_path
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt(20, 1)], p)[0].token_ids
    others = [prompt(n, s) for n, s in ((5, 2), (40, 3), (17, 4))]
    unseeded = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    in_batch = llm.generate([others[0], prompt(20, 1), others[1], others[2]],
                            [unseeded, p, unseeded, unseeded])[1].token_ids
    assert alone == in_batch
    other_seed = llm.generate([prompt(20, 1)], SamplingParams(temperature=1.0, top_p=0.95, seed=43,
                                                              max_tokens=20, ignore_eos=True))[0].token_ids
    assert other_seed != alone  # 20 draws from a near-uniform 1000-way distribution
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_n_choices_with_seed_are_distinct_and_reproducible(llm_and_path):
    llm, _ = llm_and_path
    p = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt(9, 5)], p)[0]
    second = llm.generate([prompt(9, 5)], p)[0]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in second.choices]
    assert first.choices[0].token_ids != first.choices[1].token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(llm_and_path):
    llm, path = llm_and_path
    pr = prompt(33, 6)
    ref = hf_greedy(path, pr, 10)
    for p in (SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True, seed=1),
              SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, ignore_eos=True, seed=1)):
        assert llm.generate([pr], p)[0].token_ids == ref


def test_stop_token_id_ends_generation_on_that_token(llm_and_path):
    llm, _ = llm_and_path
    pr = prompt(12, 7)
    free = llm.generate([pr], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    stop_id = free[5]
    cut = free.index(stop_id)
    out = llm.generate([pr], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                            stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free[: cut + 1]
    assert out.finish_reason == "stop"


def test_stop_string_ends_generation_and_is_excluded_from_text(llm_and_path):
    llm, _ = llm_and_path
    pr = prompt(12, 8)
    free = llm.generate([pr], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    out = llm.generate([pr], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    cut = text.index(stop)
    assert out.text == text[:cut]
    assert out.finish_reason == "stop"
    # Generation stopped at the token that completed the stop string, not later.
    decoded = llm.tokenizer.decode(out.token_ids)
    assert stop in decoded and stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_streamed_text_deltas_hold_back_stop_prefixes(llm_and_path):
    llm, _ = llm_and_path
    engine = llm.engine
    pr = prompt(12, 8)
    free = llm.generate([pr], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    engine.add_request("s", pr, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.new_text for o in engine.step()]
    assert "".join(deltas) == free[: free.index(stop)]
    assert all(stop not in d for d in deltas)


def test_without_text_the_engine_still_stops_where_the_router_would(llm_and_path):
    """Workers ask for no text (the router builds it with the same TextAssembler): a request
    without stop strings is not detokenized at all, one with them stops at the same token."""
    from splitserve.core.text_output import TextAssembler

    llm, _ = llm_and_path
    engine = llm.engine
    pr = prompt(12, 8)
    free = llm.generate([pr], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    for rid, params in (("plain", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
                        ("stop", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))):
        seq = engine.add_request(rid, pr, params, detokenize=False)
        assert (seq.text is None) == (rid == "plain")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["plain"].token_ids == free.token_ids and outs["plain"].text == ""
    router_side = TextAssembler(llm.tokenizer, [stop])
    n = next(i for i in range(1, 25) if router_side.add([free.token_ids[i - 1]]).stopped)
    assert outs["stop"].token_ids == free.token_ids[:n] and outs["stop"].finish_reason == "stop"
    assert router_side.text == free.text[: free.text.index(stop)]


def test_logprobs_match_transformers_log_softmax(llm_and_path):
    llm, path = llm_and_path
    pr = prompt(21, 9)
    out = llm.generate([pr], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    ref = hf_logprobs(path, pr + out.token_ids)  # position i predicts token i+1
    assert len(out.logprobs) == 8
    for step, lp in enumerate(out.logprobs):
        row = ref[len(pr) - 1 + step]
        assert lp.token_id == out.token_ids[step]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        values, ids = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == ids.tolist()
        for (_, mine), theirs in zip(lp.top, values.tolist(), strict=True):
            assert abs(mine - theirs) < 1e-4


def test_a_request_past_the_context_is_refused_not_cut_and_no_max_tokens_runs_to_the_end(make_ckpt):
    """Offline as on the server (same rule, core/context.py): no silent truncation."""
    from splitserve.engine.llm_engine import InvalidPromptError

    path = make_ckpt("llama")
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=40)
    with pytest.raises(InvalidPromptError, match=r"maximum context length is 40 tokens, but you requested 130 "
                                                 r"tokens \(30 in the prompt, 100 for the completion\).*at most 10"):
        llm.generate([prompt(5, 1), prompt(30, 10)], [SamplingParams(max_tokens=5),
                                                       SamplingParams(temperature=0, max_tokens=100)])
    assert not llm.engine.has_unfinished_requests()  # the first prompt, which fits, was not left queued
    out = llm.generate([prompt(30, 10)], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    small_pool = LLM(str(path), num_kv_blocks=2)  # 32 tokens of KV
    with pytest.raises(InvalidPromptError, match=r"KV cache \(--num-kv-blocks x --block-size\) is 32 tokens"):
        small_pool.generate([prompt(30, 10)], SamplingParams(max_tokens=5))


def test_filters_keep_exactly_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    kept = lambda x: (~torch.isinf(x)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(_filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)) == [0, 1]
    # top_p=0.7: 0.5 alone is below 0.7, 0.5+0.25 reaches it -> two tokens
    assert kept(_filter_logits(logits, top_k=-1, top_p=0.7, min_p=0.0)) == [0, 1]
    assert kept(_filter_logits(logits, top_k=-1, top_p=0.76, min_p=0.0)) == [0, 1, 2]
    # min_p=0.3: keep p >= 0.15
    assert kept(_filter_logits(logits, top_k=-1, top_p=1.0, min_p=0.3)) == [0, 1, 2]
    assert kept(_filter_logits(logits, top_k=-1, top_p=1e-9, min_p=0.0)) == [0]


def test_sampled_distribution_follows_temperature():
    """Many seeded draws from a known distribution land near its probabilities."""
    from splitserve.engine.sampler import sample
    from splitserve.engine.sequence import Sequence

    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    seqs = [Sequence(str(i), [1], 1, SamplingParams(temperature=1.0), 10) for i in range(4000)]
    tokens, _ = sample(logits, seqs, torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # temperature 0.5 sharpens: p^2 normalised
    seqs = [Sequence(str(i), [1], 1, SamplingParams(temperature=0.5), 10) for i in range(4000)]
    tokens, _ = sample(logits, seqs, torch.Generator().manual_seed(0))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    sharp = probs**2 / (probs**2).sum()
    assert torch.allclose(freq, sharp, atol=0.03)
    assert math.isclose(float(sharp.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"), ({"top_k": -5}, "top_k"), ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"), ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    from splitserve.engine import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("kwargs, param", [
    ({"stop_token_ids": [False]}, "stop_token_ids"), ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"n": True}, "n"), ({"max_tokens": 2**40}, "max_tokens"), ({"top_k": 2**40}, "top_k"),
    ({"seed": 2**70}, "seed"), ({"temperature": float("nan")}, "temperature"), ({"top_p": "0.5"}, "top_p"),
    ({"logprobs": True}, "logprobs"),
])
def test_values_that_cannot_travel_on_the_wire_are_rejected_by_name(kwargs, param):
    """Found by fuzzing: a bool or an out-of-range integer used to pass validation and then
    fail in protobuf encoding (a 500). Each must be a clear error naming the field."""
    from splitserve.engine import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_bool_prompt_token_is_rejected(llm_and_path):
    from splitserve.engine import InvalidPromptError

    llm, _ = llm_and_path
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.engine.add_request("b", [5, True], SamplingParams())


def test_the_migration_budget_is_what_is_left_of_max_tokens():
    p = SamplingParams(max_tokens=20, seed=3)
    assert p.resumed(0) is p
    assert p.resumed(7).max_tokens == 13 and p.resumed(7).seed == 3 and p.max_tokens == 20
    assert p.resumed(20) is None and p.resumed(25) is None  # nothing left: the choice ends "length"
    unbounded = SamplingParams(max_tokens=None)
    assert unbounded.resumed(10_000) is unbounded  # bounded by the context length instead
