"""Tensor parallelism on this machine's CPU: step time at TP=1 and TP=2 (two rank processes
over gloo), and on rank 0 the share of the step spent in the collectives (the two
all-reduces per layer, the logits all-gather, the step broadcast; each includes waiting
for the other rank). A random-weight Llama (hidden 768, 6 layers, 12 q / 4 KV heads),
float32.

    python -m bench.experiments.tp_step

Honest reading: on a 2-core machine two ranks split the cores the one rank had (each rank
runs one thread), so TP=2 shows the overhead of the collectives, not a speed-up; TP exists
for models that do not fit one device. Results go to bench/results/tp_step.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine import model_runner as runner_module
from splitserve.engine.demo import build_checkpoint_once, write_checkpoint
from splitserve.engine.parallel import linear

REPEATS = 3
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "tp_step.json"
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
             num_key_value_heads=4)


default_threads = torch.get_num_threads()


class Timed:
    """Wraps the collectives rank 0 calls, summing their wall time."""

    def __init__(self):
        self.seconds = 0.0
        self.originals = {}

    def wrap(self, module, name):
        original = getattr(module, name)
        self.originals[(module, name)] = original

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        setattr(module, name, timed)

    def restore(self):
        for (module, name), original in self.originals.items():
            setattr(module, name, original)


def measure(path: Path, tp: int, threads: int | None = None) -> dict:
    """Median over REPEATS of each phase. `threads`: torch threads of a TP=1 engine."""
    if threads:
        torch.set_num_threads(threads)
    timed = Timed()
    for module, name in ((linear, "all_reduce"), (linear, "all_gather"), (runner_module, "broadcast_object")):
        timed.wrap(module, name)
    try:
        with LLM(str(path), num_kv_blocks=256, max_num_batched_tokens=1024, tensor_parallel_size=tp) as llm:
            vocab, run, steps = llm.engine.model_config.vocab_size, llm.engine.runner.run, [0]

            def counted(batch):
                steps[0] += 1
                return run(batch)
            llm.engine.runner.run = counted
            prompts = [[(i * 31 + j * 7) % (vocab - 10) + 5 for j in range(128)] for i in range(8)]
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
            out = {}
            for phase, params, batch in (
                ("prefill_8x128", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), prompts),
                ("decode_batch8", SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
                 [p[:16] for p in prompts]),
            ):
                runs = []
                for _ in range(REPEATS):
                    steps[0], timed.seconds = 0, 0.0
                    t = time.perf_counter()
                    llm.generate(batch, params)
                    wall = time.perf_counter() - t
                    runs.append((wall / steps[0], timed.seconds / wall))
                per_step, share = sorted(runs)[len(runs) // 2]
                out[phase] = {"steps": steps[0], "ms_per_step": round(1000 * per_step, 2),
                              "collective_share": round(share, 3)}
            return out
    finally:
        timed.restore()
        torch.set_num_threads(default_threads)


def main() -> None:
    path = build_checkpoint_once(Path(tempfile.gettempdir()) / "splitserve-tp-step-llama",
                                 lambda d: write_checkpoint(d, "llama", seed=7, **SHAPE))
    results = {"machine": f"{os.cpu_count()} CPUs (shared with other work while measured)", "model": SHAPE,
               "repeats": REPEATS, "torch_threads_tp1": default_threads,
               "tp1": measure(path, 1), "tp1_one_thread": measure(path, 1, threads=1),
               "tp2_one_thread_per_rank": measure(path, 2), "tp1_again": measure(path, 1)}
    print(json.dumps(results, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
