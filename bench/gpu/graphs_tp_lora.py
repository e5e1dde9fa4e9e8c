"""CUDA graphs with LoRA adapters and under tensor parallelism (issue 50), ready for a lent
GPU, ~2 minutes. What the CPU tests cannot show is the capture itself: there the padded
static-buffer step runs eagerly (capture=False).
1. LoRA x graphs (one GPU): an engine with cuda_graphs=True and LoRA captures every bucket,
   the rows' adapter slots a column of the static input and the deltas gathered by slot in
   the graph (engine/lora/apply.py); base and three adapters mixed in every batch give the
   eager engine's greedy tokens (cuda_graphs=False) and transformers + PEFT's (float32, CPU).
2. TP x graphs (two GPUs; on one it is reported as not run): each rank captures its own
   graphs, NCCL all-reduces inside them; TP=2 with graphs, with the same adapters, gives
   the same tokens.
    python bench/gpu/graphs_tp_lora.py OUTDIR              # a GPU (two for part 2)
    python bench/gpu/graphs_tp_lora.py OUTDIR --device cpu # the same on the CPU, no capture (a dry run)
Writes OUTDIR/graphs_tp_lora.json; exits 1 when a comparison that ran disagrees.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers: the PEFT adapters and references of the test suite

from splitserve.engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from splitserve.engine.demo import build_checkpoint_once, write_checkpoint  # noqa: E402
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2)
NEW_TOKENS = 16


def requests(adapters: dict[str, Path], n: int = 12):
    """n prompts over base and every adapter, cycling, each its own output length (batches shrink)."""
    names = [*ADAPTERS, None]
    prompts = [[(i * 7919 + j * 104729) % 990 + 5 for j in range(9 + 5 * (i % 4))] for i in range(n)]
    loras = [None if names[i % 4] is None else LoRARequest(names[i % 4], i + 1, str(adapters[names[i % 4]]))
             for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS - (i % 5), ignore_eos=True) for i in range(n)]
    return prompts, loras, params


def generate(path: str, device: str, graphs: bool, reqs, tp: int = 1) -> tuple[list[list[int]], dict]:
    prompts, loras, params = reqs
    kw = dict(device=device, dtype="float32", num_kv_blocks=256, max_num_seqs=8, enable_lora=True, max_loras=4,
              max_lora_rank=16, tensor_parallel_size=tp)
    on_gpu = device == "cuda"
    with LLM(path, cuda_graphs=graphs if on_gpu else None, **kw) as llm:
        runner = llm.engine.runner
        if graphs and not on_gpu:  # the dry run: the padded step eagerly (no capture on the CPU)
            runner.enable_decode_graphs(capture=False)
        tokens = [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        dg = runner.decode_graphs
        seen = {"graph_steps": dg.steps if dg else 0, "captured_buckets": sorted(dg.graphs) if dg else []}
    return tokens, seen


def agree(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    return {"equal": a == b, "equal_token_share": round(same / max(1, sum(map(len, a))), 4)}


def main() -> None:
    out_dir, device = Path(sys.argv[1]), "cpu" if "--device" in sys.argv and "cpu" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("graphs_tp_lora: no CUDA device (use --device cpu for the dry run)")
    root = Path(tempfile.gettempdir()) / "splitserve-graphs-tp-lora"
    path = str(build_checkpoint_once(root / "base", lambda d: write_checkpoint(d, "llama", seed=5, **SHAPE)))
    adapters = {name: make_adapter(Path(path), root / name, **spec) if not (root / name).exists() else root / name
                for name, spec in ADAPTERS.items()}
    reqs = requests(adapters)
    report: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (no capture)",
                    "model": SHAPE}
    eager, _ = generate(path, device, False, reqs)
    graphed, seen = generate(path, device, True, reqs)
    peft = [peft_greedy(Path(path), lora and adapters[lora.lora_name], p, sp.max_tokens)
            for p, lora, sp in zip(*reqs, strict=True)]
    report["lora_graphs"] = {**seen, "vs_eager": agree(eager, graphed), "vs_peft": agree(peft, graphed)}
    ok = report["lora_graphs"]["vs_eager"]["equal"] and report["lora_graphs"]["vs_peft"]["equal"]
    ok = ok and seen["graph_steps"] > 0 and (device == "cpu" or bool(seen["captured_buckets"]))
    if device == "cpu" or torch.cuda.device_count() >= 2:
        tp_graphed, tp_seen = generate(path, device, True, reqs, tp=2)
        report["tp2_lora_graphs"] = {**tp_seen, "vs_tp1_graphs": agree(graphed, tp_graphed),
                                     "vs_peft": agree(peft, tp_graphed)}
        ok = ok and report["tp2_lora_graphs"]["vs_peft"]["equal"] and tp_seen["graph_steps"] > 0
    else:
        report["tp2_lora_graphs"] = f"not run: {torch.cuda.device_count()} GPU (tensor parallelism needs 2)"
    report["ok"] = ok
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "graphs_tp_lora.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
