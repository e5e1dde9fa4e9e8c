"""One real cluster for the reliability tests: redis-server, 2 decode workers, 1 prefill
worker (tests/reliability/faulty_prefill.py: faults chosen per request by its seed) and a router,
each its own OS process, every gRPC link over mutual TLS. Tests that kill a process start a replacement before they end,
so the next test finds the same shape. Greedy references come from the engine in this
process (an undisturbed run of the same model)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from tests.reliability.cluster import SERVED, Cluster
from tests.reliability.faulty_prefill import FAULT_SEEDS
from tests.security.certs import make_pki

FAULTY_PREFILL = "tests.reliability.faulty_prefill"  # FAULT_SEEDS choose its faults per request


@pytest.fixture(scope="session")
def cluster(make_ckpt, tmp_path_factory):
    """Every gRPC link of this cluster runs over mutual TLS (--tls-* flags on every
    process): the fault and load tests double as the end-to-end proof that TLS works."""
    certs = make_pki(tmp_path_factory.mktemp("pki"), "cluster")
    c = Cluster(make_ckpt("llama"), tmp_path_factory.mktemp("reliability"), tls_args=certs.args())
    c.start_redis()
    try:
        with ThreadPoolExecutor(3) as pool:  # model loading overlaps
            starts = [pool.submit(c.start_decode, "decode-0"), pool.submit(c.start_decode, "decode-1"),
                      pool.submit(c.start_prefill, "prefill-0", FAULTY_PREFILL)]
            for f in starts:
                f.result()
        c.router = c.start_router()
        c.wait_registered(c.router)
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def pools_back_to_idle(request):
    """After each test on the cluster: every live worker's pool at idle (tests/helpers/pools.py)."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").wait_all_blocks_free()


@pytest.fixture(scope="session")
def reference(make_ckpt):
    """Greedy token ids and text from an undisturbed engine, cached per (prompt, max_tokens)."""
    model = make_ckpt("llama")
    llm = LLM(str(model), num_kv_blocks=512)
    tok = Tokenizer(str(model))
    cache: dict = {}

    def ref(prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], str]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if todo:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for p, out in zip(todo, llm.generate(todo, params), strict=True):
                cache[(tuple(p), max_tokens)] = (out.token_ids, tok.decode(out.token_ids))
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    return ref


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(n)]


@dataclass
class StreamResult:
    status: int = 0
    route: str = ""
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # one entry per generated token (logprobs)
    finish: str | None = None
    usage: dict | None = None
    errors: list[dict] = field(default_factory=list)
    done: bool = False
    chunks: int = 0
    body: dict | None = None
    headers: dict = field(default_factory=dict)

    @property
    def decode_worker(self) -> str:
        return self.route.split(";")[0].split("=")[-1].strip() if self.route else ""


def with_fault(body: dict, fault: str | None) -> dict:
    """The faulty prefill worker's fault for this request (tests/reliability/faulty_prefill.py)."""
    if fault is not None:
        body["seed"] = FAULT_SEEDS[fault]  # greedy: the seed changes nothing else
    return body


async def stream_completion(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int,
                            request_id: str | None = None, headers: dict | None = None,
                            out: StreamResult | None = None, fault: str | None = None) -> StreamResult:
    """Stream one greedy completion, filling `out` as chunks arrive (tests watch progress)."""
    body = with_fault({"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}},
                      fault)
    hdrs = dict(headers or {})
    if request_id:
        hdrs["X-Request-Id"] = request_id
    out = out if out is not None else StreamResult()
    async with session.post(base + "/v1/completions", json=body, headers=hdrs) as resp:
        out.status, out.headers = resp.status, dict(resp.headers)
        out.route = resp.headers.get("X-Splitserve-Route", "")
        if resp.status != 200:
            out.body = await resp.json()
            return out
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                out.done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                out.errors.append(obj["error"])
                continue
            out.usage = obj.get("usage") or out.usage
            for ch in obj["choices"]:
                out.text += ch["text"]
                out.tokens += (ch.get("logprobs") or {}).get("tokens", [])
                out.finish = ch["finish_reason"] or out.finish
            out.chunks += 1
    return out


async def complete(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int,
                   request_id: str | None = None, fault: str | None = None) -> tuple[int, dict, dict]:
    """Non-streaming greedy completion: (status, body, headers)."""
    body = with_fault({"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}, fault)
    async with session.post(base + "/v1/completions", json=body,
                            headers={"X-Request-Id": request_id} if request_id else {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def served_by(headers: dict) -> dict:
    return dict(part.split("=", 1) for part in headers["X-Splitserve-Workers"].split("; "))


def assert_identical(results: list[StreamResult], expected: list[tuple[list[int], str]], max_tokens: int) -> None:
    """Every stream completed cleanly with exactly the undisturbed greedy tokens."""
    for i, (r, (ids, text)) in enumerate(zip(results, expected, strict=True)):
        assert r.status == 200 and not r.errors and r.done, (i, r)
        assert r.finish == "length" and len(ids) == max_tokens, (i, r.finish)
        assert len(r.tokens) == max_tokens, f"stream {i}: {len(r.tokens)} tokens streamed, expected {max_tokens}"
        assert r.usage["completion_tokens"] == max_tokens, (i, r.usage)
        assert r.text == text, f"stream {i} differs from the undisturbed run"


def run(coro):
    return asyncio.run(coro)


def metric(base_url: str, name: str, **labels) -> float:
    """Sum of a Prometheus counter's samples (matching `labels`) at a /metrics endpoint."""
    total = 0.0
    for line in requests.get(base_url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
