"""Issue 38's burst through `splitserve serve` (its defaults: 1 prefill + 1 decode worker):
rounds of N concurrent completions, each a distinct prompt of L token ids; per round, the
status of every request, their times, which worker prefilled them, and the prefill and
decode workers' counters (refused remote prefills, local fallbacks by reason, held blocks,
the measured prefill rate); then every pool after an idle pause. A remote prefill computed
twice shows as a `deadline_exceeded` fallback.

    python -m bench.experiments.prefill_burst --requests 24 --tokens 1700 --rounds 2
    python -m bench.experiments.prefill_burst --requests 8 --tokens 1500 --model ~/.cache/splitserve/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import requests

from tests.helpers.pools import serve_admins
from tests.helpers.processes import SplitserveProcess

COUNTERS = ("splitserve_local_prefill_fallbacks_total", "splitserve_prefill_refused_total",
            "splitserve_prefill_tokens_per_second", "splitserve_kv_held_blocks")


def counters(admin: str) -> list[str]:
    text = requests.get(admin + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith(COUNTERS)]


async def one_round(base: str, model: str, n: int, length: int, seed: int) -> list[dict]:
    async def one(session, i):
        rng = random.Random(seed * 1000 + i)
        prompt = [rng.randrange(5, 1000) for _ in range(length)]
        started = time.monotonic()
        async with session.post(base + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True}) as r:
            await r.read()
            return {"status": r.status, "seconds": round(time.monotonic() - started, 1),
                    "route": r.headers.get("x-splitserve-workers")}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=1700)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds after the load before the pools are read")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `serve` flags (repeatable)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    serve_args = ["--max-model-len", "4096", *args.serve_arg] + (["--model", args.model] if args.model else [])
    serve = SplitserveProcess("serve", serve_args, timeout=300)
    model = Path(args.model).name if args.model else "splitserve-demo-llama-random-v1"
    result = {"requests": args.requests, "tokens": args.tokens, "model": model, "serve_args": serve_args,
              "rounds": []}
    try:
        admins = serve_admins(serve.log())
        for rnd in range(args.rounds):
            rows = asyncio.run(one_round(serve.base_url, model, args.requests, args.tokens, rnd))
            ok = sum(r["status"] == 200 for r in rows)
            snapshot = {w: counters(url) for w, url in admins.items()}
            result["rounds"].append({"ok": ok, "seconds": sorted(r["seconds"] for r in rows),
                                     "routes": sorted({r["route"] for r in rows}), "counters": snapshot})
            print(f"round {rnd}: {ok}/{args.requests} ok, {min(r['seconds'] for r in rows)}-"
                  f"{max(r['seconds'] for r in rows)} s; {snapshot}", flush=True)
        time.sleep(args.idle)
        pools = {w: requests.get(url + "/health", timeout=10).json().get("kv") for w, url in admins.items()}
        result["pools_after_idle"] = pools
        print(f"after {args.idle:.0f} s idle: {pools}")
    finally:
        serve.stop()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
