"""The stages of `splitserve bench gpu-check` (gpu_check.py says what each runs and how long
it takes). Each runs its work in a child process with a time limit, so a crash, a hang or
a Triton mode fixed at import cannot spoil the next stage, and returns
{"ok", "reason", "seconds", "command", ...numbers}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
ENGINE_MODEL = "splitserve-gpu-check-llama-1b-shape-random-v1"
# Llama-3.2-1B's shape (random bfloat16 weights; the demo tokenizer's 1024-token vocabulary)
ENGINE_MODEL_FIELDS = dict(seed=20, dtype="bfloat16", hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
# what a dry run cannot show, per stage
GPU_PART = {
    "kernels": "the compiled kernels were not run on a GPU",
    "fidelity": "the engine was not compared with transformers on CUDA",
    "graphs": "no CUDA graph was captured or replayed",
    "mbu_mfu": "no MBU or MFU was measured (the toy CPU run's figures mean nothing)",
    "serve": "splitserve serve did not run on CUDA",
    "engine": "no GPU throughput was measured",
    "step_overhead": "no device time was measured (the host's part alone, with no forward pass)",
    "features": "speculative decoding, LoRA, KV offload and --async-scheduling did not run on CUDA",
}


@dataclass
class Context:
    dry_run: bool
    workdir: Path
    engine_model: str | None = None
    serve_model: str | None = None
    stage_limit: float | None = None  # caps every stage's time limit (a short GPU lease)


def run(ctx: Context, name: str, cmd: list[str], timeout: float, interpret: bool | None = None) -> dict:
    """Run `cmd` (its own process group, killed whole at the time limit); its output goes
    to workdir/<name>.log. `interpret`: set (True) or remove (False) TRITON_INTERPRET."""
    env = dict(os.environ)
    if interpret is not None:
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
    log = ctx.workdir / f"{name}.log"
    timeout = min(timeout, ctx.stage_limit or timeout)
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    tail = log.read_text(errors="replace")[-2500:]
    return {"exit_code": code, "seconds": round(time.monotonic() - start, 1), "command": " ".join(cmd[2:]),
            "timed_out": code is None, "log_tail": tail if code != 0 else ""}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def kernels(ctx: Context) -> dict:
    report = ctx.workdir / "kernels_junit.xml"
    report.unlink(missing_ok=True)
    if ctx.dry_run:  # the interpreter is slow: a subset, float32 plus the window/soft-cap/sink cases
        targets = ["tests/kernels/test_decode_attention.py", "tests/kernels/test_kv_movement.py",
                   "tests/kernels/test_norm_rope.py", "tests/kernels/test_window_softcap.py",
                   "tests/kernels/test_attention_sinks.py", "-k", "float32 or window or softcap or sinks"]
    else:
        targets = ["tests/kernels"]
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *targets]
    r = run(ctx, "kernels", cmd, 300 if ctx.dry_run else 900, interpret=ctx.dry_run)
    if not report.exists():
        return {"ok": False, "reason": "pytest wrote no report", **r}
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ok = r["exit_code"] == 0 and counts["tests"] > 0 and not counts["failures"] and not counts["errors"]
    mode = "Triton interpreter on the CPU, a subset" if ctx.dry_run else "compiled Triton kernels on the GPU"
    return {"ok": ok, "reason": f"{mode}: {counts['tests']} tests, {counts['failures']} failed, "
                                f"{counts['errors']} errors, {counts['skipped']} skipped", **counts, **r}


def _engine_check(ctx: Context, check: str, extra: list[str]) -> dict:
    out = ctx.workdir / f"{check}.json"
    out.unlink(missing_ok=True)
    device = "cpu" if ctx.dry_run else "cuda"
    cmd = [PY, "-m", "splitserve.benchmark.gpu_fidelity", check, "--device", device, "--out", str(out), *extra]
    r = run(ctx, check, cmd, 300 if ctx.dry_run else 600)
    result = _load(out)
    if result is None:
        return {"ok": False, "reason": f"{check} wrote no result", **r}
    keys = ("model", "dtype", "ok", "exact_outputs", "identical_tokens", "outputs", "max_top5_logprob_diff",
            "graph_steps", "captured", "setup_seconds", "eager_seconds", "graph_seconds")
    runs = [{k: run_[k] for k in keys if k in run_} for run_ in result["runs"]]
    bad = [f"{x['model']} {x['dtype']}" for x in runs if not x["ok"]]
    reason = result.get("mode", result["check"]) + (f": failed for {', '.join(bad)}" if bad else
                                                    f": {len(runs)} model/dtype runs agree")
    return {"ok": result["ok"] and r["exit_code"] == 0, "reason": reason, "runs": runs, **r}


def fidelity(ctx: Context) -> dict:
    return _engine_check(ctx, "fidelity", ["--lengths", "5,47", "--new-tokens", "8"] if ctx.dry_run else [])


def graphs(ctx: Context) -> dict:
    small = ["--requests", "12", "--max-tokens", "16", "--models", "llama,gemma2"]
    return _engine_check(ctx, "graphs", small if ctx.dry_run else [])


def mbu_mfu(ctx: Context) -> dict:
    out = ctx.workdir / "bench_kernels.json"
    out.unlink(missing_ok=True)
    sizes = ["--batch-sizes", "1,2", "--hf-new-tokens", "6"] if ctx.dry_run else \
        ["--batch-sizes", "1,8,32", "--prefill-tokens", "2048"]
    r = run(ctx, "mbu_mfu", [PY, "-m", "splitserve.cli", "bench", "kernels", *sizes, "--out", str(out)],
            300 if ctx.dry_run else 900, interpret=ctx.dry_run)
    result = _load(out)
    if result is None:
        return {"ok": False, "reason": "splitserve bench kernels wrote no result", **r}
    steps = [{k: row.get(k) for k in ("batch", "mode", "mbu", "mbu_datasheet", "seconds", "error")}
             for row in result["decode_step"]]
    # against the datasheet where the device is known (issue 37), else against the measured peaks
    sheet = result.get("datasheet")
    key, against = ("mbu_datasheet", f"{sheet['label']} datasheet") if sheet else ("mbu", "measured peaks")
    batch1 = [s[key] for s in steps if s["batch"] == 1 and s.get(key) is not None]
    mfu = result["prefill"]["mfu_datasheet" if sheet else "mfu"]
    hf = result.get("transformers", {})
    figures = {"decode_step": steps, "prefill": result["prefill"], "peak": result["peak"], "datasheet": sheet,
               "transformers_decode_mbu": [{"batch": d["batch"], "mbu": d["mbu"]} for d in hf.get("decode", [])],
               "transformers_prefill_mfu": hf.get("prefill", {}).get("mfu")}
    measured = not ctx.dry_run
    targets = [_target(f"decode MBU at batch 1 (best of eager and CUDA graph), against {against}", 0.80,
                       max(batch1, default=None), measured),
               _target(f"prefill MFU at 2048 tokens, against {against}", 0.60, mfu, measured)]
    return {"ok": r["exit_code"] == 0, "reason": result["note"], "figures": figures, "targets": targets, **r}


def _target(name: str, goal: float, value: float | None, measured: bool) -> dict:
    if not measured or value is None:
        return {"name": name, "target": f">= {goal}", "value": None, "met": None}
    return {"name": name, "target": f">= {goal}", "value": round(value, 4), "met": value >= goal}


def serve(ctx: Context) -> dict:
    from splitserve.benchmark.gpu_check_serve import run_backend

    if ctx.dry_run:
        size = dict(device="cpu", dtype="float32", prompts=8, input_len=128, output_len=16, start_timeout=180)
    else:
        size = dict(device="cuda", dtype="bfloat16", prompts=64, input_len=512, output_len=64,
                    start_timeout=min(600, ctx.stage_limit or 600))
    from splitserve.kvtransfer.mooncake_endpoint import gpu_memory_problem

    start = time.monotonic()
    rows = []
    for backend in ("grpc", "mooncake"):
        problem = gpu_memory_problem(size["device"]) if backend == "mooncake" else None
        if problem:  # serve would refuse to start (it did run, and fail every transfer, before it refused)
            rows.append({"backend": backend, "ok": None, "reason": f"not run: {problem}"})
        else:
            rows.append(run_backend(backend, model=ctx.serve_model, workdir=ctx.workdir, **size))
    reason = "; ".join(f"{r['backend']}: {r['reason']}" for r in rows)
    ok = rows[0]["ok"] and all(r["ok"] is not False for r in rows)  # gRPC must pass; Mooncake where it can run
    # A trial, not part of the verdict: the engine in a process of its own on CUDA (its KV pool crossing
    # to the worker as CUDA IPC memory) is not the CUDA default; does it run, and does it help (issue 37)?
    # (On the CPU the engine runs in its own process already: nothing to try.)
    trials = [] if ctx.dry_run else [run_backend("grpc", model=ctx.serve_model, workdir=ctx.workdir,
                                                 extra=("--engine-loop", "process"), name="grpc_engine_process",
                                                 **size)]
    reason += "".join(f"; trial, the engine in its own process: {t['reason']}" for t in trials)
    return {"ok": ok, "reason": reason, "backends": rows, "trials": trials,
            "seconds": round(time.monotonic() - start, 1)}


def engine_checkpoint() -> str:
    from splitserve.core.model_dir import cache_root
    from splitserve.engine.demo import write_checkpoint

    target = cache_root() / ENGINE_MODEL
    if not (target / "config.json").is_file():
        write_checkpoint(target, "llama", **ENGINE_MODEL_FIELDS)
    return str(target)


def engine(ctx: Context) -> dict:
    out = ctx.workdir / "bench_engine.json"
    out.unlink(missing_ok=True)
    if ctx.dry_run:  # the demo model; batch 4 stands in for 32
        args = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4", "--hf-batch-sizes", "4",
                "--threads", "1", "--requests", "8", "--async-scheduling"]
        args += ["--model", ctx.engine_model] if ctx.engine_model else []
    else:
        args = ["--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "32", "--hf-batch-sizes", "32",
                "--threads", "4", "--requests", "64", "--kv-cache-gib", "8", "--async-scheduling",
                "--model", ctx.engine_model or engine_checkpoint()]
    r = run(ctx, "engine", [PY, "-m", "splitserve.cli", "bench", "engine", *args, "--out", str(out)],
            300 if ctx.dry_run else 900)
    result = _load(out)
    if result is None:
        return {"ok": False, "reason": "splitserve bench engine wrote no result", **r}
    ratio = result["ratio_vs_best_transformers"]
    figures = {"model": Path(result["model"]).name, "dtype": result["dtype"],
               "engine_output_tok_s": result["best_engine"]["output_tokens_per_s"],
               "transformers_output_tok_s": result["best_transformers"]["output_tokens_per_s"],
               "transformers_batch_size": result["best_transformers"]["batch_size"], "ratio": ratio,
               "async_over_sync": result.get("async_over_sync")}
    target = _target("engine / transformers output tok/s at batch 32", 5.0, ratio, not ctx.dry_run)
    overlap = result.get("async_over_sync")
    reason = f"ratio {ratio:.2f}x" + (f"; --async-scheduling {overlap:.2f}x the synchronous engine" if overlap else "")
    return {"ok": r["exit_code"] == 0, "reason": reason, "figures": figures,
            "targets": [target], **r}


def step_overhead(ctx: Context) -> dict:
    """Host time of a decode step against the device's (`splitserve bench step-overhead`)."""
    out = ctx.workdir / "bench_step_overhead.json"
    out.unlink(missing_ok=True)
    if ctx.dry_run:  # the demo model, no forward pass: the host's part alone
        args = ["--device", "cpu", "--null-model", "--batch-sizes", "32,128", "--steps", "20", "--async-scheduling"]
    else:  # each batch size synchronous, then overlapped (--async-scheduling, engine/overlap.py)
        args = ["--device", "cuda", "--batch-sizes", "32,128,256", "--steps", "100", "--async-scheduling",
                "--model", ctx.engine_model or engine_checkpoint()]
    r = run(ctx, "step_overhead", [PY, "-m", "splitserve.cli", "bench", "step-overhead", *args, "--out", str(out)],
            300)
    result = _load(out)
    if result is None:
        return {"ok": False, "reason": "splitserve bench step-overhead wrote no result", **r}
    rows = result["rows"]
    at32 = next((row for row in rows if row["batch"] == 32 and not row.get("async_scheduling")), None)
    target = {"name": "host time per decode step below the device's, batch 32", "target": "host_ms < device_ms",
              "value": None, "met": None}
    if at32 is not None and "device_ms" in at32:
        target.update(value=f"{at32['host_ms']:.3f} ms host, {at32['device_ms']:.3f} ms device",
                      met=at32["host_below_device"])
    reason = "; ".join(f"batch {row['batch']}{' overlapped' if row.get('async_scheduling') else ''}: "
                       f"wall {row['wall_ms']:.3f} ms, host {row['host_ms']:.3f} ms"
                       + (f", device {row['device_ms']:.3f} ms" if "device_ms" in row else "") for row in rows)
    return {"ok": r["exit_code"] == 0, "reason": reason, "figures": result, "targets": [target], **r}


