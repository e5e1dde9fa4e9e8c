"""Tracing through a real `splitserve serve` (1 prefill + 1 decode worker, Ray, gRPC, KV
transfer) into a real OTLP/gRPC receiver in the test: one request with a client
`traceparent` gives parent-linked spans from the router, the prefill worker and the decode
worker under the client's trace id, the KV transfer among them; then, with the receiver
gone (its port closed), requests are answered exactly as before and nothing fails loudly."""

import secrets
import time

import pytest
import requests

from tests.helpers.otlp_receiver import OTLPReceiver
from tests.helpers.processes import SplitserveProcess

SERVED = "traced"
PROMPT = " ".join(f"word{i} and then some more text" for i in range(40))
OTHER_PROMPT = " ".join(f"another{i} sentence for a second prompt" for i in range(40))
EXPECTED = {"POST /v1/completions", "tokenize", "route", "router.generate", "first_token",
            "decode_worker.generate", "remote_prefill", "decode", "prefill_worker.prefill", "queue", "prefill",
            "kv_transfer", "kv_receive"}


@pytest.fixture(scope="module")
def traced(make_ckpt):
    receiver = OTLPReceiver()
    serve = SplitserveProcess("serve", [
        "--model", str(make_ckpt("llama")), "--served-model-name", SERVED, "--prefill-workers", "1",
        "--decode-workers", "1", "--num-kv-blocks", "256", "--disagg-min-uncached-tokens", "16",
        "--routing-seed", "7", "--strict-disaggregation", "--otlp-traces-endpoint", receiver.endpoint],
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # export within 0.1 s, not the SDK's 5 s
    yield serve, receiver
    receiver.stop()
    serve.stop()
    assert serve.proc.returncode == 0, serve.log()[-3000:]


def complete(serve, prompt: str, traceparent: str | None = None) -> requests.Response:
    headers = {"traceparent": traceparent} if traceparent else {}
    r = requests.post(f"{serve.base_url}/v1/completions", headers=headers, timeout=120,
                      json={"model": SERVED, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_one_request_is_one_trace_across_router_prefill_and_decode(traced):
    serve, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    r = complete(serve, PROMPT, f"00-{trace_id}-{client_span}-01")
    assert "prefill=prefill-0" in r.headers["X-Splitserve-Route"]  # disaggregated: the KV moved

    spans = receiver.wait_for(trace_id, EXPECTED)
    by_name = {s.name: s for s in spans}
    assert EXPECTED <= set(by_name), sorted(by_name)
    assert {s.service for s in spans} == {"splitserve-router", "splitserve-decode", "splitserve-prefill"}
    ids = {s.span_id: s for s in spans}
    parent_of = {name: ids[s.parent_span_id].name if s.parent_span_id in ids else s.parent_span_id
                 for name, s in by_name.items()}
    assert parent_of == {
        "POST /v1/completions": client_span,  # the client's span: its traceparent was honoured
        "tokenize": "POST /v1/completions", "route": "POST /v1/completions",
        "router.generate": "POST /v1/completions", "first_token": "router.generate",
        "decode_worker.generate": "router.generate",  # over gRPC metadata, router -> decode worker
        "remote_prefill": "decode_worker.generate", "decode": "decode_worker.generate",
        "prefill_worker.prefill": "remote_prefill",  # decode worker -> prefill worker
        "queue": "prefill_worker.prefill", "prefill": "prefill_worker.prefill",
        "kv_transfer": "prefill_worker.prefill",
        "kv_receive": "kv_transfer",  # prefill worker -> the decode worker's KV receiver
    }
    assert all(s.ok for s in spans), [s.name for s in spans if not s.ok]

    route, kv, gen = by_name["route"].attributes, by_name["kv_transfer"].attributes, by_name["decode_worker.generate"]
    assert (route["splitserve.route.decode_worker"], route["splitserve.route.prefill_worker"]) == ("decode-0",
                                                                                                   "prefill-0")
    assert route["splitserve.route.prefix_hit_blocks"] == 0
    usage = r.json()["usage"]
    assert kv["splitserve.kv.backend"] == "grpc" and kv["splitserve.kv.retries"] == 0
    assert kv["splitserve.kv.bytes"] > 0 and by_name["kv_receive"].attributes["splitserve.kv.bytes"] == kv["splitserve.kv.bytes"]
    assert gen.attributes["gen_ai.request.model"] == SERVED
    assert gen.attributes["gen_ai.request.max_tokens"] == 6 and gen.attributes["gen_ai.request.temperature"] == 0
    assert gen.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert gen.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert gen.attributes["gen_ai.response.id"] == r.json()["id"]
    assert by_name["tokenize"].attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    # the engine's timings, recorded on the worker's side: queue, then prefill, then the KV push
    queue, prefill = by_name["queue"], by_name["prefill"]
    assert queue.end_ns == prefill.start_ns <= prefill.end_ns <= by_name["kv_transfer"].start_ns
    # the TTFT histogram links to the trace (an OpenMetrics exemplar, what the dashboard's panel shows)
    metrics = requests.get(f"{serve.base_url}/metrics", timeout=10,
                           headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    assert any(line.startswith("splitserve_time_to_first_token_seconds_bucket") and f'trace_id="{trace_id}"' in line
               for line in metrics.splitlines()), metrics[:2000]


def test_an_unreachable_exporter_changes_nothing_for_the_client(traced):
    serve, receiver = traced
    before = complete(serve, PROMPT).json()["choices"][0]["text"]
    receiver.stop()  # its port closes: every export from now on fails
    after = complete(serve, PROMPT, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
    assert after.json()["choices"][0]["text"] == before
    other = complete(serve, OTHER_PROMPT, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
    assert "prefill=prefill-0" in other.headers["X-Splitserve-Route"] and other.json()["usage"]["completion_tokens"] == 6
    # the exporter did fail (and said so in a line), and nothing else was logged for it
    deadline = time.monotonic() + 60
    while "exporting traces to" not in serve.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    failures = [ln for ln in serve.log().splitlines() if "exporting traces to" in ln]
    assert failures and all(f"127.0.0.1:{receiver.port}" in ln for ln in failures), serve.log()[-3000:]
    assert "Traceback" not in serve.log(), serve.log()[-3000:]
