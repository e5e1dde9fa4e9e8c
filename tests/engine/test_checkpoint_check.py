"""A broken checkpoint is named in one line before anything starts (core/checkpoint_check.py,
issue 39): missing weights, a truncated or garbled safetensors file, a shard the index names
but nobody shipped, weights of another shape than config.json, no tokenizer; and a demo
cache that cannot be written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.core.checkpoint_check import cache_dir_problem
from splitserve.core.model_dir import checkpoint_problem


def _weights(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def _no_weights(d: Path) -> None:
    _weights(d).unlink()


def _truncated(d: Path) -> None:
    path = _weights(d)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbled_header(d: Path) -> None:
    path = _weights(d)
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00\xff" * 16
    path.write_bytes(bytes(data))


def _not_safetensors(d: Path) -> None:
    _weights(d).write_bytes(b"\xff" * 64)


def _missing_shard(d: Path) -> None:
    name = _weights(d).name
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": name, "lm_head.weight": "model-00002-of-00002.safetensors"}}))


def _other_model(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] += 7
    (d / "config.json").write_text(json.dumps(cfg))


def _no_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


BROKEN = {
    "no weights": (_no_weights, "no *.safetensors weights"),
    "truncated": (_truncated, "the file is truncated"),
    "garbled header": (_garbled_header, "safetensors header is not valid JSON"),
    "not safetensors": (_not_safetensors, "its header claims"),
    "missing shard": (_missing_shard, "names shard(s) that do not exist: ['model-00002-of-00002.safetensors']"),
    "other model": (_other_model, "the weights and the config are of different models"),
    "no tokenizer": (_no_tokenizer, "tokenizer.json: not found"),
}


@pytest.fixture
def checkpoint(make_ckpt, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(make_ckpt("llama"), target)
    return target


def test_a_good_checkpoint_has_no_problem(checkpoint):
    assert checkpoint_problem(str(checkpoint)) is None


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_broken_checkpoint_is_named_in_one_line(checkpoint, case):
    breaks, expected = BROKEN[case]
    breaks(checkpoint)
    problem = checkpoint_problem(str(checkpoint))
    assert problem is not None and expected in problem, problem
    assert "\n" not in problem and str(checkpoint) in problem


# `serve` takes ~5 s of interpreter start-up here to refuse one (torch and the router are imported
# before the check), so the edit loop runs one case per kind of check: no file, a file's header, the
# config against the weights, the tokenizer. The other weight-file cases take the same path through
# `serve` (one checkpoint_problem call; their messages are checked above) and run in `make test`
# (marker slow).
SAME_PATH_AS_GARBLED_HEADER = ("truncated", "not safetensors", "missing shard")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SAME_PATH_AS_GARBLED_HEADER else c
                                  for c in BROKEN])
def test_serve_refuses_each_broken_checkpoint_before_ray_starts(checkpoint, case):
    breaks, expected = BROKEN[case]
    breaks(checkpoint)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(checkpoint)],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr
    assert "ray" not in (proc.stdout + proc.stderr).lower()
    print(f"{case}: refused in {took:.1f} s")  # issue 39 asks for 5 s: 1.6-1.7 s here, mostly the interpreter


def test_an_unwritable_demo_cache_is_one_line(tmp_path):
    assert cache_dir_problem(tmp_path / "not" / "yet") is None  # created on first use
    problem = cache_dir_problem(Path("/dev/null/splitserve"))
    assert "/dev/null is not a directory" in problem and "--model DIR" in problem and "SPLITSERVE_CACHE" in problem
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SPLITSERVE_CACHE": "/dev/null/splitserve"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "SPLITSERVE_CACHE" in lines[0], proc.stderr
