"""Hostile configurations are refused before Ray starts (issue 49): each is one line on
stderr, exit 2, no argparse usage block, in under 10 s, with under 1 GB of RSS, and no Ray.

The red-team list of issue 49, rerun: config.json and --speculative-config nested past
Python's recursion limit, GGUF metadata arrays nested 1,500 deep and an alignment of 0, a
million speculative tokens, -tp 0 / 3 / 1000, --kv-offload-gib -1 / 1e12, a disk tier larger
than its filesystem, a GPTQ config whose group size is not the weights', and
num_hidden_layers 100,000 (or just more layers than the weights hold).

The cases share one child process (one torch import instead of twenty: the module stays
inside its time budget); the time asserted for each is the child's imports plus its checks,
what the real command takes. One more case runs `python -m splitserve.cli serve` itself.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitserve.core import bounded_json
from splitserve.core.checkpoint_check import layers_problem
from splitserve.core.gguf_file import MAX_ARRAY_DEPTH, read_gguf_header
from splitserve.core.machine_limits import (
    GIB,
    available_memory_bytes,
    free_disk_bytes,
    kv_pool_bytes,
    kv_sizes_problem,
)
from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.core.speculative import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfigError,
    parse_speculative_config,
)

# One child process runs every case through the real mains (serve's, and the workers' and the
# router's for argument errors), each with its own stderr, with serve.start_ray replaced (reaching
# it fails the case), and reports each case's exit code, stderr and seconds, the seconds its
# imports took (torch among them: most of a real command's time) and its peak RSS.
CHILD = """
import contextlib, importlib, io, json, sys, time
started = time.monotonic()
import splitserve.serve as serve
import splitserve.decode_worker.main, splitserve.prefill_worker.main, splitserve.router.main
def no_ray():
    print("start_ray was reached", file=sys.stderr)
    sys.exit(99)
