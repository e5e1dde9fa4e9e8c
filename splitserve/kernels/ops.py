"""Kernel dispatch: the engine calls these; each goes to Triton or to the torch reference.

Backend choice, in order: `set_backend()`, the SPLITSERVE_KERNELS environment
variable (auto | triton | native | reference), then auto = Triton for CUDA tensors and
native on CPU. Native is C++ for CPUs: decode and prefill attention (cpu_native.py) and the small
per-layer ops (cpu_fused.py: RMSNorm, rotary + KV write, activation * up) and weight-only
quantized linears (quant_native.py); the other ops,
and these where native cannot run (no compiler, a dtype it lacks), take the reference.
Forcing `triton` on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter), which is
how CI runs the kernels without a GPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_fused, cpu_linear, reference

_BACKENDS = ("auto", "triton", "native", "reference")
_backend: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend for this process (None: back to the environment / auto)."""
    global _backend
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {_BACKENDS}")
    _backend = name


def backend_for(t: torch.Tensor) -> str:
    name = _backend or os.environ.get("SPLITSERVE_KERNELS", "auto")
    if name not in _BACKENDS:
        raise ValueError(f"SPLITSERVE_KERNELS={name!r} is not one of {_BACKENDS}")
    if name == "auto":
        return "triton" if t.is_cuda else "native"
    return name


def _triton():
    from splitserve.kernels import triton_ops  # imported lazily: Triton is heavy

    return triton_ops


def _kv_scales(k_cache, k_scale, v_scale) -> tuple[float, float]:
    return (k_scale, v_scale) if k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)


