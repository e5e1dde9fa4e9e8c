"""The KV transfer of tensor-parallel engines (issue 32): a TP engine's pool reads and writes
as one pool holding every KV head (engine/parallel/kv_shards.py), so a prompt prefilled at
one TP size and pushed over gRPC decodes at another with the tokens of a one-process engine:
TP=1 -> TP=2, TP=2 -> TP=1 and TP=2 -> TP=2 (the prefill side in a process of its own), for
a dense GQA model (2 KV heads: split) and a model whose single KV head is replicated on both
ranks (qwen2), again with the decode side's prefix cache skipping the blocks it holds. 8 KiB chunks split
blocks across messages: the staged (partial region) write path runs too."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_cache import KVCacheSpec
from splitserve.engine.parallel.kv_shards import ShardedKVPool, readers
from splitserve.kvtransfer import KVReceiver
from splitserve.kvtransfer.sender import create_sender
from tests.helpers.processes import join_child
from tests.kvtransfer.conftest import config_for

NEW = 10
BLOCKS = 48


def test_each_head_is_read_once_from_the_first_rank_holding_it():
    assert readers([(0, 2), (2, 2)]) == [(0, 0, 2), (1, 2, 2)]
    assert readers([(0, 1), (0, 1), (1, 1), (1, 1)]) == [(0, 0, 1), (2, 1, 1)]  # 2 KV heads on 4 ranks
    assert readers([(0, 1), (0, 1)]) == [(0, 0, 1)]  # one KV head, replicated


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 2)], [(0, 1), (0, 1), (1, 1), (1, 1)]])
def test_a_sharded_pool_reads_and_writes_whole_blocks_and_layer_ranges(ranges):
    heads = max(f + n for f, n in ranges)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=4, block_size=2, dtype=torch.float32)
    full = torch.randn(6, *spec.block_shape)
    shards = [full[..., f:f + n, :].clone() for f, n in ranges]
    pool = ShardedKVPool(spec, 6, shards, ranges)
    assert torch.equal(pool.read([4, 1]), full[[4, 1]])
    assert torch.equal(pool.read([2], 1, 3), full[[2], 1:3])
    new = torch.randn(2, 2, *spec.block_shape[1:])
    pool.write([5, 0], new, layer_start=1)
    full[[5, 0], 1:3] = new
    for shard, (f, n) in zip(shards, ranges, strict=True):  # every rank holding a head got it
        assert torch.equal(shard, full[..., f:f + n, :])


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    first = [rng.randrange(5, vocab) for _ in range(45)]  # 2 full blocks of 16 and a partial third
    return [first, first[:40] + [rng.randrange(5, vocab) for _ in range(9)]]  # the second: a cached prefix


def prefill_side(path: str, tp_size: int, conn, backend: str = "grpc") -> None:
    """A prefill engine in a process of its own (one TP group per process): for each
    (request id, prompt, receiver, skip_blocks, destination blocks) it gets, it prefills the
    prompt, pushes its KV over `backend` (the Mooncake pairs' walk uses it too:
    test_compatibility_pairs.py) and answers the first token."""
    first_only = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with LLM(path, num_kv_blocks=BLOCKS, tensor_parallel_size=tp_size) as p, \
            create_sender(backend, config_for(backend)) as sender:
        pool = p.engine.share_kv_pool()
        conn.send(list(pool.spec.block_shape))
        while (job := conn.recv()) is not None:
            rid, prompt, address, skip, dest = job
            p.engine.add_request(rid, prompt, first_only, hold_kv=True)
            outs = []
            while p.engine.has_unfinished_requests():
                outs += p.engine.step()
            src, hashes = p.engine.held_blocks(rid, skip)
            sender.push(rid, address, pool, src, dest, hashes)
            p.engine.release_held(rid)
            conn.send(outs[-1].token_ids[0])


def disaggregated(path, prefill_tp: int, decode_tp: int) -> tuple[list[list[int]], list[int]]:
    """Each prompt prefilled in a prefill process, its KV pushed over gRPC into the blocks
    this process's engine reserved, decoded here: (tokens, blocks the decode side skipped)."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(str(path), prefill_tp, child), daemon=False)
    proc.start()
    try:
        with LLM(str(path), num_kv_blocks=BLOCKS, tensor_parallel_size=decode_tp) as d:
            dest_pool = d.engine.share_kv_pool()
            assert conn.recv() == list(dest_pool.spec.block_shape)  # every head, whatever the TP size
            receiver = KVReceiver(dest_pool, config_for("grpc"), worker_id="d")
            receiver.start()
            tokens, skipped = [], []
            try:
                for i, prompt in enumerate(prompts(d.engine.model_config.vocab_size)):
                    rid = f"r{i}"
                    slot = d.engine.reserve_remote_prefill(rid, prompt, params)
                    done = receiver.expect(rid, slot.block_ids, slot.block_hashes, lambda ids: None)
                    conn.send((rid, prompt, receiver.address, slot.skip_blocks, slot.block_ids))
                    first = conn.recv()
                    assert done.result(timeout=30).ok
                    out = d.engine.complete_remote_prefill(rid, first, None)
                    while d.engine.has_unfinished_requests():
                        for o in d.engine.step():
                            out = o if o.request_id == rid else out
                    tokens.append(out.token_ids)
                    skipped.append(slot.skip_blocks)
            finally:
                receiver.stop()
        conn.send(None)
    finally:
        join_child(proc)
    assert proc.exitcode == 0
    return tokens, skipped


def local(path, vocab: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with LLM(str(path), num_kv_blocks=BLOCKS) as llm:
        return [o.token_ids for o in llm.generate(prompts(vocab), params)]


# the dense GQA model (2 KV heads split) both ways; a replicated KV head sharded on both sides.
# TP=2 -> TP=2 for llama and a MoE model (qwen3_moe) through `serve -tp 2`:
# tests/chaos/test_tensor_parallel_disaggregated.py
CASES = [("llama", 1, 2), ("llama", 2, 1), ("qwen2", 2, 2)]


@pytest.mark.parametrize("family,prefill_tp,decode_tp", CASES)
def test_kv_pushed_between_tp_sizes_decodes_as_one_process(make_ckpt, family, prefill_tp, decode_tp):
    path = make_ckpt(family)
    from splitserve.core.model_config import ModelConfig

    want = local(path, ModelConfig.from_dir(path).vocab_size)
    tokens, skipped = disaggregated(path, prefill_tp, decode_tp)
    assert skipped == [0, 2]  # the second prompt's first 2 blocks were cached on the decode side
    assert tokens == want
