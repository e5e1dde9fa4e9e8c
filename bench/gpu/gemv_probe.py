"""What a batch-1 decode matmul can reach on this GPU (issue 37's decode MBU): the read
bandwidth of a plain reduction over a large tensor (a read-only ceiling; the bench's copy
peak counts read + write), cuBLAS through F.linear at the Llama-3-8B shapes, and a split-N
Triton GEMV over a few tile choices, each checked against F.linear.
    python bench/gpu/gemv_probe.py [OUT.json]
An experiment for the next change, not a stage of the GPU check: it prints a table and
writes JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


@triton.jit
def _gemv(w, x, y, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
        xv = tl.load(x + cols, mask=cols < K, other=0.0)
        acc += tl.sum(tile.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rows < N)


def gemv(w: torch.Tensor, x: torch.Tensor, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    n, k = w.shape
    y = torch.empty(n, dtype=w.dtype, device=w.device)
    _gemv[(triton.cdiv(n, block_n),)](w, x, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def read_ceiling(dev: torch.device, dt: torch.dtype) -> float:
    """Bytes/s of a plain reduction over 2 GiB: what a matmul reading weights once can reach."""
    big = torch.randn(1 << 30, device=dev, dtype=dt)
    return big.numel() * 2 / bench(lambda: big.sum(dtype=torch.float32))


def probe_shape(name: str, n: int, k: int, dev: torch.device, dt: torch.dtype) -> dict:
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(max(1, int(4e9 // (n * k * 2))))]
    x = torch.randn(k, device=dev, dtype=dt)
    turn = iter(range(1 << 30))

    def pick() -> torch.Tensor:  # rotate over ~4 GB of weights: no L2 reuse
        return ws[next(turn) % len(ws)]

    row = {"name": name, "n": n, "k": k, "cublas_s": bench(lambda: F.linear(x[None], pick()))}
    ref = F.linear(x[None].float(), ws[0].float())[0]
    best = None
    for bn, bk, warps in [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8)]:
        err = (gemv(ws[0], x, bn, bk, warps).float() - ref).norm() / ref.norm()
        if not err < 1e-2:
            row.setdefault("errors", []).append([bn, bk, warps, float(err)])
            continue
        t = bench(lambda bn=bn, bk=bk, warps=warps: gemv(pick(), x, bn, bk, warps))
        if best is None or t < best[0]:
            best = (t, bn, bk, warps)
    row["triton_s"], row["triton_tile"] = (best[0], best[1:]) if best else (None, None)
    for key in ("cublas", "triton"):
        if row[f"{key}_s"]:
            row[f"{key}_bytes_per_s"] = n * k * 2 / row[f"{key}_s"]
    return row


def main() -> int:
    dev, dt = torch.device("cuda"), torch.bfloat16
    out: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    out["read_bytes_per_s"] = read_ceiling(dev, dt)
    print(f"read-only reduction: {out['read_bytes_per_s'] / 1e12:.2f} TB/s")
    for name, (n, k) in SHAPES.items():
        row = probe_shape(name, n, k, dev, dt)
        out["rows"].append(row)
        print(f"{name:8} {n:>6}x{k:<6} cuBLAS {row['cublas_bytes_per_s'] / 1e12:.2f} TB/s"
              + (f", Triton {row['triton_bytes_per_s'] / 1e12:.2f} TB/s {row['triton_tile']}"
                 if row["triton_s"] else ""))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