def features(ctx: Context) -> dict:
    """Speculative decoding, LoRA and KV offload on the device, each a sub-check
    (gpu_check_features.py), on the demo model unless --serve-model names one."""
    from splitserve.benchmark.gpu_check_features import CHECKS

    out = ctx.workdir / "features.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "-m", "splitserve.benchmark.gpu_check_features", "--device", "cpu" if ctx.dry_run else "cuda",
           "--out", str(out), "--workdir", str(ctx.workdir), *(["--model", ctx.serve_model] if ctx.serve_model else [])]
    r = run(ctx, "features", cmd, 300)
    result = _load(out)
    ok, reason = features_verdict(result, r, CHECKS)
    return {"ok": ok, "reason": reason, "checks": (result or {}).get("checks", []), **r}


def features_verdict(result: dict | None, run: dict, expected: tuple[str, ...]) -> tuple[bool, str]:
    """The features stage's (ok, reason) from its sub-checks' rows and the child process's exit:
    a failed or missing sub-check fails it, a not-run one is named as such (never as passed),
    and at least one must pass."""
    rows = {row["name"]: row for row in (result or {}).get("checks", [])}
    ok, parts = True, []
    ended = "timed out" if run.get("timed_out") else f"exited {run.get('exit_code')}"
    for name in expected:
        row = rows.get(name)
        if row is None:
            ok = False
            parts.append(f"{name}: no result (the check process {ended} before it)")
        elif row.get("ok") is True:
            parts.append(f"{name}: {row.get('reason', '')}")
        elif row.get("ok") is None and str(row.get("reason", "")).startswith("not run"):
            parts.append(f"{name}: {row['reason']}")
        else:
            ok = False
            parts.append(f"{name}: FAILED: {row.get('reason', '')}")
    if not any(rows.get(name, {}).get("ok") is True for name in expected):
        ok = False
        parts.append("no sub-check passed")
    if run.get("exit_code") != 0 and ok:
        ok = False
        parts.append(f"the check process {ended}")
    return ok, "; ".join(parts)


STAGES = {"kernels": kernels, "fidelity": fidelity, "graphs": graphs, "mbu_mfu": mbu_mfu,
          "step_overhead": step_overhead, "serve": serve, "features": features, "engine": engine}
