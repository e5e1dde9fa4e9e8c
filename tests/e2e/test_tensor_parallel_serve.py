"""`splitserve serve --tensor-parallel-size 2` colocated (Ray, one decode worker whose engine
runs two rank processes over gloo): greedy completions answer the tokens of a TP=1
in-process engine, again as a prefix-cache hit (disaggregated TP over grpc:
tests/chaos/test_tensor_parallel_disaggregated.py; over mooncake, prefill and decode workers
at TP 2: tests/workers/test_tensor_parallel_mooncake.py)."""

from __future__ import annotations

import random

import requests

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.processes import SplitserveProcess

NEW = 16
KV_BLOCKS = 64


def complete(base: str, served: str, prompt: list[int]) -> dict:
    r = requests.post(base + "/v1/completions", json={"model": served, "prompt": prompt, "max_tokens": NEW,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_tp2_served_colocated_answers_as_a_tp1_engine():
    model = ensure_demo_checkpoint()
    rng = random.Random(32)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (9, 50)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=KV_BLOCKS) as engine:
        tok = Tokenizer(model)
        want = [tok.decode(o.token_ids) for o in engine.generate(prompts, params)]
    serve = SplitserveProcess("serve", ["-tp", "2", "--prefill-workers", "0", "--decode-workers", "1",
                                        "--num-kv-blocks", str(KV_BLOCKS)])
    try:
        for prompt, text in zip(prompts, want, strict=True):
            assert complete(serve.base_url, model.name, prompt)["choices"][0]["text"] == text
        again = complete(serve.base_url, model.name, prompts[1])  # its blocks are cached on the worker
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        assert again["choices"][0]["text"] == want[1]
    finally:
        serve.stop()
    log = serve.log()
    assert "tensor-parallel engine: 2 ranks over gloo" in log, log[-3000:]
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]

