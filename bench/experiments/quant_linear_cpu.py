"""Weight-only quantized linears on CPU (kernels/quant_native.py) against float32
`F.linear`: time per call and effective GB/s of weight bytes (what a call must read: codes,
scales, offsets; float32 weights for F.linear), at SmolLM2-135M's shapes and 4096 x 4096, for
decode (M = 1, 8) and prefill (M = 32, 256, and 1,024 for two shapes) row counts; and the
bytes one SmolLM2 decode step reads.

Each call takes the next of several copies of its weight, together larger than the L3 cache,
as a model's decode step does (SmolLM2's float32 weights are 538 MB): no figure is a weight
warm in the caches. Each figure is the median over --repeats rounds, the formats interleaved
within a round, so machine drift (the machine may be shared: the load average is recorded)
falls on all alike.

    python -m bench.experiments.quant_linear_cpu [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.experiments.harness import RESULTS, load_average, write_json
from splitserve.kernels import cpu_native, quant_native
from splitserve.kernels.quant_weight import FP8, QuantizedWeight

SHAPES = {"smollm2 qkv 576->960": (960, 576), "smollm2 up 576->1536": (1536, 576),
          "smollm2 down 1536->576": (576, 1536), "4096x4096": (4096, 4096)}
ROWS = (1, 8, 32, 256)
LARGE_ROWS = {"smollm2 up 576->1536": 1024, "4096x4096": 1024}
ROTATION_BYTES = 128 << 20  # float32 copies of each weight to cycle through: 4x this machine's L3
FORMATS = ("float32", "int8", "fp8", "int4 g128", "int4 g32+offsets")
# SmolLM2-135M: 30 layers of q, k, v, o (9 heads, 3 kv heads, head_dim 64), gate, up, down; tied lm_head
SMOLLM2_LINEARS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SMOLLM2_LAYERS, SMOLLM2_VOCAB, SMOLLM2_HIDDEN = 30, 49152, 576


def quantized(n: int, k: int, fmt: str) -> QuantizedWeight:
    """Random codes in the layout of `fmt` (values do not change the time)."""
    group = 128 if k % 128 == 0 else 64  # 576 is no multiple of 128: those shapes take groups of 64
    if fmt == "int8":
        return QuantizedWeight(torch.randint(0, 256, (n, k), dtype=torch.uint8), torch.rand(n, k // group),
                               None, 8, group, k, n)
    if fmt == "fp8":  # per output channel, as compressed-tensors float-quantized checkpoints ship
        return QuantizedWeight(torch.randn(n, k).to(torch.float8_e4m3fn), torch.rand(n, 1), None, FP8, k, k, n)
    if fmt == "int4 g32+offsets":
        group, offsets = 32, torch.rand(n, k // 32)
    else:
        offsets = None
    return QuantizedWeight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // group),
                           offsets, 4, group, k, n)


def timed(fn, min_seconds: float = 0.02) -> float:
    """Seconds per call: as many calls as fill min_seconds, after one warm-up call."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def measure(shape: str, n: int, k: int, rows: list[int], repeats: int) -> list[dict]:
    copies = max(1, ROTATION_BYTES // (n * k * 4))
    weights = {fmt: [torch.randn(n, k) if fmt == "float32" else quantized(n, k, fmt) for _ in range(copies)]
               for fmt in FORMATS}
    found = []
    for m in rows:
        x = torch.randn(m, k)
        turn = iter(range(1 << 62))

        def call(fmt: str, x=x, turn=turn):
            w = weights[fmt][next(turn) % copies]
            return F.linear(x, w) if fmt == "float32" else quant_native.quantized_linear(x, w)

        seconds: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for r in range(repeats):
            for fmt in FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]:
                seconds[fmt].append(timed(lambda fmt=fmt: call(fmt)))
        float32 = statistics.median(seconds["float32"])
        for fmt in FORMATS:
            s = statistics.median(seconds[fmt])
            w = weights[fmt][0]
            nbytes = w.numel() * 4 if fmt == "float32" else w.nbytes
            found.append({"shape": shape, "m": m, "format": fmt, "ms": round(s * 1e3, 4), "weight_bytes": nbytes,
                          "gb_per_s": round(nbytes / s / 1e9, 2), "vs_float32": round(float32 / s, 2)})
            print(f"{shape:24} M={m:<5} {fmt:17} {s * 1e3:9.3f} ms {nbytes / s / 1e9:7.2f} GB/s "
                  f"{float32 / s:5.2f}x float32", flush=True)
    return found


def smollm2_step_bytes() -> dict[str, int]:
    """Weight bytes one decode step reads (every linear once, and the tied lm_head), per format;
    int4 as GPTQ/AWQ ship it (group 128 where 576 allows, else 64, no offsets) and as GGUF
    Q4_1 does (groups of 32 with offsets)."""
    shapes = SMOLLM2_LINEARS * SMOLLM2_LAYERS + [(SMOLLM2_VOCAB, SMOLLM2_HIDDEN)]
    params = sum(n * k for n, k in shapes)
    out = {"float32": params * 4, "bfloat16": params * 2}
    for fmt in ("fp8", "int4 g128", "int4 g32+offsets"):
        total = 0
        for n, k in shapes:
            group = {"fp8": k, "int4 g128": 128 if k % 128 == 0 else 64, "int4 g32+offsets": 32}[fmt]
            per_group = 8 if fmt == "int4 g32+offsets" else 4
            total += n * k * (1 if fmt == "fp8" else 0.5) + n * (k // group) * per_group
        out[fmt] = int(total)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's workers run 1)")
    ap.add_argument("--out", default=str(RESULTS / "quant_linear_cpu.json"))
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    if cpu_native.library() is None:
        raise SystemExit("the native CPU kernels did not build (see the warning above); nothing to measure")
    before = load_average()
    document = {"command": f"python -m bench.experiments.quant_linear_cpu --repeats {ns.repeats} "
                           f"--threads {ns.threads}",
                "machine": "2 shared CPU cores (AVX-512), other engineers' tests running",
                "cpu_march": cpu_native.MARCH, "threads": ns.threads, "repeats": ns.repeats,
                "rotation_bytes": ROTATION_BYTES, "load_average_before": before,
                "linears": [row for shape, (n, k) in SHAPES.items() for row in measure(shape, n, k, ROWS, ns.repeats)],
                "large_m": [row for shape, m in LARGE_ROWS.items()
                            for row in measure(shape, *SHAPES[shape], [m], max(3, ns.repeats // 2))],
                "smollm2_decode_step_weight_bytes": smollm2_step_bytes(), "load_average_after": load_average()}
    for fmt, nbytes in document["smollm2_decode_step_weight_bytes"].items():
        print(f"SmolLM2-135M decode step reads {nbytes / 1e6:7.1f} MB of weights in {fmt}")
    write_json(Path(ns.out), document)


if __name__ == "__main__":
    main()
