"""`splitserve bench kernels` (or `python -m splitserve.benchmark.kernels`): kernel and
model-step efficiency of a Llama-3-8B-shaped model with random bfloat16 weights.

On CUDA it measures, against peaks it measures itself on the same device and against the
device's datasheet peaks (benchmark/datasheet.py; `mbu_datasheet`, `mfu_datasheet`):
  - peak HBM bandwidth (a large device-to-device copy) and peak bf16 matmul throughput;
  - paged decode attention bandwidth (K/V bytes read / time), round-robin over 32 layers
    so the KV cache is not served from L2;
  - a full decode step as model-bandwidth utilisation,
    MBU = (weight bytes + KV bytes read per step) / step time / peak bandwidth,
    eagerly and replayed from a CUDA graph of the bench's own step (launch overhead
    apart: the engine's model runner does its own capture);
  - prefill of one 2048-token prompt as model-FLOPs utilisation against the peak matmul rate;
  - the same work through transformers' LlamaForCausalLM (random init) for comparison.
The decode/prefill steps come from splitserve/benchmark/kernels_model.py (the kernels plus
torch matmuls), not from the engine's model class.

Without CUDA it runs a toy shape through Triton's interpreter so the script itself is
exercised; its figures then mean nothing and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

CPU_NOTE = ("NO CUDA DEVICE: toy model through Triton's CPU interpreter; every figure below "
            "only shows that the benchmark runs and MEANS NOTHING about performance.")


def make_timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """timer(fn, warmup, iters) -> seconds per call (CUDA events on the GPU)."""

    def timer(fn, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return begin.elapsed_time(end) / 1000 / iters

    return timer


def measure_peaks(device: torch.device, dtype: torch.dtype, timer) -> dict:
    cuda = device.type == "cuda"
    src = torch.empty((1 << 30 if cuda else 1 << 26) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src), 3, 20 if cuda else 3)
    n = 8192 if cuda else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_s = timer(lambda: a @ b, 3, 20 if cuda else 3)
    return {"hbm_bytes_per_s": 2 * src.numel() * src.element_size() / copy_s,
            "copy_bytes": src.numel() * src.element_size(),
            "matmul_flops_per_s": 2 * n**3 / mm_s, "matmul_n": n, "matmul_dtype": str(dtype)}


def measure_decode_attention(model, batches: list[int], context: int, peak_bw: float, timer, iters: int) -> list:
    from splitserve.benchmark.kernels_model import decode_inputs
    from splitserve.kernels import ops

    s, results = model.shape, []
    elem = model.kv.data.element_size()
    for batch in batches:
        step = decode_inputs(s, batch, context, model.device)
        q = torch.randn(batch, s.num_heads, s.head_dim, device=model.device, dtype=model.dtype)
        layers = [model.kv.layer(i) for i in range(s.num_layers)]

        def all_layers(step=step, q=q, layers=layers):
            for k_cache, v_cache in layers:
                ops.paged_decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, s.head_dim ** -0.5)

        seconds = timer(all_layers, 2, iters) / s.num_layers
        kv_bytes = batch * (context + 1) * 2 * s.num_kv_heads * s.head_dim * elem
        results.append({"batch": batch, "context": context + 1, "seconds": seconds, "kv_bytes": kv_bytes,
                        "bytes_per_s": kv_bytes / seconds, "fraction_of_peak": kv_bytes / seconds / peak_bw})
    return results


def measure_decode_steps(model, batches, context, peak_bw, timer, iters, cuda_graph: bool) -> list:
    from splitserve.benchmark.kernels_model import decode_inputs

    s, results = model.shape, []
    elem = model.kv.data.element_size()
    for batch in batches:
        step = decode_inputs(s, batch, context, model.device)
        moved = s.weight_bytes_per_step(batch, elem) + s.kv_bytes_read(batch * (context + 1), elem)
        modes = {"eager": lambda step=step: model.forward(step)}
        if cuda_graph:
            try:
                graph = torch.cuda.CUDAGraph()
                model.forward(step)  # compile/autotune outside the capture
                with torch.cuda.graph(graph):
                    model.forward(step)
                modes["cuda_graph"] = graph.replay
            except Exception as exc:  # report, keep the eager figures
                results.append({"batch": batch, "mode": "cuda_graph", "error": repr(exc)})
        for mode, fn in modes.items():
            seconds = timer(fn, 2, iters)
            results.append({"batch": batch, "context": context + 1, "mode": mode, "seconds": seconds,
                            "bytes_read": moved, "mbu": moved / seconds / peak_bw,
                            "tokens_per_s": batch / seconds})
    return results


def parse_args(argv: list[str] | None, cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16,64" if cuda else "1,2")
    p.add_argument("--context", type=int, default=1024 if cuda else 24, help="cached tokens per sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048 if cuda else 24)
    p.add_argument("--iters", type=int, default=20 if cuda else 1)
    p.add_argument("--hf-new-tokens", type=int, default=32, help="tokens per transformers generate call")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="time the decode step eagerly only (by default also replayed from a CUDA graph)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out", type=Path, help="write the JSON results here (also printed)")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if min(args.batches) < 1 or min(args.context, args.prefill_tokens, args.iters) < 1 or args.hf_new_tokens < 2:
        p.error("batch sizes, --context, --prefill-tokens and --iters must be positive, --hf-new-tokens >= 2")
    return args


def _kernels_usable(cuda: bool) -> str | None:
    """Load the Triton kernels in the mode this device needs; an error message if impossible."""
    if not cuda and "triton.language" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
    from splitserve.kernels.triton_decode_attention import _decode_split_kernel

    if not cuda and not _decode_split_kernel.interpreted:
        return ("no CUDA device, and triton was imported before TRITON_INTERPRET=1 could be set; "
                "rerun as: TRITON_INTERPRET=1 splitserve bench kernels ...")
    return None


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parse_args(argv, cuda)
    problem = _kernels_usable(cuda)
    if problem:
        print(f"splitserve bench kernels: {problem}", file=sys.stderr)
        return 2
    from splitserve.benchmark.kernels_model import LLAMA3_8B, TOY
    from splitserve.kernels import ops

    ops.set_backend("triton")  # the point is to time the Triton kernels, also on the CPU
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter has no fast bfloat16
    shape = LLAMA3_8B if cuda else TOY
    timer = make_timer(device)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "note": "measured on the GPU" if cuda else CPU_NOTE,
        "model": {"name": "Llama-3-8B shape" if cuda else "toy Llama shape", **shape.__dict__,
                  "dtype": str(dtype), "weights": "random"},
        "built_from": "splitserve kernels (Triton) + torch matmuls in splitserve/benchmark/kernels_model.py; "
                      "not the engine's model class",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    import triton

    result["versions"]["triton"] = triton.__version__
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # toy ops: thread start-up and contention would dominate
    try:
        peaks = measure_peaks(device, dtype, timer)
        result["peak"] = peaks
        result.update(_splitserve_figures(shape, dtype, device, args, peaks, timer, cuda))
        _against_datasheet(result, peaks)
        if cuda:
            torch.cuda.empty_cache()
        if not args.skip_transformers:
            result["transformers"] = _transformers_figures(shape, dtype, device, args, peaks, timer)
    finally:
        torch.set_num_threads(threads)
    _report(result, args.out)
    return 0


def _splitserve_figures(shape, dtype, device, args, peaks, timer, cuda: bool) -> dict:
    from splitserve.benchmark.kernels_model import BenchModel, blocks_needed, prefill_inputs

    num_blocks = max(blocks_needed(shape, max(args.batches), args.context),
                     blocks_needed(shape, 1, args.prefill_tokens))
    max_pos = max(args.context + args.hf_new_tokens, args.prefill_tokens) + 1
    bw = peaks["hbm_bytes_per_s"]
    with torch.no_grad():
        model = BenchModel(shape, dtype, device, num_blocks, max_pos)
        attention = measure_decode_attention(model, args.batches, args.context, bw, timer, args.iters)
        steps = measure_decode_steps(model, args.batches, args.context, bw, timer, args.iters,
                                     not args.no_cuda_graph and cuda)
        flops = shape.prefill_flops(args.prefill_tokens)
        step = prefill_inputs(shape, args.prefill_tokens, device)
        seconds = timer(lambda: model.forward(step), 1, max(1, args.iters // 4))
    prefill = {"tokens": args.prefill_tokens, "seconds": seconds, "flops": flops,
               "mfu": flops / seconds / peaks["matmul_flops_per_s"]}
    return {"decode_attention": attention, "decode_step": steps, "prefill": prefill}


def _against_datasheet(result: dict, peaks: dict) -> None:
    """MBU and MFU against the vendor's peaks too (benchmark/datasheet.py), where the device is known."""
    from splitserve.benchmark.datasheet import datasheet_peaks

    sheet = datasheet_peaks(result["device"])
    result["datasheet"] = sheet
    if sheet is None:
        return
    bw_ratio = peaks["hbm_bytes_per_s"] / sheet["hbm_bytes_per_s"]
    for row in result["decode_step"]:
        if "mbu" in row:
            row["mbu_datasheet"] = row["mbu"] * bw_ratio
    result["prefill"]["mfu_datasheet"] = result["prefill"]["mfu"] * peaks["matmul_flops_per_s"] / sheet[
        "bf16_flops_per_s"]
    result["peak"]["copy_fraction_of_datasheet"] = bw_ratio
    result["peak"]["matmul_fraction_of_datasheet"] = peaks["matmul_flops_per_s"] / sheet["bf16_flops_per_s"]


