"""A profile of the host side of decode steps (issue 37's "a profile before and after"): the
step-overhead bench's workload (B requests in pure decode, no forward pass, demo model) with
cProfile over the timed steps; the functions with the most own time, as JSON.

    python -m bench.experiments.step_profile OUT.json [--tree DIR] [--batch 256] [--prompt-tokens 1024]

--tree profiles another checkout's splitserve (e.g. a worktree of an older commit: the
"before"); its step_overhead.measure must exist (any version since the staged inputs).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import subprocess
import sys
from pathlib import Path


def profile(batch: int, prompt_tokens: int, steps: int, top: int) -> dict:
    from splitserve.benchmark import step_overhead
    from splitserve.engine.demo import ensure_demo_checkpoint

    prof = cProfile.Profile()
    timed = step_overhead._timed_engine

    def start_profiling(*args):  # the timed steps start right after the engine is wrapped
        out = timed(*args)
        prof.enable()
        return out

    step_overhead._timed_engine = start_profiling
    kwargs = {"delta_outputs": True} if "delta_outputs" in inspect.signature(step_overhead.measure).parameters else {}
    row = step_overhead.measure(str(ensure_demo_checkpoint()), "cpu", "float32", batch, steps, prompt_tokens, True,
                                **kwargs)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls,
                     "own_us_per_step": round(1e6 * own / steps, 1),
                     "cumulative_us_per_step": round(1e6 * cumulative / steps, 1)})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return {"row": row, "profiled_us_per_step": round(1e6 * stats.total_tt / steps, 1), "top": rows[:top]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tree", type=Path, help="a checkout whose splitserve to profile (default: this one)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--in-tree", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tree is not None and not args.in_tree:  # a fresh interpreter with that tree's splitserve first
        env = {**os.environ, "PYTHONPATH": str(args.tree.resolve())}
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]), "--in-tree"],
                               env=env)
    result = {"tree": str(args.tree) if args.tree else "this checkout", "batch": args.batch,
              "prompt_tokens": args.prompt_tokens, "steps": args.steps,
              **profile(args.batch, args.prompt_tokens, args.steps, args.top)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['profiled_us_per_step']} us a step under the profiler; top: "
          + ", ".join(f"{r['function']} {r['own_us_per_step']}" for r in result["top"][:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
