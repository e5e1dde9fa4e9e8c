"""Idle and flooding PushBlocks streams against a real KV receiver. Before, 18 streams that
sent nothing took every slot for good: real pushes failed `receiver_busy` and every
request fell back to a local prefill. Now one peer holds at most `max_pushes_per_peer`
streams, and a stream silent for `push_idle_timeout_s` is cancelled."""

from __future__ import annotations

import threading
import time

import grpc

from splitserve.kvtransfer import create_sender, frames
from tests.kvtransfer import peer
from tests.kvtransfer.conftest import config_for, hashes_for, start_decode, wait_until

# Long enough that all 18 streams reach the guard first even on a loaded machine (a make test
# run once needed more than 2.4 s for that): the test is about the guard, not arrival speed.
IDLE_S = 8.0
PER_PEER = 4


def silent_stream(stop: threading.Event):
    """A PushBlocks request stream that never sends a frame (until told to end)."""
    stop.wait(30)
    return
    yield  # noqa: B901 - a generator that yields nothing


def test_idle_and_flooding_streams_cannot_keep_real_pushes_out():
    decode = start_decode(config_for("grpc", max_pushes_per_peer=PER_PEER, push_idle_timeout_s=IDLE_S,
                                     max_concurrent_pushes=16))
    stop = threading.Event()
    try:
        with grpc.insecure_channel(decode.address) as channel:  # one connection: one peer
            push = frames.push_stub(channel)
            # Before the calls: no stream can start earlier, so a cancel before opened + IDLE_S is
            # early. (Taken after them, CI once spent 2 s creating the 18 calls while the
            # in-process server already ran their idle clocks.)
            opened = time.monotonic()
            calls = [push.future(silent_stream(stop), timeout=30) for _ in range(18)]
            # Every stream reached the guard (4 in, 14 refused) before the idle timeout frees
            # the 4: a stream arriving after that would rightly be let in (CI's slow machine).
            guard = decode.receiver.streams
            wait_until(lambda: guard.refused == 18 - PER_PEER and guard.open_streams() == PER_PEER, IDLE_S * 0.8,
                       "all 18 streams at the guard before the idle timeout")
            wait_until(lambda: all(c.done() for c in calls), IDLE_S + 10, "every stream answered")
            assert time.monotonic() - opened >= IDLE_S * 0.9  # the idle ones by the timeout, not before
            codes = sorted(c.code().name for c in calls)
            assert codes == ["CANCELLED"] * PER_PEER + ["RESOURCE_EXHAUSTED"] * (18 - PER_PEER), codes
            refused = [c for c in calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert all("max_pushes_per_peer 4" in c.details() for c in refused)
            assert decode.receiver.streams.idle_cancelled == PER_PEER
            assert decode.receiver.streams.open_streams() == 0
        # A real push from another peer lands.
        start = decode.free()
        dest = decode.allocate(3)
        lease = decode.expect("real", dest, hashes_for(3))
        with create_sender("grpc", config_for("grpc")) as sender:
            result = sender.push("real", decode.address, peer.source_pool(), [1, 2, 3], dest, hashes_for(3))
        assert result.nbytes > 0 and lease.result(timeout=10).ok
        assert decode.free() == start - 3
    finally:
        stop.set()
        decode.receiver.stop()

