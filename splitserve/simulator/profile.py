"""`splitserve profile`: measure the real engine's costs on this machine and fit the
simulator's cost models (costs.py) from them.

Measured, each point the median of --repeats runs:
- engine steps (one `LLMEngine.step()`, the worker's real forward pass): prefills of
  one prompt against prompt length and cached prefix, pure decode steps against
  batch size and context, and mixed steps (a decode batch plus a prefill chunk);
- KV transfer: a push of N blocks of this model's KV through a kvtransfer backend
  (sender and receiver in this process, over loopback);
- routing: the router's decision path (block hashes, radix-index match, policy)
  against an index of `--routing-workers` workers;
- serving overhead (--serving): a real `splitserve serve` with one decode worker,
  one request at a time: the first token's time beyond the prefill step, and each
  streamed gap's time beyond the decode step.

    splitserve profile --out bench/results/simulator_profile.json --serving
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from splitserve.simulator.costs import (
    AffineCost,
    CostModel,
    ServingOverhead,
    StepCost,
    attention_work,
)


def _engine(model: str, max_num_batched_tokens: int, max_num_seqs: int):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, num_kv_blocks=4096, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs))


class StepProbe:
    """Drives an LLMEngine and times single steps; the batch each step ran is read
    from the scheduler's own plan (captured when the engine asks for it)."""

    def __init__(self, engine, seed: int = 0):
        self.engine = engine
        self.rng = random.Random(seed)
        self.ids = 0
        vocab = engine.model_config.vocab_size
        self.lo, self.hi = min(100, vocab - 2), vocab - 1
        self.batch: list[tuple[int, int]] = []  # (new tokens, computed before) of the last step
        plan = engine.scheduler.schedule

        def capture():
            batch = plan()
            self.batch = [(n, s.num_computed_tokens) for s, n in batch.entries]
            return batch

        engine.scheduler.schedule = capture

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from splitserve.core.sampling_params import SamplingParams

        self.ids += 1
        self.engine.add_request(f"profile-{self.ids}", prompt,
                                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def timed_step(self) -> tuple[float, dict]:
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        feats = {"new_tokens": sum(n for n, _ in self.batch), "sequences": len(self.batch),
                 "attention": sum(attention_work(n, c) for n, c in self.batch if n > 1),
                 "decode_context": sum(c + 1 for n, c in self.batch if n == 1)}
        return seconds, feats

    def prefill(self, new: int, cached: int) -> tuple[float, dict]:
        prefix = self.tokens(cached)
        if cached:
            self.add(prefix + self.tokens(1), 1)
            self.drain()
        self.add(prefix + self.tokens(new), 1)
        result = self.timed_step()
        self.drain()
        return result

    def decode(self, batch: int, context: int, repeats: int, prefill_chunk: int = 0) -> list[tuple[float, dict]]:
        """`batch` sequences of `context` tokens decoding (a shared prefix keeps the
        setup cheap: paged attention still reads every sequence's context); times
        `repeats` steps, each with a fresh `prefill_chunk`-token prompt when given."""
        prefix = self.tokens(context - 16)
        self.add(prefix + self.tokens(1), 1)
        self.drain()
        for _ in range(batch):
            self.add(prefix + self.tokens(16), 64)
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            self.engine.step()
        self.engine.step()  # the first pure decode step of this batch shape warms it
        samples = []
        for _ in range(repeats):
            if prefill_chunk:
                self.add(self.tokens(prefill_chunk), 1)
            samples.append(self.timed_step())
        for rid in list(self.engine.sequences):
            self.engine.abort(rid)
        return samples


def profile_steps(model: str, repeats: int, max_batched: int, log) -> list[dict]:
    probe = StepProbe(_engine(model, max_batched, 64))
    probe.prefill(64, 0)  # warm-up (allocations, first-call costs)
    rows = []
    plan = [("prefill", n, 0) for n in (16, 64, 128, 256, 512, 1024, 1536, 2048) if n <= max_batched]
    plan += [("prefill", n, c) for n in (32, 256, 1024) for c in (512, 1024) if n <= max_batched]
    plan += [("decode", b, ctx) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (64, 512, 1024)]
    plan += [("mixed", b, n) for b in (4, 16) for n in (256, 1024) if n + b <= max_batched]
    for kind, a, b in plan:
        if kind == "prefill":
            samples = [probe.prefill(a, b) for _ in range(repeats)]
        elif kind == "decode":
            samples = probe.decode(a, b, repeats)
        else:
            samples = probe.decode(a, 128, repeats, prefill_chunk=b)
        seconds = statistics.median(s for s, _ in samples)
        row = {"kind": kind, "a": a, "b": b, "seconds": seconds, **samples[0][1]}
        rows.append(row)
        log(f"  {kind:<7} {a:>5} {b:>5}: {seconds * 1000:8.2f} ms  (new {row['new_tokens']}, "
            f"seqs {row['sequences']})")
    return rows


def profile_transfer(model: str, backend: str, repeats: int, log,
                     sizes: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512)) -> tuple[list[dict], int]:
    from splitserve.core.model_config import ModelConfig
    from splitserve.engine.config import DTYPES
    from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
    from splitserve.kvtransfer import KVReceiver, KVTransferConfig, create_sender

    mc = ModelConfig.from_dir(model)
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, DTYPES["float32"])
    src, dst = KVCachePool(spec, 600), KVCachePool(spec, 600)
    receiver = KVReceiver(dst, KVTransferConfig(backend=backend), worker_id="profile-decode")
    address = receiver.start()
    sender = create_sender(backend)
    rows = []
    try:
        for n in sizes:
            samples = []
            for r in range(repeats + 1):
                rid = f"profile-kv-{n}-{r}"
                dest = random.sample(range(600), n)
                fut = receiver.expect(rid, dest, [], lambda ids: None, timeout=60)
                start = time.perf_counter()
                sender.push(rid, address, src, list(range(n)), dest, [], timeout=60)
                fut.result(timeout=60)
                if r:  # the first push opens the channel
                    samples.append(time.perf_counter() - start)
            rows.append({"blocks": n, "bytes": n * spec.block_nbytes, "seconds": statistics.median(samples)})
            log(f"  transfer {n:>4} blocks ({n * spec.block_nbytes / 2**20:7.2f} MiB): "
                f"{rows[-1]['seconds'] * 1000:8.2f} ms")
    finally:
        sender.close()
        receiver.stop()
    return rows, spec.block_nbytes // 16


