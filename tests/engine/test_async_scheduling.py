"""Overlapped decode steps (EngineConfig.async_scheduling, engine/overlap.py) give every
request the tokens, text and finish reason of the synchronous engine: staggered finishes,
stop strings, seeded sampling, requests arriving and aborted mid-stream, steps that cannot
overlap (logprobs, penalties, a prompt to prefill, preemption, the context's end) in
between, and every block back in the pool with the same prefix cache at the end. On the
CPU the padded step runs eagerly and synchronously, so this checks the bookkeeping; the GPU
check times it."""

from __future__ import annotations

import argparse
import json

import pytest

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.args import add_engine_args, async_scheduling_problem, compatibility_problem
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from tests.helpers.real_models import gemma3_gguf, smollm2_gguf


def _prompt(i: int, n: int) -> list[int]:
    return [(37 * i + 11 * j) % 900 + 20 for j in range(n)]


GREEDY = dict(temperature=0, ignore_eos=True)
REQUESTS = {  # id: (arrival step, prompt, params)
    "a": (0, _prompt(1, 20), SamplingParams(max_tokens=40, **GREEDY)),
    "b": (0, _prompt(2, 33), SamplingParams(max_tokens=7, **GREEDY)),
    "c": (0, _prompt(3, 15), SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)),
    "d": (0, _prompt(4, 9), SamplingParams(max_tokens=25, stop=[" the"], temperature=0)),
    "e": (5, _prompt(5, 40), SamplingParams(max_tokens=20, **GREEDY)),  # a prefill between overlapped steps
    "f": (12, _prompt(6, 12), SamplingParams(max_tokens=16, logprobs=3, **GREEDY)),  # logprobs read with tokens
    "k": (2, _prompt(10, 14), SamplingParams(max_tokens=12, logprobs=0, temperature=0.7, seed=5, ignore_eos=True)),
    "m": (1, _prompt(11, 10), SamplingParams(max_tokens=14, min_tokens=10, temperature=0)),  # EOS masked a while
    "n": (1, _prompt(12, 10), SamplingParams(max_tokens=14, logit_bias={7: 4.0, 9: -100.0}, **GREEDY)),
    "g": (14, _prompt(7, 18), SamplingParams(max_tokens=9, repetition_penalty=1.3, **GREEDY)),  # drains
    "h": (3, _prompt(8, 17), SamplingParams(max_tokens=33, temperature=1.0, seed=3, top_k=20, ignore_eos=True)),
}


