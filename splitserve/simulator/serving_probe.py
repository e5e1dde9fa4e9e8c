"""The part of a request's latency the engine does not see: router (HTTP, tokenizer,
routing), gRPC hops, the worker's event loop and housekeeping (load reports, KV
events), SSE to the client.

Measured through a real `splitserve serve` (one decode worker, no prefill worker):
1. one streamed request at a time (medians: what a lone request pays);
2. a light Poisson load of random prompts (a different mix and cluster from any
   validation run), replayed in the simulator with the fitted engine costs: the
   overheads are what the real means exceed the simulated ones by. Means, not
   medians, because the means are what the simulator is asked to predict, and the
   tail (periodic housekeeping, other jobs on a shared machine) is part of them.
The CPU the router process and this client burn during the load is the frontend
load (in cores), which competes with the workers when they share a CPU
(ClusterConfig.cpu_cores).
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
import time

from splitserve.core.banner import serving_url
from splitserve.simulator.costs import CostModel, ServingOverhead

PROMPT_TOKENS = 64
OUTPUT_TOKENS = 32
REQUESTS = 20
LOAD = {"num_prompts": 50, "input_len": (64, 512), "output_len": (32, 32), "rate": 2.0}
LOAD_RUNS = 3  # overheads are the median over runs: one run can catch another job's burst


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
            if serving_url(line):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(240) or proc.poll() is not None:
        stop_process_group(proc)
        raise RuntimeError("splitserve serve did not start for the serving probe:\n" + "".join(lines[-30:]))
    return proc


def stop_process_group(proc: subprocess.Popen) -> None:
    """Ctrl-C a `splitserve serve` and everything it started; SIGKILL after 90 s."""
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(base_url: str, vocab_hi: int, seed: int):
    from splitserve.benchmark.client import ClientConfig
    from splitserve.benchmark.runner import RunConfig, run_benchmark
    from splitserve.benchmark.workloads import WorkloadConfig, build_workload

    sessions = build_workload(WorkloadConfig(
        kind="random", num_prompts=LOAD["num_prompts"], input_len=LOAD["input_len"], output_len=LOAD["output_len"],
        token_id_range=(100, vocab_hi), seed=seed))
    cfg = ClientConfig(base_url=base_url, model="profile", ignore_eos=True, timeout_s=120)
    return await run_benchmark(sessions, cfg, RunConfig(request_rate=LOAD["rate"], seed=seed, progress=False,
                                                        id_prefix=f"profile-load{seed}-"))


def _simulated_means(costs: CostModel, results: list, frontend: float) -> tuple[float, float]:
    """Mean TTFT and mean ITL (s) the simulator predicts for these requests with no
    serving overhead, on one decode worker sharing this machine's cores."""
    from dataclasses import replace

    import numpy as np

    from splitserve.simulator.report import summarize
    from splitserve.simulator.simulator import ClusterConfig, simulate
    from splitserve.simulator.workload import Trace

    done = sorted((r for r in results if r.success), key=lambda r: r.start)
    t0 = done[0].start
    trace = Trace(np.array([r.start - t0 for r in done]), np.array([r.prompt_tokens for r in done]),
                  np.array([r.output_tokens for r in done]), np.full(len(done), -1), np.zeros(len(done), dtype=int))
    bare = replace(costs, serving=ServingOverhead(frontend_load=frontend))
    s = summarize(simulate(trace, bare, ClusterConfig(num_prefill=0, num_decode=1, cpu_cores=os.cpu_count())))
    return s.mean_ttft_ms / 1000, s.mean_itl_ms / 1000


def _load_run(costs: CostModel, results: list, frontend: float, wall: float, log) -> dict:
    """One load run: real means against simulated means without overhead."""
    load = [r for r in results if r.success]
    real_ttft = statistics.fmean(r.token_times[0] - r.start for r in load)
    real_itl = statistics.fmean(b - a for r in load for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    sim_ttft, sim_itl = _simulated_means(costs, load, frontend)
    log(f"  under load ({len(load)} requests, {LOAD['rate']} req/s): mean TTFT {real_ttft * 1e3:.2f} ms "
        f"(simulated without overhead {sim_ttft * 1e3:.2f}), mean ITL {real_itl * 1e3:.2f} ms "
        f"(simulated {sim_itl * 1e3:.2f}); router + client CPU {frontend:.2f} cores")
    return {"mean_ttft_s": real_ttft, "mean_itl_s": real_itl, "simulated_mean_ttft_s": sim_ttft,
            "simulated_mean_itl_s": sim_itl, "wall_s": wall, "first_token_s": max(0.0, real_ttft - sim_ttft),
            "per_token_s": max(0.0, real_itl - sim_itl), "frontend_load": frontend}


def measure_serving_overhead(model: str, costs: CostModel, torch_threads: int, log) -> dict:
    from splitserve.core.model_config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    port = _free_port()
    proc = _start_serve(model, torch_threads, port)
    base_url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        results = asyncio.run(_requests(base_url, min(1000, vocab - 1)))
        for seed in range(LOAD_RUNS):
            router_cpu, client_cpu, wall = _cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
            outcome = asyncio.run(_load(base_url, min(1000, vocab - 1), seed))
            router_cpu = _cpu_seconds(proc.pid) - router_cpu
            client_cpu, wall = time.process_time() - client_cpu, time.perf_counter() - wall
            failed = [r for r in outcome.results if not r.success]
            if failed:
                raise RuntimeError(f"serving probe: {len(failed)} load requests failed, e.g. "
                                   f"{failed[0].request_id}: [{failed[0].status}] {failed[0].error}")
            # frontend load: the router (serve's own process) and this client, in cores
            runs.append(_load_run(costs, outcome.results, (router_cpu + client_cpu) / wall, wall, log))
    finally:
        stop_process_group(proc)
    ttfts = [r.token_times[0] - r.start for r in results]
    gaps = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    ttft, gap = statistics.median(ttfts), statistics.median(gaps)
    engine_ttft = costs.step.prefill(PROMPT_TOKENS)
    engine_gap = costs.step.decode(1, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    log(f"  one at a time: TTFT median {ttft * 1e3:.2f} ms (engine {engine_ttft * 1e3:.2f} ms), "
        f"gap median {gap * 1e3:.2f} ms (engine {engine_gap * 1e3:.2f} ms)")
    overhead = {key: statistics.median(run[key] for run in runs)
                for key in ("first_token_s", "per_token_s", "frontend_load")}
    return {"one_at_a_time": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                              "requests": len(results), "median_ttft_s": ttft, "median_gap_s": gap,
                              "mean_ttft_s": statistics.fmean(ttfts), "mean_gap_s": statistics.fmean(gaps),
                              "engine_ttft_s": engine_ttft, "engine_gap_s": engine_gap},
            "load": {k: list(v) if isinstance(v, tuple) else v for k, v in LOAD.items()},
            "load_runs": runs,
            "overhead": overhead}
