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
    return ClusterRun(trace, costs, config).run()


class ClusterRun:
    """One simulation: the event loop (`run`) and the named steps of a request's path:
    `arrive` (routing), `step_end` (a worker's step or decode segment finished),
    `boundary` (between steps: KV that arrived joins, the next step is planned),
    `start_decoding`, `push_kv`. Per-request state lives in flat lists indexed by request."""

    def __init__(self, trace: Trace, costs: CostModel, config: ClusterConfig):
        self.trace, self.costs, self.config = trace, costs, config
        self.bs = bs = costs.block_size
        self.router = RouterModel(config.num_decode, config.num_prefill, config.routing_mode, config.policy,
                                  config.seed)
        self.decode = [SimWorker("decode", i, costs, config.cache_blocks) for i in range(config.num_decode)]
        self.prefill = [SimWorker("prefill", i, costs, config.cache_blocks) for i in range(config.num_prefill)]
        self.decode_holders: dict[int, dict[int, int]] = {}  # prefix group -> {worker: cached blocks}
        self.prefill_holders: dict[int, dict[int, int]] = {}
        n = len(trace)
        self.prompt, self.out = trace.prompt_len.tolist(), trace.output_len.tolist()
        self.group, self.prefix_blocks = trace.group.tolist(), (trace.prefix_len // bs).tolist()
        self.first, self.finish = [0.0] * n, [0.0] * n
        self.dest = [0] * n  # decode worker of each request
        self.skip = [0] * n  # blocks the decode worker already held (not transferred)
        self.itl_d: list[float] = []  # step durations ...
        self.itl_w: list[float] = []  # ... and how many inter-token gaps had each
        self.heap: list = []
        self.seq = 0  # heap tie-breaker
        self.disaggregated = self.hit_tokens = self.query_tokens = 0
        self.disagg_threshold = config.policy.disagg_min_uncached_tokens if config.num_prefill > 0 else None
        self.kv_per_block = costs.kv_bytes_per_token * bs
        self.busy = 0  # workers in a step (CPU sharing)

    # ---- the event loop -------------------------------------------------------------------
    def run(self) -> SimResult:
        arrivals = (self.trace.arrival + self.costs.routing_s).tolist()
        heap, n, i, events = self.heap, len(arrivals), 0, 0
        while i < n or heap:
            if i < n and (not heap or arrivals[i] <= heap[0][0]):
                self.arrive(i, arrivals[i])
                i += 1
                events += 1
                continue
            t, _, kind, a, version = heapq.heappop(heap)
            events += 1
            if kind == _STEP:
                if version == a.version:  # else a stale end of a segment that was cut short
                    self.step_end(a, t)
            else:
                w = self.decode[self.dest[a]]
                w.joins.append(a)
                self.wake(w, t)
        tr = self.trace
        return SimResult(tr.arrival.copy(), np.array(self.first), np.array(self.finish), tr.output_len.copy(),
                         (np.array(self.itl_d, dtype=float), np.array(self.itl_w, dtype=float)), self.costs,
                         self.config, self.disaggregated, self.query_tokens, self.hit_tokens, events)

    # ---- a request's path -----------------------------------------------------------------
    def arrive(self, rid: int, t: float) -> None:
        """The router picks a decode worker, and a prefill worker when the uncached part is long."""
        bs, p, g = self.bs, self.prompt[rid], self.group[rid]
        d_holders = self.decode_holders.get(g) if g >= 0 else None
        d = self.router.choose_decode(p // bs, d_holders)
        self.router.decode_changed(d, +1)
        self.dest[rid] = d
        cached = min(d_holders.get(d, 0), (p - 1) // bs) if d_holders else 0
        if self.disagg_threshold is not None and p - cached * bs >= self.disagg_threshold:
            pw = self.prefill[self.router.choose_prefill(p, self.prefill_holders.get(g) if g >= 0 else None, bs)]
            self.skip[rid] = cached
            self.disaggregated += 1
            pw.waiting.append([rid, p, 0])
            pw.queued_tokens += p
            self.router.prefill_changed(pw.index, pw.queued_tokens)
            self.wake(pw, t)
        else:
            w = self.decode[d]
            w.waiting.append([rid, p, 0])
            self.wake(w, t)

    def lookup(self, rid: int, w: SimWorker) -> int:
        """Prefix-cache hit (tokens) of `rid` on `w`, when `w` admits it."""
        bs, g = self.bs, self.group[rid]
        blocks = min(w.cached_blocks(g), (self.prompt[rid] - 1) // bs)
        if blocks:
            w.cache.move_to_end(g)
        self.query_tokens += self.prompt[rid]
        self.hit_tokens += blocks * bs
        if w.role == "prefill":
            w.queued_tokens -= blocks * bs
        return blocks * bs

    def wake(self, w: SimWorker, t: float) -> None:
        """Work arrived for `w`: plan now if idle, else end its decode segment at the next step."""
        if not w.busy:
            self.boundary(w, t)
        elif w.cut(t):
            self.schedule(w)

    def boundary(self, w: SimWorker, t: float) -> None:
        """Between steps: admit arrived KV, then plan the next step."""
        if w.joins:
            for rid in w.joins:
                w.remember(self.group[rid], self.prefix_blocks[rid], self.decode_holders)
                self.start_decoding(w, rid, t)
            w.joins = []
        was_busy = w.busy
        slowdown = 1.0
        cores = self.config.cpu_cores
        if cores is not None:
            slowdown = max(1.0, (self.busy + (0 if was_busy else 1) + self.costs.serving.frontend_load) / cores)
        if w.plan(t, self.lookup, slowdown):
            self.busy += 0 if was_busy else 1
            self.schedule(w)
        elif was_busy:
            self.busy -= 1

    def schedule(self, w: SimWorker) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (w.end, self.seq, _STEP, w, w.version))

    def step_end(self, w: SimWorker, t: float) -> None:
        """`w` finished its planned step(s): record gaps, finish prompts and sequences."""
        self._record_itl(w, t)
        w.steps += w.seg_n
        is_prefill = w.role == "prefill"
        for entry, chunk in w.chunks:
            entry[2] += chunk
            if is_prefill:
                w.queued_tokens -= chunk
            if entry[2] >= entry[1]:
                rid = entry[0]
                w.prefilling.remove(entry)
                if is_prefill:
                    w.remember(self.group[rid], self.prefix_blocks[rid], self.prefill_holders)
                    self.push_kv(rid, t)
                else:
                    w.remember(self.group[rid], self.prefix_blocks[rid], self.decode_holders)
                    self.start_decoding(w, rid, t)
        w.chunks = []
        for rid in w.pop_finished():
            self.finish[rid] = t
            self.router.decode_changed(w.index, -1)
        if is_prefill:
            self.router.prefill_changed(w.index, w.queued_tokens)
        self.boundary(w, t)

    def _record_itl(self, w: SimWorker, t: float) -> None:
        b, k = w.seg_b, w.seg_n
        if not b:
            return
        if k == 1:
            self.itl_d.append(t - w.seg_t0)
            self.itl_w.append(b)
        else:  # step times grow linearly over a segment: its two ends, half the gaps each
            self.itl_d.append(w.seg_a)
            self.itl_d.append(w.seg_a + w.seg_g * (k - 1))
            self.itl_w.append(b * k / 2)
            self.itl_w.append(b * k / 2)

    def push_kv(self, rid: int, t: float) -> None:
        """A prompt prefilled on a prefill worker: its KV reaches the decode worker later."""
        blocks = -(-self.prompt[rid] // self.bs) - self.skip[rid]
        arrive = t + (self.costs.transfer.time(blocks * self.kv_per_block) if blocks > 0 else 0.0)
        self.seq += 1
        heapq.heappush(self.heap, (arrive, self.seq, _KV, rid, 0))

    def start_decoding(self, w: SimWorker, rid: int, t: float) -> None:
        """The first token is out at `t`; the rest decode in `w`'s batch."""
        self.first[rid] = t
        if self.out[rid] <= 1:
            self.finish[rid] = t
            self.router.decode_changed(w.index, -1)
        else:
            w.add_decoding(rid, self.prompt[rid], self.out[rid] - 1)