def _run(ckpt, async_scheduling: bool, requests=REQUESTS, aborts=None, **config) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(ckpt), async_scheduling=async_scheduling, **config))
    if engine.runner.decode_graphs is None:  # the synchronous reference takes the same padded step
        engine.runner.enable_decode_graphs(capture=False)
    got: dict[str, dict] = {rid: {"tokens": [], "text": "", "reason": None, "outputs_after_finish": 0,
                                  "logprobs": []} for rid in requests}
    step = 0
    while step < 400:
        for rid, (at, prompt, params) in requests.items():
            if at == step:
                engine.add_request(rid, prompt, params)
        if aborts and step in aborts:
            assert engine.abort(aborts[step])
        if not engine.has_unfinished_requests() and all(at < step for at, _, _ in requests.values()):
            break
        for out in engine.step():
            r = got[out.request_id]
            r["outputs_after_finish"] += r["reason"] is not None
            r["tokens"] += out.new_token_ids
            r["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
            r["text"] += out.new_text
            r["reason"] = out.finish_reason if out.finished else None
        step += 1
    if engine.overlap is not None:
        engine.step()  # nothing left: a step in flight is drained (its rows ended)
    return got, engine


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("llama")


def test_overlapped_steps_give_the_synchronous_engines_outputs(ckpt):
    sync, sync_engine = _run(ckpt, False, num_kv_blocks=96)
    overlapped, engine = _run(ckpt, True, num_kv_blocks=96)
    assert engine.overlap.steps >= 20  # the decode steps without f or g in them (~45 in all)
    assert engine.stats().overlapped_steps == engine.overlap.steps  # splitserve_engine_overlapped_steps_total
    assert sync_engine.stats().overlapped_steps == 0
    assert overlapped == sync
    assert all(r["reason"] is not None and r["outputs_after_finish"] == 0 for r in overlapped.values())
    assert sync["d"]["reason"] == "stop" and sync["b"]["reason"] == "length" and len(sync["a"]["tokens"]) == 40
    assert len(sync["f"]["logprobs"]) == 16 and len(sync["f"]["logprobs"][0][2]) == 3  # (equal bit for bit above)
    assert len(sync["k"]["logprobs"]) == 12 and sync["k"]["logprobs"][0][2] == []
    assert 9 not in sync["n"]["tokens"] and len(sync["m"]["tokens"]) >= 10
    # nothing leaked, and the prefix cache holds the same blocks (published only once computed)
    assert engine.num_free_blocks == engine.num_total_blocks == sync_engine.num_free_blocks
    assert sorted(engine.cached_block_hashes()) == sorted(sync_engine.cached_block_hashes())


def test_with_preemption_and_the_context_end(ckpt):
    """A pool too small for every stream (preemption, recompute) and a context the longest
    request runs into: neither overlaps, both drain first."""
    requests = {rid: REQUESTS[rid] for rid in "bc"}
    requests["a"] = (0, REQUESTS["a"][1], SamplingParams(max_tokens=None, **GREEDY))  # to the context's end
    requests["i"] = (2, _prompt(9, 30), SamplingParams(max_tokens=16, **GREEDY))
    sync, _ = _run(ckpt, False, requests, num_kv_blocks=9, max_model_len=48)
    overlapped, engine = _run(ckpt, True, requests, num_kv_blocks=9, max_model_len=48)
    assert engine.scheduler.num_preemptions > 0 and engine.overlap.steps > 0
    assert overlapped == sync
    assert sync["a"]["reason"] == "length" and len(REQUESTS["a"][1]) + len(sync["a"]["tokens"]) == 48
    assert engine.num_free_blocks == engine.num_total_blocks


def test_an_abort_mid_stream_ends_the_request_and_leaves_the_others_alone(ckpt):
    requests = {rid: REQUESTS[rid] for rid in "abc"}
    full, _ = _run(ckpt, False, requests, num_kv_blocks=96)
    cut, engine = _run(ckpt, True, requests, aborts={10: "a"}, num_kv_blocks=96)
    assert 0 < len(cut["a"]["tokens"]) < 40 and cut["a"]["tokens"] == full["a"]["tokens"][: len(cut["a"]["tokens"])]
    assert cut["b"] == full["b"] and cut["c"] == full["c"]
    assert engine.num_free_blocks == engine.num_total_blocks and not engine.sequences


def test_delta_outputs_and_refusals(ckpt):
    delta, _ = _run(ckpt, True, {rid: REQUESTS[rid] for rid in "ab"}, num_kv_blocks=96, delta_outputs=True)
    plain, _ = _run(ckpt, False, {rid: REQUESTS[rid] for rid in "ab"}, num_kv_blocks=96)
    assert delta == plain
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    problem = async_scheduling_problem  # serve and the workers' mains say it in one line, exit 2
    assert problem(parser.parse_args(["--async-scheduling"])) is None
    assert problem(parser.parse_args(["--async-scheduling", "--no-cuda-graphs"])) == \
        "--async-scheduling runs the padded (graph) decode step: it cannot run with --no-cuda-graphs"
    assert compatibility_problem(parser.parse_args(["--async-scheduling", "--enable-lora"])) is None  # overlaps
    draft_model = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 2}
    assert compatibility_problem(parser.parse_args(["--async-scheduling", "--speculative-config",
                                                    json.dumps(draft_model)])) is None  # (a step that may draft runs
    # ordinarily: tests/engine/test_async_scheduling_features.py; every pair: test_compatibility_table.py)
    assert EngineConfig(model=str(ckpt), async_scheduling=True, speculative_config=draft_model).async_scheduling


def test_a_failed_step_fails_every_request_with_no_placeholder_in_its_output(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), async_scheduling=True, num_kv_blocks=96))
    for rid in "ab":
        engine.add_request(rid, REQUESTS[rid][1], REQUESTS[rid][2])
    for _ in range(4):
        engine.step()
    assert engine.overlap.in_flight is not None  # a step in flight, its placeholders in the sequences
    failed = engine.fail_all("the GPU fell off the bus")
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all(o.error and o.finished and min(o.token_ids) >= 0 for o in failed)
    assert engine.overlap.in_flight is None and engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize("gguf_file", [smollm2_gguf, gemma3_gguf], ids=["smollm2", "gemma3"])
def test_a_real_trained_model_gives_the_same_outputs_overlapped(gguf_file):
    """SmolLM2-135M-Instruct (GGUF Q4_1) and Gemma 3 270M (Q4_K_M, sliding-window layers) as
    they ship: real logits, where near-ties are rare and a token read from the wrong step or
    row would change the text at once."""
    gguf = gguf_file()
    requests = {rid: REQUESTS[rid] for rid in "abcdf"}
    sync, _ = _run(gguf, False, requests, num_kv_blocks=64, max_model_len=256)
    overlapped, engine = _run(gguf, True, requests, num_kv_blocks=64, max_model_len=256)
    assert engine.overlap.steps >= 10
    assert overlapped == sync
    assert len(sync["a"]["tokens"]) == 40 and sync["a"]["text"]