serve.start_ray = no_ray
results = {"import_s": time.monotonic() - started}
for name, module, argv in json.loads(sys.argv[1]):
    err, began = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as exc:
            code = exc.code
    results[name] = {"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - began}
# VmHWM, the peak of this process image: ru_maxrss would carry over the peak of the process that
# forked it (Linux keeps it across exec), a pytest worker's gigabytes under xdist
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
results["rss_mb"] = int(hwm.split()[1]) / 1024
print(json.dumps(results))
"""
SERVE = "splitserve.serve"


@dataclass
class Case:
    argv: list[str]
    expected: str
    module: str = SERVE


def run_cases(cases: dict[str, Case]) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps([(n, c.module, c.argv) for n, c in cases.items()])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def set_config(model: Path, **fields) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(fields)
    (model / "config.json").write_text(json.dumps(cfg))


def gguf_bytes(metadata: bytes, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + metadata


def gguf_key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def nested_arrays(depth: int) -> bytes:
    """Key "x": an array of one array of ... `depth` levels, the innermost empty (of uint32)."""
    return gguf_key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)


def alignment_gguf(alignment: int) -> bytes:
    return gguf_bytes(gguf_key("general.alignment") + struct.pack("<II", 4, alignment), 1)


def build_cases(make_ckpt, root: Path) -> dict[str, Case]:
    """The red-team list of issue 49 (and a few neighbours), each as its files and flags."""
    def llama(name: str, **fields) -> str:
        target = root / name  # 4 heads, 2 KV heads, 2 layers
        shutil.copytree(make_ckpt("llama"), target)
        if fields:
            set_config(target, **fields)
        return str(target)

    brackets = llama("brackets")
    (Path(brackets) / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    deep_tokenizer_config = llama("tokenizer-config")
    (Path(deep_tokenizer_config) / "tokenizer_config.json").write_text("{\"a\":" * 100_000 + "1" + "}" * 100_000)
    (root / "deep.gguf").write_bytes(gguf_bytes(nested_arrays(1500), 1))
    (root / "align0.gguf").write_bytes(alignment_gguf(0))
    (root / "tier").mkdir()
    good = llama("good")
    from tests.engine.test_quant_formats import quantize_checkpoint

    gptq, _ = quantize_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=384), root, "gptq")
    gptq7, gptq64 = root / "gptq7", root / "gptq64"
    for target, group in ((gptq7, 7), (gptq64, 64)):  # 64 divides the columns, but the scales hold groups of 128
        shutil.copytree(gptq, target)
        cfg = json.loads((target / "config.json").read_text())
        cfg["quantization_config"]["group_size"] = group
        (target / "config.json").write_text(json.dumps(cfg))
    worker_flag = ["--block-size", "x"]
    return {
        "config.json of 100,000 nested brackets": Case(
            ["--model", brackets], "config.json: not valid JSON (nested deeper than the 128 levels allowed)"),
        "tokenizer_config.json nested 100,000 deep": Case(
            ["--model", deep_tokenizer_config],
            "tokenizer_config.json: not valid JSON (nested deeper than the 128 levels allowed)"),
        "speculative config of 1,000 nested brackets": Case(
            ["--model", good, "--speculative-config", "[" * 1000 + "]" * 1000],
            "--speculative-config: not a JSON object: nested deeper than the 128 levels allowed"),
        "a million speculative tokens": Case(
            ["--model", good, "--speculative-config", '{"method":"ngram","num_speculative_tokens":1000000}'],
            "--speculative-config: num_speculative_tokens is 1000000; at most 32 is supported"),
        "GGUF arrays nested 1,500 deep": Case(["--model", str(root / "deep.gguf")],
                                              "metadata arrays nested more than 4 deep"),
        "GGUF general.alignment 0": Case(["--model", str(root / "align0.gguf")],
                                         "general.alignment is 0; it must be a positive power of two"),
        "-tp 0": Case(["-tp", "0"], "splitserve serve: argument -tp/--tensor-parallel-size: must be >= 1, got 0"),
        "--kv-offload-gib -1": Case(["--kv-offload-gib", "-1"],
                                    "splitserve serve: argument --kv-offload-gib: '-1': a size in GiB must be finite"),
        "an unknown flag": Case(["--no-such-flag"], "splitserve serve: unrecognized arguments: --no-such-flag"),
        "decode-worker argument error": Case(worker_flag, "splitserve decode-worker: argument --block-size: invalid "
                                             "int value: 'x'", "splitserve.decode_worker.main"),
        "prefill-worker argument error": Case(worker_flag, "splitserve prefill-worker: argument --block-size: invalid "
                                              "int value: 'x'", "splitserve.prefill_worker.main"),
        "router argument error": Case(worker_flag, "splitserve router: argument --block-size: invalid int value: 'x'",
                                      "splitserve.router.main"),
        **{f"-tp {tp}": Case(["--model", good, "-tp", str(tp)],
                             f"--tensor-parallel-size {tp}: LlamaForCausalLM cannot be split that way: "
                             "num_attention_heads (4) is not divisible by it") for tp in (3, 1000)},
        **{f"--kv-offload-gib {gib}": Case(["--model", good, "--kv-offload-gib", gib],
                                           f"--kv-offload-gib {float(gib):g}, --kv-cache-memory 0.5: 2 worker(s) "
                                           "would take") for gib in ("100", "1e12")},
        "a disk tier larger than its filesystem": Case(
            ["--model", good, "--kv-offload-dir", str(root / "tier"), "--kv-offload-dir-gib", "1e9"],
            "--kv-offload-dir-gib 1e+09: 2 worker(s) would write up to"),
        "num_hidden_layers 100,000": Case(["--model", llama("layers100000", num_hidden_layers=100_000)],
                                          "field 'num_hidden_layers' is 100000; it must be an integer from 1 to 1024"),
        "more layers than the weights hold": Case(
            ["--model", llama("layers5", num_hidden_layers=5)],
            "config.json says num_hidden_layers 5, but the weights hold 2 layer(s): none for layer(s) 2, 3, 4"),
        "GPTQ group_size 7 over real tensors": Case(["--model", str(gptq7)],
                                                    "input columns, which group_size 7 does not divide"),
        "GPTQ group_size 64 over groups of 128": Case(["--model", str(gptq64)], "and group_size 64 need [6, 256] and [6, 32]"),
        "GPTQ -tp 2 splitting a group": Case(
            ["--model", str(gptq), "-tp", "2"], "--tensor-parallel-size 2: LlamaForCausalLM cannot be split that way: "
            "its mlp.down_proj has 384 input columns, 192 per rank, which is not whole quantization groups of 128"),
    }


CASE_NAMES = ["config.json of 100,000 nested brackets", "tokenizer_config.json nested 100,000 deep", "speculative config of 1,000 nested brackets",
              "a million speculative tokens", "GGUF arrays nested 1,500 deep", "GGUF general.alignment 0", "-tp 0",
              "--kv-offload-gib -1", "an unknown flag", "decode-worker argument error", "prefill-worker argument error",
              "router argument error", "-tp 3", "-tp 1000", "--kv-offload-gib 100", "--kv-offload-gib 1e12",
              "a disk tier larger than its filesystem", "num_hidden_layers 100,000",
              "more layers than the weights hold", "GPTQ group_size 7 over real tensors",
              "GPTQ group_size 64 over groups of 128", "GPTQ -tp 2 splitting a group"]


@pytest.fixture(scope="module")
def refusals(make_ckpt, tmp_path_factory):
    cases = build_cases(make_ckpt, tmp_path_factory.mktemp("hostile"))
    assert sorted(cases) == sorted(CASE_NAMES)
    return cases, run_cases(cases)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_each_hostile_configuration_is_one_line_exit_2_before_ray(refusals, name):
    cases, results = refusals
    case, got = cases[name], results[name]
    if name == "--kv-offload-gib 100" and available_memory_bytes() > 201 * GIB:
        pytest.skip("this machine has the 201 GiB that two workers would take")
    lines = [ln for ln in got["stderr"].splitlines() if ln.strip()]
    assert got["code"] == 2, got
    assert len(lines) == 1 and case.expected in lines[0], got["stderr"][-3000:]
    assert lines[0].startswith("splitserve "), lines[0]
    assert "usage:" not in got["stderr"] and "Traceback" not in got["stderr"]  # (and start_ray was not reached)
    # a real command's time: the imports (torch) and then the checks
    took = results["import_s"] + got["seconds"]
    assert took < 10 and results["rss_mb"] < 1024, (took, results["rss_mb"])
    print(f"{took:.1f} s ({got['seconds']:.2f} s after the imports), peak RSS {results['rss_mb']:.0f} MB: {lines[0]}")


def test_the_real_command_refuses_in_one_line():
    """`splitserve serve` itself, through cli.py: the same refusal, no Ray in its output."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--speculative-config",
                           '{"method":"ngram","num_speculative_tokens":1000000}'], capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - started
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "at most 32" in lines[0], proc.stderr[-3000:]
    assert "ray" not in (proc.stdout + proc.stderr).lower() and took < 10, took


