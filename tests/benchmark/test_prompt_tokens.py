"""Text prompts fitted to an exact token count: with a real tokenizer whose words take
several tokens (the demo-style checkpoint: 1,024 tokens), on both endpoints, equal to
transformers' count; the filler step; and every way sizing can fail, said plainly."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from transformers import AutoTokenizer

from splitserve.benchmark.prompt_tokens import (
    PromptFitter,
    PromptSizeError,
    local_counter,
    server_counter,
)
from splitserve.benchmark.workloads import WorkloadConfig, build_workload


@pytest.fixture(scope="module")
def model_dir(make_ckpt):
    return make_ckpt("llama")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("kind", ["random", "prefix-repetition"])
def test_prompts_have_exactly_their_length_as_transformers_counts(model_dir, chat, kind):
    hf = AutoTokenizer.from_pretrained(model_dir)

    def hf_count(text: str) -> int:
        if chat:
            return len(hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
        return len(hf(text)["input_ids"])

    cfg = WorkloadConfig(kind=kind, prompt_format="text", num_prompts=12, input_len=(24, 40), prefix_len=32,
                         num_prefixes=2, suffixes_per_prefix=3, seed=7)
    turns = [s.turns[0] for s in build_workload(cfg, PromptFitter(local_counter(str(model_dir), chat)))]
    assert [hf_count(t.prompt) for t in turns] == [t.prompt_len for t in turns]
    assert sum(len(t.prompt.split()) for t in turns) < sum(t.prompt_len for t in turns)  # words > 1 token here


def test_the_gap_a_long_word_leaves_is_filled_with_one_token_words():
    def count(text: str) -> int:  # a BOS, "a" one token, any other word three
        return 1 + sum(1 if w == "a" else 3 for w in text.split())

    fitter = PromptFitter(count)
    assert fitter.fit(["the"] * 10, 8) == "the the a"  # 1 + 3 + 3 = 7, one short: " a"
    assert fitter.fit(["the"] * 10, 9) == "the the a a"
    assert fitter.fit(["the"] * 10, 7, head="the") == "the the"  # after a shared prefix
    assert fitter.fit(["the"] * 10, 5, head="the") == "the a"  # the prefix alone, then a filler


def test_a_length_shorter_than_the_template_is_refused(model_dir):
    fitter = PromptFitter(local_counter(str(model_dir), chat=True))
    with pytest.raises(PromptSizeError, match=r"a prompt of 5 tokens cannot be made: \d+ tokens already with one "
                                              r"word \(chat template and BOS included\); ask for a longer --input-len"):
        fitter.fit(["the"] * 5, 5)


def test_a_missing_local_tokenizer_is_named(tmp_path):
    with pytest.raises(PromptSizeError, match=rf"--tokenizer {tmp_path}: .*tokenizer.json: not found"):
        local_counter(str(tmp_path), chat=False)


async def _answer(status: int, body: dict) -> TestServer:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/tokenize", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_server_counter_reads_count_and_treats_too_long_as_infinite():
    ok = await _answer(200, {"count": 17, "max_model_len": 64, "tokens": list(range(17)), "token_strs": None})
    too_long = await _answer(400, {"error": {"message": "too long", "type": "invalid_request_error",
                                             "param": "prompt", "code": "context_length_exceeded"}})
    try:
        assert await asyncio.to_thread(server_counter(str(ok.make_url("")), "m", chat=True), "hi") == 17
        assert await asyncio.to_thread(server_counter(str(too_long.make_url("")), "m", chat=False), "hi") == math.inf
    finally:
        await ok.close()
        await too_long.close()


async def test_a_server_without_tokenize_gets_a_hint():
    app = web.Application()  # no /tokenize at all: aiohttp's plain 404
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        with pytest.raises(PromptSizeError) as info:
            await asyncio.to_thread(server_counter(url, "m", chat=False), "hi")
    finally:
        await server.close()
    assert str(info.value) == (f"text prompts are sized with the served model's tokenizer, but {url}/tokenize "
                               "answered 404. Pass --tokenizer DIR (a directory with the model's tokenizer.json) "
                               "or use --prompt-format ids")
