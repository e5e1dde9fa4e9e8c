"""`splitserve bench step-overhead` and the datasheet table the GPU check states MBU/MFU against."""

from __future__ import annotations

import json

import pytest

from splitserve.benchmark import step_overhead
from splitserve.benchmark.datasheet import datasheet_peaks


def test_null_model_run_times_every_phase_of_pure_decode_steps(tmp_path):
    out = tmp_path / "r.json"
    assert step_overhead.main(["--null-model", "--batch-sizes", "3,8", "--steps", "6", "--prompt-tokens", "40",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["null_model"] and [r["batch"] for r in result["rows"]] == [3, 8]
    for row in result["rows"]:
        phases = row["phases_ms"]
        assert set(phases) == {"schedule", "stage", "launch", "wait", "sample_and_outputs"}
        assert phases["wait"] == 0 and "device_ms" not in row  # no device: nothing to wait for
        assert row["host_ms"] == row["wall_ms"] > 0
        assert sum(phases.values()) == pytest.approx(row["wall_ms"], abs=2e-3)


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        step_overhead.main(["--batch-sizes", "a,b"])
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_overhead.main(["--steps", "0"])


def test_datasheet_names_the_part_not_a_prefix_of_it():
    assert datasheet_peaks("NVIDIA H100 80GB HBM3")["label"] == "H100 SXM"
    assert datasheet_peaks("NVIDIA H100 PCIe")["hbm_bytes_per_s"] == 2.0e12
    assert datasheet_peaks("NVIDIA H100 NVL")["label"] == "H100 NVL"
    assert datasheet_peaks("NVIDIA H200")["hbm_bytes_per_s"] == 4.8e12
    assert datasheet_peaks("NVIDIA GH200 480GB")["label"] == "GH200 (HBM3)"
    assert datasheet_peaks("Tesla T4") is None
