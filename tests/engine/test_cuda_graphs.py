"""The CUDA-graph decode path (engine/cuda_graphs.py). On the CPU no graph can be captured,
but the padded static-buffer step the graphs hold can run eagerly: it must give the
eager step's logits and tokens for every batch size (padded up to a bucket), with GQA,
sliding windows and soft-capping (Gemma 2), and padding must never touch real KV."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.args import add_engine_args, engine_config_from_args
from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import (
    DecodeGraphs,
    batch_buckets,
    blocks_per_seq,
    bucket_for,
    pad_decode,
)

MAX_SEQS = 24  # buckets 1, 2, 4, 8, 16, 24


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(4) == [1, 2, 4]
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(MAX_SEQS)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, buckets) is None
    assert blocks_per_seq(4096, 16) == 256 and blocks_per_seq(100, 16) == 7
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_padding_rows_point_at_the_scratch_block_only():
    seqs = [SimpleNamespace(token_ids=[7, 8, 9, 10, 11], num_computed_tokens=4, block_table=[3, 5], long_rope=False),
            SimpleNamespace(token_ids=[1, 2], num_computed_tokens=1, block_table=[6], long_rope=True)]
    p = pad_decode(seqs, bucket=4, width=3, block_size=4, scratch_block=9)
    assert p.input_ids == [11, 2, 0, 0]
    assert p.positions == [4, 1, 0, 0] and p.long_rope == [False, True, False, False]
    assert p.slots == [5 * 4 + 0, 6 * 4 + 1, 36, 36]  # padding: the scratch block's first slot
    assert p.seq_lens == [5, 2, 1, 1]  # padding attends to one (scratch) token: finite output
    assert p.block_tables == [[3, 5, 9], [6, 9, 9], [9, 9, 9], [9, 9, 9]]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode(seqs, bucket=1, width=3, block_size=4, scratch_block=9)
    with pytest.raises(ValueError, match="wider"):
        pad_decode(seqs, bucket=2, width=1, block_size=4, scratch_block=9)


def test_configuration_and_flag():
    assert not EngineConfig(model="m").use_cuda_graphs  # CPU: off
    assert EngineConfig(model="m", device="cuda").use_cuda_graphs  # CUDA: on by default
    assert not EngineConfig(model="m", device="cuda:0", cuda_graphs=False).use_cuda_graphs
    with pytest.raises(ValueError, match="needs a CUDA device"):
        EngineConfig(model="m", cuda_graphs=True)
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_config_from_args(ap.parse_args([]), "m", "m").cuda_graphs is None
    assert engine_config_from_args(ap.parse_args(["--no-cuda-graphs"]), "m", "m").cuda_graphs is False


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # lengths around the 16-token block and Gemma 2's 32-token window
    return [[rng.randrange(5, vocab) for _ in range(rng.choice((3, 16, 17, 31, 40, 75)))] for _ in range(n)]


def _decode_batch(llm: LLM, prompts: list[list[int]]):
    """Prefill every prompt (eagerly, one token sampled), then schedule one pure-decode step."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    batch = engine.scheduler.schedule()
    assert not batch.prefills and len(batch.decodes) == len(prompts)
    return batch


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("n", [1, 3, 5, 17])
def test_padded_step_gives_the_eager_logits(make_ckpt, family, n):
    llm = LLM(str(make_ckpt(family)), num_kv_blocks=160, max_num_seqs=MAX_SEQS)
    runner = llm.engine.runner
    batch = _decode_batch(llm, _prompts(llm.engine.model_config.vocab_size, n, seed=n))
    pool = runner.kv_pool
    eager, sampled = runner.run(batch)
    real_kv = pool.data[: pool.num_blocks].clone()
    # a real row attending to a scratch token would show (masked reads multiply it by 0)
    pool.data[pool.num_blocks :] = 1000.0

    runner.enable_decode_graphs(capture=False)
    padded, sampled_padded = runner.run(batch)

    assert runner.decode_graphs.steps == 1
    assert sampled_padded == sampled == batch.decodes
    assert padded.shape == eager.shape == (n, llm.engine.model_config.vocab_size)
    torch.testing.assert_close(padded, eager, atol=2e-5, rtol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    # padding wrote only the scratch block: every real block holds what the eager step wrote
    torch.testing.assert_close(pool.data[: pool.num_blocks], real_kv, atol=2e-5, rtol=1e-5)
    scratch = pool.data[pool.num_blocks]  # [layers, 2, block_size, kv_heads, head_dim]
    assert (scratch[:, :, 1:] == 1000.0).all()  # only the scratch block's first slot is written
    padding = bucket_for(n, batch_buckets(MAX_SEQS)) > n
    assert (scratch[:, :, 0] != 1000.0).all() == padding


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "qwen3_moe"])
def test_generation_through_the_padded_path_matches_eager(make_ckpt, family):
    """Whole generations, batches shrinking as requests finish (each step a new bucket);
    Phi-3's sequences pass its 64-token longrope switch (long-factor rope rows), Qwen3-MoE
    routes padding rows through its experts too."""
    path = str(make_ckpt(family))
    eager = LLM(path, num_kv_blocks=160, max_num_seqs=MAX_SEQS)
    padded = LLM(path, num_kv_blocks=160, max_num_seqs=MAX_SEQS)
    padded.engine.runner.enable_decode_graphs(capture=False)
    prompts = _prompts(eager.engine.model_config.vocab_size, 11, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=5)
              for i in range(len(prompts))]
    want, got = eager.generate(prompts, params), padded.generate(prompts, params)
    assert padded.engine.runner.decode_graphs.steps > 10
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in lp_b.top] == [t for t, _ in lp_a.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(lp_a.top, lp_b.top, strict=True)) < 1e-4


def test_prefill_steps_and_oversized_batches_stay_eager(make_ckpt):
    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    runner.enable_decode_graphs(capture=False)
    graphs = runner.decode_graphs
    decode = SimpleNamespace(block_table=[0])
    assert graphs.fits(SimpleNamespace(prefills=[], decodes=[decode] * 4))
    assert not graphs.fits(SimpleNamespace(prefills=[], decodes=[decode] * 5))
    assert not graphs.fits(SimpleNamespace(prefills=[(decode, 3)], decodes=[decode]))
    assert not graphs.fits(SimpleNamespace(prefills=[], decodes=[]))
    wide = SimpleNamespace(block_table=list(range(graphs.width + 1)))
    assert not graphs.fits(SimpleNamespace(prefills=[], decodes=[wide]))


def test_capture_refuses_a_cpu_engine(make_ckpt):
    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=16, max_num_seqs=2)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        llm.engine.runner.enable_decode_graphs(capture=True)
    r = llm.engine.runner
    with pytest.raises(ValueError, match="scratch block"):
        DecodeGraphs(r.model, SimpleNamespace(scratch_block=None), r.ropes, 2, 64, 16, r.device, capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: graph capture needs one")
def test_captured_graphs_match_eager_on_cuda(make_ckpt):
    path = str(make_ckpt("gemma2"))
    graphs = LLM(path, device="cuda", num_kv_blocks=160, max_num_seqs=MAX_SEQS)
    eager = LLM(path, device="cuda", num_kv_blocks=160, max_num_seqs=MAX_SEQS, cuda_graphs=False)
    assert graphs.engine.runner.decode_graphs.graphs.keys() == set(batch_buckets(MAX_SEQS))
    prompts = _prompts(eager.engine.model_config.vocab_size, 11, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    assert [o.token_ids for o in graphs.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]
    assert graphs.engine.runner.decode_graphs.steps > 10
