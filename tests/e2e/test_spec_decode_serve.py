"""`splitserve serve --speculative-config` (n-gram) on the demo model with 1 prefill and 1 decode
worker: greedy and seeded completions, colocated (a short prompt the decode worker prefills
itself) and disaggregated (the decode worker speculates once the prefill worker's KV
arrived), answer the tokens of an in-process engine without speculation; the decode worker's
/metrics count the drafts it verified and accepted."""

from __future__ import annotations

import json
import re
import time

import requests

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.engine.test_spec_decode_exact import copy_heavy
from tests.helpers.pools import serve_admins
from tests.helpers.processes import SplitserveProcess

NEW = 40
KV_BLOCKS = 128
CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def complete(base: str, served: str, prompt: list[int], **sampling) -> tuple[dict, dict]:
    body = {"model": served, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, **sampling}
    r = requests.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    workers = dict(part.split("=", 1) for part in r.headers["x-splitserve-workers"].split("; "))
    return r.json(), workers


def counter(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_speculative_serve_colocated_and_disaggregated_answers_as_an_engine_without_it():
    model = ensure_demo_checkpoint()
    serve = SplitserveProcess("serve", ["--speculative-config", json.dumps(CONFIG), "--prefill-workers", "1",
                                        "--decode-workers", "1", "--num-kv-blocks", str(KV_BLOCKS),
                                        "--disagg-min-uncached-tokens", "48", "--strict-disaggregation"])
    try:
        served = model.name
        engine = LLM(str(model), num_kv_blocks=KV_BLOCKS)
        tok = Tokenizer(model)
        cases = [(copy_heavy(41, 12, 3), "decode", {}),  # 42 tokens: prefilled on the decode worker
                 (copy_heavy(42, 30, 3), "prefill", {}),  # 105: prefilled on the prefill worker
                 (copy_heavy(43, 30, 2), "prefill", {"temperature": 0.8, "seed": 5})]
        for prompt, prefilled_on, sampling in cases:
            params = SamplingParams(max_tokens=NEW, ignore_eos=True, **{"temperature": 0, **sampling})
            want = tok.decode(engine.generate(prompt, params)[0].token_ids)
            out, workers = complete(serve.base_url, served, prompt, **sampling)
            assert workers["decode"] == "decode-0", workers
            assert workers.get("prefill", "decode-0").startswith(prefilled_on), workers
            assert out["choices"][0]["text"] == want
            assert out["usage"]["completion_tokens"] == NEW
        metrics = {w: requests.get(url + "/metrics", timeout=10).text for w, url in serve_admins(serve.log()).items()}
        decode = metrics["decode-0"]
        drafted = counter(decode, "splitserve_spec_decode_num_draft_tokens_total", worker="decode-0")
        kept = counter(decode, "splitserve_spec_decode_num_accepted_tokens_total", worker="decode-0")
        steps = counter(decode, "splitserve_spec_decode_num_drafts_total", worker="decode-0")
        first = counter(decode, "splitserve_spec_decode_num_accepted_tokens_per_pos_total", worker="decode-0",
                        position="0")
        assert drafted >= kept > 0 and steps > 0 and 0 < first <= steps, decode
        assert counter(decode, "splitserve_spec_decode_num_accepted_tokens_per_pos_total") == kept
        assert not re.search(r"splitserve_spec_decode_num_drafts_total\{[^}]*\} [1-9]", metrics["prefill-0"])
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]


def test_speculative_serve_with_a_draft_model_answers_as_an_engine_without_it():
    """method draft_model, the demo model as its own draft (every draft is kept), 1 prefill and
    1 decode worker: a short prompt prefilled on the decode worker, a long one on the prefill
    worker (the draft model rebuilds its KV on the decode worker), greedy and seeded."""
    model = ensure_demo_checkpoint()
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    serve = SplitserveProcess("serve", ["--speculative-config", json.dumps(config), "--prefill-workers", "1",
                                        "--decode-workers", "1", "--num-kv-blocks", str(KV_BLOCKS),
                                        "--disagg-min-uncached-tokens", "48", "--strict-disaggregation"])
    try:
        engine = LLM(str(model), num_kv_blocks=KV_BLOCKS)
        tok = Tokenizer(model)
        cases = [(copy_heavy(44, 12, 3), "decode", {}), (copy_heavy(45, 30, 3), "prefill", {}),
                 (copy_heavy(46, 30, 2), "prefill", {"temperature": 0.8, "seed": 9})]
        for prompt, prefilled_on, sampling in cases:
            params = SamplingParams(max_tokens=NEW, ignore_eos=True, **{"temperature": 0, **sampling})
            want = tok.decode(engine.generate(prompt, params)[0].token_ids)
            out, workers = complete(serve.base_url, model.name, prompt, **sampling)
            assert workers["decode"] == "decode-0", workers
            assert workers.get("prefill", "decode-0").startswith(prefilled_on), workers
            assert out["choices"][0]["text"] == want
        admins = serve_admins(serve.log())
        deadline = time.monotonic() + 10  # the counters follow the engine's stats at the next load report
        while True:
            decode = requests.get(admins["decode-0"] + "/metrics", timeout=10).text
            drafted = counter(decode, "splitserve_spec_decode_num_draft_tokens_total", worker="decode-0")
            if drafted or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert counter(decode, "splitserve_spec_decode_num_accepted_tokens_total", worker="decode-0") == drafted > 0
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]
