"""Compile every Triton kernel for an NVIDIA GPU without having one.

The interpreter checks what the kernels compute, not whether Triton's compiler accepts
them (tl.dot shape limits, dtype rules, what the interpreter tolerates and the compiler
does not). This script runs the real launch paths on CPU tensors with each launch
intercepted, then compiles the intercepted launches - same specialisation as a real
launch - down to a cubin with Triton's bundled ptxas, and prints JSON per kernel.

    python -m tests.kernels.compile_for_cuda [--arch 90]

Must run without TRITON_INTERPRET (it needs the compiled form of the kernels). Exit
status 3 means this Triton lacks the internals used here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _launches():
    """(kernel, args, kwargs, label) for each kernel launch of representative calls."""
    import torch

    from splitserve.kernels import (
        triton_common,
        triton_decode_attention,
        triton_fused,
        triton_gemv,
        triton_lora,
        triton_moe,
        triton_ops,
        triton_prefill_attention,
        triton_quant,
    )
    from splitserve.kernels.quant_weight import FP8, QuantizedWeight

    captured = []

    class Intercept:
        def __init__(self, kernel, label):
            self.kernel, self.label = kernel, label

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.append((self.kernel.jit, args, kwargs, self.label))

    label = {"value": ""}
    triton_common.Kernel.for_tensors = lambda self, what, *tensors: Intercept(self, label["value"])
    # The launchers widen bfloat16 dot tiles to float32 on CPU tensors (the interpreter has no
    # bfloat16 dot): answer as for a GPU, so bfloat16 launches compile the tensor-core path.
    gpu = torch.device("cuda")
    for module in (triton_decode_attention, triton_prefill_attention, triton_moe, triton_lora, triton_quant):
        module.upcast_dot = lambda dtype, device: triton_common.upcast_dot(dtype, gpu)

    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        q = torch.zeros(2, 32, 128, dtype=dtype)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        lens = torch.tensor([5, 60], dtype=torch.int32)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        # attention over a cache in the queries' dtype, then over an fp8 (e4m3) one as
        # tests/kernels/test_fp8_kv.py drives it (ops folds k_scale / v_scale outside the kernels)
        for kv_dtype, label["value"] in ((dtype, name), (torch.float8_e4m3fn, f"fp8_kv/{name}")):
            pool = torch.zeros(4, 2, 2, 16, 8, 128, dtype=kv_dtype)
            k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
            triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 1)
            triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 2)
            triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1)
            if dtype == torch.bfloat16:  # the kv write and block moves see only the cache's bytes
                triton_ops.store_kv(q[:, :8], q[:, :8], k_cache, v_cache, lens, 0.5, 2.0)
                triton_ops.pack_blocks(pool, torch.tensor([1, 2]))
                triton_ops.unpack_blocks(pool[:2], pool, torch.tensor([1, 2]))
        # gpt-oss's attention sinks: the single-split epilogue, the split merge and prefill's epilogue
        label["value"] = f"sinks/{name}"
        sinks = torch.zeros(32)
        pool = torch.zeros(4, 2, 2, 16, 8, 128, dtype=dtype)
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
        triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 1, sinks=sinks)
        triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 2, sinks=sinks)
        triton_ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1, sinks=sinks)
        label["value"] = name
        if dtype == torch.bfloat16:
            triton_ops.rms_norm(torch.zeros(3, 4096, dtype=dtype), torch.zeros(4096, dtype=dtype), 1e-5)
            table = torch.zeros(2, 128, dtype=dtype)
            triton_ops.apply_rotary(q, q[:, :8], table, table)
            # one dtype throughout (triton_fused.rotary_store_supported): an fp8 cache is written
            # by apply_rotary and store_kv instead, both launched above
            pool = torch.zeros(4, 2, 2, 16, 8, 128, dtype=dtype)
            k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
            triton_fused.rotary_and_store_kv(q, q[:, :8], q[:, :8], table, table, k_cache, v_cache, lens)
            triton_fused.act_and_mul(torch.zeros(2, 2 * 14336, dtype=dtype))
            triton_fused.act_and_mul(torch.zeros(2, 2 * 1024, dtype=dtype), gelu=True)
            x = torch.zeros(3, 4096, dtype=dtype)
            triton_fused.add_rms_norm(x, x, torch.zeros(4096, dtype=dtype), 1e-5)
        # mixture of experts: 16-row tiles (decode) and 64-row tiles (prefill), both stages
        w13, w2 = torch.zeros(8, 2 * 768, 2048, dtype=dtype), torch.zeros(8, 2048, 768, dtype=dtype)
        for tokens in (1, 300):
            ids = torch.arange(tokens * 2).view(tokens, 2) % 8
            triton_moe.fused_moe(torch.zeros(tokens, 2048, dtype=dtype), w13, w2, torch.ones(tokens, 2), ids)

    # weight-only quantized linear, bfloat16 activations: GPTQ / AWQ 4-bit and 8-bit codes with
    # offsets in groups of 128, FP8 codes (no offsets); 16-row tiles (decode) and 64-row (prefill)
    n, k = 1024, 4096
    weights = {
        "int4_weight/bfloat16": QuantizedWeight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 128),
                                       torch.zeros(n, k // 128), 4, 128, k, n),
        "int8_weight/bfloat16": QuantizedWeight(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, k // 128),
                                       torch.zeros(n, k // 128), 8, 128, k, n),
        "fp8_weight/bfloat16": QuantizedWeight(torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n, k // 128),
                                      None, FP8, 128, k, n),
    }
    for label["value"], qw in weights.items():
        for rows in (4, 300):
            triton_quant.quantized_linear(torch.zeros(rows, k, dtype=torch.bfloat16), qw)
    label["value"] = "int4_weight+bias/bfloat16"
    triton_quant.quantized_linear(torch.zeros(4, k, dtype=torch.bfloat16), weights["int4_weight/bfloat16"],
                                  torch.zeros(n, dtype=torch.bfloat16))

    # the GEMV of 1-4 decode rows (ops.linear on a GPU), bfloat16, with and without a bias
    label["value"] = "bfloat16"
    for rows in (1, 4):
        triton_gemv.gemv(torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16),
                         torch.zeros(n, dtype=torch.bfloat16) if rows == 4 else None)

    # LoRA, bfloat16: shrink (x @ A.T into float32) then expand-and-add (h @ B.T), ranks 16 and 64
    label["value"] = "bfloat16"
    perm = torch.arange(6)
    for rank in (16, 64):
        a, b = torch.zeros(3, rank, 4096, dtype=torch.bfloat16), torch.zeros(3, 4096, rank, dtype=torch.bfloat16)
        out = torch.zeros(6, 4096, dtype=torch.bfloat16)
        triton_lora.lora_delta(torch.zeros(6, 4096, dtype=torch.bfloat16), a, b, out, perm, [0, 2, 6], [0, 2])
        # the padded (CUDA-graph) step's form: gathered by each row's slot, -1 rows skipped
        rows = torch.tensor([0, -1, 2, 2, -1, 0])
        triton_lora.lora_delta_by_row(torch.zeros(6, 4096, dtype=torch.bfloat16), a, b, out, rows)
    return captured


def _resource_usage(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if "REG:" in line]
    return lines[0] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_for_cuda: unset TRITON_INTERPRET; this needs the compiled kernels", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as exc:
        print(f"compile_for_cuda: this Triton lacks {exc.name}", file=sys.stderr)
        return 3
    target = GPUTarget("cuda", args.arch, 32)
    backend = make_backend(target)
    results = []
    for jit, launch_args, kwargs, label in _launches():
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, options = binder(*launch_args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        results.append({"kernel": jit.__name__, "dtype": label, "arch": f"sm_{args.arch}",
                        "cubin_bytes": len(compiled.asm["cubin"]),
                        "resources": _resource_usage(compiled.asm["cubin"])})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
