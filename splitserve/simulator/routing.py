"""The router, modelled for a simulated cluster of up to thousands of workers.

Same decisions as `splitserve.router.policy.route`, with the same constants
(`PolicyConfig`), computed without a pass over every worker:
- prefix mode: cost = load − overlap_credit × (cached blocks / prompt blocks), load =
  kv_usage + outstanding / requests_per_load_unit. Only workers holding the prompt's
  shared prefix have an overlap, so the best worker is the cheapest of those holders
  and of the least-loaded worker overall (a lazy heap). The imbalance guard compares
  the least-loaded and the most-loaded workers' queues, as the real guard does.
- round-robin and random: the baselines of `--routing-mode`.
- prefill worker (conditional disaggregation): only when the decode worker lacks at
  least `disagg_min_uncached_tokens` of the prompt; the one with the fewest queued
  tokens after crediting its own cached prefix.
Differences from the real router, on purpose: loads are exact at decision time (the
real router sees load reports every 0.5 s plus its own recent sends), and cache
contents are known per shared-prefix group rather than per block hash.
"""

from __future__ import annotations

import heapq
import random

from splitserve.router.policy import PolicyConfig

MODES = ("prefix", "round-robin", "random")


class LoadBoard:
    """Per-worker values with the minimum (and maximum) found in O(log n): lazy heaps,
    compacted when stale entries pile up. Ties at the minimum break at random."""

    def __init__(self, n: int, rng: random.Random, track_max: bool = False):
        self.value = [0.0] * n
        self.version = [0] * n
        self.rng = rng
        self.track_max = track_max
        self._min = [(0.0, rng.random(), w, 0) for w in range(n)]
        heapq.heapify(self._min)
        self._max = [(-0.0, w, 0) for w in range(n)] if track_max else []
        heapq.heapify(self._max)

    def set(self, w: int, value: float) -> None:
        self.value[w] = value
        v = self.version[w] = self.version[w] + 1
        heapq.heappush(self._min, (value, self.rng.random(), w, v))
        if self.track_max:
            heapq.heappush(self._max, (-value, w, v))
        if len(self._min) > 8 * len(self.value) + 1024:
            self._compact()

    def _compact(self) -> None:
        self._min = [(x, self.rng.random(), w, self.version[w]) for w, x in enumerate(self.value)]
        heapq.heapify(self._min)
        if self.track_max:
            self._max = [(-x, w, self.version[w]) for w, x in enumerate(self.value)]
            heapq.heapify(self._max)

    def argmin(self) -> int:
        heap, version = self._min, self.version
        while heap[0][3] != version[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][2]

    def max_value(self) -> float:
        heap, version = self._max, self.version
        while heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        return -heap[0][0]


class RouterModel:
    def __init__(self, num_decode: int, num_prefill: int, mode: str = "prefix",
                 policy: PolicyConfig = PolicyConfig(), seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)}, got {mode!r}")
        if num_decode < 1 or num_prefill < 0:
            raise ValueError(f"need >= 1 decode worker and >= 0 prefill workers, got {num_decode} and {num_prefill}")
        self.mode, self.policy = mode, policy
        self.rng = random.Random(seed)
        self.queue = [0] * num_decode  # outstanding requests per decode worker
        self.kv_usage = [0.0] * num_decode
        self.decode_load = LoadBoard(num_decode, self.rng)
        self.decode_queue = LoadBoard(num_decode, self.rng, track_max=True)  # imbalance guard
        self.prefill_tokens = LoadBoard(num_prefill, self.rng) if num_prefill else None
        self._rr = 0

    # ---- load updates (the workers call these) ------------------------------------------
    def decode_changed(self, w: int, queue_delta: int = 0, kv_usage: float | None = None) -> None:
        self.queue[w] += queue_delta
        if kv_usage is not None:
            self.kv_usage[w] = kv_usage
        self.decode_load.set(w, self.kv_usage[w] + self.queue[w] / self.policy.requests_per_load_unit)
        if queue_delta:
            self.decode_queue.set(w, self.queue[w])

    def prefill_changed(self, w: int, queued_tokens: int) -> None:
        self.prefill_tokens.set(w, queued_tokens)

    # ---- decisions --------------------------------------------------------------------------
    def choose_decode(self, prompt_blocks: int, holders: dict[int, int] | None) -> int:
        """`holders`: decode worker -> cached blocks of this prompt (None: nobody)."""
        n = len(self.queue)
        if self.mode == "round-robin":
            self._rr += 1
            return self._rr % n
        if self.mode == "random":
            return self.rng.randrange(n)
        board, policy = self.decode_load, self.policy
        least = board.argmin()
        queues = self.decode_queue
        lo, hi = queues.value[queues.argmin()], queues.max_value()
        if hi - lo > policy.imbalance_abs and hi > policy.imbalance_ratio * lo:
            return queues.argmin()
        best, best_cost = least, board.value[least]
        if holders:
            credit = policy.overlap_credit / max(prompt_blocks, 1)
            value = board.value
            for w, blocks in holders.items():
                cost = value[w] - credit * blocks
                if cost < best_cost or (cost == best_cost and value[w] < value[best]):
                    best, best_cost = w, cost
        return best

    def choose_prefill(self, prompt_tokens: int, holders: dict[int, int] | None, block_size: int) -> int | None:
        """The prefill worker that would finish this prompt soonest (queued tokens)."""
        board = self.prefill_tokens
        if board is None:
            return None
        best = board.argmin()
        best_cost = board.value[best] + prompt_tokens
        if holders:
            for w, blocks in holders.items():
                cost = board.value[w] + prompt_tokens - min(blocks * block_size, prompt_tokens)
                if cost < best_cost:
                    best, best_cost = w, cost
        return best
