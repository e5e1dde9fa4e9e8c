"""TTFT / ITL / TPOT / E2E measured against the scripted fake server, whose chunks
leave at known delays. Lower bounds are firm (the server sleeps at least that long);
upper bounds leave room for a loaded 2-core machine but are tighter than what any
wrong definition would measure (each is named next to its assertion)."""

from __future__ import annotations

import pytest

from splitserve.benchmark.client import ClientConfig, make_session, send_request
from splitserve.benchmark.metrics import request_metrics
from tests.benchmark.bench_fake_server import Script

EPS = 0.005  # timer granularity
SLACK = 0.2  # scheduling delays on a busy machine

# role chunk at once, first token at 300 ms, 4 more token chunks 100 ms apart,
# a finish chunk, then the usage chunk 600 ms later, then [DONE].
TIMED = Script(first_delay=0.3, gap=0.1, texts=[" one", " two", " three", " four", " five"],
               completion_tokens=10, usage_delay=0.6)


async def one_request(server, endpoint: str, prompt, **cfg):
    client = ClientConfig(base_url=server.base_url, model="fake-model", endpoint=endpoint, **cfg)
    async with make_session(client) as http:
        return await send_request(http, client, "req-timed", prompt, max_tokens=10,
                                  prompt_len_estimate=3)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_timings_on_a_scripted_stream(fake_server, endpoint):
    server = fake_server(lambda body, i: TIMED)
    prompt = [{"role": "user", "content": "hi"}] if "chat" in endpoint else [11, 12, 13]
    r = await one_request(server, endpoint, prompt)
    assert r.success, r.error
    m = request_metrics(r)
    # TTFT waits for the first token: the role-only chunk at ~0 ms does not count.
    assert 0.3 - EPS <= m.ttft <= 0.3 + SLACK
    # ITL: exactly the 4 gaps between the 5 token chunks; the finish and usage chunks
    # (600 ms later) carry no token and add no gap.
    assert len(m.itls) == 4
    # Token k leaves the server at 300 + 100k ms; a chunk read late shortens the next gap,
    # so the firm bound is on each token's arrival (TTFT plus the gaps so far), not on a gap.
    arrivals = [m.ttft + sum(m.itls[:k]) for k in range(1, 5)]
    assert all(0.3 + 0.1 * k - EPS <= t <= 0.3 + 0.1 * k + SLACK for k, t in enumerate(arrivals, 1)), m.itls
    assert all(gap <= 0.1 + SLACK for gap in m.itls), m.itls  # no 600 ms usage gap counted
    # E2E ends at [DONE], after the usage chunk: >= 300 + 4*100 + 600 ms.
    assert 1.3 - EPS <= m.e2el <= 1.3 + 2 * SLACK
    # TPOT divides by the server's token count (10, from usage), not by the 5 chunks:
    # chunk counting would give (e2el - ttft) / 4 >= 250 ms.
    assert (r.output_tokens, r.output_tokens_source) == (10, "usage")
    assert m.tpot == pytest.approx((m.e2el - m.ttft) / 9)
    assert 1.0 / 9 - EPS <= m.tpot <= 0.2
    assert (r.prompt_tokens, r.prompt_tokens_source) == (7, "usage")
    assert r.generated_text == " one two three four five"


async def test_output_tokens_fall_back_to_chunks_without_usage(fake_server):
    server = fake_server(lambda body, i: Script(gap=0.01, texts=["x", "y", "z"]))
    r = await one_request(server, "/v1/completions", [1, 2], include_usage=False)
    assert r.success, r.error
    assert (r.output_tokens, r.output_tokens_source) == (3, "chunks")
    assert (r.prompt_tokens, r.prompt_tokens_source) == (3, "estimate")
    assert "stream_options" not in server.requests[0]["body"]


async def test_request_body_and_headers(fake_server):
    server = fake_server(lambda body, i: Script())
    r = await one_request(server, "/v1/completions", [5, 6, 7], api_key="sk-test",
                          ignore_eos=True, extra_body={"top_p": 0.5})
    assert r.success, r.error
    seen = server.requests[0]
    assert seen["path"] == "/v1/completions"
    assert seen["body"] == {"model": "fake-model", "prompt": [5, 6, 7], "max_tokens": 10,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "top_p": 0.5}
    assert seen["headers"]["Authorization"] == "Bearer sk-test"
    assert seen["headers"]["X-Request-Id"] == "req-timed"
