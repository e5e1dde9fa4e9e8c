"""`splitserve bench gpu-check`: how stages are recorded, one real dry-run stage end to end
(the cheap one: the padded CUDA-graph step on the CPU), and the committed dry-run JSON.
The whole dry run takes minutes (Ray, transformers, the Triton interpreter): bench/gpu/run_all.sh
--dry-run runs it; here only what stays fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitserve.benchmark import gpu_check, gpu_check_stages
from splitserve.cli import BENCH_TARGETS

REPO = Path(__file__).parents[2]


@pytest.fixture
def fake_stages(monkeypatch):
    def boom(ctx):
        raise RuntimeError("stage bug")

    fakes = {"good": lambda ctx: {"ok": True, "reason": "fine", "numbers": 1},
             "bad": lambda ctx: {"ok": False, "reason": "wrong tokens"}, "boom": boom}
    monkeypatch.setattr(gpu_check_stages, "STAGES", fakes)
    monkeypatch.setattr(gpu_check_stages, "GPU_PART", dict.fromkeys(fakes, "nothing on a GPU"))


def test_a_dry_run_never_records_a_pass(fake_stages, tmp_path):
    out = tmp_path / "r.json"
    code = gpu_check.main(["--dry-run", "--stages", "good,bad,boom", "--out", str(out), "--workdir", str(tmp_path)])
    result = json.loads(out.read_text())
    assert code == 1  # a stage failed
    assert result["device"] == "cpu-dry-run" and "no GPU figure" in result["mode"]
    good, bad, boom = result["stages"]
    assert good["status"] == "skipped" and good["reason"].startswith("no CUDA device: nothing on a GPU")
    assert "CPU dry run passed: fine" in good["reason"] and good["numbers"] == 1
    assert bad["status"] == "failed" and "CPU dry run FAILED: wrong tokens" in bad["reason"]
    assert boom["status"] == "failed" and "stage bug" in boom["reason"]
    assert result["summary"] == {"passed": 0, "failed": 2, "skipped": 1, "targets": []}
    assert {"torch", "triton", "transformers"} <= result["versions"].keys()
    assert result["started"] <= result["finished"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_only_the_dry_run_runs(fake_stages, tmp_path, capsys):
    assert gpu_check.main(["--stages", "good", "--out", str(tmp_path / "r.json")]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_unknown_stage_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--stages", "kernels,nope", "--workdir", str(tmp_path)])


def test_reachable_from_the_bench_command():
    assert BENCH_TARGETS["gpu-check"] == "splitserve.benchmark.gpu_check"
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


def test_graphs_stage_dry_run_end_to_end(tmp_path):
    """A real stage in its child process: the padded decode step against eager on the CPU."""
    out = tmp_path / "r.json"
    assert gpu_check.main(["--dry-run", "--stages", "graphs", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    stage = json.loads(out.read_text())["stages"][0]
    assert stage["status"] == "skipped", stage
    assert "no CUDA graph was captured" in stage["reason"] and "run eagerly (no capture)" in stage["reason"]
    assert stage["exit_code"] == 0 and (tmp_path / "graphs.log").exists()
    for run in stage["runs"]:
        assert run["ok"] and run["identical_tokens"] == run["outputs"] and run["graph_steps"] > 0
        assert run["captured"] == []  # nothing captured on the CPU


def test_committed_dry_run_result_claims_no_gpu_result():
    result = json.loads((REPO / "bench/results/gpu_check_cpu_dry_run.json").read_text())
    assert result["device"] == "cpu-dry-run" and result["gpu"] is None
    assert [s["stage"] for s in result["stages"]] == list(gpu_check_stages.STAGES)
    assert all(s["status"] == "skipped" and s["reason"].startswith("no CUDA device") for s in result["stages"])
    assert all(t["value"] is None and t["met"] is None for t in result["summary"]["targets"])


def test_parts_run_separately_merge_into_one_result(fake_stages, tmp_path):
    """bench/gpu/run_short.sh runs stages in separate processes, side by side, then merges."""
    parts = []
    for i, stage in enumerate(("good", "bad")):
        parts.append(tmp_path / f"part_{i}.json")
        gpu_check.main(["--dry-run", "--stages", stage, "--out", str(parts[-1]), "--workdir", str(tmp_path)])
    out = tmp_path / "merged.json"
    assert gpu_check.main(["--merge", *map(str, parts), str(tmp_path / "missing.json"), "--out", str(out)]) == 1
    merged = json.loads(out.read_text())
    assert [s["stage"] for s in merged["stages"]] == ["good", "bad"]
    assert merged["summary"] == {"passed": 0, "failed": 1, "skipped": 1, "targets": []}
    assert merged["merged_from"] == [str(p) for p in parts]  # the missing part is named nowhere
    firsts = [json.loads(p.read_text())["started"] for p in parts]
    assert merged["started"] == min(firsts) and merged["device"] == "cpu-dry-run"
    assert gpu_check.main(["--merge", str(tmp_path / "missing.json")]) == 2


def test_stage_limit_caps_a_stage_and_kills_it(tmp_path):
    ctx = gpu_check_stages.Context(dry_run=True, workdir=tmp_path, stage_limit=1)
    r = gpu_check_stages.run(ctx, "slow", [gpu_check_stages.PY, "-c", "import time; time.sleep(30)"], timeout=600)
    assert r["timed_out"] and r["exit_code"] is None and r["seconds"] < 10


def test_serve_stage_needs_grpc_and_records_mooncake_it_cannot_run(monkeypatch, tmp_path):
    from splitserve.benchmark import gpu_check_serve
    from splitserve.kvtransfer import mooncake_endpoint

    results = {"grpc": True}
    monkeypatch.setattr(gpu_check_serve, "run_backend",
                        lambda backend, **kw: {"backend": backend, "ok": results[backend], "reason": "ran"})
    monkeypatch.setattr(mooncake_endpoint, "gpu_memory_problem", lambda device: "this build cannot")
    stage = gpu_check_stages.serve(gpu_check_stages.Context(dry_run=True, workdir=tmp_path))
    assert stage["ok"] and stage["backends"][1] == {"backend": "mooncake", "ok": None, "reason": "not run: this build cannot"}
    results["grpc"] = False
    assert not gpu_check_stages.serve(gpu_check_stages.Context(dry_run=True, workdir=tmp_path))["ok"]
    monkeypatch.setattr(mooncake_endpoint, "gpu_memory_problem", lambda device: None)
    results.update(grpc=True, mooncake=False)
    assert not gpu_check_stages.serve(gpu_check_stages.Context(dry_run=True, workdir=tmp_path))["ok"]
