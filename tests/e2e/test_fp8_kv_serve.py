"""`splitserve serve --kv-cache-dtype fp8` on the demo model with 1 prefill and 1 decode
worker (Ray, gRPC KV transfer of fp8 blocks): greedy completions, disaggregated and then as
a prefix-cache hit, answer the tokens an in-process engine with an fp8 KV cache makes; the
start-up lines and the metrics report the pool's tokens and dtype."""

from __future__ import annotations

import random
import re

import requests

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.pools import serve_admins
from tests.helpers.processes import SplitserveProcess

NEW = 24
KV_BLOCKS = 96


def complete(base: str, served: str, prompt: list[int]) -> tuple[dict, dict]:
    r = requests.post(base + "/v1/completions", json={"model": served, "prompt": prompt, "max_tokens": NEW,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    workers = dict(part.split("=", 1) for part in r.headers["x-splitserve-workers"].split("; "))
    return r.json(), workers


def test_fp8_kv_served_disaggregated_answers_as_an_fp8_engine():
    model = ensure_demo_checkpoint()
    serve = SplitserveProcess("serve", ["--kv-cache-dtype", "fp8", "--strict-disaggregation", "--prefill-workers", "1", "--decode-workers", "1",
                                        "--num-kv-blocks", str(KV_BLOCKS), "--disagg-min-uncached-tokens", "24"])
    try:
        served = model.name
        rng = random.Random(31)
        prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (40, 75)]
        engine = LLM(str(model), num_kv_blocks=KV_BLOCKS, kv_cache_dtype="fp8")
        tok = Tokenizer(model)
        for prompt in prompts:
            want = tok.decode(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW,
                                                                     ignore_eos=True))[0].token_ids)
            out, workers = complete(serve.base_url, served, prompt)
            assert workers["prefill"] == "prefill-0" and workers["decode"] == "decode-0", workers
            assert out["choices"][0]["text"] == want
            again, _ = complete(serve.base_url, served, prompt)  # its blocks are cached on the decode worker
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * ((len(prompt) - 1) // 16)
            assert again["choices"][0]["text"] == want
        log = serve.log()
        tokens = KV_BLOCKS * 16
        for role in ("decode", "prefill"):
            assert re.search(rf"{role} worker {role}-0: .*{KV_BLOCKS} KV blocks = {tokens} tokens of float8_e4m3fn",
                             log), log[-3000:]
        metrics = {w: requests.get(url + "/metrics", timeout=10).text for w, url in serve_admins(log).items()}
        for worker, text in metrics.items():
            assert re.search(rf'splitserve_kv_capacity_tokens\{{[^}}]*worker="{worker}"[^}}]*\}} {tokens}\.0', text), \
                worker
        sent = re.search(r'splitserve_kv_transfer_bytes_total\{[^}]*direction="sent"[^}]*\} ([0-9.e+]+)',
                         metrics["prefill-0"])
        assert sent and float(sent.group(1)) > 0  # the fp8 blocks did cross
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]
