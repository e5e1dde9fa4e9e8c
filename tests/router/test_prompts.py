"""Prompts to token ids at the router (router/prompts.py): long texts never stall the
event loop, texts far beyond the context are refused from their start, and the ids are
exactly the tokenizer's."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from splitserve.core.tokenizer import Tokenizer
from splitserve.router import prompts as P
from splitserve.router.errors import APIError

WORDS = (Path(P.__file__).parents[1] / "engine" / "demo_corpus.txt").read_text().split()


def text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_chars // 4))[:n_chars]


@pytest.fixture(scope="module")
def tokenizer(make_ckpt):
    return Tokenizer(str(make_ckpt("llama")))


async def max_loop_lag_while(coro) -> tuple[object, float]:
    """Run `coro` while a ticker measures the event loop's longest stall."""
    lag, stop = 0.0, asyncio.Event()

    async def tick():
        nonlocal lag
        while not stop.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(0.005)
            lag = max(lag, time.monotonic() - t0 - 0.005)

    ticker = asyncio.create_task(tick())
    try:
        result = await coro
    except APIError as exc:
        result = exc
    stop.set()
    await ticker
    return result, lag


async def test_a_long_text_is_tokenized_off_the_loop_and_exactly(tokenizer, monkeypatch):
    monkeypatch.setattr(P, "PROBE_CHARS_PER_TOKEN", 10**9)  # force the whole text through the tokenizer
    long = text(1 << 20)
    exact = tokenizer.encode(long)
    prompts = P.PromptTokenizer(tokenizer, max_model_len=len(exact) + 1)
    started = time.monotonic()
    ids, lag = await max_loop_lag_while(prompts.encode(long))
    took = time.monotonic() - started
    assert ids == exact
    # inline, the loop would stall for all of `took`; a quarter leaves room for a busy CI machine
    assert took > 0.1 and lag < took / 4, f"the loop stalled {lag * 1000:.0f} ms during {took:.2f}s of tokenizing"
    prompts.close()


async def test_over_the_context_is_refused_with_the_count(tokenizer):
    prompts = P.PromptTokenizer(tokenizer, max_model_len=2000)  # 20,000 characters: under the probe length
    err, _ = await max_loop_lag_while(prompts.encode(text(20_000)))  # off the loop, whole text counted
    assert isinstance(err, APIError) and err.code == "context_length_exceeded"
    assert f"has {len(tokenizer.encode(text(20_000)))} tokens" in err.message


async def test_far_over_the_context_is_refused_from_its_start(tokenizer):
    prompts = P.PromptTokenizer(tokenizer, max_model_len=64)
    err, _ = await max_loop_lag_while(prompts.encode(text(5 << 20)))
    assert isinstance(err, APIError) and err.code == "context_length_exceeded"
    # the count names the start it looked at: the other 5 MB were never tokenized (no clock
    # needed; the test above covers the loop staying free while a text is tokenized)
    assert "in its first 2048 of 5242880 characters" in err.message, err.message


async def test_a_start_under_twice_the_context_is_counted_whole(tokenizer, monkeypatch):
    """The start-only refusal needs twice the context in the start; short of that the whole
    text is counted, so a text that could fit is never turned away by the shortcut."""
    monkeypatch.setattr(P, "PROBE_CHARS_PER_TOKEN", 8)
    long = text(20_000)
    start_tokens = len(tokenizer.encode(long[:8 * 300]))
    assert 300 < start_tokens <= 600  # over the context, under twice it
    with pytest.raises(APIError) as err:
        await P.PromptTokenizer(tokenizer, max_model_len=300).encode(long)
    assert f"has {len(tokenizer.encode(long))} tokens" in err.value.message  # the exact count: counted whole


async def test_more_long_prompts_than_the_pool_takes_get_429(tokenizer):
    prompts = P.PromptTokenizer(tokenizer, max_model_len=10**6, max_pending=2)
    long = text(400_000)
    results = await asyncio.gather(*(prompts.encode(long) for _ in range(5)), return_exceptions=True)
    busy = [r for r in results if isinstance(r, APIError)]
    assert len(busy) == 3 and all(r.status == 429 and r.code == "tokenizer_busy" for r in busy)
    assert all(r == tokenizer.encode(long) for r in results if not isinstance(r, APIError))
    prompts.close()
