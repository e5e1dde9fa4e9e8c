"""Where a GPU decode step's time goes (issue 20 follow-up; run on one GPU, ~2 min):
1. the engine (Llama-3.2-1B shape, bf16, batch 32, the engine-stage workload) run three times in
   one process: Triton compilations and CUDA-graph steps per run, then a cProfile of the third;
2. the kernel bench's Llama-3-8B-shape decode step at batch 1: GPU time per kernel (torch profiler,
   eager) beside the CUDA-graph step time.
    python bench/gpu/diagnose.py OUTDIR
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


def kernel_part(report: dict) -> None:
    from splitserve.benchmark.kernels_model import (
        LLAMA3_8B,
        BenchModel,
        blocks_needed,
        decode_inputs,
    )
    from splitserve.kernels import ops

    ops.set_backend("triton")
    dev = torch.device("cuda")
    with torch.no_grad():
        model = BenchModel(LLAMA3_8B, torch.bfloat16, dev, blocks_needed(LLAMA3_8B, 1, 1024), 1100)
        step = decode_inputs(LLAMA3_8B, 1, 1024, dev)
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
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model.forward(step)
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us > 0:
                rows.append({"name": e.key[:90], "calls_per_step": e.count / 5, "us_per_step": us / 5})
        rows.sort(key=lambda r: -r["us_per_step"])
        report["kernel_rows"] = rows[:30]
        report["kernel_sum_ms_per_step"] = sum(r["us_per_step"] for r in rows) / 1e3
        print(json.dumps(rows[:30], indent=1), flush=True)


report = {"device": torch.cuda.get_device_name(0)}
for part in (engine_part, kernel_part):
    try:
        part(report)
    except Exception:  # noqa: BLE001
        import traceback

        report[part.__name__ + "_error"] = traceback.format_exc()
        print(report[part.__name__ + "_error"], flush=True)
    (OUT / "diagnose.json").write_text(json.dumps(report, indent=1))
