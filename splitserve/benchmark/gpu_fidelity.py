"""Engine outputs checked on one device, for the GPU check (gpu_check.py):

  fidelity  greedy generations of small random-weight checkpoints against transformers'
            generate on the same device and dtype: a Llama (GQA, Llama-3 rope), a Gemma 2
            (sliding window, attention and final soft-capping) and a Qwen3-MoE (the fused
            MoE kernel). The engine runs all prompts as one batch, transformers one at a time.
  graphs    the engine with CUDA-graph decode against the same engine without, many batch
            sizes (requests finishing one by one). On the CPU nothing can be captured, so
            the padded static-buffer step runs eagerly instead (capture=False).

float32 must give identical tokens and top-5 logprobs within FP32_TOLERANCE. bfloat16
rounds differently in every implementation, so greedy paths may part at a near-tie; the
rule is vLLM's (check_logprobs_close): up to the first differing token the outputs are
equal, and there each side's token is in the other's top 5. Exact-match counts are
reported as well.

    python -m splitserve.benchmark.gpu_fidelity {fidelity,graphs} --device cuda --out r.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

FP32_TOLERANCE = 1e-3  # top-5 logprob difference (GPU reductions reorder sums; the CPU tests use 1e-4)
TOP = 5
# name -> (family, write_checkpoint fields): small shapes, random weights, built once in the cache
CHECKPOINTS = {
    "llama": ("llama", dict(seed=11, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 1024})),
    "gemma2": ("gemma2", dict(seed=16, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              query_pre_attn_scalar=24, sliding_window=32, attn_logit_softcapping=5.0,
                              final_logit_softcapping=8.0, tie_word_embeddings=True, perturb_norms=True)),
    "qwen3_moe": ("qwen3_moe", dict(seed=19, hidden_size=128, intermediate_size=192, moe_intermediate_size=80,
                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=32, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1],
                                    perturb_norms=True)),
}


def checkpoint(name: str) -> Path:
    from splitserve.core.model_dir import cache_root
    from splitserve.engine.demo import write_checkpoint

    family, fields = CHECKPOINTS[name]
    out = cache_root() / f"gpu-check-{name}-v1"
    if not (out / "config.json").is_file():
        write_checkpoint(out, family, **fields)
    return out


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # ids 0-4 are special tokens
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def compare(tokens_a: list[int], tops_a: list[list[tuple[int, float]]], tokens_b: list[int],
            tops_b: list[list[tuple[int, float]]], exact: bool) -> dict:
    """One output against another: exact (tokens equal, top-5 logprobs within
    FP32_TOLERANCE) or vLLM's close rule (see the module docstring)."""
    same = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=False)) if a != b), min(len(tokens_a), len(tokens_b)))
    diffs = [abs(x - y) for step in range(same) for (_, x), (_, y) in zip(tops_a[step], tops_b[step], strict=True)
             if [t for t, _ in tops_a[step]] == [t for t, _ in tops_b[step]]]
    worst = max(diffs, default=0.0)
    if exact:
        ok = tokens_a == tokens_b and worst < FP32_TOLERANCE
    elif same == len(tokens_a) == len(tokens_b):
        ok = True
    else:
        ok = (tokens_a[same] in {t for t, _ in tops_b[same]}) and (tokens_b[same] in {t for t, _ in tops_a[same]})
    return {"ok": ok, "equal_prefix": same, "tokens": len(tokens_a), "max_top5_logprob_diff": worst}


def engine_outputs(llm, batch: list[list[int]], max_tokens: list[int]):
    from splitserve.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=TOP) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    seconds = time.perf_counter() - start
    return [(o.token_ids, [lp.top for lp in o.logprobs]) for o in outs], seconds


