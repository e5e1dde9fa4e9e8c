"""Two real processes on 127.0.0.1: blocks pushed by a prefill-side process land
byte-identical in the right destination slots of the decode side's KV pool."""

from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import KVTransferConfig, KVTransferError, create_sender
from splitserve.metrics import Metrics
from tests.kvtransfer import peer
from tests.kvtransfer.conftest import config_for, hashes_for, start_decode


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_landed(pool: KVCachePool, src_ids: list[int], dest_ids: list[int],
                  layers: tuple[int, int] | None = None) -> None:
    source = peer.source_pool()
    for s, d in zip(src_ids, dest_ids, strict=True):
        lo, hi = layers or (0, peer.SPEC.num_layers)
        assert torch.equal(as_bytes(pool.data[d, lo:hi]), as_bytes(source.data[s, lo:hi])), f"block {s} -> {d}"
    untouched = [b for b in range(pool.num_blocks) if b not in set(dest_ids)]
    assert not as_bytes(pool.data[untouched]).any(), "bytes landed outside the destination blocks"


def test_blocks_arrive_byte_identical_in_their_destination_slots(decode, sender, backend):
    start = decode.free()
    decoy = decode.allocate(5)  # destination blocks are not simply 0..n-1
    dest = decode.allocate(7)
    decode.release(decoy)
    src = [17, 3, 9, 0, 22, 5, 11]
    hashes = hashes_for(6)  # 6 full blocks; the 7th is the prompt's partial tail
    fut = decode.expect("req-1", dest, hashes)

    reply = sender.push(request_id="req-1", receiver_address=decode.address, src_block_ids=src,
                        dest_block_ids=dest, block_hashes=hashes)

    assert reply["ok"], reply
    assert reply["attempts"] == 1 and reply["nbytes"] == 7 * peer.SPEC.block_nbytes
    outcome = fut.result(timeout=10)
    assert outcome.ok and outcome.reason == "ok" and outcome.nbytes == 7 * peer.SPEC.block_nbytes
    assert_landed(decode.pool, src, dest)
    # The blocks now belong to the request: the receiver gave nothing back.
    assert decode.free() == start - 7 and decode.released == [decoy]


def test_layer_ranges_complete_one_lease_together(decode, sender, backend):
    dest = decode.allocate(3)
    src = [4, 5, 6]
    fut = decode.expect("req-layers", dest, hashes_for(3))
    first = sender.push(request_id="req-layers", receiver_address=decode.address, src_block_ids=src,
                        dest_block_ids=dest, block_hashes=hashes_for(3), layer_range=(0, 1))
    assert first["ok"], first
    assert not fut.done()  # layers 1..3 still missing
    assert decode.receiver.in_flight()["req-layers"]["layers_done"] == 1
    rest = sender.push(request_id="req-layers", receiver_address=decode.address, src_block_ids=src,
                       dest_block_ids=dest, block_hashes=hashes_for(3), layer_range=(1, 4))
    assert rest["ok"], rest
    assert fut.result(timeout=10).ok
    assert_landed(decode.pool, src, dest)


def test_push_with_wrong_block_hashes_is_refused_and_frees_the_lease(decode, sender, backend):
    start = decode.free()
    dest = decode.allocate(2)
    fut = decode.expect("req-hash", dest, hashes_for(2))
    wrong = [h ^ 1 for h in hashes_for(2)]
    reply = sender.push(request_id="req-hash", receiver_address=decode.address, src_block_ids=[1, 2],
                        dest_block_ids=dest, block_hashes=wrong)
    assert not reply["ok"] and reply["reason"] == "bad_header"
    assert "block hashes differ" in reply["detail"]
    outcome = fut.result(timeout=10)
    assert not outcome.ok and outcome.reason == "bad_header"
    assert decode.free() == start
    assert not as_bytes(decode.pool.data).any()


