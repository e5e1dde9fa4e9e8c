"""The native CPU prefill attention (kernels/cpu_prefill_attention.cpp) per layer, on one
thread, against torch's SDPA (the reference path) and, with --baseline, against another
build of the same kernel: the way its speed-ups were measured.

Each geometry is one layer's prefill of SEQS prompts of TOKENS new tokens each (no cached
prefix), K/V in a paged pool. Timings are medians of 15 blocks of 5 calls; the blocks of
the kernels alternate, so machine drift falls on all alike. Outputs are checked to agree.

    python -m bench.experiments.cpu_prefill_kernel
    git show 40b820d:splitserve/kernels/cpu_prefill_attention.cpp > /tmp/old.cpp
    python -m bench.experiments.cpu_prefill_kernel --baseline /tmp/old.cpp
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from splitserve.kernels import cpu_native, reference

# heads, kv heads, head_dim, new tokens per prompt, prompts: the demo model's layer, then
# Llama/Qwen-like shapes, then SmolLM2-135M prompts
GEOMETRIES = [(8, 4, 32, 290, 7), (16, 8, 64, 400, 4), (16, 4, 128, 400, 4), (8, 2, 256, 300, 3),
              (9, 3, 64, 384, 1), (9, 3, 64, 1536, 1)]  # the last two: SmolLM2-135M
BLOCK = 16


def case(heads: int, kv_heads: int, dim: int, tokens: int, seqs: int):
    g = torch.Generator().manual_seed(0)
    per_seq = (tokens + BLOCK - 1) // BLOCK
    k = torch.randn(seqs * per_seq, BLOCK, kv_heads, dim, generator=g)
    v = torch.randn(seqs * per_seq, BLOCK, kv_heads, dim, generator=g)
    tables = torch.randperm(seqs * per_seq, generator=g).to(torch.int32).reshape(seqs, per_seq)
    q = torch.randn(seqs * tokens, heads, dim, generator=g)
    cu = torch.arange(seqs + 1, dtype=torch.int32) * tokens
    lens = torch.full((seqs,), tokens, dtype=torch.int32)
    return q, k, v, tables, cu, lens, dim ** -0.5


def build_from(source: Path) -> ctypes.CDLL:
    """The kernel library built with `source` in place of the prefill kernel's own file."""
    saved, flags = list(cpu_native.SOURCES), list(cpu_native.FLAGS)
    cpu_native.SOURCES[cpu_native.SOURCES.index(cpu_native._HERE / "cpu_prefill_attention.cpp")] = source
    cpu_native.FLAGS.append(f"-I{cpu_native._HERE}")  # its cpu_scalar.h, wherever the file is
    try:
        lib = ctypes.CDLL(str(cpu_native._build(cpu_native._compiler())))
    finally:
        cpu_native.SOURCES[:], cpu_native.FLAGS[:] = saved, flags
    for name, argtypes in cpu_native.SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
    return lib


def with_library(lib: ctypes.CDLL, args):
    def run():
        saved, cpu_native._library = cpu_native._library, lib
        try:
            return cpu_native.paged_prefill_attention(*args)
        finally:
            cpu_native._library = saved
    return run


def median_ms(fns: dict, blocks: int = 15, calls: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for block in range(blocks):
        order = list(fns.items()) if block % 2 == 0 else list(fns.items())[::-1]
        for name, fn in order:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another version of cpu_prefill_attention.cpp to time beside")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    if cpu_native.library() is None:
        raise SystemExit("no native kernel library here (no C++ compiler?): nothing to measure")
    baseline = build_from(ns.baseline.resolve()) if ns.baseline else None
    print(f"{'heads/kv/dim tokens x seqs':>28} {'native ms':>10} {'SDPA ms':>8} {'vs SDPA':>8}"
          + (f" {'baseline ms':>12} {'vs baseline':>12}" if baseline else ""))
    for heads, kv_heads, dim, tokens, seqs in GEOMETRIES:
        args = case(heads, kv_heads, dim, tokens, seqs)
        fns = {"native": lambda a=args: cpu_native.paged_prefill_attention(*a),
               "sdpa": lambda a=args: reference.paged_prefill_attention(*a)}
        if baseline:
            fns["baseline"] = with_library(baseline, args)
        for name, fn in fns.items():  # warm up, and the outputs agree
            torch.testing.assert_close(fn(), fns["sdpa"](), rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        ms = median_ms(fns)
        line = (f"{f'{heads}/{kv_heads}/{dim} {tokens} x {seqs}':>28} {ms['native']:>10.2f} {ms['sdpa']:>8.2f} "
                f"{ms['sdpa'] / ms['native']:>7.2f}x")
        if baseline:
            line += f" {ms['baseline']:>12.2f} {ms['baseline'] / ms['native']:>11.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
