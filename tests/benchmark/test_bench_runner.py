"""The runner against the scripted fake server: errors are counted (never raised),
concurrency is capped, arrivals follow the schedule, conversations carry answers."""

from __future__ import annotations

import socket

import pytest

from splitserve.benchmark.client import ClientConfig
from splitserve.benchmark.metrics import compute_metrics
from splitserve.benchmark.prompt_tokens import PromptFitter
from splitserve.benchmark.request import Session, Turn
from splitserve.benchmark.results import error_summary
from splitserve.benchmark.runner import RunConfig, run_benchmark
from splitserve.benchmark.sse import SSEDecoder
from splitserve.benchmark.workloads import WorkloadConfig, build_workload
from tests.benchmark.bench_fake_server import Script


def client(server_or_url, endpoint="/v1/completions", **kw) -> ClientConfig:
    url = server_or_url if isinstance(server_or_url, str) else server_or_url.base_url
    return ClientConfig(base_url=url, model="fake-model", endpoint=endpoint, **kw)


def singles(n: int) -> list[Session]:
    return [Session(f"s{i}", [Turn(f"req-{i}", [1, 2, 3], 3, 4)]) for i in range(n)]


WORDS = PromptFitter(lambda text: len(text.split()))  # a toy tokenizer: one token per word


def quiet(**kw) -> RunConfig:
    return RunConfig(progress=False, id_prefix="", **kw)


async def test_error_responses_are_counted_not_raised(fake_server):
    overloaded = Script(status=503, error_body={"error": {"message": "decode pool saturated",
                                                          "type": "overloaded"}})
    server = fake_server(lambda body, i: overloaded if i % 3 == 2 else Script(texts=["a", "b"]))
    outcome = await run_benchmark(singles(6), client(server), quiet(max_concurrency=1))
    assert [r.success for r in outcome.results] == [True, True, False, True, True, False]
    assert error_summary(outcome.results) == [{"status": 503, "message": "decode pool saturated",
                                               "count": 2, "example_request_id": "req-2"}]
    m = compute_metrics(outcome.results, outcome.duration_s, [50])
    assert (m.completed, m.failed, m.total_output_tokens) == (4, 2, 8)


@pytest.mark.parametrize("script,expected", [
    (Script(status=500, error_body="worker crashed"), "worker crashed"),
    (Script(error_event="KV transfer failed"), "error event in stream: KV transfer failed"),
    (Script(done=False), "stream ended before [DONE] after 3 token chunks"),
])
async def test_each_kind_of_failure_names_what_happened(fake_server, script, expected):
    server = fake_server(lambda body, i: script)
    outcome = await run_benchmark(singles(1), client(server), quiet())
    (r,) = outcome.results
    assert not r.success
    assert r.error.startswith(expected), r.error


async def test_timeout_and_refused_connection_are_errors():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcome = await run_benchmark(singles(2), client(f"http://127.0.0.1:{port}"), quiet())
    assert [r.status for r in outcome.results] == [None, None]
    assert all(r.error.startswith("ClientConnectorError") for r in outcome.results)


async def test_request_timeout_is_reported(fake_server):
    server = fake_server(lambda body, i: Script(first_delay=2.0))
    outcome = await run_benchmark(singles(1), client(server, timeout_s=0.3), quiet())
    assert outcome.results[0].error == "TimeoutError: no complete answer within 0.3s (--request-timeout)"


async def test_max_concurrency_caps_requests_in_flight(fake_server):
    server = fake_server(lambda body, i: Script(first_delay=0.1))
    outcome = await run_benchmark(singles(6), client(server), quiet(max_concurrency=2))
    assert all(r.success for r in outcome.results)
    assert server.max_in_flight == 2
    # 3 waves of >= 100 ms each
    assert outcome.duration_s >= 0.3


async def test_sessions_are_released_on_the_arrival_schedule(fake_server):
    server = fake_server(lambda body, i: Script())
    outcome = await run_benchmark(singles(5), client(server),
                                  quiet(request_rate=20.0, arrival="constant"))
    offsets = [r.send_offset for r in outcome.results]
    for k, offset in enumerate(offsets):
        assert k * 0.05 - 0.005 <= offset <= k * 0.05 + 0.2
    assert offsets == sorted(offsets)


async def test_chat_sessions_carry_previous_answers(fake_server):
    server = fake_server(lambda body, i: Script(texts=[" answer", f" {i}"]))
    sessions = build_workload(WorkloadConfig(kind="multi-turn", prompt_format="text",
                                             num_prompts=1, turns=3, input_len=(3, 3)), WORDS)
    outcome = await run_benchmark(sessions, client(server, "/v1/chat/completions"), quiet())
    assert all(r.success for r in outcome.results)
    msgs = [req["body"]["messages"] for req in server.requests]
    users = [t.prompt for t in sessions[0].turns]
    assert msgs[0] == [{"role": "user", "content": users[0]}]
    assert msgs[2] == [{"role": "user", "content": users[0]},
                       {"role": "assistant", "content": " answer 0"},
                       {"role": "user", "content": users[1]},
                       {"role": "assistant", "content": " answer 1"},
                       {"role": "user", "content": users[2]}]


async def test_completion_transcripts_extend_the_previous_prompt_exactly(fake_server):
    server = fake_server(lambda body, i: Script(texts=[" ok", f" {i}"]))
    sessions = build_workload(WorkloadConfig(kind="multi-turn", prompt_format="text",
                                             num_prompts=1, turns=2), WORDS)
    await run_benchmark(sessions, client(server), quiet())
    first, second = (req["body"]["prompt"] for req in server.requests)
    assert second.startswith(first + " ok 0\n")  # previous prompt + answer: cacheable prefix


async def test_a_failed_turn_stops_its_session(fake_server):
    server = fake_server(lambda body, i: Script(status=429, error_body={"message": "slow down"})
                         if i == 1 else Script())
    sessions = build_workload(WorkloadConfig(kind="multi-turn", prompt_format="text",
                                             num_prompts=1, turns=4), WORDS)
    outcome = await run_benchmark(sessions, client(server), quiet())
    assert [r.success for r in outcome.results] == [True, False, False, False]
    assert outcome.results[1].error == "slow down"
    assert outcome.results[3].error == "not sent: turn req-0-t1 of session s0 failed"
    assert len(server.requests) == 2


def test_sse_decoder_handles_split_events_comments_and_crlf():
    stream = (b": keep-alive\r\n\r\ndata: {\"a\": 1}\r\n\r\nevent: x\ndata: line1\ndata: line2\n\n"
              b"data: [DONE]")
    for size in (1, 3, 7, len(stream)):
        dec, events = SSEDecoder(), []
        for start in range(0, len(stream), size):
            events += dec.feed(stream[start:start + size])
        events += dec.close()
        assert events == ['{"a": 1}', "line1\nline2", "[DONE]"]


async def test_request_ids_are_unique_per_run_and_sent_as_a_header(fake_server):
    server = fake_server(lambda body, i: Script())
    first = await run_benchmark(singles(2), client(server), RunConfig(progress=False))
    second = await run_benchmark(singles(2), client(server), RunConfig(progress=False))
    ids = [r.request_id for r in first.results + second.results]
    assert len(set(ids)) == 4 and all(i.startswith("bench-") for i in ids)
    assert [req["headers"]["X-Request-Id"] for req in server.requests] == ids