def test_a_decode_worker_restarted_at_the_same_address_is_described_again(decode, sender, backend):
    """The sender caches each receiver's description (its epoch; for mooncake its session
    and pool address). A decode worker that restarted at the same address refuses a header
    built for its old epoch; the sender then describes it again and pushes once more, so the
    request keeps its remote prefill instead of falling back to a local one."""
    first = decode.allocate(1)
    decode.expect("req-before", first, hashes_for(1))
    assert sender.push(request_id="req-before", receiver_address=decode.address, src_block_ids=[2],
                       dest_block_ids=first, block_hashes=hashes_for(1))["ok"]  # described and cached
    port = int(decode.address.rsplit(":", 1)[1])
    old_epoch = decode.receiver.epoch
    decode.receiver.stop()
    restarted = start_decode(config_for(backend, port=port))
    try:
        assert restarted.address == decode.address and restarted.receiver.epoch != old_epoch
        dest = restarted.allocate(3)
        fut = restarted.expect("req-after", dest, hashes_for(3))
        reply = sender.push(request_id="req-after", receiver_address=restarted.address, src_block_ids=[7, 8, 9],
                            dest_block_ids=dest, block_hashes=hashes_for(3))
        assert reply["ok"], reply
        assert reply["attempts"] == 2  # the refused header, then the push with the new epoch
        assert fut.result(timeout=10).ok
        assert_landed(restarted.pool, [7, 8, 9], dest)
    finally:
        restarted.receiver.stop()


def test_push_for_a_request_nobody_expects_is_refused(decode, sender, backend):
    reply = sender.push(request_id="nobody", receiver_address=decode.address, src_block_ids=[1],
                        dest_block_ids=[0], block_hashes=[])
    assert not reply["ok"] and reply["reason"] == "unknown_request"
    assert "expect()" in reply["detail"]
    assert not as_bytes(decode.pool.data).any()


def test_grpc_messages_above_the_default_4mib_limit():
    """6 MiB chunks: both ends raise gRPC's message limit from the same config."""
    config = config_for("grpc", chunk_bytes=6 << 20)
    metrics = Metrics()
    decode = start_decode(config, metrics=metrics, num_blocks=512)  # 8 MiB
    src_pool = peer.source_pool()
    n = decode.pool.num_blocks
    src = [i % src_pool.num_blocks for i in range(n)]
    dest = decode.allocate(n)
    try:
        fut = decode.expect("big", dest, [])
        with create_sender("grpc", config, metrics=metrics) as sender:
            result = sender.push("big", decode.address, src_pool, src, dest, [])
        assert result.nbytes == n * peer.SPEC.block_nbytes > 4 << 20
        assert fut.result(timeout=10).ok
        assert torch.equal(as_bytes(decode.pool.data[dest]), as_bytes(src_pool.data[src]))
        received = metrics.kv_transfer_bytes.labels(backend="grpc", direction="received")._value.get()
        sent = metrics.kv_transfer_bytes.labels(backend="grpc", direction="sent")._value.get()
        assert received == sent == result.nbytes
    finally:
        decode.receiver.stop()


def test_mismatched_message_limits_fail_with_a_clear_reason():
    decode = start_decode(config_for("grpc", chunk_bytes=1 << 20), num_blocks=512)  # receiver: 4 MiB limit
    src_pool = peer.source_pool()
    dest = decode.allocate(decode.pool.num_blocks)
    src = [i % src_pool.num_blocks for i in range(len(dest))]
    try:
        fut = decode.expect("too-big", dest, [])
        with create_sender("grpc", KVTransferConfig(chunk_bytes=6 << 20)) as sender:
            try:
                sender.push("too-big", decode.address, src_pool, src, dest, [])
                raise AssertionError("push should have failed")
            except KVTransferError as exc:
                assert exc.reason == "message_too_large" and "chunk_bytes" in str(exc)
        assert fut.result(timeout=10).reason == "sender_lost"
        assert decode.free() == decode.pool.num_blocks
    finally:
        decode.receiver.stop()
