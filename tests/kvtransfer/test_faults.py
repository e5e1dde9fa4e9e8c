"""Injected faults, each against real processes on 127.0.0.1 for both backends. After
each one the decode side's free-block count is back where it started (except blocks a
successful transfer handed to its request) and no request waits forever."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from splitserve.kvtransfer import KVTransferError, create_sender
from tests.kvtransfer import peer
from tests.kvtransfer.conftest import CTX, SenderProcess, config_for, hashes_for, wait_until
from tests.kvtransfer.test_transfer import as_bytes, assert_landed


def test_corrupted_chunk_is_detected_and_retried(decode, sender, backend):
    start = decode.free()
    dest = decode.allocate(4)
    src = [2, 8, 13, 21]
    fut = decode.expect("corrupt-once", dest, hashes_for(4))
    reply = sender.push(request_id="corrupt-once", receiver_address=decode.address, src_block_ids=src,
                        dest_block_ids=dest, block_hashes=hashes_for(4), behaviour="corrupt_once")
    assert reply["ok"] and reply["attempts"] == 2, reply  # first push rejected by checksum, second clean
    assert fut.result(timeout=10).ok
    assert_landed(decode.pool, src, dest)  # the corrupted bytes were overwritten, never accepted
    assert decode.free() == start - 4


def test_persistently_corrupted_transfer_fails_cleanly(decode, sender, backend):
    start = decode.free()
    dest = decode.allocate(3)
    fut = decode.expect("corrupt-always", dest, hashes_for(3))
    reply = sender.push(request_id="corrupt-always", receiver_address=decode.address, src_block_ids=[1, 2, 3],
                        dest_block_ids=dest, block_hashes=hashes_for(3), behaviour="corrupt_always")
    assert not reply["ok"] and reply["reason"] == "checksum_mismatch", reply
    assert "destination block" in reply["detail"] and "gave up after 3" in reply["detail"]
    outcome = fut.result(timeout=10)
    assert not outcome.ok and outcome.reason == "checksum_mismatch"
    wait_until(lambda: decode.free() == start, what="leased blocks back in the free list")
    assert decode.released == [dest]


def test_sender_killed_mid_transfer(decode, backend):
    start = decode.free()
    dest = decode.allocate(6)
    fut = decode.expect("killed", dest, hashes_for(6), timeout=30)
    doomed = SenderProcess(backend)
    try:
        doomed.start_push(request_id="killed", receiver_address=decode.address, src_block_ids=list(range(6)),
                          dest_block_ids=dest, block_hashes=hashes_for(6), behaviour="stall")
        assert doomed.progress.wait(30), "the sender never started"
        key = "bytes_received" if backend == "grpc" else "one_sided_writers"
        wait_until(lambda: decode.receiver.in_flight().get("killed", {}).get(key), what="transfer under way")
        os.kill(doomed.process.pid, signal.SIGKILL)
        outcome = fut.result(timeout=10)  # long before the 30 s lease timeout
        assert not outcome.ok and outcome.reason == "sender_lost", outcome
        wait_until(lambda: decode.free() == start, what="leased blocks back in the free list")
    finally:
        doomed.close()


@pytest.mark.parametrize("when", ["before_push", "mid_transfer"])
def test_transfer_to_an_aborted_request(decode, sender, backend, when):
    start = decode.free()
    dest = decode.allocate(4)
    fut = decode.expect("aborted", dest, hashes_for(4))
    push = dict(request_id="aborted", receiver_address=decode.address, src_block_ids=[5, 6, 7, 8],
                dest_block_ids=dest, block_hashes=hashes_for(4))
    if when == "before_push":
        assert decode.receiver.abort("aborted", "client disconnected")
        assert fut.result(timeout=1).reason == "aborted"
        assert decode.free() == start  # nothing was writing: released at once
        reply = sender.push(**push)
    else:
        sender.start_push(behaviour="slow", **push)
        assert sender.progress.wait(30)
        assert decode.receiver.abort("aborted", "client disconnected")
        assert fut.result(timeout=1).reason == "aborted"
        reply = sender.result()
    assert not reply["ok"] and reply["reason"] == "request_aborted", reply
    wait_until(lambda: decode.free() == start, what="leased blocks back in the free list")
    assert decode.released == [dest]
    assert not decode.receiver.in_flight()


def test_receiver_that_never_acknowledges(backend):
    """The decode process freezes (SIGSTOP): the push gives up at its deadline; once the
    decode process runs again its lease times out and its blocks go back."""
    conn, child_conn = CTX.Pipe()
    child = CTX.Process(target=peer.receiver_main, daemon=True,
                        args=(child_conn, config_for(backend), 32))
    child.start()
    src_pool = peer.source_pool()
    try:
        assert conn.poll(60)
        address = conn.recv()
        with create_sender(backend, config_for(backend)) as sender:
            conn.send(("expect", "warm", 1, 10.0))
            warm = conn.recv()
            sender.push("warm", address, src_pool, [0], warm, [])  # connection and description cached
            conn.send(("free",))
            start = conn.recv()
            conn.send(("expect", "frozen", 4, 2.0))
            dest = conn.recv()
            os.kill(child.pid, signal.SIGSTOP)
            began = time.monotonic()
            with pytest.raises(KVTransferError) as err:
                sender.push("frozen", address, src_pool, [1, 2, 3, 4], dest, [], timeout=1.0)
            assert err.value.reason == "deadline" and "frozen" in str(err.value)
            assert time.monotonic() - began < 5.0  # nobody waits forever on a silent receiver
            os.kill(child.pid, signal.SIGCONT)
            conn.send(("outcome", "frozen", 10.0))
            ok, reason = conn.recv()
            assert not ok and reason in ("timeout", "sender_lost")

            def free_again():
                conn.send(("free",))
                return conn.recv() == start
            wait_until(free_again, what="decode process to release the frozen lease")
        conn.send(None)
        child.join(10)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.join(5)


def test_lease_timeout_without_any_sender(decode, backend):
    start = decode.free()
    dest = decode.allocate(2)
    fut = decode.expect("never-sent", dest, [], timeout=0.3)
    outcome = fut.result(timeout=5)
    assert not outcome.ok and outcome.reason == "timeout"
    assert decode.free() == start
    assert not as_bytes(decode.pool.data).any()
    assert torch.count_nonzero(decode.pool.data) == 0
