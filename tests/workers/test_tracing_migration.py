"""Tracing across a migration: two real decode workers on 127.0.0.1 behind the router's
Dispatcher, the first failing a step mid-stream (fault injection), spans collected by the
OpenTelemetry SDK's in-memory exporter. The migrated request stays one trace: a failed
attempt, a `migration` span naming both workers, and the attempt that finished, each worker's
span under the router's call that reached it."""

import json

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from splitserve.core import tracing
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.faults import ENV
from tests.helpers.migration_pair import migration_pair, to


async def test_a_migrated_stream_is_one_trace_with_a_migration_span(make_ckpt, monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))  # this test's own, undone after it
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-fail", "fault": "raise", "at_step": 3}]))
    path = make_ckpt("llama")
    async with migration_pair(EngineConfig(model=str(path), num_kv_blocks=64)) as (dispatcher, _):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with tracing.current_span("request") as root:  # the router's request span
            events = [e async for e in dispatcher.generate("r", [5, 6, 7, 8], params, to("d-fail"))]
    assert sum(len(e.token_ids) for e in events) == 8 and events[-1].finish_reason == "length"
    assert [e.decode_worker for e in events if e.decode_worker] == ["d-fail", "d-ok"]

    spans = exporter.get_finished_spans()
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    by_id = {s.context.span_id: s for s in spans}

    def parent(s):
        return by_id[s.parent.span_id].name if s.parent is not None else None

    calls = sorted((s for s in spans if s.name == "router.generate"), key=lambda s: s.attributes["splitserve.attempt"])
    assert [(c.attributes["splitserve.route.decode_worker"], c.status.status_code, parent(c)) for c in calls] == [
        ("d-fail", StatusCode.ERROR, "request"), ("d-ok", StatusCode.UNSET, "request")]
    assert calls[1].attributes["gen_ai.usage.output_tokens"] == 8  # the tokens so far count on the new worker
    (moved,) = [s for s in spans if s.name == "migration"]
    assert parent(moved) == "request"
    assert (moved.attributes["splitserve.migration.from"], moved.attributes["splitserve.migration.to"]) == (
        "d-fail", "d-ok")
    assert 0 < moved.attributes["splitserve.migration.tokens_so_far"] < 8
    served = {s.attributes["splitserve.worker"]: s for s in spans if s.name == "decode_worker.generate"}
    assert by_id[served["d-fail"].parent.span_id] is calls[0] and by_id[served["d-ok"].parent.span_id] is calls[1]
    assert served["d-fail"].status.status_code == StatusCode.ERROR
    assert served["d-ok"].attributes["splitserve.resumed_tokens"] == moved.attributes[
        "splitserve.migration.tokens_so_far"]
