"""The router micro-benchmark runs end to end on a small index (timings are reported by
`splitserve bench router`, never asserted)."""

import json

import pytest

from splitserve.cli import main as cli_main


def test_bench_router_small_run_writes_its_report(tmp_path, capsys):
    out = tmp_path / "router.json"
    assert cli_main(["bench", "router", "--blocks", "20000", "--workers", "8",
                     "--prefill-workers", "2", "--iters", "300", "--warmup", "20",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert cfg["index_blocks"] >= 20000 and cfg["workers"] == 8
    assert sum(result["paths"].values()) == 300
    assert result["paths"]["disaggregated"] > 0  # cold prompts go to a prefill worker
    for stage in ("hash", "match", "policy", "decision", "decision_cpu", "hash+decision"):
        s = result["latency"][stage]
        assert 0 < s["p50_us"] <= s["p99_us"] <= s["p999_us"] <= s["max_us"]
    printed = capsys.readouterr().out
    assert "decision p99" in printed and "wrote" in printed


def test_bench_router_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["bench", "router", "--prompt-tokens", "100"])
    assert info.value.code == 2
    assert "--prompt-tokens must be at least" in capsys.readouterr().err
