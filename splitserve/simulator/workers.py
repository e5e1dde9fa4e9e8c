"""Simulated engines: the scheduler of `splitserve.engine.scheduler` replayed on costs.

One class serves both roles. A step is planned like the real scheduler plans it:
every running sequence first (a decode takes one token, a prompt being prefilled its
next chunk), then waiting prompts, FIFO, with what is left of the token budget, up
to `max_num_seqs`. Its duration comes from the fitted step cost.

Speed: while a decode worker has nothing to prefill, its batch does not change
until the next sequence finishes, so those steps are one *segment* with a
closed-form duration (each step's context grows by the batch size). Work arriving
mid-segment cuts it at the next step boundary, as the real engine takes new
requests between steps. So a worker costs a few events per request, not one per token.

KV capacity is not modelled as blocks: prompts are admitted whatever the pool
holds (no preemption). The prefix cache is an LRU of shared-prefix groups holding
up to `cache_blocks` blocks.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

from splitserve.simulator.costs import CostModel


class SimWorker:
    __slots__ = ("role", "index", "costs", "steps", "busy", "version", "end", "seg_n", "seg_t0", "seg_a",
                 "seg_g", "seg_b", "chunks", "waiting", "prefilling", "joins", "finish_heap", "offset",
                 "ctx_off", "cache", "cache_blocks", "cached_total", "queued_tokens")

    def __init__(self, role: str, index: int, costs: CostModel, cache_blocks: int):
        self.role, self.index, self.costs = role, index, costs
        self.steps = 0  # decode steps completed (a step counter shared by all its sequences)
        self.busy = False
        self.version = 0  # bumped when the planned end of the current step changes
        self.end = 0.0
        self.seg_n = 0  # steps in the current plan
        self.seg_t0 = self.seg_a = self.seg_g = 0.0
        self.seg_b = 0
        self.chunks: list[tuple[list, int]] = []  # prefill chunks of the current (single) step
        self.waiting: deque[list] = deque()  # [request, prompt tokens, computed tokens]
        self.prefilling: list[list] = []
        self.joins: list[int] = []  # requests whose KV arrived; they join at the next boundary
        self.finish_heap: list[tuple[int, int]] = []  # (finishing step, request)
        self.offset: dict[int, int] = {}  # request -> context at join minus the step it joined
        self.ctx_off = 0  # sum of offsets: the batch's context at step s is ctx_off + b * s
        self.cache: OrderedDict[int, int] = OrderedDict()  # shared-prefix group -> blocks; LRU first
        self.cache_blocks = cache_blocks
        self.cached_total = 0
        self.queued_tokens = 0  # prompt tokens not yet computed (the prefill routing signal)

    # ---- prefix cache -------------------------------------------------------------------
    def cached_blocks(self, group: int) -> int:
        return self.cache.get(group, 0) if group >= 0 else 0

    def remember(self, group: int, blocks: int, holders: dict[int, dict[int, int]]) -> None:
        """A prompt with shared prefix `group` (of `blocks` full blocks) was computed here."""
        if group < 0 or blocks <= 0 or blocks > self.cache_blocks:
            return
        if group in self.cache:
            self.cache.move_to_end(group)
            return
        self.cache[group] = blocks
        self.cached_total += blocks
        holders.setdefault(group, {})[self.index] = blocks
        while self.cached_total > self.cache_blocks:
            old, n = self.cache.popitem(last=False)
            self.cached_total -= n
            del holders[old][self.index]

    # ---- planning -----------------------------------------------------------------------
    @property
    def num_decoding(self) -> int:
        return len(self.offset)

    def has_prefill_work(self) -> bool:
        return bool(self.waiting or self.prefilling)

    def plan(self, now: float, lookup, slowdown: float = 1.0) -> bool:
        """Plan the next step (or decode segment) starting at `now`; False when idle.
        `lookup(request, worker)` -> cached tokens, called when a prompt is admitted.
        `slowdown` stretches the step (workers sharing too few CPU cores)."""
        c = self.costs
        b = len(self.offset)
        step = c.step
        self.chunks = []
        if self.waiting or self.prefilling:
            budget = c.max_num_batched_tokens - b
            new = b
            attn = 0.0
            keys = float(self.ctx_off + b * self.steps + b)  # what the decodes read
            for entry in self.prefilling:
                if budget <= 0:
                    break
                n = min(entry[1] - entry[2], budget)
                self.chunks.append((entry, n))
                attn += n * (entry[2] + (n + 1) / 2)
                new += n
                budget -= n
            while self.waiting and budget > 0 and b + len(self.prefilling) < c.max_num_seqs:
                entry = self.waiting.popleft()
                entry[2] = lookup(entry[0], self)
                self.prefilling.append(entry)
                n = min(entry[1] - entry[2], budget)
                self.chunks.append((entry, n))
                attn += n * (entry[2] + (n + 1) / 2)
                new += n
                budget -= n
            seqs = b + len(self.chunks)
            self._start(now, 1, slowdown * step.time(new, seqs, attn, keys), 0.0, b)
            return True
        if b:
            n = self.finish_heap[0][0] - self.steps
            a = step.decode(b, self.ctx_off + b * self.steps)
            self._start(now, max(n, 1), slowdown * a, slowdown * step.c_ctx * b, b)
            return True
        self.busy = False
        return False

    def _start(self, now: float, n: int, a: float, g: float, b: int) -> None:
        self.busy = True
        self.seg_t0, self.seg_n, self.seg_a, self.seg_g, self.seg_b = now, n, a, g, b
        self.end = now + self.segment_time(n)
        self.version += 1

    def segment_time(self, k: int) -> float:
        """Duration of the first k steps of the current plan: step j lasts a + g (j − 1)."""
        return k * self.seg_a + self.seg_g * k * (k - 1) / 2

    def cut(self, now: float) -> bool:
        """New work arrived at `now` during a decode segment: end it at the next step
        boundary. True when the planned end moved (the caller schedules the new one)."""
        if not self.busy or self.seg_n <= 1:
            return False
        elapsed = now - self.seg_t0
        a, g = self.seg_a, self.seg_g
        if g > 0:  # largest k with segment_time(k) <= elapsed
            k = int((-(a - g / 2) + math.sqrt((a - g / 2) ** 2 + 2 * g * elapsed)) / g)
        else:
            k = int(elapsed / a) if a > 0 else self.seg_n
        while k > 0 and self.segment_time(k) > elapsed:
            k -= 1
        while self.segment_time(k + 1) <= elapsed:
            k += 1
        k = min(k + 1, self.seg_n)
        if k == self.seg_n:
            return False
        self.seg_n = k
        self.end = self.seg_t0 + self.segment_time(k)
        self.version += 1
        return True

    # ---- decode set ---------------------------------------------------------------------
    def add_decoding(self, request: int, context: int, remaining: int) -> None:
        """`request` holds `context` tokens of KV and has `remaining` tokens to decode."""
        off = context - self.steps
        self.offset[request] = off
        self.ctx_off += off
        heapq.heappush(self.finish_heap, (self.steps + remaining, request))

    def pop_finished(self) -> list[int]:
        done = []
        heap = self.finish_heap
        while heap and heap[0][0] <= self.steps:
            _, request = heapq.heappop(heap)
            self.ctx_off -= self.offset.pop(request)
            done.append(request)
        return done