# ---- the parsers and checks themselves, in process -------------------------------------------

@pytest.fixture
def llama(make_ckpt, tmp_path) -> Path:
    target = tmp_path / "llama"
    shutil.copytree(make_ckpt("llama"), target)
    return target


def test_config_json_bounds(llama):
    (llama / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested deeper than the 128 levels allowed"):
        ModelConfig.from_dir(llama)
    with (llama / "config.json").open("w") as f:
        f.write('{"pad": "' + "x" * (bounded_json.MAX_CONFIG_BYTES + 10) + '"}')
    with pytest.raises(CheckpointError, match="more than the 16777216 allowed"):
        ModelConfig.from_dir(llama)


def test_config_sizes_are_bounded(llama):
    for fields, expected in (({"num_hidden_layers": 100_000}, "'num_hidden_layers' is 100000"),
                             ({"hidden_size": "4096"}, "'hidden_size' is '4096'"),
                             ({"num_attention_heads": 0}, "'num_attention_heads' is 0"),
                             ({"num_key_value_heads": 3}, "(4) is not a multiple of num_key_value_heads (3)"),
                             ({"max_position_embeddings": 10**12}, "'max_position_embeddings' is 1000000000000")):
        raw = json.loads((llama / "config.json").read_text()) | fields
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            ModelConfig.from_dict(raw)


def test_a_speculative_config_nested_1000_deep():
    with pytest.raises(SpeculativeConfigError, match="nested deeper"):
        parse_speculative_config("[" * 1000 + "]" * 1000)


@pytest.mark.parametrize("field", ["num_speculative_tokens", "prompt_lookup_max"])
def test_speculative_token_counts_have_a_documented_maximum(field):
    ok = {"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS, "prompt_lookup_max": 32}
    assert parse_speculative_config(json.dumps(ok)).num_speculative_tokens == MAX_SPECULATIVE_TOKENS
    with pytest.raises(SpeculativeConfigError, match=f"{field} is 33; at most 32"):
        parse_speculative_config(json.dumps(ok | {field: MAX_SPECULATIVE_TOKENS + 1}))


def test_gguf_array_nesting_is_bounded(tmp_path):
    deep, shallow = tmp_path / "deep.gguf", tmp_path / "shallow.gguf"
    deep.write_bytes(gguf_bytes(nested_arrays(1500), 1))
    shallow.write_bytes(gguf_bytes(nested_arrays(MAX_ARRAY_DEPTH), 1))
    with pytest.raises(CheckpointError, match=f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep"):
        read_gguf_header(deep)
    assert read_gguf_header(shallow).metadata["x"] == 1  # the limit itself is readable


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_gguf_alignment_must_be_a_power_of_two(tmp_path, alignment):
    path = tmp_path / "align.gguf"
    path.write_bytes(alignment_gguf(alignment))
    with pytest.raises(CheckpointError, match=f"general.alignment is {alignment}; it must be a positive power of two"):
        read_gguf_header(path)
    path.write_bytes(alignment_gguf(64))
    assert read_gguf_header(path).metadata["general.alignment"] == 64


def test_kv_sizes_against_given_limits():
    class Args:
        device, kv_cache_memory, num_kv_blocks = "cpu", 0.5, None
        kv_offload_gib, kv_offload_dir, kv_offload_dir_gib = 4.0, "/nowhere", 10.0

    assert kv_sizes_problem(Args, 2, available=10 * GIB, free_disk=20 * GIB) is None
    problem = kv_sizes_problem(Args, 2, available=8 * GIB)
    assert problem.startswith("--kv-offload-gib 4, --kv-cache-memory 0.5: 2 worker(s) would take 9 GiB of host "
                              "memory, and this machine has 8 GiB available"), problem
    assert "its filesystem has 19 GiB free" in kv_sizes_problem(Args, 2, available=10 * GIB, free_disk=19 * GIB)
    Args.device = "cuda"  # the pool is on the GPU: only the host tier counts
    assert kv_sizes_problem(Args, 2, available=8 * GIB, free_disk=20 * GIB) is None
    assert available_memory_bytes() and free_disk_bytes("/no/such/dir")  # measured here (Linux)


def test_a_cpu_pool_of_num_kv_blocks_is_sized_from_the_model(llama):
    class Args:  # 2 layers x 2 (K, V) x 16 tokens x 2 KV heads x head_dim 32 x 4 bytes: 16 KiB a block
        model, device, dtype, kv_cache_dtype = str(llama), "cpu", "float32", "auto"
        block_size, tensor_parallel_size, num_kv_blocks, kv_offload_gib = 16, 1, 1000, 0.0

    assert kv_pool_bytes(Args) == 1000 * 16 * 1024
    assert kv_sizes_problem(Args, 2, available=GIB) is None
    Args.num_kv_blocks = 10**9
    assert kv_sizes_problem(Args, 2, available=GIB).startswith("--num-kv-blocks 1e+09: 2 worker(s) would take 3.05e+04 "
                                                               "GiB of host memory")


def test_layer_counts_against_tensor_names():
    headers = {f"model.layers.{i}.mlp.up_proj.weight": {} for i in range(3)} | {"model.norm.weight": {}}
    assert layers_problem(headers, 3, "m") is None
    assert "none for layer(s) 3, 4, 5, 6, 7 and 2 more" in layers_problem(headers, 10, "m")
    assert "layer(s) 2 are beyond it" in layers_problem(headers, 2, "m")
