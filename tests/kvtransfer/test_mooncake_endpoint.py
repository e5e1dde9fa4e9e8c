"""Two real Mooncake Transfer Engines (tcp, in this process): polled one-sided writes land,
report each landing, and a failed write is raised only after every other write ended."""

from __future__ import annotations

import pytest
import torch

from splitserve.kvtransfer.mooncake_endpoint import MooncakeEndpoint, MooncakeError, Write


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
