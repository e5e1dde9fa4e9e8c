"""The start-up warm-up (engine/warmup.py): on by default on CUDA only; it leaves no request,
no cached block and no pending block event behind, and later outputs are what they would
have been without it."""

from __future__ import annotations

import os
import random
import subprocess
import sys

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


def test_a_cpu_engine_has_its_native_kernels_loaded_before_its_first_request(make_ckpt):
    """The library is built (or loaded from its cache) while the engine starts, not in the
    first request: a fresh process, since this one has it loaded already."""
    code = ("from splitserve.engine import LLM; from splitserve.kernels import cpu_native; "
            f"LLM({str(make_ckpt('llama'))!r}, num_kv_blocks=8); print(cpu_native._library is not None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "SPLITSERVE_KERNELS"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