def prepare_sinks(sinks, q) -> torch.Tensor | None:
    """gpt-oss's per-head sink logits as every kernel reads them: float32, contiguous, [num_heads]
    on q's device (a float32 parameter passes through as itself: CUDA graphs keep its address)."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"attention sinks must be [num_heads={q.shape[1]}], got shape {tuple(sinks.shape)}")
    return sinks.to(device=q.device, dtype=torch.float32).contiguous()


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None, window=0,
                           softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None):
    """k_scale / v_scale: what one stored unit of an fp8 cache is worth (engine/kv_cache.py).
    The kernels read fp8 codes as their plain values; the scales fold in here, exactly as
    q . (k * k_scale) = (q . k) * k_scale and sum p (v * v_scale) = v_scale * sum p v. A float
    cache holds values, not codes: the scales do not apply to it. `sinks`: None or [num_heads]
    logits (this rank's heads), in the scaled domain: not multiplied by k_scale (reference.py)."""
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale)
    sinks = prepare_sinks(sinks, q)
    backend = backend_for(q)
    impl = _triton() if backend == "triton" else reference
    if backend == "native":
        from splitserve.kernels import cpu_native  # lazily: the first call builds it

        if cpu_native.supports(q, k_cache, v_cache):
            impl = cpu_native
    out = impl.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale * k_scale, num_splits,
                                      window, softcap, sinks)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window=0,
                            softcap=0.0, k_scale=1.0, v_scale=1.0, sinks=None):
    """k_scale / v_scale and sinks as in paged_decode_attention."""
    k_scale, v_scale = _kv_scales(k_cache, k_scale, v_scale)
    sinks = prepare_sinks(sinks, q)
    backend = backend_for(q)
    impl = _triton() if backend == "triton" else reference
    if backend == "native":
        from splitserve.kernels import cpu_native

        if cpu_native.supports_prefill(q, k_cache, v_cache):
            impl = cpu_native
    out = impl.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale * k_scale,
                                       window, softcap, sinks)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Write K/V rows to their slots; into an fp8 cache as clamp(x / scale, +-448) in e4m3."""
    impl = _triton() if backend_for(key) == "triton" else reference
    return impl.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def pack_blocks(pool, block_ids):
    impl = _triton() if backend_for(pool) == "triton" else reference
    return impl.pack_blocks(pool, block_ids)


def unpack_blocks(buffer, pool, block_ids):
    impl = _triton() if backend_for(pool) == "triton" else reference
    return impl.unpack_blocks(buffer, pool, block_ids)


def _triton_fused():
    from splitserve.kernels import triton_fused  # lazily, like _triton()

    return triton_fused


def rms_norm(x, weight, eps, gemma: bool = False):
    """Llama's RMSNorm; with `gemma`, Gemma's: x * (1 + w), all in float32, then cast."""
    backend = backend_for(x)
    if backend == "native" and cpu_fused.supports(x, weight):
        return cpu_fused.rms_norm(x, weight, eps, gemma)
    impl = _triton() if backend == "triton" else reference
    if gemma:
        return impl.rms_norm(x.float(), weight.float() + 1.0, eps).to(x.dtype)
    return impl.rms_norm(x, weight, eps)


def add_rms_norm(x, delta, weight, eps, gemma: bool = False):
    """(x + delta, rms_norm(x + delta)): a residual add and the norm that reads the sum, one
    launch on the GPU (Llama form, one dtype), one native call on the CPU; elsewhere the add,
    then rms_norm."""
    same = delta.shape == x.shape and delta.dtype == x.dtype
    backend = backend_for(x)
    if backend == "native" and same and cpu_fused.supports(x, delta, weight):
        return cpu_fused.add_rms_norm(x, delta, weight, eps, gemma)
    if not gemma and backend == "triton" and x.dim() == 2 and same:
        return _triton_fused().add_rms_norm(x, delta, weight, eps)
    total = x + delta
    return total, rms_norm(total, weight, eps, gemma=gemma)


def apply_rotary(q, k, cos, sin):
    impl = _triton() if backend_for(q) == "triton" else reference
    return impl.apply_rotary(q, k, cos, sin)


def rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Neox rotary on the first cos.shape[-1] dims of each q and k head (all of them unless the
    model rotates only part: Phi-4-mini's partial_rotary_factor), then k and v written to
    their slots (as store_kv, scales included); returns the rotated q."""
    backend = backend_for(q)
    if backend == "native" and cpu_fused.rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache):
        return cpu_fused.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if backend == "triton" and _triton_fused().rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache):
        return _triton_fused().rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        q, k = apply_rotary(q, k, cos, sin)
    else:
        q_rot, k_rot = apply_rotary(q[..., :rot].contiguous(), k[..., :rot].contiguous(), cos, sin)
        q, k = torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def act_and_mul(x, gelu: bool = False):
    """The gated MLP's act(gate) * up over x = [gate | up] (SiLU; GELU-tanh with `gelu`)."""
    backend = backend_for(x)
    if backend == "native" and cpu_fused.supports(x):
        return cpu_fused.act_and_mul(x, gelu)
    if backend == "triton" and x.dim() == 2:
        return _triton_fused().act_and_mul(x, gelu)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def fused_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Mixture-of-experts SwiGLU MLPs; see splitserve/kernels/moe_reference.py for the contract."""
    if backend_for(hidden) == "triton":
        from splitserve.kernels import triton_moe  # lazily, like _triton()

        return triton_moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids)
    from splitserve.kernels import moe_reference

    return moe_reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids)


def quantized_linear(x, qw, bias=None):
    """x [M, K] @ dequantize(qw).T (+ bias), in x's dtype, for a weight-only quantized weight
    (kernels/quant_weight.py); float32 accumulation on every path."""
    from splitserve.kernels import quant_weight

    backend = backend_for(x)
    if backend == "triton":
        from splitserve.kernels import triton_quant  # lazily, like _triton()

        return triton_quant.quantized_linear(x, qw, bias)
    if backend == "native":
        from splitserve.kernels import quant_native  # lazily, like _triton()

        if quant_native.supports(x, qw):
            return quant_native.quantized_linear(x, qw, bias)
    return quant_weight.quantized_linear_reference(x, qw, bias)


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias): F.linear, except float32 on a CPU under the native backend: one
    row through the native gemv, several through oneDNN; a weight the loader packed for oneDNN
    always through oneDNN (kernels/cpu_linear.py says why); and 1-4 rows of 16-bit x on a GPU
    through the Triton GEMV (kernels/triton_gemv.py: faster than cuBLAS there)."""
    if weight.is_mkldnn:
        return cpu_linear.packed_linear(x, weight, bias)
    if x.is_cuda and x.shape[0] <= 4 and backend_for(x) == "triton":  # a decode batch of 1-4 rows
        from splitserve.kernels import triton_gemv  # lazily, like _triton()

        if triton_gemv.eligible(x, weight):
            return triton_gemv.gemv(x, weight, bias)
    if x.device.type == "cpu" and backend_for(x) == "native":
        if x.shape[0] >= cpu_linear.MIN_ROWS:
            if cpu_linear.eligible(x, weight):
                return cpu_linear.linear(x, weight, bias)
        elif cpu_linear.gemv_eligible(x, weight):
            return cpu_linear.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
