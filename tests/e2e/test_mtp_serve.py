"""`splitserve serve --speculative-config '{"method": "mtp", ...}'` on a tiny DeepSeek-V3 whose
MTP layer reproduces the model (tests/engine/test_spec_decode_mtp.py), 1 prefill and 1 decode
worker: a short prompt prefilled on the decode worker (the MTP layer's rows cover the prompt)
and a long one on the prefill worker (the decode worker has no hidden states for the prompt:
its MTP rows start at the first token it decodes), each text equal to transformers' greedy
continuation; the decode worker's /metrics count drafts kept."""

from __future__ import annotations

import json
import time

import requests

from splitserve.core.tokenizer import Tokenizer
from tests.e2e.test_spec_decode_serve import complete, counter
from tests.engine.test_spec_decode_mtp import MTP, write_mtp_checkpoint
from tests.helpers.pools import serve_admins
from tests.helpers.processes import SplitserveProcess
from tests.helpers.reference import hf_greedy
from tests.reliability.conftest import prompts

NEW = 40


def test_mtp_serve_disaggregated_answers_as_transformers(tmp_path):
    model = write_mtp_checkpoint(tmp_path / "deepseek_v3_mtp", "deepseek_v3", reproduces=True)
    serve = SplitserveProcess("serve", ["--model", str(model), "--speculative-config", json.dumps(MTP),
                                        "--prefill-workers", "1", "--decode-workers", "1", "--num-kv-blocks", "128",
                                        "--disagg-min-uncached-tokens", "48", "--strict-disaggregation"])
    try:
        tok = Tokenizer(str(model))
        short, long = prompts(11, 1, 20)[0], prompts(12, 1, 70)[0]
        for prompt, prefilled_on in [(short, "decode"), (long, "prefill")]:
            out, workers = complete(serve.base_url, model.name, prompt)
            assert workers["decode"] == "decode-0", workers
            assert workers.get("prefill", "decode-0").startswith(prefilled_on), workers
            assert out["choices"][0]["text"] == tok.decode(hf_greedy(model, prompt, NEW))
        admins = serve_admins(serve.log())
        deadline = time.monotonic() + 10  # the counters follow the engine's stats at the next load report
        while True:
            decode = requests.get(admins["decode-0"] + "/metrics", timeout=10).text
            drafted = counter(decode, "splitserve_spec_decode_num_draft_tokens_total", worker="decode-0")
            if drafted or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        kept = counter(decode, "splitserve_spec_decode_num_accepted_tokens_total", worker="decode-0")
        assert drafted > 0 and kept > drafted / 2, decode
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]
