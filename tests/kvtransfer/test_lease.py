"""LeaseTable with a hand-driven clock: every lease ends once, failed leases release their
blocks exactly once and never while something could still write into them."""

from __future__ import annotations

import pytest

from splitserve.kvtransfer.lease import LeaseError, LeaseTable
from splitserve.kvtransfer.wire import TransferHeader


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env():
    clock = Clock()
    released: list[list[int]] = []
    table = LeaseTable(max_attempts=2, quarantine_s=1.0, clock=clock)
    return table, clock, released


def head(request_id="r", dest=(4, 5), hashes=(), layers=(0, 2), backend="grpc") -> TransferHeader:
    return TransferHeader(request_id=request_id, backend=backend, dest_block_ids=list(dest),
                          block_hashes=list(hashes), layer_start=layers[0], layer_end=layers[1], dtype="bfloat16",
                          block_shape=[2, 2, 16, 2, 32], region_nbytes=1,
                          receiver_epoch="e")


def test_timeout_resolves_and_releases_once(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [], num_layers=2, timeout_s=5, release_blocks=released.append)
    clock.now += 4.9
    table.tick()
    assert not fut.done()
    clock.now += 0.2
    table.tick()
    table.tick()
    assert fut.result(0).reason == "timeout" and released == [[4, 5]]
    with pytest.raises(LeaseError) as err:
        table.attach(head(), one_sided=False)
    assert err.value.status == "LEASE_EXPIRED"


def test_abort_during_a_copy_releases_when_the_copy_ends(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [], 2, 5, released.append)
    lease = table.attach(head(), one_sided=False)
    table.begin_io(lease)
    assert table.abort("r", "client went away")
    assert fut.result(0).reason == "aborted" and released == []  # a thread is still copying
    table.end_io(lease, 10)
    assert released == [[4, 5]]
    with pytest.raises(LeaseError) as err:
        table.begin_io(lease)
    assert err.value.status == "REQUEST_ABORTED"
    table.detach(lease, head(), one_sided=False, lost=None)
    assert released == [[4, 5]]


def test_one_sided_failure_waits_for_the_writer_then_the_quarantine(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [], 2, 5, released.append)
    lease = table.attach(head(backend="mooncake"), one_sided=True)
    table.abort("r", "cancelled")
    assert fut.done() and released == []  # the remote writer may still be writing
    clock.now += 3
    table.tick()
    assert released == []
    table.detach(lease, head(), one_sided=True, lost=None)
    clock.now += 0.5
    table.tick()
    assert released == []  # a write already on the wire could still land
    clock.now += 0.6
    table.tick()
    assert released == [[4, 5]]


def test_stuck_one_sided_writer_is_cut_off_after_a_timeout(env):
    table, clock, released = env
    table.expect("r", [4, 5], [], 2, 5, released.append)
    table.attach(head(backend="mooncake"), one_sided=True)
    clock.now += 5
    assert table.tick() <= 5.0  # lease expired; the next look is at most one timeout away
    assert released == []
    clock.now += 5
    table.tick()
    assert released == [[4, 5]]


def test_layer_ranges_and_overlaps(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [], 2, 5, released.append)
    lease = table.attach(head(layers=(0, 1)), one_sided=False)
    with pytest.raises(LeaseError, match="already received or in flight"):
        table.attach(head(layers=(0, 2)), one_sided=False)
    assert table.push_succeeded(lease, head(layers=(0, 1)))
    table.detach(lease, head(layers=(0, 1)), one_sided=False, lost=None)
    assert not fut.done()
    lease = table.attach(head(layers=(1, 2)), one_sided=False)
    assert table.push_succeeded(lease, head(layers=(1, 2)))
    table.detach(lease, head(layers=(1, 2)), one_sided=False, lost=None)
    assert fut.result(0).ok and released == []  # success: the blocks belong to the request


def test_checksum_failures_allow_retries_up_to_the_limit(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [], 2, 5, released.append)
    lease = table.attach(head(), one_sided=False)
    assert table.checksum_failed(lease, "block 0 bad") is True
    assert table.checksum_failed(lease, "block 0 bad") is False
    assert fut.result(0).reason == "checksum_mismatch" and released == [[4, 5]]


def test_header_that_does_not_match_the_lease_fails_it(env):
    table, clock, released = env
    fut = table.expect("r", [4, 5], [9], 2, 5, released.append)
    with pytest.raises(LeaseError, match="block hashes differ"):
        table.attach(head(hashes=(8,)), one_sided=False)
    assert fut.result(0).reason == "bad_header" and released == [[4, 5]]


def test_sender_lost_and_owner_callback_errors_do_not_leak_state(env):
    table, clock, _ = env
    calls = []

    def broken_release(ids):
        calls.append(ids)
        raise RuntimeError("allocator exploded")

    fut = table.expect("r", [4, 5], [], 2, 5, broken_release)
    lease = table.attach(head(), one_sided=False)
    table.detach(lease, head(), one_sided=False, lost="stream broke")
    assert fut.result(0).reason == "sender_lost" and calls == [[4, 5]]
    assert table.reserved_blocks == 0 and table.snapshot() == {}


def test_expect_rejects_bad_arguments(env):
    table, clock, released = env
    with pytest.raises(ValueError, match="at least one"):
        table.expect("r", [], [], 2, 5, released.append)
    with pytest.raises(ValueError, match="repeat"):
        table.expect("r", [1, 1], [], 2, 5, released.append)
    table.expect("r", [1], [], 2, 5, released.append)
    with pytest.raises(ValueError, match="already has a KV transfer"):
        table.expect("r", [2], [], 2, 5, released.append)


def test_stop_ends_everything(env):
    table, clock, released = env
    f1 = table.expect("a", [1], [], 2, 5, released.append)
    f2 = table.expect("b", [2], [], 2, 5, released.append)
    table.attach(head("b", dest=(2,), backend="mooncake"), one_sided=True)
    table.stop("shutting down")
    assert f1.result(0).reason == f2.result(0).reason == "receiver_stopped"
    assert sorted(released) == [[1], [2]]
