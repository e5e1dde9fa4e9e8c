"""`splitserve bench kvtransfer` runs end to end on a small size for both backends: every
round's bytes are verified at the receiver, and the JSON holds what docs/kv_transfer.md
describes. (Throughput itself is measured by `make bench-kvtransfer`, never asserted.)"""

from __future__ import annotations

import json
import os

import pytest

from splitserve.benchmark import kvtransfer as bench


@pytest.mark.parametrize("backend", ["grpc", "mooncake"])
def test_bench_kvtransfer_writes_its_json(tmp_path, backend, capsys):
    out = tmp_path / "kv.json"
    affinity = os.sched_getaffinity(0)
    try:
        assert bench.main(["--backend", backend, "--size-mb", "4", "--repeat", "2", "--json", str(out)]) == 0
    finally:
        os.sched_setaffinity(0, affinity)  # the bench pins this process
    result = json.loads(out.read_text())
    assert result["backend"] == ("grpc" if backend == "grpc" else "mooncake-tcp")
    assert result["blocks"] == 2 and result["size_mb"] == 4
    for key in ("raw_gbps", "bare_gbps", "backend_gbps"):
        assert len(result[key]) == 2 and all(v > 0 for v in result[key])
    ratios = sorted(b / r for b, r in zip(result["backend_gbps"], result["raw_gbps"], strict=True))
    assert result["ratio"] == pytest.approx(sum(ratios) / 2)  # median of the per-round ratios
    assert result["target_met"] == (result["ratio"] >= bench.TARGETS[backend])
    # both ends spent CPU on every way of moving the bytes (the ceiling's side shows here)
    assert set(result["cpu_seconds_per_gb"]) == {"raw", "bare", "backend"}
    for sides in result["cpu_seconds_per_gb"].values():
        assert set(sides) == {"sender", "receiver"} and all(v >= 0 for v in sides.values())
    assert result["cpu_seconds_per_gb"]["backend"]["sender"] > 0
    expected_pin = sorted(affinity)[:2] if len(affinity) >= 2 else None
    assert result["pinned_cpus"] == expected_pin
    assert "target" in capsys.readouterr().out
