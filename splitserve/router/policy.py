"""Routing policy: pure functions from (index match, loads) to a decision.

Decode worker: cost = load − overlap_credit × overlap, where
  load    = kv_usage + (waiting + running + pending) / requests_per_load_unit
  overlap = fraction of the prompt's full blocks the worker already holds (0..1), a block
            in its offload tiers (host, disk) counting `tier_credit` of a device block
            (router/tier_scoring.py): device hit > tier hit > miss
so with the defaults a worker holding the whole prompt is worth `requests_per_load_unit`
extra queued requests. The imbalance guard overrides the cost when queues are far apart
(both an absolute and a relative gap, so two nearly idle workers never trip it). Ties
break by load, then at random from a seeded RNG over workers sorted by id: never "the
first index", which makes routers pile onto one worker, and the same seed gives the
same choice on every router replica.

Prefill worker (conditional disaggregation): only when the part of the prompt the
chosen decode worker lacks is long enough to be worth a transfer. Its cost is in tokens:
what it already has queued plus what this prompt would add there (its own cached prefix
is credited).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from splitserve.cluster.messages import LoadReport
from splitserve.router.prefill_placement import PlacementInputs, prefill_locally
from splitserve.router.tier_scoring import prefix_scores, pull_source, reachable_blocks

TIE_EPSILON = 1e-9


class NoHealthyWorker(RuntimeError):
    """No decode worker is alive; the server answers 503."""


@dataclass(frozen=True)
class PolicyConfig:
    overlap_credit: float = 1.0  # cost units for a fully cached prompt
    requests_per_load_unit: float = 32.0  # queued+running requests that weigh 1.0
    imbalance_abs: int = 16  # guard trips when max−min outstanding requests exceeds this
    imbalance_ratio: float = 1.5  # ... and max > ratio × min
    disagg_min_uncached_tokens: int = 256  # below this the decode worker prefills itself
    strict_disaggregation: bool = False  # never prefill locally because the prefill pool is backed up (prefill_placement.py)
    tier_credit: float = 0.5  # a block in a worker's host/disk tier, in device blocks (loaded back, not recomputed)
    peer_credit: float = 0.25  # a block only a peer holds, in device blocks (pulled from it, not recomputed)
    peer_pull_min_blocks: int = 4  # a pull hint needs the peer to hold this many more blocks (bench/experiments/kv_tiers.py)

    def __post_init__(self) -> None:
        if self.overlap_credit < 0 or self.requests_per_load_unit <= 0:
            raise ValueError("overlap_credit must be >= 0 and requests_per_load_unit > 0")
        if self.imbalance_abs < 0 or self.imbalance_ratio < 1:
            raise ValueError("imbalance_abs must be >= 0 and imbalance_ratio >= 1")
        if not 0 <= self.peer_credit <= self.tier_credit <= 1:
            raise ValueError("need 0 <= peer_credit <= tier_credit <= 1")
        if self.peer_pull_min_blocks < 1:
            raise ValueError("peer_pull_min_blocks must be >= 1")
        if self.disagg_min_uncached_tokens < 0:
            raise ValueError("disagg_min_uncached_tokens must be >= 0")


@dataclass(frozen=True)
class RouteDecision:
    decode_worker: str
    prefill_worker: str | None  # None: the decode worker prefills locally
    prompt_tokens: int
    prompt_blocks: int
    decode_cached_blocks: int
    prefill_cached_blocks: int
    reason: str  # why this decode worker
    prefill_reason: str  # why (not) disaggregated
    costs: dict[str, float] = field(default_factory=dict)  # decode candidates' costs
    pull_worker: str | None = None  # a peer decode worker holding more of the prefix: pull from it
    pull_blocks: int = 0  # ... the prompt's leading blocks it holds

    @property
    def path(self) -> str:
        """Label for `splitserve_router_requests_total{path}`."""
        return "disaggregated" if self.prefill_worker else "local"

    def header_value(self) -> str:
        """One line for a response header, e.g. `x-splitserve-route`."""
        parts = [f"decode={self.decode_worker}", f"prefill={self.prefill_worker or '-'}",
                 f"cached={self.decode_cached_blocks}/{self.prompt_blocks}",
                 f"reason={self.reason}"]
        if self.pull_worker:
            parts.insert(2, f"pull={self.pull_worker}:{self.pull_blocks}")
        return "; ".join(parts).encode("ascii", "replace").decode()

    def log_fields(self) -> dict:
        return {"decode_worker": self.decode_worker, "prefill_worker": self.prefill_worker,
                "prompt_tokens": self.prompt_tokens, "prompt_blocks": self.prompt_blocks,
                "decode_cached_blocks": self.decode_cached_blocks,
                "prefill_cached_blocks": self.prefill_cached_blocks, "reason": self.reason,
                "prefill_reason": self.prefill_reason, "pull_worker": self.pull_worker,
                "pull_blocks": self.pull_blocks,
                "costs": {w: round(c, 4) for w, c in self.costs.items()}}


def outstanding(report: LoadReport | None, pending: int = 0) -> int:
    """Requests a worker has, including those routed since its last load report."""
    if report is None:
        return pending
    return report.waiting + report.running + pending


def decode_load(report: LoadReport | None, pending: int, config: PolicyConfig) -> float:
    kv = min(max(report.kv_usage, 0.0), 1.0) if report is not None else 0.0
    return kv + outstanding(report, pending) / config.requests_per_load_unit


def choose_decode(
    decode_workers: Sequence[str],
    matched: Mapping[str, int],
    prompt_blocks: int,
    loads: Mapping[str, LoadReport],
    rng: random.Random,
    config: PolicyConfig,
    pending: Mapping[str, int] | None = None,
) -> tuple[str, str, dict[str, float]]:
    """Returns (worker, reason, costs). One pass over the workers: this runs per request."""
    if not decode_workers:
        raise NoHealthyWorker("no healthy decode worker: check worker heartbeats on the cluster "
                              "bus and splitserve_workers_healthy{role=\"decode\"}")
    get_report = loads.get
    get_matched = prefix_scores(matched, decode_workers, config.tier_credit, config.peer_credit).get
    credit = config.overlap_credit / max(prompt_blocks, 1)
    per_unit = config.requests_per_load_unit
    queue: list[int] = []
    load: list[float] = []
    cost: list[float] = []
    for w in decode_workers:  # decode_load() inlined: this loop is the hot path
        report = get_report(w)
        if report is None:
            q, kv = 0, 0.0
        else:
            q, kv = report.waiting + report.running, report.kv_usage
            kv = 0.0 if kv < 0.0 else 1.0 if kv > 1.0 else kv
        if pending:
            q += pending.get(w, 0)
        queue.append(q)
        lw = kv + q / per_unit
        load.append(lw)
        cost.append(lw - credit * get_matched(w, 0))
    costs = dict(zip(decode_workers, cost, strict=True))
    lo, hi = min(queue), max(queue)
    if hi - lo > config.imbalance_abs and hi > config.imbalance_ratio * lo:
        least = [w for w, q in zip(decode_workers, queue, strict=True) if q == lo]
        best_overlap = max(get_matched(w, 0) for w in least)
        least = [w for w in least if get_matched(w, 0) == best_overlap]
        return _pick(least, rng), f"imbalance-guard(queues {lo}..{hi})", costs
    best = min(cost)
    tied = [i for i, c in enumerate(cost) if c - best <= TIE_EPSILON]
    reason = "best-cost"
    if len(tied) > 1:
        least_load = min(load[i] for i in tied)
        tied = [i for i in tied if load[i] - least_load <= TIE_EPSILON]
        reason = f"tie-random-of-{len(tied)}" if len(tied) > 1 else "tie-least-loaded"
    return _pick([decode_workers[i] for i in tied], rng), reason, costs


def choose_prefill(
    prefill_workers: Sequence[str],
    matched: Mapping[str, int],
    prompt_tokens: int,
    block_size: int,
    loads: Mapping[str, LoadReport],
    rng: random.Random,
) -> str:
    """The prefill worker that would finish this prompt soonest, in queued tokens (its last
    load report's)."""
    workers = prefill_workers

    def queued(w: str) -> int:
        report = loads.get(w)
        return report.waiting_tokens if report is not None else 0

    cost = {w: queued(w) + prompt_tokens - min(reachable_blocks(matched, w) * block_size, prompt_tokens)
            for w in workers}
    best = min(cost.values())
    tied = [w for w in workers if cost[w] == best]
    least = min(queued(w) for w in tied)
    return _pick([w for w in tied if queued(w) == least], rng)


def route(
    prompt_tokens: int,
    block_size: int,
    matched: Mapping[str, int],
    decode_workers: Sequence[str],
    prefill_workers: Sequence[str],
    loads: Mapping[str, LoadReport],
    rng: random.Random,
    config: PolicyConfig = PolicyConfig(),
    pending: Mapping[str, int] | None = None,
    peers: Sequence[str] | None = None,
    pending_tokens: Mapping[str, int] | None = None,
    is_idle: Callable[[str], bool] | None = None,
) -> RouteDecision:
    """Choose the decode worker, whether it pulls the prefix from a peer, then whether (and
    where) to prefill the rest remotely.

    `matched` is `RadixIndex.match(prompt_hashes)`; the worker lists hold only live
    workers of each role. `pending` counts the requests this router sent to each decode
    worker since its last load report (optional, keeps bursts spread). `peers`: the live
    decode workers a prefix may be pulled from (default: `decode_workers`). `pending_tokens`:
    prompt tokens this router sent each worker to compute since its last load report (the
    backlogs prefill_placement.py weighs); `is_idle(worker)`: no stream runs on that decode worker
    (asked only of the chosen one, and only when a prefill worker could take the prompt)."""
    prompt_blocks = prompt_tokens // block_size
    decode, reason, costs = choose_decode(decode_workers, matched, prompt_blocks, loads, rng,
                                          config, pending)
    decode_cached = reachable_blocks(matched, decode)  # tier blocks are loaded back there, not prefilled
    pull = pull_source(matched, decode, decode_workers if peers is None else peers, config.peer_pull_min_blocks)
    uncached = prompt_tokens - max(decode_cached, pull[1] if pull else 0) * block_size
    prefill = None
    prefill_cached = 0
    if not prefill_workers:
        prefill_reason = "local: no healthy prefill worker"
    elif uncached < config.disagg_min_uncached_tokens:
        prefill_reason = (f"local: uncached {uncached} tokens < "
                          f"{config.disagg_min_uncached_tokens}")
    else:
        candidate = choose_prefill(prefill_workers, matched, prompt_tokens, block_size, loads, rng)
        backlogs = (_backlog(w, loads, pending_tokens) for w in (decode, candidate))
        idle = is_idle is not None and not config.strict_disaggregation and is_idle(decode)
        local = prefill_locally(PlacementInputs(uncached, *backlogs, decode_idle=idle), config.strict_disaggregation)
        if local is not None:
            prefill_reason = local
        else:
            prefill = candidate
            prefill_cached = reachable_blocks(matched, prefill)
            prefill_reason = (f"disaggregated: uncached {uncached} tokens >= "
                              f"{config.disagg_min_uncached_tokens}")
    return RouteDecision(decode, prefill, prompt_tokens, prompt_blocks, decode_cached,
                         prefill_cached, reason, prefill_reason, costs, *(pull or (None, 0)))


def _pick(candidates: list[str], rng: random.Random) -> str:
    """Sorted first, so that replicas given the same seed pick the same worker whatever
    order their registries listed the workers in."""
    return candidates[0] if len(candidates) == 1 else rng.choice(sorted(candidates))


def _backlog(worker: str, loads: Mapping[str, LoadReport], pending_tokens: Mapping[str, int] | None) -> int:
    """Prompt tokens `worker` has still to compute: its last report's, plus what was sent since."""
    report = loads.get(worker)
    return (report.waiting_tokens if report is not None else 0) + (pending_tokens or {}).get(worker, 0)
