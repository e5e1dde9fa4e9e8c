"""Prefill on one engine, move the KV blocks, decode on another: the output must be the
same as one engine doing both (greedy and seeded sampling), with prefix reuse on both."""

import random

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.kernels import reference


def drain(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def handoff(prefill, decode, rid, prompt, params):
    """What the workers do over the network, done in-process."""
    slot = decode.reserve_remote_prefill(rid, prompt, params)
    assert slot is not None
    skip, dest, hashes = slot.skip_blocks, slot.block_ids, slot.block_hashes
    assert skip == slot.num_cached_tokens // decode.config.block_size
    prefill.add_request(rid, prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), hold_kv=True)
    first = drain(prefill)[rid]
    src, src_hashes = prefill.held_blocks(rid, skip)
    assert src_hashes == hashes  # one hash space on both workers
    buf = reference.pack_blocks(prefill.runner.kv_pool.data, torch.tensor(src))
    reference.unpack_blocks(buf, decode.runner.kv_pool.data, torch.tensor(dest))
    prefill.release_held(rid)
    lp = first.logprobs[0] if first.logprobs else None
    decode.complete_remote_prefill(rid, first.token_ids[0], lp)
    return slot


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True),
])
def test_prefill_here_decode_there_equals_one_engine(make_ckpt, params):
    path = str(make_ckpt("llama"))
    single = LLM(path, num_kv_blocks=64)
    prefill = LLM(path, num_kv_blocks=64).engine
    decode = LLM(path, num_kv_blocks=64).engine
    rng = random.Random(1)
    shared = [rng.randrange(5, 1000) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 1000) for _ in range(n)] for n in (9, 23)]
    expected = single.generate(prompts, params)

    for i, prompt in enumerate(prompts):
        slot = handoff(prefill, decode, f"r{i}", prompt, params)
        out = drain(decode)[f"r{i}"]
        assert out.token_ids == expected[i].token_ids
        if params.logprobs is not None:
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
        if i == 1:  # the second prompt shares 2 full blocks with the first on the decode side
            assert slot.num_cached_tokens == 32 and slot.skip_blocks == 2
    assert decode.num_free_blocks == decode.num_total_blocks
    assert prefill.num_free_blocks == prefill.num_total_blocks
    assert not prefill.held and not decode.remote


def test_cancelled_remote_prefill_frees_its_blocks(make_ckpt):
    decode = LLM(str(make_ckpt("llama")), num_kv_blocks=16).engine
    slot = decode.reserve_remote_prefill("x", list(range(5, 60)), SamplingParams(max_tokens=4))
    assert len(slot.block_ids) == 4 and len(slot.block_hashes) == 3 and decode.num_free_blocks == 12
    decode.cancel_remote_prefill("x")
    assert decode.num_free_blocks == 16
    # Does not fit while another reservation holds 10 blocks: None (the worker then queues it locally).
    decode.reserve_remote_prefill("a", list(range(5, 165)), SamplingParams(max_tokens=4))
    assert decode.reserve_remote_prefill("b", list(range(500, 600)), SamplingParams(max_tokens=4)) is None
    decode.cancel_remote_prefill("a")
    assert decode.num_free_blocks == 16
