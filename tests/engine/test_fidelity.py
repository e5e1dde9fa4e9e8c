"""Greedy output must equal transformers' generate, token for token, on every path:
odd lengths, chunked prefill, prefix-cache hits, preemption by recompute."""

import json
import random
import shutil

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.helpers.reference import hf_greedy

BUDGET = 64  # tokens per step: the 230-token prompt is prefilled in 4 chunks
POOL_BLOCKS = 22  # far fewer than the batch needs at once: forces preemption


def workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(5, vocab) for _ in range(n)]  # ids 0-4 are special tokens

    shared = toks(90)
    prompts = [toks(3), toks(16), toks(17), toks(31), toks(48), toks(100), toks(230),
               shared + toks(7), shared + toks(12)]
    max_tokens = [24, 8, 30, 12, 20, 16, 10, 24, 18]
    return prompts, max_tokens


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers_with_chunking_prefix_hits_and_preemption(make_ckpt, family):
    path = make_ckpt(family)
    llm = LLM(str(path), num_kv_blocks=POOL_BLOCKS, max_num_batched_tokens=BUDGET)
    prompts, max_tokens = workload(llm.engine.model_config.vocab_size)
    assert max(len(p) for p in prompts) > BUDGET  # one prompt must be chunked
    assert len({len(p) % 16 for p in prompts}) > 3  # lengths off the block boundary
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]

    outs = llm.generate(prompts, params)

    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(path, prompt, m)
        assert out.finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    # Nothing leaks: every block is free again (cached content may stay, unreferenced).
    assert llm.engine.num_free_blocks == POOL_BLOCKS

    # The same batch again: the shared-prefix prompts now hit the cache, and
    # reusing cached KV changes nothing in the output.
    again = llm.generate(prompts[-2:], params[-2:])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[-2:]]
    assert again[0].num_cached_tokens >= 80  # 90 shared tokens = 5 full blocks at least
    assert again[1].num_cached_tokens >= 80
    assert llm.engine.num_free_blocks == POOL_BLOCKS


def test_prefix_hit_inside_one_batch(make_ckpt):
    """A request arriving while another holds its prefix reuses the blocks at once."""
    path = make_ckpt("llama")
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    rng = random.Random(5)
    shared = [rng.randrange(5, 1000) for _ in range(70)]
    first = shared + [7, 8, 9]
    second = shared + [10, 11]
    engine = llm.engine
    engine.add_request("a", first, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # chunk 1 of "a" (64 tokens, 4 full blocks published)
    engine.add_request("b", second, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["b"].num_cached_tokens == 64
    assert done["b"].token_ids == hf_greedy(path, second, 12)
    assert done["a"].token_ids == hf_greedy(path, first, 12)
    assert engine.scheduler.prefix_hit_tokens == 64
    assert engine.num_free_blocks == 64


def test_eos_from_generation_config_stops_like_transformers(make_ckpt, tmp_path):
    """EOS ids come from generation_config.json: make the model's 4th greedy token an EOS
    id and both engines must stop right after emitting it (ignore_eos overrides)."""
    src = make_ckpt("qwen2")
    prompt = workload(1000, seed=3)[0][4]
    free_run = LLM(str(src), num_kv_blocks=64).generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))[0]
    eos_token = free_run.token_ids[3]
    first = free_run.token_ids.index(eos_token)
    path = tmp_path / "eos-model"
    shutil.copytree(src, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos_token]
    (path / "generation_config.json").write_text(json.dumps(gen))

    llm = LLM(str(path), num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.token_ids == hf_greedy(path, prompt, 12, eos=True)
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free_run.token_ids
