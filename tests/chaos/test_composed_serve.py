"""Features composed in one deployment (issue 50): `splitserve serve -tp 2` disaggregated (one
prefill and two decode workers, every engine two rank processes) with `--enable-lora`, a host KV
tier (`--kv-offload-gib`) and n-gram speculation (`--speculative-config`) all at once.

- base and adapter prompts, long (prefilled on the prefill worker under the adapter, KV pushed
  TP=2 -> TP=2) and short (colocated), answer transformers' and transformers + PEFT's greedy
  tokens, with n-gram drafts accepted on the decode workers;
- their prefixes evicted from the device pools by filler traffic and asked again: served from
  the host tier (blocks loaded back, counted), the same tokens;
- streams under the adapter and the base model when one rank of their decode worker freezes
  (SIGSTOP): the worker leaves the registry, the streams migrate and finish token-exact on the
  other decode worker, and after SIGCONT every pool is idle."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from tests.chaos.conftest import LONG_TOKENS, Serve
from tests.chaos.test_tensor_parallel_disaggregated import children, decode_workers
from tests.engine.test_spec_decode_exact import copy_heavy
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy
from tests.reliability.conftest import SERVED, metric, prompts

ADAPTER = "all-r8"
NEW = 24
STREAM_TOKENS = 256  # with 20 ms added to every decode step: open for seconds, so the freeze lands mid-stream
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SLOW_DECODE = [{"engine": f"decode-{i}", "fault": "slow", "at_step": 0, "step_ms": 20} for i in (0, 1)]


@pytest.fixture(scope="module")
def composed(make_ckpt, tmp_path_factory):
    base = make_ckpt("llama")
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapters") / ADAPTER, **ADAPTERS[ADAPTER])
    s = Serve(base, tmp_path_factory.mktemp("composed"), extra_args=[
        "-tp", "2", "--engine-heartbeat-timeout", "3", "--num-kv-blocks", "64",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", f"{ADAPTER}={adapter}",
        "--kv-offload-gib", "0.05", "--speculative-config", json.dumps(SPEC)],
        env={"SPLITSERVE_FAULT_INJECTION": json.dumps(SLOW_DECODE)})
    client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)
    yield s, client, base, adapter
    s.stop()
    log = s.log()
    assert s.proc.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]


def complete(client, model: str, prompt: list[int]) -> tuple[str, dict, dict]:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0,
                                                      extra_body={"ignore_eos": True})
    out = raw.parse()
    workers = dict(p.split("=", 1) for p in raw.headers["x-splitserve-workers"].split("; "))
    return out.choices[0].text, workers, out.usage.model_dump()


def decode_metric(s: Serve, name: str, **labels) -> float:
    return sum(metric(w.admin, name, **labels) for w in s.workers().values() if w.role == "decode")


def test_base_and_adapter_disaggregated_and_again_from_the_host_tier(composed):
    s, client, base, adapter = composed
    tok = Tokenizer(base)
    cases = [(SERVED, copy_heavy(5001, 40, 5)), (ADAPTER, copy_heavy(5002, 40, 5)),  # 220 tokens: prefill-0
             (ADAPTER, copy_heavy(5003, 12, 3))]  # 42 tokens: prefilled on the decode worker
    want = [tok.decode(peft_greedy(base, None if m == SERVED else adapter, p, NEW)) for m, p in cases]
    assert want[1] != tok.decode(peft_greedy(base, None, cases[1][1], NEW))  # the adapter changes the answer
    for (model, prompt), text in zip(cases, want, strict=True):
        got, workers, _ = complete(client, model, prompt)
        assert got == text, (model, workers)
        assert workers.get("prefill", "decode").startswith("prefill" if len(prompt) >= LONG_TOKENS else "decode")
    assert decode_metric(s, "splitserve_spec_decode_num_accepted_tokens_total") > 0  # n-gram drafts taken
    loaded = decode_metric(s, "splitserve_kv_offload_loaded_blocks_total")
    # filler traffic: 24 prompts of 12 blocks each through 2 decode pools of 64 blocks evict the
    # cases' blocks to the tiers
    for filler in prompts(5004, 24, LONG_TOKENS):
        client.completions.create(model=SERVED, prompt=filler, max_tokens=2, temperature=0)
    for (model, prompt), text in zip(cases[:2], want[:2], strict=True):
        got, workers, usage = complete(client, model, prompt)
        assert got == text, (model, workers)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 12 * 16, (model, usage)
    assert decode_metric(s, "splitserve_kv_offload_loaded_blocks_total") - loaded >= 12  # from the host tier


def test_base_and_adapter_streams_migrate_token_exact_when_a_rank_freezes(composed):
    s, client, base, adapter = composed
    tok = Tokenizer(base)
    jobs = [(SERVED, copy_heavy(5011, 40, 5)), (ADAPTER, copy_heavy(5012, 40, 5)), (ADAPTER, prompts(5013, 1, 30)[0]),
            (SERVED, prompts(5014, 1, 30)[0])]
    want = [tok.decode(peft_greedy(base, None if m == SERVED else adapter, p, STREAM_TOKENS)) for m, p in jobs]
    migrations = metric(s.base_url, "splitserve_request_migrations_total")
    pieces: list[list[str]] = [[] for _ in jobs]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        model, prompt = jobs[i]
        try:
            for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=STREAM_TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                pieces[i].extend(c.text for c in chunk.choices)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the stream it ended
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(len(p) >= 4 for p in pieces):
            assert time.monotonic() < deadline, "the streams never got under way"
            time.sleep(0.01)
        healths = {w.worker_id: w.health() for w in s.workers().values() if w.role == "decode"}
        victim = next((w for w, h in healths.items() if h.get("streams")), None)
        assert victim is not None, f"every stream had already ended: {healths}"
        (rank1,) = children(healths[victim]["engine"]["pid"])
        os.kill(rank1, signal.SIGSTOP)
        stopped.append(rank1)
        frozen = time.monotonic()
        while victim in decode_workers(s):
            assert time.monotonic() - frozen < 60, f"{victim} stayed registered with a frozen rank"
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=180)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert not errors, errors
    for (model, _), got, text in zip(jobs, pieces, want, strict=True):
        assert "".join(got) == text, model
    assert metric(s.base_url, "splitserve_request_migrations_total") > migrations
    s.wait_recovered(timeout=120)
    deadline = time.monotonic() + 60
    while len(decode_workers(s)) < 2:  # the thawed worker registers again
        assert time.monotonic() < deadline, decode_workers(s)
        time.sleep(0.2)
    assert requests.get(s.base_url + "/health", timeout=5).status_code == 200
