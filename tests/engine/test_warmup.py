"""The start-up warm-up (engine/warmup.py): on by default on CUDA only; it leaves no request,
no cached block and no pending block event behind, and later outputs are what they would
have been without it."""

from __future__ import annotations

import random

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import EngineConfig


def test_on_by_default_for_cuda_only():
    assert EngineConfig(model="m", device="cuda").use_warm_up
    assert not EngineConfig(model="m", device="cpu").use_warm_up
    assert not EngineConfig(model="m", device="cuda", warm_up=False).use_warm_up


def test_warm_up_leaves_nothing_behind_and_changes_no_output(make_ckpt):
    path = make_ckpt("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 40, 90)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    plain = LLM(str(path), num_kv_blocks=64)
    warmed = LLM(str(path), num_kv_blocks=64, warm_up=True)
    engine = warmed.engine
    assert not engine.has_unfinished_requests() and not engine.sequences
    assert engine.num_free_blocks == engine.num_total_blocks == 64
    assert engine.cached_block_hashes() == []
    assert engine.drain_block_events() == []  # the router is never told of the throwaway blocks
    assert [o.token_ids for o in warmed.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
