"""Bodies a hostile or broken client sends, against a real `splitserve serve`: each is a 4xx
in OpenAI's error format (never a 500, a hang or a 200 with an empty stream), and a prompt
of megabytes neither stalls the router's event loop (its /health stays fast, no worker
drops out of the registry) nor leaves the router holding the memory."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import pytest
import requests

from tests.chaos.conftest import SERVED
from tests.reliability.conftest import assert_identical, prompts, stream_completion

DEEP = 10_000
HUGE_INT = int("9" * 400)


def body(path_fields: dict) -> bytes:
    """JSON as a client would send it: json.dumps writes a lone surrogate as \\udXXX."""
    return json.dumps({"model": SERVED, **path_fields}).encode()


def deep(inner_open: str, inner_close: str, before: str) -> bytes:
    """A body with one value nested DEEP levels (too deep for json.dumps to write)."""
    return f'{{"model": "{SERVED}", {before}{inner_open * DEEP}1{inner_close * DEEP}}}'.encode()


CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE = [
    ("nested arrays 10,000 deep as the prompt", "/v1/completions", deep("[", "]", '"prompt": '), 400, "invalid_json"),
    ("nested objects 10,000 deep in an unknown field", "/v1/chat/completions",
     deep('{"a":', "}", '"messages": [{"role": "user", "content": "hi"}], "x": '), 400, "invalid_json"),
    ("lone surrogate in prompt", "/v1/completions", body({"prompt": "hello \ud800 world", "max_tokens": 2}), 400,
     "invalid_value"),
    ("lone low surrogate in chat content", "/v1/chat/completions",
     body({"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}), 400, "invalid_value"),
    ("lone surrogate in stop", "/v1/completions", body({"prompt": "hello", "stop": ["\ud800"], "max_tokens": 2}),
     400, "invalid_value"),
    ("lone surrogate in stop, streaming", "/v1/completions",
     body({"prompt": "hello", "stop": "x\udbff", "max_tokens": 2, "stream": True}), 400, "invalid_value"),
    ("lone surrogate in a content part", "/v1/chat/completions",
     body({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}), 400, "invalid_value"),
    ("a reversed surrogate pair", "/v1/completions", body({"prompt": "\ude00\ud83d", "max_tokens": 2}), 400,
     "invalid_value"),
    ("lone surrogate in a field name", "/v1/chat/completions", body({**CHAT_HI, "x\ud800": 1}), 400,
     "invalid_value"),
    *[(f"{name} as a 400-digit integer", "/v1/completions", body({"prompt": "hi", "max_tokens": 2, name: HUGE_INT}),
       400, "invalid_value") for name in ("temperature", "top_p", "min_p")],
    ("temperature 1e308 (infinite as float32)", "/v1/completions",
     body({"prompt": "hi", "max_tokens": 2, "temperature": 1e308}), 400, None),
    ("max_tokens as a 400-digit integer", "/v1/completions", body({"prompt": "hi", "max_tokens": HUGE_INT}), 400,
     None),
]


@pytest.mark.parametrize("what, path, body, status, code", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_is_a_clean_4xx(serve, what, path, body, status, code):
    r = requests.post(serve.base_url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, (what, r.status_code, r.text[:300])
    assert r.headers["Content-Type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    if code is not None:
        assert err["code"] == code, err


def test_a_50mb_body_is_refused_at_once(serve):
    """Refused once the body passes the limit (16 MiB), not after all of it arrived: the
    client sends the headers and 17 MiB of the 50, then only reads, and gets its 413 (a
    router that read the whole body first would wait for the rest until its body-read
    timeout and answer 408). No clock in the assertion."""
    body = json.dumps({"model": SERVED, "prompt": "a " * (25 << 20)}).encode()
    url = urlparse(serve.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:17 << 20])
        response = http.client.HTTPResponse(s)
        response.begin()
        payload = json.loads(response.read())
    assert response.status == 413, payload
    assert "--max-request-body-mb" in payload["error"]["message"]
    assert serve.router_health()["status"] == "ok"


def _words(n_chars: int, seed: int) -> str:
    words = (Path(__file__).parents[2] / "splitserve/engine/demo_corpus.txt").read_text().split()
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


class HealthProbe(threading.Thread):
    """GET /health every 10 ms; keeps the slowest answer and every worker list seen."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.url = base_url + "/health"
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.worker_sets: set[tuple] = set()

    def run(self) -> None:
        with requests.Session() as s:
            while not self.stop.is_set():
                t0 = time.monotonic()
                body = s.get(self.url, timeout=10).json()
                self.latencies.append(time.monotonic() - t0)
                self.worker_sets.add((tuple(body["decode_workers"]), tuple(body["prefill_workers"])))
                time.sleep(0.01)


def _5mb_body(shape: str) -> dict:
    if shape == "completion":
        return {"model": SERVED, "prompt": _words(5 << 20, seed=4), "max_tokens": 4}
    if shape == "chat":
        return {"model": SERVED, "messages": [{"role": "user", "content": _words(5 << 20, seed=5)}], "max_tokens": 4}
    # 130,000 short messages: JSON parsing and validation alone take about 0.3 s
    return {"model": SERVED, "messages": [{"role": "user", "content": w} for w in _words(5 << 20, 6).split(" ")[:130_000]],
            "max_tokens": 4}


@pytest.mark.parametrize("shape", ["completion", "chat", "chat-many-messages"])
def test_a_5mb_prompt_keeps_health_fast_the_registry_whole_and_memory_flat(serve, shape):
    chat = shape != "completion"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    data = json.dumps(_5mb_body(shape)).encode()
    for _ in range(2):  # warm: the tokenizer pool's threads and allocator arenas exist before we measure
        requests.post(serve.base_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
    time.sleep(1.0)
    rss_before = serve.router_rss()
    probe = HealthProbe(serve.base_url)
    probe.start()
    time.sleep(0.3)
    r = requests.post(serve.base_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)
    time.sleep(0.3)
    probe.stop.set()
    probe.join()
    rss_after = serve.router_rss()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    slowest = max(probe.latencies)
    print(f"{len(data) / 2**20:.1f} MiB {shape} body: refused in {r.elapsed.total_seconds():.2f}s; "
          f"/health answered {len(probe.latencies)} times, slowest {slowest * 1000:.0f} ms; router RSS "
          f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    # Inline tokenizing stalled /health for the whole request (3-5 s of its 3-5 s). The bound
    # scales with the request's own time, so a slower or busier machine moves both sides; a
    # request refused in milliseconds cannot have stalled anything, hence the 0.5 s floor.
    took = r.elapsed.total_seconds()
    assert slowest < max(took / 3, 0.5), \
        f"/health took {slowest * 1000:.0f} ms while the {took:.2f}s request was processed"
    assert probe.worker_sets == {(("decode-0", "decode-1"), ("prefill-0",))}, probe.worker_sets
    assert rss_after <= rss_before * 1.10, (rss_before, rss_after)


def test_clients_reusing_one_x_request_id_do_not_collide(serve, reference):
    """The client's X-Request-Id is a correlation id only: requests get router-made ids on
    the workers, so four concurrent requests sharing one header all complete."""
    batch = prompts(811, 4, 30)

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(stream_completion(s, serve.base_url, p, 40, request_id="same-id")
                                          for p in batch))

    results = asyncio.run(go())
    assert_identical(results, reference(batch, 40), 40)
    assert {r.headers["X-Request-ID"] for r in results} == {"same-id"}
    assert len({r.headers["X-Splitserve-Request-Id"] for r in results}) == 4
