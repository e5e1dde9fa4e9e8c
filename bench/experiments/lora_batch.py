"""Multi-LoRA batching cost (issue 35): decode tok/s of one batch of 32 sequences with the
base model alone (an engine without --enable-lora), the base model on a LoRA engine (hooks
installed, no adapted token), and 1, 8 and 32 distinct rank-16 adapters on every attention
and MLP projection spread over the batch (4 sequences per adapter at 8, one each at 32).
Each measurement prefills the batch (not timed), then times its decode steps.

    python -m bench.experiments.lora_batch [--model smollm2|DIR] [--rank 16] [--steps 8] [--rounds 3] [--threads 1]
        [--device cuda --dtype bfloat16]   # on a GPU: the Triton kernel

SmolLM2 is ~/.cache/splitserve/smollm2-135m-instruct (bench/experiments/smollm2_checkpoint.py
writes it), float32 on the CPU by default. The adapters are random, written in PEFT's format (the
engine reads them as it reads PEFT's; tests/engine/test_lora_engine.py checks PEFT-written
ones against PeftModel). Results: bench/results/lora_batch.json. The configurations take
turns, round after round, in this process, so the machine's load drifts over all alike.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitserve.core.model_config import ModelConfig
from splitserve.core.model_dir import cache_root
from splitserve.engine import LLM, SamplingParams

IDS = itertools.count()
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "lora_batch.json"
BATCH, PROMPT = 32, 32
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(out: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT-format adapter (adapter_config.json + adapter_model.safetensors)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
             "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
             "up_proj": (cfg.hidden_size, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = sizes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in PROJECTIONS.values() for n in names]}))
    return out


def decode_tok_s(engine, prompts, names, steps: int) -> float:
    """Decode tok/s of the batch: every prompt prefilled first (not timed), then `steps`
    engine steps in which each of the sequences gets one token."""
    params = [SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, lora_name=n) for n in names]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{next(IDS)}-{i}", prompt, p)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # prefill (chunks) until every sequence has its first token
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    assert not engine.has_unfinished_requests()
    return len(prompts) * steps / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cuda: the Triton LoRA kernel (kernels/triton_lora.py) runs")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared, oversubscribed machine every parallel region "
                         "of a small op waits for a descheduled thread, which measures the machine, not the engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(cache_root() / "smollm2-135m-instruct") if args.model == "smollm2" else args.model
    cfg = ModelConfig.from_dir(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, cfg.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(BATCH)]
    common = dict(num_kv_blocks=BATCH * 4 + 8, max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT,
                  enable_prefix_caching=False, device=args.device, dtype=args.dtype)  # prefills afresh, not timed
    started = time.perf_counter()
    plain = LLM(model, **common).engine
    with tempfile.TemporaryDirectory() as tmp:
        lora = LLM(model, enable_lora=True, max_loras=BATCH, max_lora_rank=args.rank, **common).engine
        for i in range(BATCH):
            lora.loras.add(f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", cfg, args.rank, seed=i)))
    configs = {"base, no --enable-lora": (plain, [None] * BATCH), "base on a LoRA engine": (lora, [None] * BATCH)}
    for distinct in (1, 8, 32):
        configs[f"{distinct} distinct adapters"] = (lora, [f"a{i % distinct}" for i in range(BATCH)])
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # round-robin: the machine's load drifts over all alike
        for name, (engine, names) in configs.items():
            rates[name].append(decode_tok_s(engine, prompts, names, args.steps))
            print(name, round(rates[name][-1], 1), flush=True)
    base = statistics.median(rates["base, no --enable-lora"])
    result = {
        "model": Path(model).name, "dtype": args.dtype, "device": args.device, "batch": BATCH, "prompt_tokens": PROMPT,
        "decode_steps": args.steps, "rounds": args.rounds, "rank": args.rank, "targets": "q,k,v,o,gate,up,down",
        "torch_threads": torch.get_num_threads(), "load_avg_1min_at_end": os.getloadavg()[0],
        "note": "shared 2-core machine: other sessions' jobs ran at the same time" if args.device == "cpu" else "",
        "decode_tok_s": {k: {"median": round(statistics.median(v), 1), "runs": [round(r, 1) for r in v],
                             "relative_to_base": round(statistics.median(v) / base, 3)} for k, v in rates.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = RESULTS if args.device == "cpu" else RESULTS.with_name(f"lora_batch_{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
