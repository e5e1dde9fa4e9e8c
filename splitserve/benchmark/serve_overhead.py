"""`splitserve bench serve-overhead`: one workload through the offline engine
(`LLM.generate`) and through `splitserve serve`, in one run, and where the serving path
spends CPU per generated token.

  splitserve bench serve-overhead --requests 64 --concurrency 32 --json out.json

The served run reports output tok/s, TTFT and ITL (the `splitserve bench` client), and CPU
seconds per generated token: in the serve process (router, bus, bridge), in each worker
outside its engine steps (gRPC, event loop, token streaming), and in the engine steps
themselves (process_cpu_seconds_total and splitserve_engine_step_cpu_seconds_total,
scraped before and after). The offline run uses the same prompts, every request at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from splitserve.benchmark.client import ClientConfig
from splitserve.benchmark.metrics import compute_metrics
from splitserve.benchmark.request import Session, Turn
from splitserve.benchmark.runner import RunConfig, run_benchmark
from splitserve.core.banner import serving_url

_ADMIN = re.compile(r"(decode|prefill) worker (\S+?):? .*?(?:metrics|admin) (http://[0-9.:]+)")


def workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(5, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


def offline(model: str, requests, threads: int, max_num_seqs: int | None = None) -> dict:
    """The engine alone: every request at once, or at most `max_num_seqs` in a batch (the
    served run's concurrency, so both decode in batches of the same size)."""
    import torch

    from splitserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, num_kv_blocks=None, **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": wall, "output_tok_s": tokens / wall,
            "cpu_s_per_token": cpu / tokens, "torch_threads": threads, "max_num_seqs": llm.engine.config.max_num_seqs}


def scrape(url: str) -> dict[str, float]:
    """Sum of each metric family's samples we need, from a /metrics page."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("process_cpu_seconds_total", "splitserve_engine_step_cpu_seconds_total",
                     "splitserve_engine_step_seconds_total", "splitserve_engine_process_cpu_seconds"):
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def served(model: str, requests, concurrency: int, serve_args: list[str], warmup) -> dict:
    """`requests` through `splitserve serve`, after `warmup` (other prompts: the measured ones
    must not find their prefixes cached; with the first `concurrency` of the same requests as
    the warm-up, a quarter of a 128-request run was answered from the cache)."""
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "serve", "--model", model, "--port", str(port),
                             "--served-model-name", "bench", *serve_args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if serving_url(line):
                break
        else:
            raise RuntimeError("splitserve serve did not start:\n" + "".join(lines[-40:]))
        base = f"http://127.0.0.1:{port}"
        workers = {m.group(2): m.group(3) for m in _ADMIN.finditer("".join(lines))}
        client = ClientConfig(base_url=base, model="bench", ignore_eos=True)
        sessions = [Session(f"s{i}", [Turn(f"r{i}", p, len(p), m)]) for i, (p, m) in enumerate(requests)]
        warm = [Session(f"w{i}", [Turn(f"w{i}", p, len(p), m)]) for i, (p, m) in enumerate(warmup)]
        asyncio.run(run_benchmark(warm, client, RunConfig(max_concurrency=concurrency, progress=False)))
        before = {"serve": scrape(base), **{w: scrape(u) for w, u in workers.items()}}
        outcome = asyncio.run(run_benchmark(sessions, client, RunConfig(max_concurrency=concurrency,
                                                                        progress=False)))
        after = {"serve": scrape(base), **{w: scrape(u) for w, u in workers.items()}}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    m = compute_metrics(outcome.results, outcome.duration_s, [50, 99])
    tokens = sum(r.output_tokens for r in outcome.results if r.success)
    cpu = {}
    for who in before:
        d = {k: after[who].get(k, 0.0) - before[who].get(k, 0.0) for k in after[who]}
        step_cpu = d.get("splitserve_engine_step_cpu_seconds_total", 0.0)
        # a worker's engine process (--engine-loop process) is not in its process_cpu_seconds_total
        process_cpu = d.get("process_cpu_seconds_total", 0.0) + d.get("splitserve_engine_process_cpu_seconds", 0.0)
        cpu[who] = {"process_cpu_s_per_token": process_cpu / tokens,
                    "engine_step_cpu_s_per_token": step_cpu / tokens,
                    "outside_steps_cpu_s_per_token": (process_cpu - step_cpu) / tokens,
                    # share of the run the engine spent inside steps: well below 1 under load means
                    # the engine waited (for the GIL, for work) rather than computed
                    "engine_busy_fraction": d.get("splitserve_engine_step_seconds_total", 0.0) / outcome.duration_s}
    return {"output_tokens": tokens, "seconds": outcome.duration_s, "output_tok_s": m.output_throughput,
            "ttft_ms": m.ttft_ms, "itl_ms": m.itl_ms, "failed": m.failed, "cpu": cpu,
            "serve_args": serve_args}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench serve-overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", default="64:512")
    ap.add_argument("--output-len", default="64:128")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="offline engine's torch threads")
    ap.add_argument("--serve-args", default="--prefill-workers 1 --decode-workers 1",
                    help="passed to splitserve serve")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    if ns.model is None:
        from splitserve.engine.demo import ensure_demo_checkpoint

        ns.model = str(ensure_demo_checkpoint())
    from splitserve.core.model_config import ModelConfig

    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    vocab = ModelConfig.from_dir(ns.model).vocab_size
    requests = workload(ns.requests, span(ns.input_len), span(ns.output_len), vocab, seed=0)
    warmup = workload(ns.concurrency, span(ns.input_len), span(ns.output_len), vocab, seed=1)
    doc = {"benchmark": "serve_overhead", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
           "command": "splitserve bench serve-overhead " + " ".join(argv or sys.argv[1:]),
           "requests": ns.requests, "concurrency": ns.concurrency, "input_len": ns.input_len,
           "output_len": ns.output_len, "offline": offline(ns.model, requests, ns.threads),
           "offline_at_concurrency": offline(ns.model, requests, ns.threads, ns.concurrency),
           "served": served(ns.model, requests, ns.concurrency, ns.serve_args.split(), warmup)}
    doc["served_over_offline"] = doc["served"]["output_tok_s"] / doc["offline"]["output_tok_s"]
    doc["served_over_offline_at_concurrency"] = (doc["served"]["output_tok_s"]
                                                 / doc["offline_at_concurrency"]["output_tok_s"])
    print(json.dumps(doc, indent=2))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
