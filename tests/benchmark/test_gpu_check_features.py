"""`splitserve bench gpu-check`'s features stage (gpu_check_features.py): how sub-check results
become the stage's ok and reason (a failed, missing or crashed sub-check fails it; one that
cannot run is named "not run", never passed), the stage through gpu_check.main with its child
process faked, and the random adapter it serves. The sub-checks themselves start engines and
two `splitserve serve`s: `splitserve bench gpu-check --dry-run --stages features` runs them."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from splitserve.benchmark import gpu_check, gpu_check_features, gpu_check_stages
from splitserve.benchmark.gpu_check_features import CHECKS, Failed, NotRun
from splitserve.benchmark.gpu_check_stages import features_verdict

EXITED = {"exit_code": 0, "timed_out": False}


def rows(**oks) -> dict:
    reasons = {True: "fine", False: "wrong tokens", None: "not run: peft is not importable"}
    return {"checks": [{"name": n, "ok": ok, "reason": reasons[ok]} for n, ok in oks.items()]}


def test_all_sub_checks_passing_pass_the_stage():
    ok, reason = features_verdict(rows(**dict.fromkeys(CHECKS, True)), EXITED, CHECKS)
    assert ok and reason.count("fine") == len(CHECKS) and "FAILED" not in reason


def test_one_failed_sub_check_fails_the_stage():
    result = rows(**{**dict.fromkeys(CHECKS, True), "spec_exact": False})
    ok, reason = features_verdict(result, {"exit_code": 1, "timed_out": False}, CHECKS)
    assert not ok and "spec_exact: FAILED: wrong tokens" in reason and "kv_offload: fine" in reason


def test_a_sub_check_not_run_is_named_and_never_passed():
    result = rows(**{**dict.fromkeys(CHECKS, True), "lora_peft": None})
    ok, reason = features_verdict(result, EXITED, CHECKS)
    assert ok and "lora_peft: not run: peft is not importable" in reason
    # nothing passed: no pass to record
    ok, reason = features_verdict(rows(**dict.fromkeys(CHECKS, None)), EXITED, CHECKS)
    assert not ok and "no sub-check passed" in reason
    # ok None without saying why it did not run is no "not run"
    odd = {"checks": [{"name": "kv_offload", "ok": True, "reason": "fine"}, {"name": "spec_exact", "ok": None}]}
    assert not features_verdict(odd, EXITED, ("kv_offload", "spec_exact"))[0]


def test_missing_sub_checks_and_a_bad_exit_fail_the_stage():
    partial = rows(kv_offload=True, spec_exact=True)  # the child was killed during spec_serve
    ok, reason = features_verdict(partial, {"exit_code": None, "timed_out": True}, CHECKS)
    assert not ok and "spec_serve: no result (the check process timed out before it)" in reason
    ok, reason = features_verdict(None, {"exit_code": 1, "timed_out": False}, CHECKS)
    assert not ok and "kv_offload: no result (the check process exited 1 before it)" in reason
    everything = rows(**dict.fromkeys(CHECKS, True))  # all passed, then the process crashed on the way out
    ok, reason = features_verdict(everything, {"exit_code": -11, "timed_out": False}, CHECKS)
    assert not ok and reason.endswith("the check process exited -11")


@pytest.fixture
def fake_child(monkeypatch):
    """gpu_check_stages.run replaced: the 'child' writes the given result where --out says."""
    calls = []

    def install(result: dict | None, exit_code: int = 0):
        def run(ctx, name, cmd, timeout, interpret=None):
            calls.append(cmd)
            if result is not None:
                Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(result))
            return {"exit_code": exit_code, "seconds": 1.0, "command": " ".join(cmd[2:]), "timed_out": False,
                    "log_tail": ""}

        monkeypatch.setattr(gpu_check_stages, "run", run)
        return calls

    return install


@pytest.mark.parametrize("failed", [None, "lora_serve"])
def test_stage_in_a_dry_run_is_skipped_or_failed_never_passed(fake_child, tmp_path, failed):
    result = rows(**{n: n != failed for n in CHECKS})
    calls = fake_child(result, exit_code=1 if failed else 0)
    out = tmp_path / "r.json"
    code = gpu_check.main(["--dry-run", "--stages", "features", "--out", str(out), "--workdir", str(tmp_path),
                           "--serve-model", "/models/x"])
    stage = json.loads(out.read_text())["stages"][0]
    assert calls[0][:3] == [gpu_check_stages.PY, "-m", "splitserve.benchmark.gpu_check_features"]
    assert calls[0][calls[0].index("--device") + 1] == "cpu" and calls[0][-2:] == ["--model", "/models/x"]
    assert [c["name"] for c in stage["checks"]] == list(CHECKS)
    assert stage["reason"].startswith("no CUDA device: speculative decoding, LoRA, KV offload and --async-scheduling did not run")
    if failed:
        assert code == 1 and stage["status"] == "failed" and "lora_serve: FAILED: wrong tokens" in stage["reason"]
    else:
        assert code == 0 and stage["status"] == "skipped" and "CPU dry run passed" in stage["reason"]


def test_each_sub_check_outcome_is_recorded_and_a_failure_sets_the_exit_code(monkeypatch, tmp_path, capsys):
    def failed(env, row):
        row["figure"] = 3
        raise Failed("2 of 5 outputs differ")

    def not_run(env, row):
        raise NotRun("peft is not importable")

    def crashed(env, row):
        raise RuntimeError("CUDA error")

    fakes = {"a": lambda env, row: "all good", "b": failed, "c": not_run, "d": crashed}
    monkeypatch.setattr(gpu_check_features, "FUNCTIONS", fakes)
    out = tmp_path / "f.json"
    code = gpu_check_features.main(["--device", "cpu", "--out", str(out), "--model", str(tmp_path),
                                    "--checks", "a,b,c,d"])
    got = {r["name"]: r for r in json.loads(out.read_text())["checks"]}
    assert code == 1
    assert got["a"]["ok"] is True and got["a"]["reason"] == "all good"
    assert got["b"]["ok"] is False and got["b"]["reason"] == "2 of 5 outputs differ" and got["b"]["figure"] == 3
    assert got["c"]["ok"] is None and got["c"]["reason"] == "not run: peft is not importable"
    assert got["d"]["ok"] is False and "CUDA error" in got["d"]["reason"]
    assert "Traceback" in capsys.readouterr().err  # the crash's traceback goes to the stage's log
    assert not features_verdict(json.loads(out.read_text()), {"exit_code": code}, ("a", "b", "c", "d"))[0]
    monkeypatch.setitem(fakes, "b", fakes["a"])
    monkeypatch.setitem(fakes, "d", fakes["a"])
    assert gpu_check_features.main(["--device", "cpu", "--out", str(out), "--model", str(tmp_path),
                                    "--checks", "a,b,c,d"]) == 0


def test_the_random_adapter_is_one_splitserve_serves_for_the_checkpoint(make_ckpt, tmp_path):
    from splitserve.engine.lora.args import lora_problem

    ckpt = make_ckpt("llama")
    adapter = gpu_check_features.write_adapter(str(ckpt), tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and len(config["target_modules"]) == 7
    args = Namespace(enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules=[f"x={adapter}"], model=str(ckpt))
    assert lora_problem(args) is None
    first = (adapter / "adapter_model.safetensors").read_bytes()
    gpu_check_features.write_adapter(str(ckpt), tmp_path / "again")
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == first  # seeded


def test_registered_as_a_stage_with_what_a_dry_run_cannot_show():
    assert "features" in gpu_check_stages.STAGES and "features" in gpu_check_stages.GPU_PART
    assert list(gpu_check_stages.STAGES).index("features") == list(gpu_check_stages.STAGES).index("serve") + 1
    script = (Path(__file__).parents[2] / "bench/gpu/run_short.sh").read_text()
    assert "serve,features,engine" in script
