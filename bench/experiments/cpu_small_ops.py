"""The native CPU small ops (kernels/cpu_fused_ops.cpp) against the torch reference, inside
one engine: the offline engine's decode step time at batch 1 to 32, the same sequences,
blocks of steps alternating native and reference small ops (decode attention is native in
both), medians over the blocks. One process and interleaved blocks, so machine drift falls
on both alike; contexts grow while it runs (prompts 64-512, then one token a step).

    python -m bench.experiments.cpu_small_ops [--batches 1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.experiments.harness import load_average
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.demo import ensure_demo_checkpoint
from splitserve.kernels import cpu_fused


def step_times(batch: int, blocks: int, steps: int) -> dict[str, float]:
    llm = LLM(str(ensure_demo_checkpoint()), max_num_seqs=batch)
    engine, rng = llm.engine, random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(64, 512))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
    for _ in range(40):  # prefill done: decoding from here
        engine.step()
    native = (cpu_fused.supports, cpu_fused.rotary_store_supported)
    times: dict[str, list[float]] = {"native": [], "reference": []}
    try:
        for block in range(blocks):
            for mode in ("native", "reference") if block % 2 == 0 else ("reference", "native"):
                if mode == "native":
                    cpu_fused.supports, cpu_fused.rotary_store_supported = native
                else:  # ops.py then takes the reference for the small ops
                    cpu_fused.supports = cpu_fused.rotary_store_supported = lambda *a: False
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[mode].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        cpu_fused.supports, cpu_fused.rotary_store_supported = native
    return {mode: statistics.median(ms) for mode, ms in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of steps, alternating (even: fair order)")
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"load average before: {load_average()}")
    for batch in map(int, ns.batches.split(",")):
        t = step_times(batch, ns.blocks, ns.steps)
        print(f"batch {batch:>2}: native {t['native']:6.2f} ms/step, reference small ops "
              f"{t['reference']:6.2f} ms/step, {t['reference'] / t['native']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
