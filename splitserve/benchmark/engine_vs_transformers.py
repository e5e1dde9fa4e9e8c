"""Engine against transformers' generate with static batching, on one workload, in one run.

64 requests, prompt lengths 16-512 and output lengths 8-256 (uniform, seeded), greedy,
EOS ignored so both produce exactly the requested tokens. transformers runs the
requests in fixed batches (left-padded, each batch generating until its longest
request is done, the way static batching works). Both sides are run at each CPU
thread count in --threads and transformers at each batch size; the ratio compares
the best engine run with the best transformers run. Throughput counts only
requested output tokens.

The model is the random-weight demo Llama, or with --family qwen3_moe a random-weight
Qwen3-MoE of the same width (16 experts, top-4, renormalised; built once in the cache),
or any checkpoint given with --model. With --device cuda both sides run on the GPU (the
engine with its CUDA graphs) and the clocks stop only when the GPU has finished.

    splitserve bench engine [--family llama|qwen3_moe] [--model DIR] [--device cuda]
                            [--max-num-seqs 32 --hf-batch-sizes 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

MOE_NAME = "splitserve-bench-qwen3-moe-random-v1"
# The demo Llama's width (hidden 256, 4 layers, 8 heads / 4 KV heads), every MLP a mixture
# of 16 experts of intermediate size 128, 4 per token: per token three quarters of the
# demo's dense 704-wide MLP weights are active, in Qwen3-30B-A3B's top-k-of-many shape.
MOE_FIELDS = dict(seed=1234, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=128, norm_topk_prob=True)


def ensure_moe_checkpoint() -> Path:
    """The random-weight Qwen3-MoE benchmark checkpoint, built on first use."""
    from splitserve.core.model_dir import cache_root
    from splitserve.engine.demo import write_checkpoint

    target = cache_root() / MOE_NAME
    if not (target / "config.json").is_file():
        write_checkpoint(target, "qwen3_moe", **MOE_FIELDS)
    return target


def make_workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    outputs = [rng.randint(8, 256) for _ in range(n)]
    return prompts, outputs


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(model_dir: str, prompts, outputs, dtype: str, device: str = "cpu", max_num_seqs: int = 64,
               kv_cache_gib: float = 0.5, async_scheduling: bool = False) -> dict:
    from splitserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=int(kv_cache_gib * 2**30), async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    _sync(device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(outputs)
    return {"seconds": elapsed, "cpu_seconds": cpu, "output_tokens": produced,
            "output_tokens_per_s": produced / elapsed, "output_tokens_per_cpu_s": produced / cpu,
            "preemptions": llm.engine.scheduler.num_preemptions, "max_num_seqs": max_num_seqs,
            "async_scheduling": async_scheduling,
            "overlapped_steps": llm.engine.overlap.steps if llm.engine.overlap is not None else 0}


def run_transformers(model_dir: str, prompts, outputs, batch_size: int, dtype: str, device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    pad = model.generation_config.eos_token_id[0]

    def generate(batch_prompts, new_tokens):
        width = max(len(p) for p in batch_prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad)

    generate(prompts[:2], 4)  # warm-up
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i : i + batch_size], max(outputs[i : i + batch_size]))
    _sync(device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"batch_size": batch_size, "seconds": elapsed, "cpu_seconds": cpu,
            "output_tokens_per_s": sum(outputs) / elapsed, "output_tokens_per_cpu_s": sum(outputs) / cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: the random-weight model of --family)")
    ap.add_argument("--family", choices=("llama", "qwen3_moe"), default="llama",
                    help="random-weight model when --model is not given: the demo Llama or a Qwen3-MoE")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", default="1,2", help="torch CPU thread counts to try on both sides")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N (both sides)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's largest batch")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="the engine's KV cache")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also run the engine with overlapped decode steps (engine/overlap.py); the ratio to "
                         "transformers stays the synchronous engine's")
    ap.add_argument("--out", help="write JSON results here")
    args = ap.parse_args(argv)
    from splitserve.core.model_config import ModelConfig
    from splitserve.engine.demo import ensure_demo_checkpoint

    thread_counts = [int(t) for t in args.threads.split(",")]
    if args.model:
        model_dir = args.model
    else:
        model_dir = str(ensure_moe_checkpoint() if args.family == "qwen3_moe" else ensure_demo_checkpoint())
    prompts, outputs = make_workload(args.requests, ModelConfig.from_dir(model_dir).vocab_size)
    engine_runs, hf_runs, async_runs = [], [], []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        e = {"threads": threads, **run_engine(model_dir, prompts, outputs, args.dtype, args.device, args.max_num_seqs,
                                                 args.kv_cache_gib)}
        engine_runs.append(e)
        print(f"splitserve engine  threads={threads}: {e['output_tokens_per_s']:8.1f} output tok/s "
              f"({e['seconds']:.1f} s, {e['output_tokens_per_cpu_s']:.1f} per CPU-second)", flush=True)
        if args.async_scheduling:
            a = {"threads": threads, **run_engine(model_dir, prompts, outputs, args.dtype, args.device,
                                                     args.max_num_seqs, args.kv_cache_gib, async_scheduling=True)}
            async_runs.append(a)
            print(f"  overlapped steps  threads={threads}: {a['output_tokens_per_s']:8.1f} output tok/s "
                  f"({a['overlapped_steps']} steps overlapped)", flush=True)
        for bs in (int(b) for b in args.hf_batch_sizes.split(",")):
            r = {"threads": threads, **run_transformers(model_dir, prompts, outputs, bs, args.dtype, args.device)}
            hf_runs.append(r)
            print(f"transformers bs={bs:<3} threads={threads}: {r['output_tokens_per_s']:8.1f} output tok/s "
                  f"({r['seconds']:.1f} s, {r['output_tokens_per_cpu_s']:.1f} per CPU-second)", flush=True)
    engine = max(engine_runs, key=lambda r: r["output_tokens_per_s"])
    best = max(hf_runs, key=lambda r: r["output_tokens_per_s"])
    ratio = engine["output_tokens_per_s"] / best["output_tokens_per_s"]
    print(f"best engine (threads={engine['threads']}) / best transformers (bs={best['batch_size']}, "
          f"threads={best['threads']}): {ratio:.2f}x output tokens/s")
    result = {
        "benchmark": "engine_vs_transformers", "model": model_dir,
        "architecture": ModelConfig.from_dir(model_dir).architecture, "dtype": args.dtype, "device": args.device,
        "requests": args.requests, "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
        "engine_runs": engine_runs, "transformers_runs": hf_runs, "best_engine": engine,
        "best_transformers": best, "ratio_vs_best_transformers": ratio, "engine_async_runs": async_runs,
        "async_over_sync": (max(r["output_tokens_per_s"] for r in async_runs) / engine["output_tokens_per_s"]
                            if async_runs else None),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_1m_at_end": os.getloadavg()[0],
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None},
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
