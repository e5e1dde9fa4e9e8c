"""The part of a request's latency the engine does not see: router (HTTP, tokenizer,
routing), gRPC hops, the worker's event loop, SSE to the client.

Measured through a real `splitserve serve` (one decode worker, no prefill worker),
one streamed request at a time so nothing queues: what the first token takes
beyond the fitted prefill step is the first-token overhead; what each gap takes
beyond the fitted decode step is the per-token overhead. Medians, because other
jobs on a shared machine add rare long stalls that are not the server's.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading

from splitserve.simulator.costs import CostModel

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 32
REQUESTS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(model: str, torch_threads: int, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port), "--model", model,
           "--served-model-name", "profile", "--prefill-workers", "0", "--decode-workers", "1",
           "--torch-threads", str(torch_threads), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("splitserve: serving "):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(240) or proc.poll() is not None:
        _stop(proc)
        raise RuntimeError("splitserve serve did not start for the serving probe:\n" + "".join(lines[-30:]))
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _requests(base_url: str, vocab_hi: int) -> list:
    from splitserve.benchmark.client import ClientConfig, make_session, send_request

    cfg = ClientConfig(base_url=base_url, model="profile", ignore_eos=True, timeout_s=120)
    rng = random.Random(0)
    results = []
    async with make_session(cfg) as http:
        for i in range(REQUESTS + 2):
            prompt = [rng.randrange(100, vocab_hi) for _ in range(PROMPT_TOKENS)]
            r = await send_request(http, cfg, f"profile-{i}", prompt, OUTPUT_TOKENS, PROMPT_TOKENS)
            if not r.success:
                raise RuntimeError(f"serving probe request {r.request_id} failed: [{r.status}] {r.error}")
            if i >= 2:  # the first requests warm the router and the worker
                results.append(r)
    return results


def measure_serving_overhead(model: str, costs: CostModel, torch_threads: int, log) -> dict:
    from splitserve.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    port = _free_port()
    proc = _start_serve(model, torch_threads, port)
    try:
        results = asyncio.run(_requests(f"http://127.0.0.1:{port}", min(1000, vocab - 1)))
    finally:
        _stop(proc)
    ttfts = [r.token_times[0] - r.start for r in results]
    gaps = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    ttft, gap = statistics.median(ttfts), statistics.median(gaps)
    engine_ttft = costs.step.prefill(PROMPT_TOKENS)
    engine_gap = costs.step.decode(1, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    overhead = {"first_token_s": max(0.0, ttft - engine_ttft), "per_token_s": max(0.0, gap - engine_gap)}
    log(f"  TTFT median {ttft * 1e3:.2f} ms (engine {engine_ttft * 1e3:.2f} ms), "
        f"gap median {gap * 1e3:.2f} ms (engine {engine_gap * 1e3:.2f} ms)")
    return {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "requests": len(results),
            "median_ttft_s": ttft, "median_gap_s": gap, "mean_ttft_s": statistics.fmean(ttfts),
            "mean_gap_s": statistics.fmean(gaps), "engine_ttft_s": engine_ttft, "engine_gap_s": engine_gap,
            "overhead": overhead}
