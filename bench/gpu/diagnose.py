"""Where a GPU step's time goes (issue 20 follow-up; run on one GPU, ~2 min in all):
1. engine: the engine (Llama-3.2-1B shape, bf16, batch 32, the engine-stage workload) run three
   times in one process: Triton compilations and CUDA-graph steps per run, then a cProfile of the third;
2. kernel: the kernel bench's Llama-3-8B-shape decode step at batch 1: GPU time per kernel (torch
   profiler, eager) beside the CUDA-graph step time;
3. prefill: its 2,048-token prefill step (issue 37's MFU): GPU time per kernel, summed into
   matmuls, attention and the rest, with the step's MFU against the datasheet.
    python bench/gpu/diagnose.py OUTDIR [--parts engine,kernel,prefill]
"""
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
CACHE = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = CACHE  # fresh: one new directory per compiled kernel variant

import torch  # noqa: E402


def compiled() -> int:
    return sum(1 for p in Path(CACHE).iterdir() if p.is_dir())


def engine_part(report: dict) -> None:
    from splitserve.benchmark.engine_vs_transformers import make_workload
    from splitserve.benchmark.gpu_check_stages import engine_checkpoint
    from splitserve.engine import LLM, SamplingParams

    ck = engine_checkpoint()
    t = time.perf_counter()
    llm = LLM(ck, dtype="bfloat16", device="cuda", max_num_seqs=32, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=8 << 30)
    report["engine_init_s"], report["compiled_after_init"] = time.perf_counter() - t, compiled()
    prompts, outputs = make_workload(64, llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2])
    report["compiled_after_warmup"] = compiled()
    steps = {"n": 0}
    original = llm.engine.step

    def counted():
        steps["n"] += 1
        return original()

    llm.engine.step = counted
    dg = llm.engine.runner.decode_graphs
    for run in range(3):
        steps["n"], g0, c0 = 0, dg.steps if dg else 0, compiled()
        prof = cProfile.Profile() if run == 2 else None
        torch.cuda.synchronize()
        t, cpu = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        report[f"run{run}"] = {"wall_s": wall, "cpu_s": cpu, "tok_s": sum(outputs) / wall, "steps": steps["n"],
                               "graph_steps": (dg.steps if dg else 0) - g0, "new_compiles": compiled() - c0,
                               "profiled": bool(prof)}
        print(run, report[f"run{run}"], flush=True)
        if prof:
            for key in ("cumulative", "tottime"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
                (OUT / f"engine_profile_{key}.txt").write_text(s.getvalue())


def bench_step(kind: str, tokens: int):
    """The kernel bench's Llama-3-8B model (bf16, Triton kernels) and one step's inputs: a
    decode at batch 1 over `tokens` of context, or a prefill of `tokens`."""
    from splitserve.benchmark.kernels_model import (
        LLAMA3_8B,
        BenchModel,
        blocks_needed,
        decode_inputs,
        prefill_inputs,
    )
    from splitserve.kernels import ops

    ops.set_backend("triton")
    dev = torch.device("cuda")
    model = BenchModel(LLAMA3_8B, torch.bfloat16, dev, blocks_needed(LLAMA3_8B, 1, tokens), tokens + 76)
    step = decode_inputs(LLAMA3_8B, 1, tokens, dev) if kind == "decode" else prefill_inputs(LLAMA3_8B, tokens, dev)
    return model, step


def kernel_times(model, step, steps: int) -> list[dict]:
    """GPU time per kernel of `steps` eager steps (torch profiler), most first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.forward(step)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"name": e.key[:90], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def kernel_part(report: dict) -> None:
    with torch.no_grad():
        model, step = bench_step("decode", 1024)
        for _ in range(3):
            model.forward(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward(step)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        report["graph_step_ms"] = (time.perf_counter() - t) / 50 * 1e3
        rows = kernel_times(model, step, 5)
    report["kernel_rows"] = rows[:30]
    report["kernel_sum_ms_per_step"] = sum(r["us_per_step"] for r in rows) / 1e3
    print(json.dumps(rows[:30], indent=1), flush=True)


def kind_of(name: str) -> str:
    low = name.lower()
    if "_prefill_kernel" in low or "attention" in low:
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "_gemv_kernel")):
        return "matmul"
    return "other"


def prefill_part(report: dict, tokens: int = 2048) -> None:
    from splitserve.benchmark.datasheet import datasheet_peaks
    from splitserve.benchmark.kernels_model import LLAMA3_8B

    with torch.no_grad():
        model, step = bench_step("prefill", tokens)
        for _ in range(3):
            model.forward(step)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            model.forward(step)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t) / 10
        rows = kernel_times(model, step, 3)
    by_kind: dict[str, float] = {}
    for r in rows:
        by_kind[kind_of(r["name"])] = by_kind.get(kind_of(r["name"]), 0.0) + r["us_per_step"] / 1e3
    sheet = datasheet_peaks(torch.cuda.get_device_name(0))
    flops = LLAMA3_8B.prefill_flops(tokens)
    report["prefill"] = {"tokens": tokens, "step_ms": seconds * 1e3, "ms_by_kind": by_kind,
                         "kernel_rows": rows[:30], "tflops": flops / seconds / 1e12,
                         "mfu_datasheet": (flops / seconds / sheet["bf16_flops_per_s"]) if sheet else None}
    print(json.dumps(report["prefill"], indent=1)[:3000], flush=True)


PARTS = {"engine": engine_part, "kernel": kernel_part, "prefill": prefill_part}
chosen = sys.argv[sys.argv.index("--parts") + 1].split(",") if "--parts" in sys.argv else list(PARTS)
report = {"device": torch.cuda.get_device_name(0)}
for part in (PARTS[name] for name in chosen):
    try:
        part(report)
    except Exception:  # noqa: BLE001
        import traceback

        report[part.__name__ + "_error"] = traceback.format_exc()
        print(report[part.__name__ + "_error"], flush=True)
    (OUT / "diagnose.json").write_text(json.dumps(report, indent=1))
