"""End to end through the official openai client: outputs equal transformers on every
path, streaming, usage, n, prefix-aware routing, bad requests, router rebuilds."""

import time

import openai
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from tests.e2e.conftest import DISAGG_MIN, SERVED
from tests.helpers.processes import SplitserveProcess
from tests.helpers.reference import hf_greedy

LONG = ("The router sits in front. It tokenizes each request once, hashes the prompt block by block, "
        "and looks in its radix tree for the worker that already holds the longest matching prefix. ")
MORE = ("Prefill is the first pass over the prompt. It is compute bound: every token of the prompt is "
        "processed at once, and the keys and values of each layer are written into blocks of the cache. ")


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def workers(raw) -> dict:
    return dict(part.split("=", 1) for part in raw.headers["x-splitserve-workers"].split("; "))


def reference_text(cluster, prompt_ids, n) -> str:
    tok = Tokenizer(cluster.model)
    return tok.decode(hf_greedy(cluster.model, prompt_ids, n))


def complete(cluster, prompt, n=12):
    raw = client(cluster).completions.with_raw_response.create(model=SERVED, prompt=prompt, max_tokens=n,
                                                               temperature=0)
    return raw, raw.parse()


def test_every_path_matches_transformers(cluster):
    tok = Tokenizer(cluster.model)
    assert len(tok.encode(LONG)) >= DISAGG_MIN + 10 and len(tok.encode("Hello there")) < DISAGG_MIN

    # 1) short prompt: the decode worker prefills itself
    raw, out = complete(cluster, "Hello there")
    w = workers(raw)
    assert w["prefill"] == w["decode"]
    assert out.choices[0].text == reference_text(cluster, tok.encode("Hello there"), 12)

    # 2) long prompt: disaggregated (prefill worker -> KV transfer -> decode worker)
    raw, out = complete(cluster, LONG)
    first = workers(raw)
    assert first["prefill"].startswith("prefill-") and first["decode"].startswith("decode-")
    assert out.choices[0].text == reference_text(cluster, tok.encode(LONG), 12)
    assert out.usage.prompt_tokens == len(tok.encode(LONG)) and out.usage.completion_tokens == 12

    # 3) same prompt again: the router sends it to the decode worker holding it (cache hit there)
    raw, again = complete(cluster, LONG)
    assert workers(raw)["decode"] == first["decode"]
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * ((len(tok.encode(LONG)) - 1) // 16)
    assert again.choices[0].text == out.choices[0].text

    # 4) a longer prompt sharing that prefix: same decode worker (cached prefix), and the
    #    prefill worker that computed the prefix reuses its own cache for the rest
    raw, longer = complete(cluster, LONG + MORE)
    w = workers(raw)
    assert w["decode"] == first["decode"] and int(w["decode_cached"]) >= 16
    assert w["prefill"] == first["prefill"] and int(w["prefill_cached"]) >= 16
    assert longer.choices[0].text == reference_text(cluster, tok.encode(LONG + MORE), 12)

    # 5) chat: the checkpoint's chat template, same tokens as transformers
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]
    chat = client(cluster).chat.completions.create(model=SERVED, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == reference_text(cluster, tok.encode_chat(messages), 10)
    assert chat.usage.prompt_tokens == len(tok.encode_chat(messages))


def test_streamed_chunks_concatenate_to_the_full_text_and_usage_is_last(cluster):
    c = client(cluster)
    full = c.completions.create(model=SERVED, prompt=MORE, max_tokens=16, temperature=0)
    chunks = list(c.completions.create(model=SERVED, prompt=MORE, max_tokens=16, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    chat_chunks = list(c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    chat_full = c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0)
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_chunks) == chat_full.choices[0].message.content
    assert chat_chunks[0].choices[0].delta.role == "assistant"


def test_responses_api_answers_as_chat_completions_and_continues_a_conversation(cluster):
    """/v1/responses through the whole stack: the same greedy answer as chat completions, streamed
    and not, and a previous_response_id follow-up answered as the whole conversation would be."""
    c = client(cluster)
    chat = c.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                     temperature=0)
    first = c.responses.create(model=SERVED, input="Hi", max_output_tokens=8, temperature=0)
    assert first.output_text == chat.choices[0].message.content and first.output_text
    assert first.usage.input_tokens == chat.usage.prompt_tokens and first.usage.output_tokens == \
        chat.usage.completion_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with c.responses.stream(model=SERVED, input="Hi", max_output_tokens=8, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert deltas == stream.get_final_response().output_text == first.output_text
    follow = c.responses.create(model=SERVED, previous_response_id=first.id, input="More", max_output_tokens=8,
                                temperature=0)
    whole = c.chat.completions.create(model=SERVED, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"}])
    assert follow.output_text == whole.choices[0].message.content


def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(cluster):
    """vLLM's extra, which guidellm always sends: every chunk carries the usage so far."""
    chunks = list(client(cluster).completions.create(
        model=SERVED, prompt=MORE, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None and ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and chunks[-1].choices == []
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)


def test_echo_puts_the_prompt_before_the_completion_streamed_and_not(cluster):
    c = client(cluster)
    plain = c.completions.create(model=SERVED, prompt=MORE, max_tokens=8, temperature=0).choices[0].text
    echoed = c.completions.create(model=SERVED, prompt=MORE, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == MORE + plain and echoed.usage.completion_tokens == 8
    chunks = list(c.completions.create(model=SERVED, prompt=MORE, max_tokens=8, temperature=0, echo=True,
                                       stream=True))
    assert chunks[0].choices[0].text == MORE and "".join(ch.choices[0].text for ch in chunks) == MORE + plain
    ids = Tokenizer(cluster.model).encode("Hello there")  # a token-id prompt echoes its decoded text
    by_ids = c.completions.create(model=SERVED, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(Tokenizer(cluster.model).decode(ids, skip_special_tokens=False))


def test_n_choices_with_seed_are_reproducible(cluster):
    c = client(cluster)
    kw = dict(model=SERVED, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=11)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 20


def test_n_choices_stream_interleaved_with_the_same_text_as_unstreamed(cluster):
    """n > 1 streams every choice's chunks as they come (one task per choice), then the usage
    of all of them; a one-choice stream (written from the request's task) likewise."""
    c = client(cluster)
    kw = dict(model=SERVED, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=11)
    for n in (2, 1):
        whole = c.completions.create(n=n, **kw)
        texts, usage, finishes = [""] * n, None, [None] * n
        for chunk in c.completions.create(n=n, stream=True, stream_options={"include_usage": True}, **kw):
            for ch in chunk.choices:
                texts[ch.index] += ch.text
                finishes[ch.index] = ch.finish_reason or finishes[ch.index]
            usage = chunk.usage or usage
        assert texts == [x.text for x in whole.choices] and finishes == ["length"] * n
        assert usage.completion_tokens == 10 * n == whole.usage.completion_tokens


def test_distinct_prompts_one_at_a_time_spread_over_decode_workers(cluster):
    used = []
    for i in range(8):
        raw, _ = complete(cluster, f"Question number {i}: what is {i} times {i + 3}?", n=2)
        used.append(workers(raw)["decode"])
    assert len(set(used)) == 2, used


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b"{not json", 400, "invalid_request_error"),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "invalid_request_error"),
    ("missing prompt", "/v1/completions", {"model": SERVED}, 400, "invalid_request_error"),
    ("missing messages", "/v1/chat/completions", {"model": SERVED}, 400, "invalid_request_error"),
    ("empty messages", "/v1/chat/completions", {"model": SERVED, "messages": []}, 400, "invalid_request_error"),
    ("prompt wrong type", "/v1/completions", {"model": SERVED, "prompt": 5}, 400, "invalid_request_error"),
    ("max_tokens wrong type", "/v1/completions", {"model": SERVED, "prompt": "a", "max_tokens": "9"}, 400,
     "invalid_request_error"),
    ("negative max_tokens", "/v1/completions", {"model": SERVED, "prompt": "a", "max_tokens": -1}, 400,
     "invalid_request_error"),
    ("temperature < 0", "/v1/completions", {"model": SERVED, "prompt": "a", "temperature": -0.5}, 400,
     "invalid_request_error"),
    ("top_p = 0", "/v1/completions", {"model": SERVED, "prompt": "a", "top_p": 0}, 400, "invalid_request_error"),
    ("top_p > 1", "/v1/completions", {"model": SERVED, "prompt": "a", "top_p": 1.5}, 400, "invalid_request_error"),
    ("prompt longer than context", "/v1/completions", {"model": SERVED, "prompt": "word " * 5000}, 400,
     "invalid_request_error"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "not_found_error"),
    ("token id out of vocabulary", "/v1/completions", {"model": SERVED, "prompt": [1, 99999999]}, 400,
     "invalid_request_error"),
    ("messages wrong type", "/v1/chat/completions", {"model": SERVED, "messages": "hi"}, 400,
     "invalid_request_error"),
    ("unknown route", "/v1/embeddings", {"model": SERVED, "input": "a"}, 404, "not_found_error"),
]


@pytest.mark.parametrize("name, path, body, status, kind", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_openai_error_and_the_server_keeps_serving(cluster, name, path, body, status, kind):
    kw = {"data": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = requests.post(cluster.base_url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["message"] and set(err) >= {"message", "type", "param", "code"}
    assert requests.get(cluster.base_url + "/health", timeout=10).status_code == 200


def test_router_rebuilds_the_same_index_and_replicas_agree(cluster):
    if cluster.redis_url is None:
        pytest.skip("needs the Redis bus: an in-process bus lives and dies with its router")
    complete(cluster, LONG + MORE)  # make sure the index holds something

    def digest(base):
        return requests.get(base + "/health", params={"index_digest": "1"}, timeout=30).json()["index"]

    second = SplitserveProcess("router", ["--model", str(cluster.model), "--served-model-name", SERVED,
                                          "--redis-url", cluster.redis_url, "--routing-seed", "7",
                                          "--disagg-min-uncached-tokens", str(DISAGG_MIN), "--strict-disaggregation",
                                          "--cluster-token-file", str(cluster.token_file)])
    try:
        deadline = time.monotonic() + 30
        while digest(second.base_url) != digest(cluster.base_url) and time.monotonic() < deadline:
            time.sleep(0.5)
        original, rebuilt = digest(cluster.base_url), digest(second.base_url)
        assert rebuilt["blocks"] > 0 and rebuilt == original
        # Two routers on one bus choose the same worker for the same prompt.
        routes = []
        for base in (cluster.base_url, second.base_url):
            c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            raw = c.completions.with_raw_response.create(model=SERVED, prompt=LONG + MORE + "And then?",
                                                         max_tokens=2, temperature=0)
            routes.append(raw.headers["x-splitserve-route"].split(";")[0])
        assert routes[0] == routes[1]
    finally:
        second.stop()


def test_penalties_and_logit_bias_through_the_served_stack_match_transformers(cluster):
    """Short (local prefill) and long (disaggregated: the prefill worker samples the first
    token with the same processors) prompts, greedy, against generate with the same processors."""
    import torch

    from splitserve.engine import SamplingParams
    from tests.engine.test_logits_processors import reference_processors
    from tests.helpers.reference import hf_model

    tok = Tokenizer(cluster.model)
    params = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={"300": 4.0})
    for text in ("Hello there", MORE + LONG):  # MORE + LONG is cached nowhere yet: disaggregated
        raw = client(cluster).completions.with_raw_response.create(
            model=SERVED, prompt=text, max_tokens=16, temperature=0, extra_body={
                "repetition_penalty": params["repetition_penalty"]},
            presence_penalty=params["presence_penalty"], frequency_penalty=params["frequency_penalty"],
            logit_bias=params["logit_bias"])
        out = raw.parse()
        ids = tok.encode(text)
        procs = reference_processors(len(ids), SamplingParams(
            presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={300: 4.0}))
        prompt = torch.tensor([ids])
        with torch.no_grad():
            ref = hf_model(str(cluster.model)).generate(prompt, attention_mask=torch.ones_like(prompt),
                                                        max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                                        logits_processor=procs, eos_token_id=None, pad_token_id=0)
        assert out.choices[0].text == tok.decode(ref[0, len(ids):].tolist()), text
        assert out.choices[0].text != reference_text(cluster, ids, 16)  # the processors changed something
        if text != "Hello there":
            assert workers(raw)["prefill"].startswith("prefill-")
