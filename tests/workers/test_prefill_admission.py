"""A prefill worker refuses up front a prompt it cannot finish before its caller's deadline
(prefill_worker/admission.py), instead of computing it until the deadline passes while the
decode worker computes it again (issue 38); and held blocks that no Prefill call owns any
longer are released, not kept for good."""

from __future__ import annotations

import time

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.prefill_timeout import MAX_PREFILL_TIMEOUT_S
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.prefill_worker import worker as prefill_module
from splitserve.prefill_worker.admission import REMEASURE_S, PrefillThroughput, refusal
from splitserve.prefill_worker.worker import MAX_PUSH_TIMEOUT_S, PrefillWorker, PrefillWorkerConfig
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import PrefillWorkerStub
from tests.workers.test_prefill_deadline_release import wait_for


def test_the_rate_is_the_engines_prompt_tokens_over_its_step_seconds():
    t = PrefillThroughput(smoothing=1.0, blind_tokens=2048)
    assert t.refusal(10_000, 1.0, now=0.0) is None  # nothing measured, nothing queued: admitted
    t.started(1500)
    assert t.refusal(500, 1.0, now=0.0) is None  # within one step's budget
    assert "has not measured its prefill rate yet" in t.refusal(600, 1.0, now=0.0)  # beyond it
    t.finished(1500)
    t.observe(0, 0.0, now=0.0)  # the counters' first look starts a window
    t.observe(100, 0.05, now=1.0)
    assert t.tokens_per_s is None  # under MIN_WINDOW_S of steps: no sample yet
    t.observe(400, 1.0, now=50.0)  # 400 tokens in 1 s of steps; the idle wall time does not count
    assert t.tokens_per_s == pytest.approx(400.0) and t.measured_at == 50.0
    t.started(1500)
    t.started(1500)
    assert (t.outstanding, t.outstanding_tokens) == (2, 3000)
    assert "about 11.2 s" in t.refusal(1500, 10.0, now=51.0)  # (3000 + 1500) / 400 > 8 s
    assert t.refusal(200, 10.0, now=51.0) is None  # 8.0 s fits
    t.finished(1500)
    t.finished(1500)
    assert t.refusal(4000, 10.0, now=51.0) is not None  # idle, recent: the estimate stands
    assert t.refusal(4000, 10.0, now=50.0 + REMEASURE_S + 1) is None  # idle and stale: measure again
    t.observe(400, 1.0, now=60.0)
    t.observe(0, 0.0, now=61.0)  # counters went back (a restarted engine): a new window, no sample
    assert t.tokens_per_s == pytest.approx(400.0)


def test_refusal_keeps_a_share_of_the_deadline_for_the_push():
    assert refusal(0, 790, 100.0, 10.0) is None  # 7.9 s of a 10 s deadline: 2 s left to push
    why = refusal(700, 200, 100.0, 10.0)  # 9 s > 8 s
    assert why is not None and "700 prompt tokens are queued ahead of these 200" in why and "10 s deadline" in why
    assert refusal(10**9, 1, 1.0, 0) is None  # no deadline: nothing to miss
    assert MAX_PREFILL_TIMEOUT_S == MAX_PUSH_TIMEOUT_S  # the decode side's flag accepts what a prefill worker does


def _request(rid: str, prompt: list[int], timeout_s: float) -> pb.PrefillRequest:
    """Every block cached on the decode side (skip_blocks): nothing to push, no receiver needed."""
    return pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=4)),
                             kv_receiver_address="127.0.0.1:1", kv_backend="grpc", timeout_s=timeout_s,
                             skip_blocks=len(prompt) // 16, dest_block_ids=[])


@pytest.fixture
async def prefill_worker(make_ckpt, monkeypatch):
    monkeypatch.setattr(prefill_module, "HELD_SWEEP_S", 0.2)
    monkeypatch.setattr(prefill_module, "ORPHAN_GRACE_S", 0.5)
    cfg = EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64, model_id="test-model")
    worker = PrefillWorker(PrefillWorkerConfig(cfg, worker_id="p0", engine_process=False), bus=InProcBus())
    await worker.start()
    yield worker
    await worker.stop()


async def test_a_prompt_that_would_miss_its_deadline_is_refused_before_any_work(prefill_worker):
    worker = prefill_worker
    worker.throughput.tokens_per_s = 10.0  # as measured just now on a slow machine: 10 prompt tokens a second
    worker.throughput.measured_at = time.monotonic()
    worker.throughput.outstanding_tokens = 40  # and a queue ahead
    worker.throughput.outstanding = 1
    worker.throughput.observe = lambda *a: None  # the engine's own counters would measure it fast
    async with grpc.aio.insecure_channel(worker.address) as channel:
        stub = PrefillWorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Prefill(_request("too-late", list(range(5, 69)), timeout_s=5.0), timeout=5.0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "request too-late: prefill worker p0: 40 prompt tokens are queued ahead of these 64" in \
            err.value.details() and "prefill it locally" in err.value.details()
        assert worker.metrics.prefill_refused.labels(worker="p0")._value.get() == 1
        assert worker.engine.stats.sequences == 0 and not worker.waiters  # nothing started
        # the same prompt with room in its deadline is served
        worker.throughput.outstanding_tokens = worker.throughput.outstanding = 0
        reply = await stub.Prefill(_request("in-time", list(range(5, 69)), timeout_s=60.0), timeout=60.0)
    assert reply.worker_id == "p0"
    assert worker.throughput.outstanding_tokens == 0 and worker.throughput.outstanding == 0


async def test_held_blocks_nobody_will_push_are_released_and_counted(prefill_worker):
    worker = prefill_worker
    # a hold with no Prefill call behind it: what the leak of issue 38 left
    await worker.engine.add_request("orphan", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=1),
                                    hold_kv=True)
    def held_gauge():  # what a scrape reads
        return worker.metrics.registry.get_sample_value("splitserve_kv_held_blocks",
                                                        {"role": "prefill", "worker": "p0"})

    await wait_for(lambda: held_gauge() == 3, "the gauge to count the 3 held blocks", timeout=30)
    await wait_for(lambda: worker.metrics.kv_held_expired.labels(worker="p0")._value.get() == 1,
                   "the orphan to be released", timeout=30)
    await wait_for(lambda: held_gauge() == 0, "the gauge to fall back to 0", timeout=30)
    stats = worker.engine.stats
    assert stats.held_for_push == 0 and not worker.engine.engine.held
    assert worker.kv_state()["held_expired"] == 1  # what the suites' pool invariant refuses
    assert await worker.engine.held_summary() == {}