def hf_outputs(path: Path, batch: list[list[int]], new_tokens: int, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    outs = []
    for prompt in batch:
        tokens, logprobs = generate_with_logprobs(model, prompt, new_tokens)
        top = logprobs.topk(TOP)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
        outs.append((tokens, tops))
    return outs


def generate_with_logprobs(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Exactly `new_tokens` greedy tokens from transformers' generate (batch of one, on the
    model's device) and the log-softmax of the raw logits at each step ([new_tokens, vocab]).
    generate itself, not one forward pass: for longrope models it recomputes the cache when
    a sequence passes the original length. The CPU fidelity tests use it too."""
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=model.generation_config.eos_token_id[0], output_logits=True,
                             return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.stack([lg[0].float() for lg in out.logits]), dim=-1)
    return out.sequences[0, len(prompt_ids):].tolist(), logprobs


def fidelity(device: str, dtypes: list[str], names: list[str], lengths: list[int], new_tokens: int) -> dict:
    from splitserve.engine import LLM

    runs = []
    for name in names:
        path = checkpoint(name)
        for dtype in dtypes:
            llm = LLM(str(path), dtype=dtype, device=device, num_kv_blocks=256, max_num_seqs=32)
            batch = prompts(llm.engine.model_config.vocab_size, lengths)
            got, _ = engine_outputs(llm, batch, [new_tokens] * len(batch))
            want = hf_outputs(path, batch, new_tokens, dtype, device)
            rows = [{"prompt_tokens": len(p), **compare(g[0], g[1], w[0], w[1], exact=dtype == "float32")}
                    for p, g, w in zip(batch, got, want, strict=True)]
            runs.append({"model": name, "dtype": dtype, "ok": all(r["ok"] for r in rows),
                         "exact_outputs": sum(r["equal_prefix"] == r["tokens"] for r in rows),
                         "outputs": len(rows), "rows": rows})
            del llm
    return {"check": "engine vs transformers", "device": device, "ok": all(r["ok"] for r in runs), "runs": runs}


def graphs(device: str, dtypes: list[str], names: list[str], requests: int, max_tokens: int) -> dict:
    """Requests of staggered lengths: the decode batch shrinks one by one through every bucket."""
    from splitserve.engine import LLM

    capture = torch.device(device).type == "cuda"
    runs = []
    for name in names:
        path = checkpoint(name)
        for dtype in dtypes:
            kw = dict(dtype=dtype, device=device, num_kv_blocks=1024, max_num_seqs=max(requests, 1))
            eager = LLM(str(path), **kw, **({"cuda_graphs": False} if capture else {}))
            start = time.perf_counter()
            padded = LLM(str(path), **kw)
            if not capture:
                padded.engine.runner.enable_decode_graphs(capture=False)
            setup = time.perf_counter() - start
            batch = prompts(eager.engine.model_config.vocab_size,
                            [random.Random(i).randint(3, 200) for i in range(requests)], seed=7)
            lengths = [max(1, max_tokens * (i + 1) // requests) for i in range(requests)]
            want, eager_s = engine_outputs(eager, batch, lengths)
            got, graph_s = engine_outputs(padded, batch, lengths)
            rows = [compare(g[0], g[1], w[0], w[1], exact=dtype == "float32")
                    for g, w in zip(got, want, strict=True)]
            dg = padded.engine.runner.decode_graphs
            runs.append({"model": name, "dtype": dtype, "ok": all(r["ok"] for r in rows),
                         "identical_tokens": sum(r["equal_prefix"] == r["tokens"] for r in rows),
                         "outputs": len(rows), "max_top5_logprob_diff": max(r["max_top5_logprob_diff"] for r in rows),
                         "graph_steps": dg.steps, "buckets": dg.buckets, "captured": sorted(dg.graphs),
                         "setup_seconds": setup, "eager_seconds": eager_s, "graph_seconds": graph_s,
                         "output_tokens": sum(lengths)})
            del eager, padded
    mode = "CUDA graphs captured and replayed" if capture else "padded static-buffer step run eagerly (no capture)"
    return {"check": "CUDA-graph decode vs eager", "device": device, "mode": mode,
            "ok": all(r["ok"] and r["graph_steps"] > 0 for r in runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitserve.benchmark.gpu_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=("fidelity", "graphs"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--models", default=",".join(CHECKPOINTS))
    ap.add_argument("--lengths", default="5,30,47,90,300", help="fidelity: prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=32, help="fidelity: tokens per prompt")
    ap.add_argument("--requests", type=int, default=40, help="graphs: requests in the batch (max_num_seqs)")
    ap.add_argument("--max-tokens", type=int, default=48, help="graphs: the longest request's output")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dtypes, names = args.dtypes.split(","), args.models.split(",")
    if args.check == "fidelity":
        result = fidelity(args.device, dtypes, names, [int(n) for n in args.lengths.split(",")], args.new_tokens)
    else:
        result = graphs(args.device, dtypes, names, args.requests, args.max_tokens)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
