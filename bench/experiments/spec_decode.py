"""Speculative decoding (n-gram prompt lookup, issue 34): output tok/s and inter-token latency
with and without it, side by side in one process, on a copy-heavy workload (edit this code,
repeat this JSON) and a plain chat workload, at concurrency 1 and 8 (32 with --concurrency).

Two in-process engines on the same checkpoint, one with --speculative-config and one without;
each (workload, concurrency) cell runs the engines alternately, `--rounds` times each, and
reports the medians, so a shared machine's noise hits both alike. Greedy decoding: the two
engines must produce the same tokens (checked and reported). ITL here is per request
(last token time - first token time) / (tokens - 1), averaged over requests: speculation
emits several tokens in one step, so this is the time per output token a client sees.

    python -m bench.experiments.spec_decode --model ~/.cache/splitserve/smollm2-135m-instruct \\
        --out bench/results/spec_decode_smollm2.json

`--draft-layers N` measures the draft_model method instead: the draft is the target's first N
layers with its final norm and LM head (a layer-truncated copy, written once next to the
checkpoint; no smaller model with SmolLM2's vocabulary can be obtained here), k from --k.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from splitserve.engine.llm import LLM

CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    totals = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            totals.append(running / window)
    return totals
'''
JSON_DOC = json.dumps({"order": 1182, "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
                       "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-02", "qty": 1, "price": 24.0},
                                 {"sku": "C-33", "qty": 5, "price": 1.25}],
                       "shipping": {"method": "express", "address": "12 Analytical Way, London"}}, indent=2)
COPY_HEAVY = [
    f"Repeat this JSON exactly, then nothing else:\n\n{JSON_DOC}",
    f"Add type hints to this function and show the whole function:\n\n{CODE}",
    f"Change the shipping method to \"standard\" in this JSON and show the whole JSON:\n\n{JSON_DOC}",
]
CHAT = [
    "Tell me about the history of the Roman Empire.",
    "What are three good habits for staying healthy?",
    "Write a short story about a lighthouse keeper.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def layer_truncated_draft(model: str, layers: int) -> str:
    """The target's first `layers` decoder layers, its embeddings, final norm and LM head, as a
    checkpoint directory beside the target's (made once)."""
    out = Path(model).with_name(f"{Path(model).name}-first{layers}layers")
    if (out / "model.safetensors").is_file():
        return str(out)
    out.mkdir(exist_ok=True)
    for f in Path(model).iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((Path(model) / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers {layers}: the target has only {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(Path(model) / "model.safetensors"))
    kept = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once through the engine's step loop; per-request token times."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]  # (unique across calls)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    wall = time.perf_counter() - start
    itl = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    return {"seconds": wall, "itl_ms": [1e3 * x for x in itl],
            "tokens": [tokens[r] for r in ids]}


def cell(base: LLM, spec: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int, rounds: int) -> dict:
    """Every prompt (cycled up to `concurrency`) in groups of `concurrency` at once; the two
    engines alternate group by group, so both see the same machine."""
    batch = [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]
    groups = [batch[i : i + concurrency] for i in range(0, len(batch), concurrency)]
    stats = spec.engine.speculator.stats
    drafted, accepted, drafts = stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts
    rates: dict[str, list[float]] = {"base": [], "spec": []}  # output tok/s of each round
    itls: dict[str, list[float]] = {"base": [], "spec": []}  # mean ITL of each round
    equal, tokens = True, 0
    for _ in range(rounds):
        seconds = {"base": 0.0, "spec": 0.0}
        itl: dict[str, list[float]] = {"base": [], "spec": []}
        round_tokens = 0
        for group in groups:
            runs = {name: run_batch(llm, group, max_tokens) for name, llm in (("base", base), ("spec", spec))}
            equal &= runs["base"]["tokens"] == runs["spec"]["tokens"]
            round_tokens += sum(len(t) for t in runs["spec"]["tokens"])
            for name, run in runs.items():
                seconds[name] += run["seconds"]
                itl[name] += run["itl_ms"]
        tokens += round_tokens
        for name in rates:
            rates[name].append(round_tokens / seconds[name])
            itls[name].append(statistics.mean(itl[name]))
    drafted, accepted, drafts = (stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted,
                                 stats.num_drafts - drafts)
    med = {name: (statistics.median(rates[name]), statistics.median(itls[name])) for name in ("base", "spec")}
    return {"base_tok_s": round(med["base"][0], 1), "spec_tok_s": round(med["spec"][0], 1),
            "speedup": round(med["spec"][0] / med["base"][0], 2),
            "base_itl_ms": round(med["base"][1], 2), "spec_itl_ms": round(med["spec"][1], 2),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else 1.0,
            "requests": len(batch) * rounds, "output_tokens": tokens, "tokens_equal": equal}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--k", type=int, default=NGRAM["num_speculative_tokens"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--workloads", default="copy_heavy,chat")
    ap.add_argument("--disable-by-batch-size", type=int, help="the config's disable_by_batch_size")
    ap.add_argument("--draft-layers", type=int, help="method draft_model: the target's first N layers as the draft")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_demo_checkpoint())
    config = {**NGRAM, "num_speculative_tokens": args.k}
    if args.draft_layers:
        config = {"method": "draft_model", "model": layer_truncated_draft(model, args.draft_layers),
                  "num_speculative_tokens": args.k}
    if args.disable_by_batch_size:
        config["disable_by_batch_size"] = args.disable_by_batch_size
    base = LLM(model, num_kv_blocks=1024, enable_prefix_caching=False)
    spec = LLM(model, num_kv_blocks=1024, enable_prefix_caching=False, speculative_config=config)
    tok = base.tokenizer
    workloads = {"copy_heavy": [tok.encode_chat([{"role": "user", "content": p}]) for p in COPY_HEAVY],
                 "chat": [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT]}
    run_batch(base, workloads["chat"][:1], 4)  # warm both (first-call costs)
    run_batch(spec, workloads["chat"][:1], 4)
    results = {"model": Path(model).name, "speculative_config": config, "max_tokens": args.max_tokens,
               "rounds": args.rounds, "torch_threads": args.threads, "cells": {}}
    started = time.perf_counter()
    for name, prompts in ((w, workloads[w]) for w in args.workloads.split(",")):
        for c in (int(x) for x in args.concurrency.split(",")):
            results["cells"][f"{name}@{c}"] = row = cell(base, spec, prompts, c, args.max_tokens, args.rounds)
            print(f"{name:10s} c={c:<3d} {row}", flush=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
