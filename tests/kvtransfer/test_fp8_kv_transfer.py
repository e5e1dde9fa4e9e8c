"""An fp8 KV pool on the wire: a prompt prefilled by a real engine moves half the bytes of
bf16 (the sender's own byte counter), its fp8 codes land byte for byte; and workers whose KV
dtypes differ are refused: at the transfer handshake and, earlier, at registration."""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.messages import WorkerInfo
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import KVReceiver, KVTransferError
from splitserve.kvtransfer.sender import create_sender
from splitserve.metrics import Metrics
from splitserve.router.index_sync import IndexSync
from splitserve.router.radix_index import RadixIndex
from tests.kvtransfer.conftest import config_for

PROMPT = list(range(7, 7 + 45))  # 2 full blocks of 16 and a partial third


def prefill_engine(ckpt: str, kv_cache_dtype: str):
    """A prefill engine holding PROMPT's KV, as a prefill worker does until it is pushed."""
    engine = LLM(ckpt, dtype="bfloat16", num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype).engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def push(engine, receiver_pool: KVCachePool) -> tuple[float, KVCachePool]:
    """Push the held prompt into receiver_pool over gRPC; (bytes the sender counted, pool)."""
    metrics = Metrics()
    receiver = KVReceiver(receiver_pool, config_for("grpc"), worker_id="d")
    receiver.start()
    blocks = BlockManager(receiver_pool.num_blocks, receiver_pool.spec.block_size)
    try:
        src, hashes = engine.held_blocks("r", 0)
        dest = blocks.allocate_blocks(len(src))
        done = receiver.expect("r", dest, hashes, blocks.release_blocks)
        with create_sender("grpc", config_for("grpc"), metrics) as sender:
            sender.push("r", receiver.address, engine.runner.kv_pool, src, dest, hashes)
        assert done.result(timeout=10).ok
        landed = receiver_pool.data[dest].view(torch.uint8)
        assert torch.equal(landed, engine.runner.kv_pool.data[src].view(torch.uint8))
    finally:
        receiver.stop()
    return metrics.kv_transfer_bytes.labels(backend="grpc", direction="sent")._value.get(), receiver_pool


def test_fp8_kv_moves_half_the_bytes_of_bf16(make_ckpt):
    ckpt = str(make_ckpt("llama"))
    sent = {}
    for kv in ("auto", "fp8"):
        engine = prefill_engine(ckpt, kv)
        pool = KVCachePool(engine.runner.kv_pool.spec, 16)
        sent[kv], _ = push(engine, pool)
    spec = engine.runner.kv_pool.spec
    assert spec.dtype == torch.float8_e4m3fn
    assert sent["fp8"] == 3 * spec.block_nbytes  # three blocks, each its bytes and nothing else
    assert sent["auto"] == 2 * sent["fp8"]


def test_a_bf16_receiver_refuses_an_fp8_sender_naming_both_dtypes(make_ckpt):
    engine = prefill_engine(str(make_ckpt("llama")), "fp8")
    spec = engine.runner.kv_pool.spec
    bf16_pool = KVCachePool(type(spec)(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                                       torch.bfloat16), 16)
    with pytest.raises(KVTransferError) as err:
        push(engine, bf16_pool)
    message = str(err.value)
    assert "float8_e4m3fn" in message and "bfloat16" in message and "same model" in message


def test_workers_with_another_kv_dtype_are_refused_at_registration(caplog):
    async def scenario():
        bus = InProcBus("fp8")
        await bus.register(WorkerInfo("p0", "prefill", "h:1", "m", 16, 64, kv_cache_dtype="float8_e4m3fn"), 30)
        await bus.register(WorkerInfo("d0", "decode", "h:2", "m", 16, 64, kv_cache_dtype="bfloat16"), 30)
        await bus.register(WorkerInfo("d1", "decode", "h:3", "m", 16, 64, kv_cache_dtype="float8_e4m3fn"), 30)
        metrics = Metrics()
        sync = IndexSync(bus, RadixIndex(), metrics=metrics, model="m", block_size=16)
        for _ in range(3):
            await sync.refresh()
        return sync, metrics

    sync, metrics = asyncio.run(scenario())
    assert sync.live("prefill") == ["p0"] and sync.live("decode") == ["d1"]  # p0 registered first
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, refusals  # once per registration, not once a refresh
    assert "d0 (decode at h:2) keeps its KV cache in bfloat16, worker p0 (prefill) in float8_e4m3fn" in refusals[0]
    assert "--kv-cache-dtype" in refusals[0]
    count = metrics.worker_registrations_refused.labels(reason="kv_cache_dtype_mismatch")._value.get()
    assert count == 1
