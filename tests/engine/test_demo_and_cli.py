"""The built-in demo checkpoint, the `splitserve generate` command and the engine flags' defaults."""

import argparse
import json
import subprocess
import sys

import pytest

from splitserve.core.model_dir import DEMO_NAME
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.args import add_engine_args, decode_worker_engine, engine_config_from_args
from splitserve.engine.demo import ensure_demo_checkpoint


def test_demo_checkpoint_is_deterministic_labelled_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "a"))
    first = ensure_demo_checkpoint()
    assert first.name == DEMO_NAME and "random" in (first / "README.md").read_text()
    assert ensure_demo_checkpoint() == first  # second call reuses it
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "b"))
    second = ensure_demo_checkpoint()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    out = LLM(str(first), num_kv_blocks=32).generate(["Hello"], SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_generate_cli_prints_json_and_rejects_bad_input(make_ckpt):
    path = make_ckpt("llama")
    ok = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--model", str(path),
                         "--max-tokens", "5", "--json", "Hello world"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    row = json.loads(ok.stdout.strip())
    assert len(row["token_ids"]) <= 5 and row["finish_reason"] in ("stop", "length")
    bad = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--model", str(path),
                          "--temperature", "-1", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "temperature must be >= 0" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--model", "/nonexistent",
                              "x"], capture_output=True, text=True)
    assert missing.returncode == 2 and "/nonexistent/config.json: not found" in missing.stderr


@pytest.mark.parametrize("command", [["serve"], ["router", "--redis-url", "redis://127.0.0.1:1/0"],
                                     ["decode-worker", "--redis-url", "redis://127.0.0.1:1/0"]])
def test_an_unsupported_architecture_is_one_line_and_exit_2_before_anything_starts(tmp_path, command):
    import time

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["JambaForCausalLM"],
                                                      "model_type": "jamba", "hidden_size": 64}))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", *command, "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "architecture 'JambaForCausalLM' is not supported; supported: " in lines[0]
    assert "Qwen3ForCausalLM" in lines[0] and "Traceback" not in proc.stderr
    assert "ray" not in proc.stdout.lower()
    print(f"{command[0]}: refused in {took:.1f}s")


def test_a_cpu_decode_worker_steps_512_tokens_while_streams_decode_unless_told():
    """Those steps carry its streams' next tokens (engine/args.py says why); a prefill
    worker's and a GPU's keep 2048, and an explicit --max-num-batched-tokens wins everywhere."""
    def budgets(*argv: str) -> tuple[int, int | None]:
        ap = argparse.ArgumentParser()
        add_engine_args(ap)
        args = ap.parse_args(list(argv))
        engine = engine_config_from_args(args, "m", "m")
        decode = decode_worker_engine(engine, args)
        assert decode.max_num_batched_tokens == engine.max_num_batched_tokens and engine.decoding_step_tokens is None
        return engine.max_num_batched_tokens, decode.decoding_step_tokens

    assert budgets() == (2048, 512)  # 512 while its streams decode; a lone prompt takes 2048
    assert budgets("--device", "cuda") == (2048, None)
    assert budgets("--max-num-batched-tokens", "4096") == (4096, None)
    with pytest.raises(SystemExit):
        budgets("--max-num-batched-tokens", "0")
