"""`splitserve serve` with two decode workers, `--routing-mode round-robin` and host KV tiers
(`--kv-offload-gib`): the first request's blocks, once idle, reach the holder's host tier and
the router's index (under the holder's tier holder); the second request, sharing a
2,000-token prefix, lands on the worker without it, which pulls the prefix blocks from its
peer over the KV transfer (the router's pull hint; the worker's metric counts the blocks)
and answers the tokens of an in-process engine; every pool is back at idle."""

from __future__ import annotations

import random
import re
import time

import requests

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.pools import serve_admins, wait_pools_idle
from tests.helpers.processes import SplitserveProcess

NEW = 8
KV_BLOCKS = 160
rng = random.Random(41)
PREFIX = [rng.randrange(5, 1000) for _ in range(2000)]  # 125 blocks
PREFIX_BLOCKS = len(PREFIX) // 16


def complete(base: str, served: str, prompt: list[int]) -> tuple[dict, dict, str]:
    r = requests.post(base + "/v1/completions", json={"model": served, "prompt": prompt, "max_tokens": NEW,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    workers = dict(part.split("=", 1) for part in r.headers["x-splitserve-workers"].split("; "))
    return r.json(), workers, r.headers["x-splitserve-route"]


def metric(text: str, name: str, **labels) -> float:
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? ([0-9.e+]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def wait_indexed(base: str, blocks: int, timeout: float = 30.0) -> None:
    """Until the router's index holds `blocks` blocks (the first worker's KV events arrived)."""
    deadline = time.monotonic() + timeout
    while metric(requests.get(base + "/metrics", timeout=10).text, "splitserve_router_index_blocks") < blocks:
        assert time.monotonic() < deadline, "the router never indexed the first request's blocks"
        time.sleep(0.1)


def test_round_robin_second_request_pulls_the_prefix_from_its_peer():
    model = ensure_demo_checkpoint()
    served = model.name
    first, second = PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]
    with LLM(str(model), num_kv_blocks=KV_BLOCKS) as llm:
        want = [o.token_ids for o in llm.generate([first, second], SamplingParams(temperature=0, max_tokens=NEW,
                                                                                  ignore_eos=True))]
    serve = SplitserveProcess("serve", ["--prefill-workers", "0", "--decode-workers", "2", "--routing-mode",
                                        "round-robin", "--num-kv-blocks", str(KV_BLOCKS), "--kv-offload-gib", "0.01"])
    try:
        out, workers, _ = complete(serve.base_url, served, first)
        holder = workers["decode"]
        assert out["choices"][0]["text"] and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_indexed(serve.base_url, PREFIX_BLOCKS)
        # its idle blocks were written down to its host tier: the router indexes them under its tier holder
        deadline = time.monotonic() + 30
        while requests.get(serve.base_url + "/health", timeout=10).json()["index"]["per_worker"].get(
                f"{holder}@offload", 0) < PREFIX_BLOCKS:
            assert time.monotonic() < deadline, "the holder's host-tier blocks never reached the router's index"
            time.sleep(0.1)
        out, workers, route = complete(serve.base_url, served, second)
        puller = workers["decode"]
        assert puller != holder  # round robin
        assert f"pull={holder}:{PREFIX_BLOCKS}" in route, route
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_BLOCKS * 16  # pulled, not computed
        admins = serve_admins(serve.log())
        text = requests.get(admins[puller] + "/metrics", timeout=10).text
        assert metric(text, "splitserve_kv_peer_pull_blocks_total", worker=puller, direction="pulled") == PREFIX_BLOCKS
        assert metric(text, "splitserve_kv_offload_blocks", worker=puller, tier="host", state="capacity") > 0
        holder_text = requests.get(admins[holder] + "/metrics", timeout=10).text
        assert metric(holder_text, "splitserve_kv_peer_pull_blocks_total", worker=holder,
                      direction="pushed") == PREFIX_BLOCKS
        from splitserve.core.tokenizer import Tokenizer

        tok = Tokenizer(model)
        assert out["choices"][0]["text"] == tok.decode(want[1])
        wait_pools_idle(admins)
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]
