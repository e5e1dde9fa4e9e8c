"""Discrete-event simulation of a splitserve cluster: router, prefill pool, decode pool.

A request's path is the real one: the router picks a decode worker (and, when the
uncached part of the prompt is long enough and prefill workers exist, a prefill
worker); a local prompt is prefilled inside the decode worker's continuous batch; a
disaggregated one is prefilled on the prefill worker, its KV pushed (transfer cost
by bytes), and it joins the decode batch at the next step boundary, where its first
token is streamed. Costs come from `splitserve profile` (costs.py).

One heap of events (step ends, KV arrivals); arrivals are read in order from the
trace's arrays and merged in, never pushed. Stale step-end events (a segment cut
short) are skipped by version.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from splitserve.router.policy import PolicyConfig
from splitserve.simulator.costs import CostModel
from splitserve.simulator.routing import RouterModel
from splitserve.simulator.workers import SimWorker
from splitserve.simulator.workload import Trace

_STEP, _KV = 0, 1


@dataclass
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    routing_mode: str = "prefix"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cache_blocks: int = 16384  # prefix-cache capacity per worker, in blocks
    seed: int = 0
    # Workers sharing a CPU (this machine: `splitserve serve` on 2 cores) rather than one
    # accelerator each: a step that starts while k workers are busy runs
    # max(1, (k + frontend load) / cpu_cores) times slower than profiled alone. None: off.
    cpu_cores: float | None = None

    def validate(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError(f"need >= 1 decode worker and >= 0 prefill workers, "
                             f"got {self.num_decode} decode and {self.num_prefill} prefill")
        if self.cache_blocks < 0:
            raise ValueError(f"cache_blocks must be >= 0, got {self.cache_blocks}")
        if self.cpu_cores is not None and not self.cpu_cores > 0:
            raise ValueError(f"cpu_cores must be > 0 (or None), got {self.cpu_cores}")


@dataclass
class SimResult:
    arrival: np.ndarray  # as in the trace
    first_token: np.ndarray  # engine time of the first token (before serving overhead)
    finish: np.ndarray  # engine time of the last token
    output_len: np.ndarray
    itl_samples: tuple[np.ndarray, np.ndarray]  # (step seconds, number of gaps of that length)
    costs: CostModel
    config: ClusterConfig
    disaggregated: int  # requests prefilled on a prefill worker
    prefix_query_tokens: int
    prefix_hit_tokens: int
    events: int


def simulate(trace: Trace, costs: CostModel, config: ClusterConfig) -> SimResult:
    trace.check()
    config.validate()
    bs = costs.block_size
    router = RouterModel(config.num_decode, config.num_prefill, config.routing_mode, config.policy, config.seed)
    decode = [SimWorker("decode", i, costs, config.cache_blocks) for i in range(config.num_decode)]
    prefill = [SimWorker("prefill", i, costs, config.cache_blocks) for i in range(config.num_prefill)]
    decode_holders: dict[int, dict[int, int]] = {}
    prefill_holders: dict[int, dict[int, int]] = {}
    n = len(trace)
    arrivals = (trace.arrival + costs.routing_s).tolist()
    prompt, out = trace.prompt_len.tolist(), trace.output_len.tolist()
    group, prefix_blocks = trace.group.tolist(), (trace.prefix_len // bs).tolist()
    first, finish = [0.0] * n, [0.0] * n
    dest = [0] * n  # decode worker of each request
    skip = [0] * n  # blocks the decode worker already held (not transferred)
    itl_d: list[float] = []
    itl_w: list[int] = []
    heap: list = []
    seq = 0
    disaggregated = hit_tokens = query_tokens = events = 0
    thresh = config.policy.disagg_min_uncached_tokens
    transfer, kv_per_block = costs.transfer, costs.kv_bytes_per_token * bs
    threshold_active = config.num_prefill > 0
    cores, frontend = config.cpu_cores, costs.serving.frontend_load
    busy = 0  # workers in a step (CPU sharing)

    def lookup(rid: int, w: SimWorker) -> int:
        nonlocal hit_tokens, query_tokens
        blocks = min(w.cached_blocks(group[rid]), (prompt[rid] - 1) // bs)
        if blocks:
            w.cache.move_to_end(group[rid])
        query_tokens += prompt[rid]
        hit_tokens += blocks * bs
        if w.role == "prefill":
            w.queued_tokens -= blocks * bs
        return blocks * bs

    def schedule(w: SimWorker) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (w.end, seq, _STEP, w, w.version))

    def start_decoding(w: SimWorker, rid: int, t: float) -> None:
        first[rid] = t
        if out[rid] <= 1:
            finish[rid] = t
            router.decode_changed(w.index, -1)
        else:
            w.add_decoding(rid, prompt[rid], out[rid] - 1)

    def boundary(w: SimWorker, t: float) -> None:
        """Between steps: admit arrived KV, then plan the next step."""
        nonlocal busy
        if w.joins:
            for rid in w.joins:
                w.remember(group[rid], prefix_blocks[rid], decode_holders)
                start_decoding(w, rid, t)
            w.joins = []
        was_busy = w.busy
        slowdown = 1.0
        if cores is not None:
            slowdown = max(1.0, (busy + (0 if was_busy else 1) + frontend) / cores)
        if w.plan(t, lookup, slowdown):
            busy += 0 if was_busy else 1
            schedule(w)
        elif was_busy:
            busy -= 1

    def wake(w: SimWorker, t: float) -> None:
        if not w.busy:
            boundary(w, t)
        elif w.cut(t):
            schedule(w)

    def step_end(w: SimWorker, t: float) -> None:
        b, k = w.seg_b, w.seg_n
        if b:
            if k == 1:
                itl_d.append(t - w.seg_t0)
                itl_w.append(b)
            else:  # step times grow linearly over a segment: its two ends, half the gaps each
                itl_d.append(w.seg_a)
                itl_d.append(w.seg_a + w.seg_g * (k - 1))
                itl_w.append(b * k / 2)
                itl_w.append(b * k / 2)
        w.steps += k
        is_prefill = w.role == "prefill"
        for entry, chunk in w.chunks:
            entry[2] += chunk
            if is_prefill:
                w.queued_tokens -= chunk
            if entry[2] >= entry[1]:
                rid = entry[0]
                w.prefilling.remove(entry)
                if is_prefill:
                    w.remember(group[rid], prefix_blocks[rid], prefill_holders)
                    blocks = -(-prompt[rid] // bs) - skip[rid]
                    arrive = t + (transfer.time(blocks * kv_per_block) if blocks > 0 else 0.0)
                    push_kv(rid, arrive)
                else:
                    w.remember(group[rid], prefix_blocks[rid], decode_holders)
                    start_decoding(w, rid, t)
        w.chunks = []
        for rid in w.pop_finished():
            finish[rid] = t
            router.decode_changed(w.index, -1)
        if is_prefill:
            router.prefill_changed(w.index, w.queued_tokens)
        boundary(w, t)

    def push_kv(rid: int, t: float) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, _KV, rid, 0))

    def arrive(rid: int, t: float) -> None:
        nonlocal disaggregated
        p, g = prompt[rid], group[rid]
        d_holders = decode_holders.get(g) if g >= 0 else None
        d = router.choose_decode(p // bs, d_holders)
        router.decode_changed(d, +1)
        dest[rid] = d
        cached = min(d_holders.get(d, 0), (p - 1) // bs) if d_holders else 0
        if threshold_active and p - cached * bs >= thresh:
            pw = prefill[router.choose_prefill(p, prefill_holders.get(g) if g >= 0 else None, bs)]
            skip[rid] = cached
            disaggregated += 1
            pw.waiting.append([rid, p, 0])
            pw.queued_tokens += p
            router.prefill_changed(pw.index, pw.queued_tokens)
            wake(pw, t)
        else:
            w = decode[d]
            w.waiting.append([rid, p, 0])
            wake(w, t)

    i = 0
    while i < n or heap:
        if i < n and (not heap or arrivals[i] <= heap[0][0]):
            arrive(i, arrivals[i])
            i += 1
            events += 1
            continue
        t, _, kind, a, version = heapq.heappop(heap)
        events += 1
        if kind == _STEP:
            if version == a.version:
                step_end(a, t)
        else:
            w = decode[dest[a]]
            w.joins.append(a)
            wake(w, t)
    return SimResult(trace.arrival.copy(), np.array(first), np.array(finish), trace.output_len.copy(),
                     (np.array(itl_d, dtype=float), np.array(itl_w, dtype=float)), costs, config,
                     disaggregated, query_tokens, hit_tokens, events)
