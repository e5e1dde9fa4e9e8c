"""Each newly supported family through `splitserve serve` for real (Ray, 1 prefill and 1
decode worker, gRPC KV transfer): prompts longer than the sliding window go through the
prefill worker (disaggregated) and come back token for token as transformers' generate
makes them, a Phi-3 prompt that grows past its longrope switch is recomputed on the
decode worker, and a repeated prompt is a prefix-cache hit with the same output (gpt-oss:
its attention sinks and 8-token window on both workers, the KV crossing the transfer).

Mistral and dense Qwen3 are served only in-process (tests/engine/test_model_families.py):
through serve they add nothing Mixtral (the same sliding-window attention) and Qwen3-MoE
(the same q/k-normed attention) do not already send over the KV transfer."""

from __future__ import annotations

import random
import secrets
import subprocess
import sys

import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from tests.engine.test_deepseek_v3 import write_deepseek_v3
from tests.engine.test_deepseek_v32 import write_deepseek_v32
from tests.engine.test_glm4_moe import write_glm4_moe
from tests.engine.test_glm_moe_dsa import write_glm_moe_dsa
from tests.engine.test_gpt_oss import write_gpt_oss
from tests.engine.test_minimax_m2 import write_minimax_m2
from tests.engine.test_qwen3_next import write_qwen3_next
from tests.helpers.checkpoints import WINDOW
from tests.helpers.processes import SplitserveProcess
from tests.helpers.reference import hf_greedy

SERVED = "family-under-test"
NEW = 40  # new tokens a request, as in the engine tests
FAMILIES = {"phi3": {}, "gemma2": {}, "gemma3": {}, "mixtral": {"sliding_window": WINDOW}, "qwen3_moe": {},
            "glm4_moe": {}, "minimax_m2": {}, "deepseek_v3": {},
            "deepseek_v32": {}, "glm_moe_dsa": {}, "gpt_oss": {}}
# families whose engine test writes a tiny checkpoint whose routing decides choices
WRITERS = {"glm4_moe": write_glm4_moe, "minimax_m2": write_minimax_m2, "deepseek_v3": write_deepseek_v3,
           "deepseek_v32": write_deepseek_v32, "glm_moe_dsa": write_glm_moe_dsa, "gpt_oss": write_gpt_oss}


def complete(base: str, prompt: list[int]) -> tuple[dict, dict]:
    r = requests.post(base + "/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": NEW,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    workers = dict(part.split("=", 1) for part in r.headers["x-splitserve-workers"].split("; "))
    return r.json(), workers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_served_disaggregated_matches_transformers(make_ckpt, tmp_path, family):
    model = WRITERS[family](tmp_path / family) if family in WRITERS else make_ckpt(family, **FAMILIES[family])
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    serve = SplitserveProcess("serve", ["--model", str(model), "--served-model-name", SERVED,
                                        "--prefill-workers", "1", "--decode-workers", "1", "--num-kv-blocks", "128",
                                        "--disagg-min-uncached-tokens", "24", "--cluster-token-file", str(token),
                                        "--strict-disaggregation"])
    try:
        tok = Tokenizer(model)
        rng = random.Random(7)
        for n in (40, 47, 90):  # past the 32-token window; 47 + 40 crosses Phi-3's 64
            prompt = [rng.randrange(5, 1000) for _ in range(n)]
            out, workers = complete(serve.base_url, prompt)
            assert workers["prefill"] == "prefill-0" and workers["decode"] == "decode-0", workers
            want = tok.decode(hf_greedy(model, prompt, NEW))
            assert out["choices"][0]["text"] == want, (family, n)
            again, workers = complete(serve.base_url, prompt)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * ((n - 1) // 16)
            assert again["choices"][0]["text"] == want
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]  # the whole traceback


def test_a_hybrid_is_served_colocated_and_refused_disaggregated(tmp_path):
    """Qwen3-Next (recurrent state: docs/architecture.md, "Hybrid models with recurrent state"):
    `serve` with its default prefill worker exits 2 with one line before any process starts;
    colocated (--prefill-workers 0) a decode worker computes prompts of 7 to 150 tokens in
    64-token chunks and answers as transformers' generate does."""
    model = write_qwen3_next(tmp_path / "qwen3_next")
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(32))
    common = ["--model", str(model), "--served-model-name", SERVED, "--cluster-token-file", str(token)]
    refused = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", *common], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot be served disaggregated yet (prefill workers)" in refused.stderr
    serve = SplitserveProcess("serve", [*common, "--prefill-workers", "0", "--decode-workers", "1",
                                        "--num-kv-blocks", "64", "--max-num-batched-tokens", "64"])
    try:
        tok = Tokenizer(model)
        rng = random.Random(7)
        for n in (7, 45, 150):
            prompt = [rng.randrange(5, 1000) for _ in range(n)]
            out, workers = complete(serve.base_url, prompt)
            assert workers["decode"] == "decode-0", workers
            assert out["choices"][0]["text"] == tok.decode(hf_greedy(model, prompt, NEW)), n
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]