def profile_routing(workers: int, prompt_tokens: int, repeats: int) -> dict:
    from splitserve.core.hashing import block_hashes, hash_seed
    from splitserve.router.policy import PolicyConfig, route
    from splitserve.router.radix_index import RadixIndex

    rng = random.Random(0)
    seed = hash_seed("profile")
    index = RadixIndex()
    names = [f"decode-{i}" for i in range(workers)]
    prompts = [[rng.randrange(100, 1000) for _ in range(prompt_tokens)] for _ in range(64)]
    for i, p in enumerate(prompts):
        index.apply_stored(names[i % workers], None, block_hashes(p, 16, seed))
    times = []
    for r in range(repeats * 200):
        p = prompts[r % len(prompts)]
        start = time.perf_counter()
        hashes = block_hashes(p, 16, seed)
        route(len(p), 16, index.match(hashes), names, [], {}, rng, PolicyConfig())
        times.append(time.perf_counter() - start)
    return {"workers": workers, "prompt_tokens": prompt_tokens, "mean_s": statistics.fmean(times),
            "median_s": statistics.median(times)}


def fit(profile: dict, max_batched: int, max_seqs: int) -> CostModel:
    samples = profile["samples"]
    step = StepCost.fit(samples["steps"])
    rows = samples["transfer"]
    transfer = AffineCost.fit([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    serving = ServingOverhead(**samples.get("serving", {}).get("overhead", {}))
    return CostModel(step=step, transfer=transfer, routing_s=samples["routing"]["mean_s"], serving=serving,
                     kv_bytes_per_token=samples["kv_bytes_per_token"], block_size=16,
                     max_num_batched_tokens=max_batched, max_num_seqs=max_seqs)


def fit_errors(costs: CostModel, rows: list[dict]) -> dict:
    """Relative error of the fitted step model on the measured steps."""
    rel = np.array([costs.step.time(r["new_tokens"], r["sequences"], r["attention"], r["decode_context"])
                    / r["seconds"] - 1 for r in rows])
    return {"mean_abs_rel_error": float(np.mean(np.abs(rel))), "max_abs_rel_error": float(np.max(np.abs(rel)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--out", type=Path, default=Path("profile.json"))
    ap.add_argument("--torch-threads", type=int, default=1, help="as the workers run (splitserve serve default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")
    ap.add_argument("--routing-workers", type=int, default=4)
    ap.add_argument("--serving", action="store_true",
                    help="also measure serving overhead through a real `splitserve serve` (about a minute)")
    ns = ap.parse_args(argv)
    if ns.repeats < 1 or ns.torch_threads < 1:
        ap.error("--repeats and --torch-threads must be >= 1")
    import torch

    from splitserve.engine.demo import ensure_demo_checkpoint

    torch.set_num_threads(ns.torch_threads)
    model = ns.model or str(ensure_demo_checkpoint())
    if not os.path.isfile(os.path.join(model, "config.json")):
        ap.error(f"--model {model}: config.json not found (a Hugging Face checkpoint directory)")

    def log(msg: str) -> None:
        print(msg, flush=True)

    load_before = [round(x, 2) for x in os.getloadavg()]
    log(f"[profile] engine steps ({model}, {ns.torch_threads} torch thread(s))")
    steps = profile_steps(model, ns.repeats, ns.max_num_batched_tokens, log)
    log(f"[profile] KV transfer ({ns.kv_backend})")
    transfer, kv_bytes_per_token = profile_transfer(model, ns.kv_backend, ns.repeats, log)
    routing = profile_routing(ns.routing_workers, 1024, ns.repeats)
    log(f"[profile] routing decision: {routing['mean_s'] * 1e6:.1f} us mean")
    doc = {"tool": "splitserve profile", "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "model": model, "torch_threads": ns.torch_threads, "cpus": os.cpu_count(),
           "samples": {"steps": steps, "transfer": transfer, "routing": routing,
                       "kv_bytes_per_token": kv_bytes_per_token}}
    costs = fit(doc, ns.max_num_batched_tokens, ns.max_num_seqs)
    if ns.serving:
        from splitserve.simulator.serving_probe import measure_serving_overhead

        log("[profile] serving overhead through splitserve serve")
        doc["samples"]["serving"] = measure_serving_overhead(model, costs, ns.torch_threads, log)
        costs = fit(doc, ns.max_num_batched_tokens, ns.max_num_seqs)
    doc["costs"] = costs.to_dict()
    doc["fit"] = fit_errors(costs, steps)
    doc["load_average"] = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=2) + "\n")
    s = costs.step
    log(f"[profile] step = {s.c_step * 1e3:.3f} ms + {s.c_token * 1e6:.2f} us/token + {s.c_seq * 1e6:.1f} us/seq "
        f"+ {s.c_attn * 1e9:.3f} ns/prefill pair + {s.c_ctx * 1e9:.2f} ns/decode key "
        f"(mean |error| {doc['fit']['mean_abs_rel_error']:.1%})")
    log(f"[profile] transfer = {costs.transfer.fixed * 1e3:.3f} ms + {costs.transfer.per_unit * 2**30:.3f} s/GiB")
    log(f"[profile] serving overhead: first token +{costs.serving.first_token_s * 1e3:.2f} ms, "
        f"per token +{costs.serving.per_token_s * 1e3:.2f} ms")
    log(f"[profile] wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
