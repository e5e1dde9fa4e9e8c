"""`splitserve bench gpu-check` (bench/gpu/run_all.sh): the whole stack on one GPU in one
go (issue 20), each stage recorded in one JSON, bench/results/gpu_check_<device>.json.

Stage      what runs (each in its own process, with a time limit)          on one H100
kernels    pytest tests/kernels compiled (no TRITON_INTERPRET), fp32/fp16/bf16  ~5 min
           against the torch references
fidelity   engine vs transformers' generate on the GPU, fp32 and bf16:       ~2 min
           Llama, Gemma 2, Qwen3-MoE (gpu_fidelity.py fidelity)
graphs     CUDA-graph decode vs eager, tokens and top-5 logprobs, every      ~2 min
           bucket (gpu_fidelity.py graphs)
mbu_mfu    splitserve bench kernels: Llama-3-8B shape bf16, decode MBU at    ~8 min
           batch 1/8/32, prefill MFU at 2048 tokens (against the measured
           and the datasheet peaks), and transformers
step_overhead  splitserve bench step-overhead: host time of a decode step  ~1 min
           against the device's (CUDA events), batch 32/128/256, same model
serve      splitserve serve --device cuda, 1 prefill + 1 decode worker, a    ~6 min
           64-request splitserve bench load, grpc then mooncake (tcp)
features   n-gram speculative decoding and a LoRA adapter through            ~2 min
           splitserve serve on CUDA, greedy outputs against the engine
           without speculation / PeftModel; KV offload to host and back
           (demo model; gpu_check_features.py)
engine     splitserve bench engine at batch 32 vs transformers generate at   ~7 min
           batch 32, Llama-3.2-1B shape bf16 random weights
About 32 minutes in all; the limits add up to 49 so one hang cannot eat the session.

--dry-run (any machine, CPU) runs what it can at tiny sizes: a kernel subset under
TRITON_INTERPRET=1, fidelity on the CPU, the padded CUDA-graph step eagerly, serve on
the CPU with the demo model, the kernel bench's toy shape, engine vs transformers with
the demo model, the decode step's host time with no forward pass, the features with the
demo model on the CPU. A stage whose CPU run passes is still recorded as "skipped: no CUDA
device", never as passed; one whose CPU run fails is "failed".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

from splitserve.benchmark import gpu_check_stages as stages

TARGETS = {"decode MBU at batch 1": ">= 0.80", "prefill MFU at 2048 tokens": ">= 0.60",
           "engine / transformers output tok/s at batch 32": ">= 5.0"}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def versions() -> dict:
    import transformers
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda}


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_stage(name: str, ctx: stages.Context) -> dict:
    started = now()
    try:
        record = stages.STAGES[name](ctx)
    except Exception as exc:  # noqa: BLE001 - one broken stage must not lose the others' results
        record = {"ok": False, "reason": f"the stage itself raised {exc!r}"}
    ok = record.pop("ok")
    if ctx.dry_run:  # a CPU run shows the script works; it is no GPU result
        status = "skipped" if ok else "failed"
        reason = f"no CUDA device: {stages.GPU_PART[name]}; CPU dry run {'passed' if ok else 'FAILED'}: " + \
            record.pop("reason", "")
    else:
        status, reason = ("passed" if ok else "failed"), record.pop("reason", "")
    return {"stage": name, "status": status, "reason": reason, "started": started, "finished": now(), **record}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes; CUDA-only parts are skipped")
    ap.add_argument("--stages", default=",".join(stages.STAGES), help="comma-separated subset, in order")
    ap.add_argument("--out", type=Path, help="default: bench/results/gpu_check_<device>.json")
    ap.add_argument("--workdir", type=Path, default=Path("bench/results/gpu_check_work"),
                    help="stage logs and raw outputs (not committed)")
    ap.add_argument("--engine-model", help="checkpoint for the engine stage (default: a random Llama-3.2-1B shape)")
    ap.add_argument("--serve-model", help="checkpoint for the serve stage (default: the demo model)")
    ap.add_argument("--stage-limit", type=float,
                    help="seconds: caps each stage's own time limit (for a lease shorter than the ~44 min they add up to)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="combine the results of runs of separate stages (bench/gpu/run_short.sh) into one file")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    names = [s for s in args.stages.split(",") if s]
    unknown = [s for s in names if s not in stages.STAGES]
    if unknown:
        ap.error(f"unknown stages {unknown}; choose from {list(stages.STAGES)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("splitserve bench gpu-check: no CUDA device here; run with --dry-run to exercise the script "
              "on the CPU", file=sys.stderr)
        return 2
    device = "cpu-dry-run" if args.dry_run else torch.cuda.get_device_name(0)
    out = args.out or Path("bench/results") / f"gpu_check_{device_slug(device)}.json"
    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = stages.Context(dry_run=args.dry_run, workdir=args.workdir, engine_model=args.engine_model,
                         serve_model=args.serve_model, stage_limit=args.stage_limit)
    result = {"check": "splitserve bench gpu-check (issue 20)", "device": device,
              "mode": "cpu dry run: no GPU figure in this file" if args.dry_run else "cuda",
              "gpu": torch.cuda.get_device_name(0) if cuda else None, "versions": versions(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "started": now(), "targets": TARGETS, "stages": []}
    for name in names:
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        record = run_stage(name, ctx)
        result["stages"].append(record)
        print(f"gpu-check: {name}: {record['status']} ({record['reason'][:200]})", file=sys.stderr, flush=True)
        _write(result, out)  # after every stage: a crash later keeps what was measured
    result["finished"] = now()
    return _finish(result, out)


def _finish(result: dict, out: Path) -> int:
    result["summary"] = {s: sum(r["status"] == s for r in result["stages"]) for s in ("passed", "failed", "skipped")}
    result["summary"]["targets"] = [t for r in result["stages"] for t in r.get("targets", [])]
    _write(result, out)
    print(json.dumps(result["summary"], indent=2))
    print(f"gpu-check: results in {out}", file=sys.stderr)
    return 1 if result["summary"]["failed"] else 0


def merge(paths: list[Path], out: Path | None) -> int:
    """One result from several runs' files (each run's own stages), in the order given."""
    parts = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not parts:
        print(f"splitserve bench gpu-check: none of {[str(p) for p in paths]} exists", file=sys.stderr)
        return 2
    result = {**parts[0], "stages": [stage for part in parts for stage in part["stages"]],
              "started": min(p["started"] for p in parts), "finished": max(p.get("finished", "") for p in parts),
              "merged_from": [str(p) for p in paths if p.exists()]}
    out = out or Path("bench/results") / f"gpu_check_{device_slug(result['device'])}.json"
    return _finish(result, out)


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
