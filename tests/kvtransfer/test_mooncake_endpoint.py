"""Two real Mooncake Transfer Engines (tcp, in this process): polled one-sided writes land,
report each landing, and a failed write is raised only after every other write ended."""

from __future__ import annotations

import pytest
import torch

from splitserve.kvtransfer.mooncake_endpoint import (
    MooncakeEndpoint,
    MooncakeError,
    PollPacer,
    Write,
)


@pytest.fixture(scope="module")
def engines():
    target, source = MooncakeEndpoint("127.0.0.1", "tcp"), MooncakeEndpoint("127.0.0.1", "tcp")
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    source.register(src.data_ptr(), src.numel())  # once: Mooncake refuses overlapping registrations
    target.register(dst.data_ptr(), dst.numel())
    yield target, source, src, dst
    source.close()
    target.close()


@pytest.fixture
def endpoints(engines):
    engines[3].zero_()
    return engines


def test_writes_land_and_each_landing_is_reported(endpoints):
    target, source, src, dst = endpoints
    k = 64 << 10
    writes = [Write(src.data_ptr() + i * k, dst.data_ptr() + (15 - i) * k, k, i, 1) for i in range(16)]
    landed = []
    source.write(target.session, writes, on_landed=landed.append)
    assert sorted(w.first for w in landed) == list(range(16))
    for i in range(16):
        assert torch.equal(dst[(15 - i) * k:(16 - i) * k], src[i * k:(i + 1) * k])


def test_a_failed_write_is_raised_after_the_others_landed(endpoints):
    target, source, src, dst = endpoints
    k = 256 << 10
    writes = [Write(src.data_ptr(), dst.data_ptr(), k, 0, 1),
              Write(src.data_ptr() + k, dst.data_ptr() + k, k, 1, 1),
              Write(src.data_ptr() + 2 * k, 4096, k, 2, 1)]  # not registered at the target
    landed = []
    with pytest.raises(MooncakeError, match="a write failed"):
        source.write(target.session, writes, on_landed=landed.append)
    # raised only once the writes submitted before the failing one had ended
    assert sorted(w.first for w in landed) == [0, 1]
    assert torch.equal(dst[:2 * k], src[:2 * k]) and not dst[2 * k:].any()


def test_an_unreachable_target_fails_fast(endpoints):
    _, source, src, _ = endpoints
    with pytest.raises(MooncakeError, match="could not submit"):
        source.write("127.0.0.1:1", [Write(src.data_ptr(), 0, 4096, 0, 1)])


def test_polling_naps_long_while_much_is_in_flight_and_learns_the_rate(endpoints, monkeypatch):
    target, source, src, dst = endpoints
    k = 256 << 10
    writes = [Write(src.data_ptr() + i * k, dst.data_ptr() + i * k, k, i, 1) for i in range(4)]
    naps = []
    real_nap = source.pacer.nap
    monkeypatch.setattr(source.pacer, "nap", lambda in_flight: naps.append((in_flight, real_nap(in_flight))) or 0.0)
    monkeypatch.setattr(source.pacer, "rate", 1e6)  # 1 MB/s: even 256 KiB in flight is a capped nap
    monkeypatch.setattr(source.pacer, "MIN_SAMPLE_BYTES", 1 << 20)
    for _ in range(20):  # on an idle loopback all four can land before the first status check
        source.write(target.session, writes)
        if naps:
            break
        monkeypatch.setattr(source.pacer, "rate", 1e6)
    assert naps, "20 writes of 1 MiB all landed before their first status check"
    assert all(nap == PollPacer.MAX_NAP_S for _, nap in naps)  # slow link: few wake-ups
    assert torch.equal(dst[:4 * k], src[:4 * k])
    assert source.pacer.rate > 1e6  # the 1 MiB it just moved in well under a second


def test_poll_pacer_scales_the_nap_with_the_bytes_in_flight():
    pacer = PollPacer(rate_bytes_per_s=4e9)
    assert pacer.nap(0) == PollPacer.MIN_NAP_S
    assert pacer.nap(1 << 30) == PollPacer.MAX_NAP_S
    eight_mib = pacer.nap(8 << 20)  # a quarter of 8 MiB at 4 GB/s
    assert eight_mib == pytest.approx(0.25 * (8 << 20) / 4e9)
    assert pacer.nap(4 << 20) == pytest.approx(eight_mib / 2)


def test_poll_pacer_learns_from_large_transfers_only():
    pacer = PollPacer(rate_bytes_per_s=4e9)
    pacer.observe(64 << 10, 1.0)  # a small write measures latency: ignored
    assert pacer.rate == 4e9
    pacer.observe(64 << 20, (64 << 20) / 2e9)  # 2 GB/s: halfway there
    assert pacer.rate == pytest.approx(3e9)
    pacer.observe(64 << 20, 0.0)
    assert pacer.rate == pytest.approx(3e9)


def test_a_gpu_pool_is_refused_by_the_non_cuda_build(engines, monkeypatch):
    """On an H200 the non-CUDA build failed every write from a GPU pool (EFAULT) and each
    request fell back to a local prefill; registering such a pool now says what to do."""
    from importlib import metadata

    from splitserve.kvtransfer import mooncake_endpoint

    assert mooncake_endpoint.gpu_memory_problem("cpu") is None
    message = mooncake_endpoint.gpu_memory_problem("cuda")
    assert "mooncake-transfer-engine-non-cuda" in message and "--kv-backend grpc" in message
    target = engines[0]
    with pytest.raises(MooncakeError, match="pip install mooncake-transfer-engine"):
        target.register(1 << 40, 4096, "cuda")
    assert (1 << 40) not in target._registered  # nothing was registered
    real_version = metadata.version
    monkeypatch.setattr(metadata, "version",  # the CUDA build beside it: allowed
                        lambda name: "0.3" if name == "mooncake-transfer-engine" else real_version(name))
    assert mooncake_endpoint.gpu_memory_problem("cuda") is None
