"""gpt-oss MXFP4 experts on CPU, four ways through one projection: the form the engine runs
(engine/quant/mxfp4.py: the packed E2M1 nibbles as they ship, a float32 scale per 32
columns, through the native quantized-linear kernel's FP4 path, kernels/cpu_quant_linear.cpp);
the same values converted to FP8 codes (one byte a value: the kernel's FP8 path, this
module's first form); dequantising the checkpoint's blocks to float32 at every call in torch
(transformers' LUT + ldexp) and F.linear; and float32 weights kept dequantised (4 bytes a
value).

Shapes: one gpt-oss-20b expert (hidden 2880, intermediate 2880: gate_up 2880 -> 5760, down
2880 -> 2880); rows per expert M = 1 (decode, one token to that expert), 4, 32 (a prefill
chunk's share). Each call takes the next of several copies of its weight, together larger
than the L3 cache (a decode step touches many experts); medians over --repeats rounds with
the forms interleaved.

    python -m bench.experiments.mxfp4_expert_cpu [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.experiments.harness import RESULTS, load_average, write_json
from bench.experiments.quant_linear_cpu import timed
from splitserve.engine.quant.mxfp4 import mxfp4_weights
from splitserve.kernels import cpu_native, quant_native
from splitserve.kernels.quant_weight import E2M1, FP8, QuantizedWeight

SHAPES = {"gpt-oss-20b gate_up 2880->5760": (5760, 2880), "gpt-oss-20b down 2880->2880": (2880, 2880)}
ROWS = (1, 4, 32)
ROTATION_BYTES = 128 << 20
FORMS = ("fp4 nibbles (native kernel)", "fp8 codes (native kernel)", "blocks dequantised per call + F.linear",
         "float32 F.linear")
LUT = torch.tensor(E2M1)


def dequantise_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K / 32, 16] uint8 + [N, K / 32] E8M0 -> float32 [N, K] (transformers' way: LUT, ldexp)."""
    values = torch.stack([LUT[(blocks & 0xF).long()], LUT[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).flatten(-2)


def as_fp8_codes(qw: QuantizedWeight) -> QuantizedWeight:
    """The same weight with each E2M1 value as its (exact) e4m3 byte: one byte a value."""
    codes = qw.dequantize() / qw.scales.repeat_interleave(qw.group_size, dim=1)
    return QuantizedWeight(codes.to(torch.float8_e4m3fn), qw.scales, None, FP8, qw.group_size, qw.in_features,
                           qw.out_features)


def measure(shape: str, n: int, k: int, repeats: int) -> list[dict]:
    copies = max(1, ROTATION_BYTES // (n * k))
    gen = torch.Generator().manual_seed(0)
    raw = [(torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen),
            torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=gen)) for _ in range(copies)]
    fp4 = [mxfp4_weights(b, s, shape)[0] for b, s in raw]
    fp8 = [as_fp8_codes(w) for w in fp4[:max(1, copies // 2)]]  # twice the bytes: half the copies
    dense = [dequantise_blocks(*raw[i]) for i in range(max(1, copies // 4))]  # 4 bytes a value: fewer copies
    nbytes = {FORMS[0]: fp4[0].nbytes, FORMS[1]: fp8[0].nbytes, FORMS[2]: raw[0][0].numel() + raw[0][1].numel(),
              FORMS[3]: n * k * 4}
    found = []
    for m in ROWS:
        x = torch.randn(m, k)
        turn = iter(range(1 << 62))

        def call(form: str, x=x, turn=turn):
            i = next(turn)
            if form == FORMS[0]:
                return quant_native.quantized_linear(x, fp4[i % copies])
            if form == FORMS[1]:
                return quant_native.quantized_linear(x, fp8[i % len(fp8)])
            if form == FORMS[2]:
                return F.linear(x, dequantise_blocks(*raw[i % copies]))
            return F.linear(x, dense[i % len(dense)])

        seconds: dict[str, list[float]] = {f: [] for f in FORMS}
        for r in range(repeats):
            for form in FORMS[r % 4:] + FORMS[:r % 4]:
                seconds[form].append(timed(lambda form=form: call(form)))
        for form in FORMS:
            s = statistics.median(seconds[form])
            found.append({"shape": shape, "m": m, "form": form, "ms": round(s * 1e3, 3),
                          "weight_bytes_in_memory": nbytes[form]})
            print(f"{shape:32} M={m:<3} {form:40} {s * 1e3:9.3f} ms  {nbytes[form] / 1e6:6.1f} MB", flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's workers run 1)")
    ap.add_argument("--out", default=str(RESULTS / "mxfp4_expert_cpu.json"))
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    if cpu_native.library() is None:
        raise SystemExit("the native CPU kernels did not build; nothing to measure")
    before = load_average()
    rows = [row for shape, (n, k) in SHAPES.items() for row in measure(shape, n, k, ns.repeats)]
    write_json(Path(ns.out), {"command": f"python -m bench.experiments.mxfp4_expert_cpu --repeats {ns.repeats} "
                                         f"--threads {ns.threads}",
                              "machine": "2 shared CPU cores (AVX-512), other sessions' work running",
                              "cpu_march": cpu_native.MARCH, "threads": ns.threads, "load_average_before": before,
                              "load_average_after": load_average(), "rows": rows})


if __name__ == "__main__":
    main()
