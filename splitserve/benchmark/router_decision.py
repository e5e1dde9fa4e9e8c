"""`splitserve bench router`: routing decision latency against a large index.

Builds a radix index of about `--blocks` blocks spread over `--workers` decode workers
(plus `--prefill-workers`), from real token sequences hashed with the engine's hash
function: shared "system prompt" prefixes, each continued by many distinct
conversations cached on one to three workers. Then times, per request, what the router
does before it can call a worker: hash the prompt's blocks, match them against the
index, and run the policy. Prompts are a mix of fully cached conversations, shared
prefix only, and cold prompts. Prints p50/p99 (and optionally writes JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time

import numpy as np

from splitserve.cluster.messages import LoadReport
from splitserve.core.hashing import block_hashes, hash_seed
from splitserve.router.policy import PolicyConfig, route
from splitserve.router.radix_index import RadixIndex

PREFIX_BLOCKS = 32  # shared system prompt length
N_PREFIXES = 256
TARGET_P99_US = 200.0
FLUSH_EVERY = 500  # decisions between two flushes of the index's queued LRU touches


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_index(n_blocks: int, decode: list[str], prefill: list[str], prompt_tokens: int,
                block_size: int, seed: int, rng: random.Random):
    """Returns (index, sample conversations' tokens, prefixes' tokens)."""
    nprng = np.random.default_rng(seed)
    vocab = 32000
    prefixes = [nprng.integers(0, vocab, PREFIX_BLOCKS * block_size) for _ in range(N_PREFIXES)]
    tail_len = prompt_tokens - PREFIX_BLOCKS * block_size
    index = RadixIndex(max_blocks=n_blocks + n_blocks // 10)
    hseed = hash_seed("bench-model")
    prefix_hashes = [block_hashes(p.tolist(), block_size, hseed) for p in prefixes]
    samples: list[np.ndarray] = []  # arrays, so they stay out of the RSS of the index
    while index.num_blocks < n_blocks:
        k = rng.randrange(N_PREFIXES)
        tail = nprng.integers(0, vocab, tail_len)
        hashes = prefix_hashes[k] + block_hashes(
            tail.tolist(), block_size, start_parent=prefix_hashes[k][-1])
        holders = rng.sample(decode, rng.randint(1, 3))
        if prefill and rng.random() < 0.3:
            holders.append(rng.choice(prefill))
        for w in holders:
            index.apply_stored(w, None, hashes)
        if len(samples) < 2000:
            samples.append(np.concatenate([prefixes[k], tail]))
    return index, samples, prefixes, hseed


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    decode = [f"decode-{i}" for i in range(args.workers)]
    prefill = [f"prefill-{i}" for i in range(args.prefill_workers)]
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    index, samples, prefixes, hseed = build_index(
        args.blocks, decode, prefill, args.prompt_tokens, args.block_size, args.seed, rng)
    build_s = time.perf_counter() - t0
    rss1 = _rss_bytes()
    loads = {w: LoadReport(w, "decode", rng.randint(0, 2), rng.randint(0, 24), rng.random(),
                           waiting_tokens=rng.randint(0, 16384)) for w in decode}  # both paths get taken
    loads.update({w: LoadReport(w, "prefill", rng.randint(0, 2), 0, rng.random(),
                                waiting_tokens=rng.randint(0, 16384)) for w in prefill})
    config = PolicyConfig()
    vocab = 32000
    if not args.no_gc_freeze:
        # What a tuned router does after start-up: long-lived objects (imports, the
        # index's containers) leave the collector's view, so a full collection does not
        # walk them in the middle of a request.
        gc.collect()
        gc.freeze()

    def prompt() -> list[int]:
        kind = rng.random()
        if kind < 0.5:  # a cached conversation
            return rng.choice(samples).tolist()
        if kind < 0.8:  # a known system prompt, new question
            p = rng.choice(prefixes).tolist()
            return p + [rng.randrange(vocab) for _ in range(args.prompt_tokens - len(p))]
        return [rng.randrange(vocab) for _ in range(args.prompt_tokens)]  # cold

    # Wall-clock per stage; the decision (match + policy) also in thread CPU time, which
    # leaves out time this process spent descheduled on a busy machine.
    timings = {"hash": [], "match": [], "policy": [], "decision": [], "decision_cpu": [],
               "hash+decision": []}
    paths = {"local": 0, "disaggregated": 0}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    flush_ns = 0
    for i in range(args.warmup + args.iters):
        if i % FLUSH_EVERY == 0:  # IndexSync does this on each poll, between requests
            t_flush = clock()
            index.flush_touches()
            flush_ns += clock() - t_flush
        tokens = prompt()
        t_start = clock()
        hashes = block_hashes(tokens, args.block_size, hseed)
        t_hash = clock()
        c_start = cpu()
        matched = index.match(hashes)
        t_match = clock()
        decision = route(len(tokens), args.block_size, matched, decode, prefill, loads, rng,
                         config)
        t_end = clock()
        c_end = cpu()
        if i >= args.warmup:
            timings["hash"].append(t_hash - t_start)
            timings["match"].append(t_match - t_hash)
            timings["policy"].append(t_end - t_match)
            timings["decision"].append(t_end - t_hash)
            timings["decision_cpu"].append(c_end - c_start)
            timings["hash+decision"].append(t_end - t_start)
            paths[decision.path] += 1

    def stats(ns: list[int]) -> dict:
        s = sorted(ns)
        n = len(s)
        return {"p50_us": s[n // 2] / 1e3, "p99_us": s[min(n - 1, int(n * 0.99))] / 1e3,
                "p999_us": s[min(n - 1, int(n * 0.999))] / 1e3, "max_us": s[-1] / 1e3}

    return {
        "config": {"workers": args.workers, "prefill_workers": args.prefill_workers,
                   "index_blocks": index.num_blocks, "index_entries": index.num_entries,
                   "prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
                   "iters": args.iters, "seed": args.seed},
        "build_seconds": round(build_s, 2),
        "index_rss_mb": round((rss1 - rss0) / 2**20, 1),
        "latency": {k: stats(v) for k, v in timings.items()},
        "paths": paths,
        "touch_flush_us_per_decision": round(flush_ns / (args.warmup + args.iters) / 1e3, 2),
        "target_p99_us": TARGET_P99_US,
        "env": {"python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "gc_frozen": not args.no_gc_freeze,
                "loadavg": [round(x, 2) for x in os.getloadavg()]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64, help="decode workers (default 64)")
    ap.add_argument("--prefill-workers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="index size in blocks")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the index in the garbage collector's view (see gc.freeze)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.blocks < 1 or args.iters < 1:
        ap.error("--workers, --blocks and --iters must be >= 1")
    if args.prompt_tokens < (PREFIX_BLOCKS + 1) * args.block_size:
        ap.error(f"--prompt-tokens must be at least {(PREFIX_BLOCKS + 1) * args.block_size}")
    print(f"building an index of {args.blocks:,} blocks over {args.workers} decode + "
          f"{args.prefill_workers} prefill workers...", file=sys.stderr)
    result = run(args)
    cfg = result["config"]
    print(f"index: {cfg['index_blocks']:,} blocks, {cfg['index_entries']:,} worker entries, "
          f"~{result['index_rss_mb']} MB RSS, built in {result['build_seconds']} s")
    print(f"{cfg['prompt_tokens']}-token prompt ({cfg['prompt_tokens'] // cfg['block_size']} "
          f"blocks), {cfg['iters']} decisions; paths {result['paths']}; gc frozen: "
          f"{result['env']['gc_frozen']}; queued LRU touches flushed every {FLUSH_EVERY} "
          f"decisions, {result['touch_flush_us_per_decision']} µs per decision")
    print(f"{'stage':<15}{'p50 µs':>10}{'p99 µs':>10}{'p99.9 µs':>10}{'max µs':>10}")
    for stage, s in result["latency"].items():
        print(f"{stage:<15}{s['p50_us']:>10.1f}{s['p99_us']:>10.1f}{s['p999_us']:>10.1f}"
              f"{s['max_us']:>10.1f}")
    print(f"load average during the run: {result['env']['loadavg']} on "
          f"{result['env']['cpus']} CPUs (wall-clock tails grow when the machine is busy)")
    for stage in ("decision", "decision_cpu", "hash+decision"):
        p99 = result["latency"][stage]["p99_us"]
        verdict = "meets" if p99 < TARGET_P99_US else "misses"
        print(f"{stage} p99 {p99:.1f} µs {verdict} the {TARGET_P99_US:.0f} µs target")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
