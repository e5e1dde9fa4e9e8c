"""bench/gpu/gpt_oss_20b.py, the trained gpt-oss-20b's GPU script (issue 52), kept working before a
device is lent: its dry run end to end on the CPU (serve disaggregated with a tiny random gpt-oss
in the shipped MXFP4 layout and the real harmony tokenizer, the chat checks through the openai
client, greedy tokens against transformers, `splitserve bench` at concurrency 1 and 8), the one
line and exit 2 without a checkpoint, and the answer checks a trained model must pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "gpt_oss_20b.py"
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

from gpt_oss_chat import WEATHER, expectation_problems, form_problems  # noqa: E402


def answer(**fields) -> dict:
    return {"content": None, "reasoning_content": None, "tool_calls": [], "finish_reason": "stop", **fields}


def test_without_a_checkpoint_it_says_so_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--model", str(tmp_path / "absent")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"gpt_oss_20b: no gpt-oss-20b checkpoint at {tmp_path / 'absent'}: it is ~13 GB and "
                           "cannot be carried to or downloaded on a lent GPU; pass --model DIR where it is on disk "
                           "(or --dry-run on the CPU)\n")
    assert not (tmp_path / "gpt_oss_20b.json").exists()


def test_malformed_answers_are_named():
    assert form_problems(answer(content="17 * 23 = 391", reasoning_content="multiply"), None) == []
    assert form_problems(answer(content="<|channel|>final<|message|>391"), None) == [
        "content holds a harmony control token"]
    assert form_problems(answer(content="391", reasoning_content="391"), None) == [
        "content and reasoning_content are the same text"]
    assert form_problems(answer(finish_reason="tool_calls"), [WEATHER]) == [
        "finish_reason 'tool_calls' with 0 tool calls"]
    assert form_problems(answer(finish_reason="tool_calls", tool_calls=[{"name": "search", "arguments": "{}"}]),
                         [WEATHER]) == ["a call to 'search', not an offered tool"]
    assert form_problems(answer(finish_reason=None, deltas_mixing_channels=2), None) == [
        "finish_reason None", "a streamed delta carries reasoning and content together"]


def test_what_a_trained_model_must_answer():
    call = [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert expectation_problems(answer(content="391", reasoning_content="17*23"), "answer") == []
    assert expectation_problems(answer(content="391", finish_reason="length"), "answer") == [
        "no reasoning_content", "finish_reason 'length'"]
    assert expectation_problems(answer(reasoning_content="r", finish_reason="tool_calls", tool_calls=call), "call") == []
    bad = [{"name": "get_weather", "arguments": "{city: Paris"}]
    assert expectation_problems(answer(reasoning_content="r", finish_reason="tool_calls", tool_calls=bad), "call") == [
        "the arguments are not JSON"]
    assert expectation_problems(answer(reasoning_content="r", content="sunny"), "call") == [
        "not one get_weather call (finish_reason 'stop')"]


def test_the_dry_run_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--dry-run"], capture_output=True, text=True,
                          timeout=300)
    report = json.loads((tmp_path / "gpt_oss_20b.json").read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], json.dumps(report)[:3000])
    assert report["ok"] and report["device"] == "cpu-dry-run" and report["dtype"] == "float32"
    assert "--prefill-workers 1 --decode-workers 1" in report["serve_command"]
    assert report["serve"]["exit_code"] == 0
    checks = report["chat"]["checks"]
    assert set(checks) == {"effort_low", "effort_low_streamed", "effort_medium_streamed", "effort_high", "tool_call",
                           "tool_call_streamed", "tool_result_followup", "effort_low_streamed_equals_effort_low",
                           "tool_call_streamed_equals_tool_call", "responses_create"}
    assert all(c["ok"] for c in checks.values()) and checks["tool_call_streamed_equals_tool_call"]["equal"]
    greedy = report["greedy_vs_transformers"]
    assert greedy["matched_prefix"] == [8, 8, 8, 8] and greedy["serve"] == greedy["transformers"]  # float32: exact
    for c in (1, 8):
        run = report["throughput"][f"concurrency_{c}"]
        assert run["ok"] and run["completed"] == run["requests"] and run["output_tok_per_s"] > 0
