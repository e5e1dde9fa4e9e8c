"""Run a few throwaway requests through the engine before it serves, so that the GPU kernels
the first real requests need are compiled already.

Why: Triton compiles a kernel variant on first use, ~0.3 s each on an H200. CUDA-graph
capture at start-up covers the pure-decode steps, but prefill and mixed prefill + decode
steps run eagerly and compiled theirs on the first requests: on a fresh machine the GPU
check's first 8 concurrent requests through `splitserve serve` waited for them (TTFT mean
221 ms against a median of 44). vLLM does the same with its start-up profile run.

Two requests, so the second step mixes a prefill with a decode: one 80-token prompt (its
decode attention splits) and one 8-token prompt. Afterwards the prefix cache is emptied and
its block events dropped: the router never hears of blocks it was never told about, and
the pool is as it was. Off on the CPU (nothing to compile per shape: the native kernel
library is built once, cached on disk, and loaded by the model runner before the engine
reports ready).
"""

from __future__ import annotations

import logging
import time

from splitserve.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)
WARMUP_PREFIX = "splitserve-warmup-"
PROMPT_LENGTHS = (80, 8)
MAX_STEPS = 16


def warm_up(engine) -> float:
    """Seconds spent; the engine has no request, no cached block and no pending event after."""
    started = time.perf_counter()
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, length in enumerate(PROMPT_LENGTHS):
        length = min(length, int(engine.max_model_len) - params.max_tokens)
        if length < 1:
            continue
        try:
            engine.add_request(f"{WARMUP_PREFIX}{i}", [(t * 7 + 1) % vocab for t in range(length)], params,
                               detokenize=False)
        except ValueError as exc:  # InvalidPromptError: a pool or limit too small for it; warm what fits
            log.info("engine warm-up: skipped a %d-token prompt: %s", length, exc)
            continue
        engine.step()  # the first alone: its prefill; then with the second, a mixed step
    for _ in range(MAX_STEPS):  # bounded: a pool too small for the prompts must not hang start-up
        if not engine.has_unfinished_requests():
            break
        engine.step()
    for i in range(len(PROMPT_LENGTHS)):
        engine.abort(f"{WARMUP_PREFIX}{i}")  # no-op for the finished ones
    engine.scheduler.bm.reset_prefix_cache()
    engine.drain_block_events()
    seconds = time.perf_counter() - started
    log.info("engine warm-up on %s: %.1f s (kernels compiled before the first request)", engine.config.device,
             seconds)
    return seconds