def _transformers_figures(shape, dtype, device, args, peaks, timer) -> dict:
    import transformers

    from splitserve.benchmark.kernels_hf import measure_hf

    hf = measure_hf(shape, dtype, device, args.batches, args.context, args.prefill_tokens,
                    args.hf_new_tokens, timer)
    elem = torch.empty((), dtype=dtype).element_size()
    for row in hf["decode"]:
        context = row["context"] + args.hf_new_tokens // 2  # the cache grows during generate
        moved = shape.weight_bytes_per_step(row["batch"], elem) + shape.kv_bytes_read(row["batch"] * context, elem)
        row["mbu"] = moved / row["seconds_per_step"] / peaks["hbm_bytes_per_s"]
    hf["prefill"]["mfu"] = shape.prefill_flops(args.prefill_tokens) / hf["prefill"]["seconds"] / peaks[
        "matmul_flops_per_s"]
    hf["version"] = transformers.__version__
    return hf


def _report(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    lines = [f"device: {result['device']}",
             f"peak: {result['peak']['hbm_bytes_per_s'] / 1e9:.0f} GB/s copy, "
             f"{result['peak']['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s matmul"]
    lines += [f"decode attention batch {r['batch']}: {r['bytes_per_s'] / 1e9:.0f} GB/s "
              f"({100 * r['fraction_of_peak']:.0f}% of peak)" for r in result["decode_attention"]]
    sheet = result.get("datasheet")
    if sheet:
        lines.append(f"datasheet ({sheet['label']}): {sheet['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
                     f"{sheet['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16 dense")
    lines += [f"decode step batch {r['batch']} ({r['mode']}): {1e3 * r['seconds']:.2f} ms, MBU {100 * r['mbu']:.0f}%"
              + (f" ({100 * r['mbu_datasheet']:.0f}% of datasheet)" if "mbu_datasheet" in r else "")
              for r in result["decode_step"] if "error" not in r]
    pre = result["prefill"]
    lines.append(f"prefill {pre['tokens']} tokens: {1e3 * pre['seconds']:.1f} ms, MFU {100 * pre['mfu']:.0f}%"
                 + (f" ({100 * pre['mfu_datasheet']:.0f}% of datasheet)" if "mfu_datasheet" in pre else ""))
    if "transformers" in result:
        hf = result["transformers"]
        lines += [f"transformers decode batch {r['batch']}: {1e3 * r['seconds_per_step']:.2f} ms/step, "
                  f"MBU {100 * r['mbu']:.0f}%" for r in hf["decode"]]
        lines.append(f"transformers prefill: {1e3 * hf['prefill']['seconds']:.1f} ms, "
                     f"MFU {100 * hf['prefill']['mfu']:.0f}%")
    if result["note"] != "measured on the GPU":
        lines.insert(0, result["note"])
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
