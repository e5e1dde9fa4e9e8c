"""The Triton dequantising GEMM (kernels/triton_quant.py) against cuBLAS bf16 F.linear at the
Llama-3-8B shapes: time per call and weight GB/s for int4 (group 128), int8 and fp8 codes at
M = 1, 16, 256, each result checked against the float32 reference first.
    python bench/gpu/quant_linear_probe.py [OUT.json]
Written without a GPU (the development machine has none) and not yet run: an experiment for
the first session that has one, not a stage of the GPU check."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton

from splitserve.kernels import triton_quant
from splitserve.kernels.quant_weight import FP8, QuantizedWeight, quantized_linear_reference

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 256)


def quantized(n: int, k: int, fmt: str, dev: torch.device) -> QuantizedWeight:
    scales = torch.rand(n, k // 128, device=dev) / 64
    if fmt == "int4 g128":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        return QuantizedWeight(codes, scales, -8 * scales, 4, 128, k, n)
    if fmt == "int8 g128":
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev)
        return QuantizedWeight(codes, scales / 16, -8 * scales, 8, 128, k, n)
    codes = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes, scales, None, FP8, 128, k, n)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def main() -> None:
    dev = torch.device("cuda")
    rows_out = []
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cublas = bench(lambda x=x, dense=dense: F.linear(x, dense))
            row = {"shape": name, "n": n, "k": k, "m": m, "bf16_cublas_s": cublas,
                   "bf16_gb_per_s": n * k * 2 / cublas / 1e9}
            for fmt in ("int4 g128", "int8 g128", "fp8 g128"):
                qw = quantized(n, k, fmt, dev)
                got = triton_quant.quantized_linear(x, qw).float()
                want = quantized_linear_reference(x.float(), qw).float()
                error = ((got - want).abs().max() / want.abs().max()).item()
                seconds = bench(lambda x=x, qw=qw: triton_quant.quantized_linear(x, qw))
                row[fmt] = {"s": seconds, "gb_per_s": qw.nbytes / seconds / 1e9, "vs_bf16": cublas / seconds,
                            "max_rel_error": error}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    document = {"device": torch.cuda.get_device_name(), "rows": rows_out}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(document, f, indent=2)


if __name__ == "__main__":
    main()
