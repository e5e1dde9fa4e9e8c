"""KV offload tiers (engine/kv_offload/) and peer prefix pulls (decode_worker/peer_pull.py).

- prefix: time to first token of a prompt whose 2,000-token prefix is cold (computed),
  evicted from the device pool but in the host tier, or only in the disk tier (the host tier
  is full), in one engine;
- peer: two real decode workers on 127.0.0.1 (gRPC, KV receiver): TTFT of a prompt whose
  prefix the worker computes (cold) or pulls from the peer holding it, by prefix length
  (the pull-vs-recompute crossover on this machine);
- agentic: sessions taking turns, each turn the whole history again, a working set several
  times the device pool: no tier, a host tier, a disk tier.

    python -m bench.experiments.kv_tiers [--model demo|smollm2|DIR ...] [--parts prefix,peer,write_down,agentic]

SmolLM2 is ~/.cache/splitserve/smollm2-135m-instruct (bench/experiments/smollm2_checkpoint.py
writes it), float32. Results: bench/results/kv_tiers.json. Every configuration runs in this
process one after the other, so they share the machine's load (recorded); the disk tier's
files were just written, so its reads come from the page cache: a cold disk adds its read time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import grpc

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.core.model_dir import cache_root
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "kv_tiers.json"
PREFIX_TOKENS = 2000
SUFFIX_TOKENS = 24
DEVICE_BLOCKS = 160  # 2,560 tokens: one 2,000-token prefix fits, a second one evicts it
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def model_dir(name: str) -> str:
    if name == "demo":
        from splitserve.engine.demo import ensure_demo_checkpoint

        return str(ensure_demo_checkpoint())
    if name == "smollm2":
        return str(cache_root() / "smollm2-135m-instruct")
    return name


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached prompt tokens, that token) of one request alone."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(f"r{random.random()}", prompt, GREEDY, detokenize=False)
    while True:
        for out in engine.step():
            if out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed, out.num_cached_tokens, out.token_ids
        assert engine.has_unfinished_requests()


def block_nbytes(llm: LLM) -> int:
    return llm.engine.runner.kv_pool.spec.block_nbytes


def prefix_ttfts(model: str, tier: str, repeats: int) -> dict:
    """Cold, then (prefix evicted from the device) from `tier`: best of `repeats` each."""
    probe = LLM(model, num_kv_blocks=4)
    nb, vocab = block_nbytes(probe), probe.engine.model_config.vocab_size
    probe.close()
    tmp = tempfile.TemporaryDirectory(prefix="kv-tiers-")
    fields = {"none": {}, "host": {"kv_offload_bytes": 512 * nb},  # the prefix and the evicting document fit
              "disk": {"kv_offload_bytes": 8 * nb, "kv_offload_dir": tmp.name, "kv_offload_dir_bytes": 512 * (nb + 64)}}
    rng = random.Random(7)
    cold, warm, exact = [], [], True
    with LLM(model, num_kv_blocks=DEVICE_BLOCKS, **fields[tier]) as llm:
        ttft(llm, tokens(rng, 64, vocab))  # warm the kernels
        for _ in range(repeats):
            prefix = tokens(rng, PREFIX_TOKENS, vocab)
            question = tokens(rng, SUFFIX_TOKENS, vocab)
            t_cold, cached_cold, first_cold = ttft(llm, prefix + question)
            if llm.engine.offloader is not None:
                llm.engine.offloader.wait_idle()
            ttft(llm, tokens(rng, DEVICE_BLOCKS * 16 - 40, vocab))  # a longer document: evicts the prefix
            if llm.engine.offloader is not None:
                llm.engine.offloader.wait_idle()
            t_warm, cached, first = ttft(llm, prefix + question)
            assert cached_cold == 0
            exact &= first == first_cold
            cold.append(t_cold)
            warm.append((t_warm, cached))
        stats = llm.engine.offloader.stats() if llm.engine.offloader is not None else None
    tmp.cleanup()
    best_warm = min(warm)
    return {"tier": tier, "cold_ttft_s": round(min(cold), 4), "again_ttft_s": round(best_warm[0], 4),
            "again_cached_tokens": best_warm[1], "ratio": round(best_warm[0] / min(cold), 3),
            "first_token_identical": exact, "repeats": repeats,
            "loaded_blocks": stats.counters.loaded_blocks if stats else None}


async def first_token(worker, prompt: list[int], pull_from=None, pull_blocks: int = 0) -> tuple[float, int, int]:
    """(seconds to the first chunk, cached prompt tokens, first token) of one Generate call."""
    req = pb.GenerateRequest(request_id=f"r{random.random()}", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY))
    if pull_from is not None:
        req.pull_worker_id, req.pull_address, req.pull_blocks = pull_from.worker_id, pull_from.address, pull_blocks
    async with grpc.aio.insecure_channel(worker.address) as ch:
        start = time.perf_counter()
        chunks = []
        async for chunk in DecodeWorkerStub(ch).Generate(req):
            if not chunks:
                elapsed = time.perf_counter() - start
            chunks.append(chunk)
    return elapsed, chunks[0].num_cached_tokens, chunks[0].token_ids[0]


async def peer_ttfts(model: str, lengths: list[int]) -> list[dict]:
    """Per prefix length: the worker computes a fresh prefix (cold), then pulls another one
    from the peer that holds it; the pulled answer's first token against the holder's."""
    bs = 16
    workers = [DecodeWorker(DecodeWorkerConfig(EngineConfig(model=model, num_kv_blocks=2 * max(lengths) // bs + 32,
                                                            model_id="bench"), worker_id=w), bus=InProcBus())
               for w in ("holder", "puller")]
    await asyncio.gather(*(w.start() for w in workers))
    holder, puller = workers
    vocab = holder.engine.engine.model_config.vocab_size
    rng = random.Random(5)
    rows = []
    try:
        await first_token(puller, tokens(rng, 64, vocab))  # warm the kernels
        for n in lengths:
            prefix, question = tokens(rng, n, vocab), tokens(rng, SUFFIX_TOKENS, vocab)
            await first_token(holder, prefix + tokens(rng, SUFFIX_TOKENS, vocab))  # the holder computes it
            cold, cached_cold, _ = await first_token(puller, tokens(rng, n, vocab) + question)
            pulled, cached, token = await first_token(puller, prefix + question, holder, n // bs)
            _, _, holder_token = await first_token(holder, prefix + question)
            assert cached_cold == 0
            rows.append({"prefix_tokens": n, "cold_ttft_s": round(cold, 4), "pull_ttft_s": round(pulled, 4),
                         "ratio": round(pulled / cold, 3), "pulled_tokens": cached,
                         "first_token_identical": token == holder_token})
            for w in workers:  # start the next length from empty pools
                await w.engine.call(w.engine.engine.scheduler.bm.reset_prefix_cache)
    finally:
        await asyncio.gather(*(w.stop() for w in workers))
    return rows


def agentic(model: str, tier: str, sessions: int, turns: int) -> dict:
    """`sessions` agents take turns (round robin); each turn appends a tool result and asks
    again with the whole history. The histories outgrow the device pool several times over."""
    probe = LLM(model, num_kv_blocks=4)
    nb, vocab = block_nbytes(probe), probe.engine.model_config.vocab_size
    probe.close()
    device_blocks = 64
    tmp = tempfile.TemporaryDirectory(prefix="kv-tiers-")
    fields = {"none": {}, "host": {"kv_offload_bytes": 2048 * nb},
              "disk": {"kv_offload_bytes": 32 * nb, "kv_offload_dir": tmp.name, "kv_offload_dir_bytes": 2048 * (nb + 64)}}
    rng = random.Random(11)
    histories = [tokens(rng, 400, vocab) for _ in range(sessions)]
    ttfts, generated = [], 0
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model, num_kv_blocks=device_blocks, **fields[tier]) as llm:
        start = time.perf_counter()
        for _ in range(turns):
            for s in range(sessions):
                histories[s] += tokens(rng, 48, vocab)  # the tool's output
                t0 = time.perf_counter()
                out = llm.generate(histories[s], params)[0]
                ttfts.append(time.perf_counter() - t0)
                histories[s] += out.token_ids
                generated += len(out.token_ids)
        wall = time.perf_counter() - start
    tmp.cleanup()
    working_set = sum(len(h) for h in histories) // llm.engine.config.block_size
    return {"tier": tier, "sessions": sessions, "turns": turns, "device_blocks": device_blocks,
            "working_set_blocks": working_set, "working_set_x_device": round(working_set / device_blocks, 1),
            "mean_request_s": round(sum(ttfts) / len(ttfts), 4), "tokens_per_s": round(generated / wall, 1),
            "wall_s": round(wall, 2)}


def write_down_cost(model: str, blocks: int = 256) -> dict:
    """What the engine thread pays per idle cached block: noting it for the background writer
    (this design) against copying its bytes itself when it is evicted (copy-on-evict)."""
    with LLM(model, num_kv_blocks=4) as probe:
        nb = block_nbytes(probe)
    with LLM(model, num_kv_blocks=blocks + 8, kv_offload_bytes=(blocks + 8) * nb) as llm:
        off = llm.engine.offloader
        start = time.perf_counter()
        for b in range(blocks):
            off.on_cached_free(b, 10_000 + b)
        note = (time.perf_counter() - start) / blocks
        off.wait_idle()
        import torch

        host = torch.empty(nb, dtype=torch.uint8)
        start = time.perf_counter()
        for b in range(blocks):
            off.blocks.read_into(b, host)  # what copy-on-evict would do inline
        copy = (time.perf_counter() - start) / blocks
    return {"block_nbytes": nb, "note_us_per_block": round(note * 1e6, 2), "copy_us_per_block": round(copy * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="demo, smollm2 or a checkpoint directory (repeatable)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default="prefix,peer,write_down,agentic", help="which parts to run")
    ap.add_argument("--peer-lengths", default="64,256,1024,2000", help="prefix lengths of the peer-pull part")
    ap.add_argument("--agentic-models", default="demo", help="models the agentic part runs on (SmolLM2's "
                    "no-tier run alone takes ~3 minutes on 2 cores)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    results = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
               "prefix_tokens": PREFIX_TOKENS, "device_blocks": DEVICE_BLOCKS, "models": {}}
    started = time.perf_counter()
    for name in args.model or ["demo", "smollm2"]:
        path = model_dir(name)
        entry = {}
        if "prefix" in parts:
            entry["prefix"] = [prefix_ttfts(path, tier, args.repeats) for tier in ("host", "disk")]
        if "peer" in parts:
            entry["peer"] = asyncio.run(peer_ttfts(path, [int(n) for n in args.peer_lengths.split(",")]))
        if "write_down" in parts:
            entry["write_down"] = write_down_cost(path)
        if "agentic" in parts and name in args.agentic_models.split(","):
            entry["agentic"] = [agentic(path, tier, sessions=6, turns=4) for tier in ("none", "host", "disk")]
        results["models"][name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
