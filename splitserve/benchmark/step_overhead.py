"""`splitserve bench step-overhead`: how much host (CPU) time a decode step of the engine
costs beside the device's time, per batch size.

A decode step is scheduled, its inputs staged (engine/decode_inputs.py), the model run
(a CUDA graph replayed on the GPU), the logits sampled and the outputs built. On a GPU the
host work must take less time than the device's, or the GPU waits on Python (issue 37).
For each batch size B the bench fills the engine with B requests, runs them into pure
decode, then times N steps, each in phases measured on the host clock:

    schedule | stage inputs | launch | wait for the device | sample + outputs

`host_ms` is the step's wall time minus the wait; `device_ms` is the replay between two
CUDA events. On the CPU, `--null-model` replaces the forward pass by a fixed logits
tensor, so the step is host work alone (the figure the staging change was measured by);
without it the CPU's forward is in `launch`.

The heap is frozen after start-up as a worker freezes it (engine/heap.py). The requests
are the workers' kind (`detokenize=False`: the router builds the text; delta outputs, as a
worker's engine makes them; `--cumulative-outputs` for the offline API's kind), greedy,
with long outputs so no request finishes inside the timed steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def _timed_engine(engine, device: torch.device, null_model: bool):
    """Wrap the engine's decode path with phase clocks; returns (clocks, device_ms list, the
    CUDA events of each step: with the overlapped step they are read after the run, as waiting
    for each would undo the overlap)."""
    graphs = engine.runner.decode_graphs
    clocks: dict[str, float] = defaultdict(float)
    device_ms: list[float] = []
    cuda = device.type == "cuda"
    schedule, stage, execute = engine.scheduler.schedule, graphs.stage, graphs.execute
    vocab = engine.model_config.vocab_size
    fixed: dict[int, torch.Tensor] = {}
    events: list[tuple] = []
    overlapped = engine.overlap is not None

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            clocks[name] += time.perf_counter() - t
            return out
        return wrapper

    def execute_timed(bucket):
        t0 = time.perf_counter()
        if null_model:
            graphs.steps += 1
            if bucket not in fixed:
                fixed[bucket] = torch.randn(bucket, vocab, generator=torch.Generator().manual_seed(0))
            out = fixed[bucket]
        elif not cuda:
            out = execute(bucket)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = execute(bucket)
            end.record()
            t1 = time.perf_counter()
            clocks["launch"] += t1 - t0
            if overlapped:
                events.append((start, end))
                return out
            end.synchronize()  # the wait, timed apart: host_ms leaves it out
            clocks["wait"] += time.perf_counter() - t1
            device_ms.append(start.elapsed_time(end))
            return out
        clocks["launch"] += time.perf_counter() - t0
        return out

    engine.scheduler.schedule = timed("schedule", schedule)
    graphs.stage = timed("stage", stage)
    graphs.execute = execute_timed
    return clocks, device_ms, events


def measure(model: str, device: str, dtype: str, batch: int, steps: int, prompt_len: int,
            null_model: bool, delta_outputs: bool = True, async_scheduling: bool = False) -> dict:
    from splitserve.core.sampling_params import SamplingParams
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    dev = torch.device(device)
    blocks_each = -(-(prompt_len + steps + 64) // 16)
    cfg = EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=batch,
                       num_kv_blocks=batch * blocks_each + 16, max_num_batched_tokens=max(4096, prompt_len),
                       max_model_len=4096, warm_up=False, delta_outputs=delta_outputs,
                       async_scheduling=async_scheduling)
    engine = LLMEngine(cfg)
    if engine.runner.decode_graphs is None:
        engine.runner.enable_decode_graphs(capture=False)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        prompt = [(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(prompt_len)]
        engine.add_request(f"step-overhead-{i}", prompt, params, detokenize=False)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    from splitserve.engine.heap import freeze_startup_heap

    freeze_startup_heap()  # as a serving worker does after start-up (engine/heap.py)
    clocks, device_ms, events = _timed_engine(engine, dev, null_model)
    graph_steps = engine.runner.decode_graphs.steps
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if events:  # the overlapped step: the device's times once it is done
        torch.cuda.synchronize(dev)
        device_ms.extend(a.elapsed_time(b) for a, b in events)
    wall = time.perf_counter() - start
    if engine.runner.decode_graphs.steps - graph_steps != steps:
        raise RuntimeError("a timed step did not take the decode-graph path; the figures would mix step kinds")
    per = {k: 1e3 * v / steps for k, v in clocks.items()}
    wall_ms = 1e3 * wall / steps
    host_ms = wall_ms - per.get("wait", 0.0)
    row = {"batch": batch, "async_scheduling": async_scheduling, "steps": steps, "prompt_tokens": prompt_len,
           "wall_ms": round(wall_ms, 4),
           "host_ms": round(host_ms, 4),
           "phases_ms": {"schedule": per.get("schedule", 0.0), "stage": per.get("stage", 0.0),
                         "launch": per.get("launch", 0.0), "wait": per.get("wait", 0.0),
                         "sample_and_outputs": wall_ms - sum(per.values())}}
    if device_ms:
        device_ms.sort()
        row["device_ms"] = round(device_ms[len(device_ms) // 2], 4)
        row["host_below_device"] = host_ms < row["device_ms"]
        row["wall_over_device"] = round(wall_ms / row["device_ms"], 3)  # 1.0: the device is the bound
    row["phases_ms"] = {k: round(v, 4) for k, v in row["phases_ms"].items()}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench step-overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batch-sizes", default="32,128,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--null-model", action="store_true",
                    help="no forward pass (fixed logits): host time alone (CPU only)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also time the overlapped decode step (engine/overlap.py): a second row per batch size")
    ap.add_argument("--cumulative-outputs", action="store_true",
                    help="outputs carry the whole request so far (the offline API's kind), not a worker's deltas")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if min(batches) < 1 or args.steps < 1 or args.prompt_tokens < 1:
        ap.error("batch sizes, --steps and --prompt-tokens must be positive")
    cuda = torch.device(args.device).type == "cuda"
    if args.null_model and cuda:
        ap.error("--null-model is for the CPU: on a GPU the device time is the point")
    if args.model is None:
        from splitserve.engine.demo import ensure_demo_checkpoint
        args.model = str(ensure_demo_checkpoint())
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    modes = (False, True) if args.async_scheduling else (False,)
    rows = [measure(args.model, args.device, dtype, b, args.steps, args.prompt_tokens, args.null_model,
                    not args.cumulative_outputs, overlap)
            for overlap in modes for b in batches]
    result = {"device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()}, "
              f"{torch.get_num_threads()} threads)", "model": Path(args.model).name, "dtype": dtype,
              "null_model": args.null_model, "delta_outputs": not args.cumulative_outputs, "torch": torch.__version__, "rows": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for r in rows:
        dev = f", device {r['device_ms']:.3f} ms" if "device_ms" in r else ""
        print(f"batch {r['batch']}{' overlapped' if r['async_scheduling'] else ''}: host {r['host_ms']:.3f} ms "
              f"a decode step{dev}; phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms"].items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
