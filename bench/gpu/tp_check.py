"""Tensor parallelism on two GPUs (NCCL; issue 32), ready for a lent machine, ~3 minutes:
1. TP=2 greedy tokens equal TP=1's (bf16 is not bit-exact across a different reduction
   order, so the share of equal tokens is reported, as are the first differing positions),
   and a prefix-cache hit at TP=2;
2. step time at TP=1 and TP=2, prefill 8x512 and decode at batch 32 (eager at both: TP
   decodes eagerly), and the share of a TP=2 step in NCCL kernels (torch profiler);
3. the KV transfer between CUDA pools: a prompt prefilled at TP=2 (rank 1's pool reached
   through CUDA IPC) pushed over gRPC into a TP=1 engine, which decodes the TP=2 tokens.
    python bench/gpu/tp_check.py OUTDIR              # two GPUs
    python bench/gpu/tp_check.py OUTDIR --device cpu # the same on the CPU over gloo, tiny (a dry run)
Writes OUTDIR/tp_check.json.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import build_checkpoint_once, write_checkpoint
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from splitserve.kvtransfer.sender import create_sender

GPU_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=8)  # Llama-3-8B's layers, 4 of them (1.7 GB of bf16 to write)
CPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2)


def engine(path: str, device: str, tp: int, **kw) -> LLM:
    dtype = "bfloat16" if device == "cuda" else "float32"
    return LLM(path, device=device, dtype=dtype, tensor_parallel_size=tp, num_kv_blocks=1024,
               max_num_batched_tokens=4096, cuda_graphs=False, **kw)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    return [[(seed + i * 7919 + j * 104729) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]


def greedy(llm: LLM, batch, tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(batch, params)]


def step_ms(llm: LLM, batch, tokens: int) -> float:
    run, steps = llm.engine.runner.run, [0]

    def counted(b):
        steps[0] += 1
        return run(b)
    llm.engine.runner.run = counted
    greedy(llm, batch, tokens)  # warm: Triton compiles, NCCL communicators
    steps[0] = 0
    start = time.perf_counter()
    greedy(llm, batch, tokens)
    llm.engine.runner.run = run
    return round(1000 * (time.perf_counter() - start) / steps[0], 2)


def nccl_share(llm: LLM, batch) -> float:
    """Share of rank 0's CUDA time in NCCL kernels over decode steps at TP=2."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        greedy(llm, batch, 16)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    return round(sum(e.self_device_time_total for e in events if "nccl" in e.key.lower()) / total, 3)


def prefill_side(path: str, device: str, conn) -> None:
    """TP=2 prefill in a process of its own (one TP group per process): prefill, push, first token."""
    with engine(path, device, 2) as p, create_sender("grpc", KVTransferConfig(backend="grpc")) as sender:
        pool = p.engine.share_kv_pool()
        while (job := conn.recv()) is not None:
            rid, prompt, address, skip, dest = job
            p.engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                 hold_kv=True)
            outs = []
            while p.engine.has_unfinished_requests():
                outs += p.engine.step()
            src, hashes = p.engine.held_blocks(rid, skip)
            result = sender.push(rid, address, pool, src, dest, hashes)
            p.engine.release_held(rid)
            conn.send((outs[-1].token_ids[0], result.nbytes, result.seconds))


def kv_transfer(path: str, device: str, batch, tokens: int) -> dict:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(path, device, child))
    proc.start()
    out, moved = [], []
    try:
        with engine(path, device, 1) as d:
            receiver = KVReceiver(d.engine.share_kv_pool(), KVTransferConfig(backend="grpc"), worker_id="tp-check")
            receiver.start()
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            try:
                for i, prompt in enumerate(batch):
                    slot = d.engine.reserve_remote_prefill(f"r{i}", prompt, params)
                    done = receiver.expect(f"r{i}", slot.block_ids, slot.block_hashes, lambda ids: None)
                    conn.send((f"r{i}", prompt, receiver.address, slot.skip_blocks, slot.block_ids))
                    first, nbytes, seconds = conn.recv()
                    assert done.result(timeout=60).ok
                    moved.append((nbytes, seconds))
                    last = d.engine.complete_remote_prefill(f"r{i}", first, None)
                    while d.engine.has_unfinished_requests():
                        last = next((o for o in d.engine.step() if o.request_id == f"r{i}"), last)
                    out.append(last.token_ids)
            finally:
                receiver.stop()
        conn.send(None)
    finally:
        proc.join(120)
    nbytes = sum(n for n, _ in moved)
    return {"tokens": out, "bytes": nbytes, "gb_per_s": round(nbytes / sum(s for _, s in moved) / 1e9, 2)}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
             for p, q in zip(a, b, strict=True)]
    return {"equal_token_share": round(same / sum(map(len, a)), 4), "first_difference": first}


def main() -> None:
    out_dir, device = Path(sys.argv[1]), "cpu" if "--device" in sys.argv and "cpu" in sys.argv else "cuda"
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"tp_check: needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    path = str(build_checkpoint_once(Path(tempfile.gettempdir()) / f"splitserve-tp-check-{device}",
                                     lambda d: write_checkpoint(d, "llama", seed=3, dtype="bfloat16" if device
                                                                == "cuda" else "float32", **shape)))
    long_len, decode_batch, tokens = (512, 32, 64) if device == "cuda" else (64, 4, 8)
    report: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "model": shape}
    results = {}
    for tp in (1, 2):
        with engine(path, device, tp) as llm:
            vocab = llm.engine.model_config.vocab_size
            batch = prompts(4, long_len, vocab)
            hit = batch[0][:long_len // 2] + prompts(1, 16, vocab, seed=1)[0]
            results[tp] = {
                "tokens": greedy(llm, batch, tokens),
                "hit": greedy(llm, [hit], tokens)[0],
                "prefill_8x_ms_per_step": step_ms(llm, prompts(8, long_len, vocab, seed=2), 1),
                "decode_ms_per_step": step_ms(llm, prompts(decode_batch, 16, vocab, seed=3), 33),
            }
            if tp == 2 and device == "cuda":
                results[tp]["nccl_share_of_decode"] = nccl_share(llm, prompts(decode_batch, 16, vocab, seed=3))
    report["tp2_vs_tp1"] = agreement(results[1]["tokens"] + [results[1]["hit"]],
                                     results[2]["tokens"] + [results[2]["hit"]])
    for tp in (1, 2):
        report[f"tp{tp}"] = {k: v for k, v in results[tp].items() if k not in ("tokens", "hit")}
    moved = kv_transfer(path, device, prompts(4, long_len, vocab), tokens)
    report["kv_transfer_tp2_to_tp1"] = {"vs_tp2_local": agreement(results[2]["tokens"], moved["tokens"]),
                                        "bytes": moved["bytes"], "gb_per_s": moved["gb_per_s"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tp_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
