"""A worker's load report counts the prompt tokens it handed its engine after the engine's
stats were taken (worker_base/worker.py): a step can take seconds, and the router, which
counts what it sent a worker only until that worker's next report, placed prompts by
reports that showed neither (engine/async_engine.py drains what arrived during a step
before it takes the stats: tests/engine/test_async_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

from splitserve.engine.stats import EngineStats
from splitserve.worker_base.worker import WorkerBase


def stats(taken_at: float, queued: int = 0) -> EngineStats:
    return EngineStats(steps=1, waiting=0, running=0, prefilling=0, queued_prompt_tokens=queued, remote_prefills=0,
                       held_for_push=0, sequences=0, free_blocks=8, total_blocks=8, prefix_query_tokens=0,
                       prefix_hit_tokens=0, preemptions=0, taken_at=taken_at)


def test_prompts_handed_over_after_the_snapshot_count_until_a_later_one_shows_them():
    worker = SimpleNamespace(_handed=[(10.0, 100), (20.0, 300), (21.0, 50)])
    assert WorkerBase._tokens_not_in(worker, stats(taken_at=15.0)) == 350  # the first is in the stats
    assert worker._handed == [(20.0, 300), (21.0, 50)]  # and no longer kept
    assert WorkerBase._tokens_not_in(worker, stats(taken_at=30.0)) == 0
    assert worker._handed == []


def test_the_time_of_a_snapshot_does_not_make_it_differ():
    """The engine process sends stats only when they changed: a new time alone is no change."""
    assert stats(taken_at=1.0, queued=5) == stats(taken_at=2.0, queued=5)
    assert stats(taken_at=1.0, queued=5) != stats(taken_at=1.0, queued=6)
