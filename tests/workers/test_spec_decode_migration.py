"""A speculating request migrated mid-stream resumes token-exact: two real decode workers with
--speculative-config (ngram, a draft model: the target as its own draft, or an MTP layer) on 127.0.0.1 behind the router's Dispatcher, the first failing a
step (fault injection) after drafts were accepted; the stream the client gets, greedy and
seeded, equals an in-process engine's without speculation, and the second worker
speculated on the resumed request."""

import json

import pytest

from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.engine.faults import ENV
from tests.engine.test_spec_decode_exact import NGRAM, copy_heavy
from tests.engine.test_spec_decode_mtp import MTP, write_mtp_checkpoint
from tests.helpers.migration_pair import migration_pair, to


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=4, seed=77, max_tokens=48, ignore_eos=True),
])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
async def test_a_migrated_speculating_stream_resumes_token_exact(make_ckpt, monkeypatch, tmp_path, params, method):
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-fail", "fault": "raise", "at_step": 4}]))
    # mtp: a tiny DeepSeek-V3 whose MTP layer reproduces it (its rows start anew on the second worker)
    path = str(make_ckpt("llama") if method != "mtp" else
               write_mtp_checkpoint(tmp_path / "mtp", "deepseek_v3", reproduces=True))
    config = {"ngram": NGRAM, "mtp": MTP,
              "draft_model": {"method": "draft_model", "model": path, "num_speculative_tokens": 3}}[method]
    prompt = copy_heavy(61, 20, 3)
    want = LLM(path, num_kv_blocks=64).generate(prompt, params)[0].token_ids
    async with migration_pair(EngineConfig(model=path, num_kv_blocks=64, speculative_config=config)) as (
            dispatcher, workers):
        events = [e async for e in dispatcher.generate("r", prompt, params, to("d-fail"))]
        resumed = workers[1].stats.spec_decode
    assert [e.decode_worker for e in events if e.decode_worker] == ["d-fail", "d-ok"]  # it did migrate
    moved = next(i for i, e in enumerate(events) if e.decode_worker == "d-ok")
    first_part = sum(len(e.token_ids) for e in events[:moved])
    assert 0 < first_part < len(want)
    assert [t for e in events for t in e.token_ids] == want
    assert resumed.num_accepted_tokens > 0  # the new worker speculated on the resumed request
