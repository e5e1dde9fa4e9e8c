"""The CUDA-graph decode path (engine/cuda_graphs.py). On the CPU no graph can be captured,
but the padded static-buffer step the graphs hold can run eagerly: it must give the
eager step's logits and tokens for every batch size (padded up to a bucket), with GQA,
sliding windows and soft-capping (Gemma 2), and padding must never touch real KV. With LoRA
(adapter slots a column of the static input, deltas gathered by slot) and under tensor
parallelism (each rank's own padded step) the padded step's tokens equal transformers + PEFT;
capture itself is checked on a GPU only (the CUDA test below, bench/gpu/graphs_tp_lora.py)."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine import LLM, LoRARequest
from splitserve.engine.args import add_engine_args, engine_config_from_args
from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs, batch_buckets, blocks_per_seq, bucket_for
from splitserve.engine.decode_inputs import DecodeInputs
from splitserve.kernels import lora_reference
from tests.helpers.lora_adapters import ADAPTERS, peft_greedy

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


def _seq(tokens, computed, table, long_rope=False):
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, block_table=table, long_rope=long_rope)


def _layout(flat, bucket, width, ropes):
    b = bucket
    cols = [flat[i * b:(i + 1) * b].tolist() for i in range(3 + ropes)]
    return cols, flat[(3 + ropes) * b:].view(b, width)


def test_padding_rows_point_at_the_scratch_block_only():
    seqs = [_seq([7, 8, 9, 10, 11], 4, [3, 5]), _seq([1, 2], 1, [6], long_rope=True)]
    inputs = DecodeInputs(width=3, block_size=4, scratch_block=9, rope_offsets=[0, 100], device=torch.device("cpu"))
    (ids, slots, lens, rope, long_rope), tables = _layout(inputs.write(seqs, 4), 4, 3, 2)
    assert ids == [11, 2, 0, 0]
    assert rope == [4, 1, 0, 0] and long_rope == [4, 101, 0, 0]  # the long table's rows sit past `offset`
    assert slots == [5 * 4 + 0, 6 * 4 + 1, 36, 36]  # padding: the scratch block's first slot
    assert lens == [5, 2, 1, 1]  # padding attends to one (scratch) token: finite output
    assert tables.tolist() == [[3, 5, 9], [6, 9, 9], [9, 9, 9], [9, 9, 9]]
    with pytest.raises(ValueError, match="do not fit"):
        inputs.write(seqs, 1)
    with pytest.raises(ValueError, match="wider"):
        inputs.write([_seq([1] * 20, 13, [1, 2, 3, 4])], 1)


def test_adapter_slots_are_a_column_of_the_static_input():
    seqs = [_seq([7, 8], 1, [3]), _seq([1, 2, 3], 2, [6])]
    inputs = DecodeInputs(width=2, block_size=4, scratch_block=9, rope_offsets=[0], device=torch.device("cpu"),
                          adapter_column=True)
    (ids, _, lens, adapter, rope), _ = _layout(inputs.write(seqs, 4, adapter_slots=[1, -1]), 4, 2, 2)
    assert ids == [8, 3, 0, 0] and lens == [2, 3, 1, 1] and rope == [1, 2, 0, 0]
    assert adapter == [1, -1, -1, -1]  # the base model's row and the padding rows: no adapter


def test_block_tables_are_written_incrementally_and_rewritten_for_another_owner():
    inputs = DecodeInputs(width=4, block_size=2, scratch_block=0, rope_offsets=[0], device=torch.device("cpu"))
    a, b = _seq([1, 2, 3], 2, [4, 5]), _seq([1], 0, [6])
    inputs.write([a, b], 2)
    host = inputs.host(2)
    tables = host[8:].view(2, 4)
    tables[0, 0] = 99  # a row already written is not written again...
    a.token_ids.append(4)
    a.num_computed_tokens = 3
    inputs.write([a, b], 2)
    assert tables[0].tolist() == [99, 5, 0, 0]
    a.block_table.extend([7])  # ...only the blocks appended since
    a.token_ids.append(5)
    a.num_computed_tokens = 4
    inputs.write([a, b], 2)
    assert tables[0].tolist() == [99, 5, 7, 0] and host[2].item() == 7 * 2  # slot in the new block
    a.block_table = [8, 9, 10]  # preempted and re-admitted: a new list, rewritten whole
    inputs.write([b, a], 2)  # and another batch order
    assert tables[0, :1].tolist() == [6] and tables[1, :3].tolist() == [8, 9, 10]
    assert host[:2].tolist() == [1, 5] and host[4:6].tolist() == [1, 5]  # ids; seq_lens


def test_staged_inputs_match_a_fresh_build_over_random_batches():
    """Whatever the order of steps, batch orders, growth and new tables, the entries a step
    reads (each row's first ceil(len / block_size) table ids, the scalars) are those of
    a build from scratch."""
    rng = random.Random(5)
    bs, width, scratch = 4, 8, 63
    inputs = DecodeInputs(width, bs, scratch, [0], torch.device("cpu"))
    pool = [_seq([rng.randrange(100) for _ in range(rng.randrange(1, 20))], 0, []) for _ in range(12)]
    next_block = iter(range(1000))
    for _ in range(300):
        seqs = rng.sample(pool, rng.randrange(1, 9))
        for s in seqs:
            if rng.random() < 0.1:
                s.block_table = []  # preempted: a new table
            s.num_computed_tokens = len(s.token_ids) - 1
            while len(s.block_table) * bs < len(s.token_ids):
                s.block_table.append(next(next_block) % scratch)
            if len(s.token_ids) >= width * bs:
                s.token_ids, s.block_table = s.token_ids[:1], []
                s.block_table.append(next(next_block) % scratch)
                s.num_computed_tokens = 0
        bucket = bucket_for(len(seqs), batch_buckets(8))
        (ids, slots, lens, rope), tables = _layout(inputs.write(seqs, bucket), bucket, width, 1)
        for i, s in enumerate(seqs):
            pos = s.num_computed_tokens
            assert (ids[i], rope[i], lens[i]) == (s.token_ids[pos], pos, pos + 1)
            assert slots[i] == s.block_table[pos // bs] * bs + pos % bs
            assert tables[i, : -(-(pos + 1) // bs)].tolist() == s.block_table[: -(-(pos + 1) // bs)]
        for i in range(len(seqs), bucket):
            assert (ids[i], slots[i], lens[i], rope[i], tables[i, 0].item()) == (0, scratch * bs, 1, 0, scratch)
        for s in seqs:
            s.token_ids.append(rng.randrange(100))


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


def _adapter_requests(adapters, n: int, seed: int):
    """n prompts cycling over the adapters and the base model, each its own length of output."""
    rng = random.Random(seed)
    names = [*ADAPTERS, None]
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.choice((7, 16, 40)))] for _ in range(n)]
    loras = [None if names[i % 4] is None else LoRARequest(names[i % 4], i + 1, str(adapters[names[i % 4]]))
             for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(n)]
    return prompts, loras, params


def _assert_equal_peft(base, adapters, prompts, loras, params, outs):
    for prompt, lora, p, out in zip(prompts, loras, params, outs, strict=True):
        want = peft_greedy(base, lora and adapters[lora.lora_name], prompt, p.max_tokens)
        assert out.token_ids == want, (lora and lora.lora_name, len(prompt))


@pytest.fixture
def by_row_calls(monkeypatch):
    """The distinct row-slot columns the padded step's LoRA deltas were gathered by."""
    seen, original = set(), lora_reference.lora_delta_by_row

    def spy(x, a, b, out, row_slots):
        seen.add(tuple(row_slots.tolist()))
        return original(x, a, b, out, row_slots)

    monkeypatch.setattr(lora_reference, "lora_delta_by_row", spy)
    return seen


def test_lora_batches_through_the_padded_step_equal_peft(base, adapters, by_row_calls):
    """LoRA x CUDA graphs on the CPU path (capture=False: the padded step eagerly; capture is
    checked on a GPU only). One bucket's static step serves changing mixes of adapters and
    the base model (2 slots for 3 adapters: swaps between steps), every row gathering its own
    slot, padding rows none."""
    llm = LLM(str(base), num_kv_blocks=128, max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.engine.runner.enable_decode_graphs(capture=False)
    prompts, loras, params = _adapter_requests(adapters, 8, seed=1)
    outs = llm.generate(prompts, params, lora_request=loras)
    _assert_equal_peft(base, adapters, prompts, loras, params, outs)
    assert llm.engine.runner.decode_graphs.steps > 10
    assert any(len({s for s in rows if s >= 0}) == 2 and -1 in rows for rows in by_row_calls)  # a mixed step
    assert llm.engine.loras.slots.num_loads >= 3


def test_tensor_parallel_padded_steps_with_adapters_equal_peft(base, adapters, by_row_calls):
    """TP x CUDA graphs and TP x LoRA x CUDA graphs on the CPU path: rank 0 stages each
    pure-decode step and broadcasts its static input (adapter slots included), rank 1 copies
    it into its own static buffer and runs the same padded step on its slices (capture=False:
    gloo's collectives cannot be captured; NCCL's are, on a GPU: bench/gpu/graphs_tp_lora.py)."""
    with LLM(str(base), num_kv_blocks=96, max_num_seqs=8, tensor_parallel_size=2, enable_lora=True, max_loras=3,
             max_lora_rank=16) as llm:
        llm.engine.runner.enable_decode_graphs(capture=False)  # (rank 1 builds its own on the first step)
        prompts, loras, params = _adapter_requests(adapters, 6, seed=2)
        outs = llm.generate(prompts, params, lora_request=loras)
        _assert_equal_peft(base, adapters, prompts, loras, params, outs)
        assert llm.engine.runner.decode_graphs.steps > 5
        assert any(len({s for s in rows if s >= 0}) >= 2 and -1 in rows for rows in by_row_calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: graph capture needs one")
def test_captured_lora_graphs_match_peft_on_cuda(base, adapters):
    """What the CPU cannot check: the deltas gathered by slot inside captured graphs."""
    llm = LLM(str(base), device="cuda", num_kv_blocks=128, max_num_seqs=8, enable_lora=True, max_loras=2,
              max_lora_rank=16, cuda_graphs=True)
    assert llm.engine.runner.decode_graphs.graphs.keys() == set(batch_buckets(8))
    prompts, loras, params = _adapter_requests(adapters, 8, seed=1)
    _assert_equal_peft(base, adapters, prompts, loras, params, llm.generate(prompts, params, lora_request=loras))
    assert llm.engine.runner.decode_graphs.steps > 10


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor-parallel graph capture needs two CUDA devices")
def test_captured_tensor_parallel_graphs_with_adapters_match_peft_on_cuda(base, adapters):
    """Each rank captures its own graphs, NCCL all-reduces inside them."""
    with LLM(str(base), device="cuda", num_kv_blocks=96, max_num_seqs=8, tensor_parallel_size=2, enable_lora=True,
             max_loras=3, max_lora_rank=16, cuda_graphs=True) as llm:
        assert llm.engine.runner.decode_graphs.graphs.keys() == set(batch_buckets(8))
        prompts, loras, params = _adapter_requests(adapters, 6, seed=2)
        _assert_equal_peft(base, adapters, prompts, loras, params,
                           llm.generate(prompts, params, lora_request=loras))
        assert llm.engine.runner.decode_graphs.steps > 5
