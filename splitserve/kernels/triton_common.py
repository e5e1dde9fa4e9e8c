"""Launch-side helpers shared by the Triton kernels: where a kernel may run, tile padding,
the per-dtype switches for `tl.dot`, argument checks.

Triton decides when `triton.language` and a `@triton.jit` function are *defined* whether
kernels are compiled for a GPU or run by its interpreter (TRITON_INTERPRET=1, numpy on
the CPU). So the variable must be set before anything imports triton (torch._dynamo
does, and transformers' model classes import that); afterwards it cannot be changed in
the process. `Kernel` records which mode it got and refuses tensors it cannot run on
with an error that says what to do, instead of Triton's driver errors.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - every Triton this project supports has it
    InterpretedFunction = type("NoInterpreter", (), {})


# do_not_specialize_on_alignment came with Triton 3.2; older ones specialize on alignment
_ALIGNMENT_OPTION = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


class Kernel:
    """A `triton.jit` kernel plus the device check its launches go through."""

    def __init__(self, fn, do_not_specialize=(), do_not_specialize_on_alignment=()):
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self.do_not_specialize_on_alignment = tuple(do_not_specialize_on_alignment)
        options = {"do_not_specialize": list(do_not_specialize)}
        if do_not_specialize_on_alignment and _ALIGNMENT_OPTION:
            options["do_not_specialize_on_alignment"] = list(do_not_specialize_on_alignment)
        self.jit = triton.jit(fn, **options)
        self.__name__ = fn.__name__
        self.interpreted = isinstance(self.jit, InterpretedFunction)

    def for_tensors(self, what: str, *tensors: torch.Tensor):
        """The kernel to launch (`kernel.for_tensors(...)[grid](...)`) on these tensors, or a
        clear error when they are on different devices or on one this mode cannot run on."""
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            names = ", ".join(sorted(str(d) for d in devices))
            raise ValueError(f"{what}: tensors are on different devices ({names}); move them to one device")
        device = next(iter(devices))
        if self.interpreted and device.type != "cpu":
            raise RuntimeError(
                f"{what}: TRITON_INTERPRET=1 was set when Triton was imported, so kernels run on CPU "
                f"tensors only, got {device}; unset TRITON_INTERPRET to run them on the GPU"
            )
        if not self.interpreted and device.type != "cuda":
            raise RuntimeError(
                f"{what}: Triton kernels need CUDA tensors, got {device}. To run them on the CPU set "
                "TRITON_INTERPRET=1 before anything imports triton, or use the torch reference "
                "(SPLITSERVE_KERNELS=reference)"
            )
        return self.jit


def kernel(fn=None, *, do_not_specialize=(), do_not_specialize_on_alignment=()):
    """Decorator used instead of @triton.jit for the kernels of this package.

    Triton compiles one variant per combination of integer arguments equal to 1 or divisible
    by 16 (and pointers aligned to 16 bytes). Arguments that change from step to step (the
    number of sequences, a block table's width) would make a served engine compile new
    variants in the middle of traffic, ~0.3 s each on an H200 (issue 20: 10 compilations
    during the first 64 requests); they are named here so one variant serves every step."""
    def wrap(f):
        return Kernel(f, do_not_specialize, do_not_specialize_on_alignment)

    return wrap(fn) if fn is not None else wrap


@triton.jit
def softcap_tanh(scores, cap):
    """cap * tanh(scores / cap) (attention logit soft-capping), written with exp because
    not every Triton build (the interpreter included) has tanh in its language."""
    e = tl.exp(-2.0 * tl.abs(scores / cap))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(scores < 0, -t, t)


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): tile extents must be powers of two."""
    return max(minimum, triton.next_power_of_2(max(1, n)))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied exactly ("ieee"), not through TF32's 10-bit mantissa."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Triton's interpreter computes `tl.dot` on bfloat16 operands wrongly (numpy has no
    bfloat16), so there (CPU tensors) bfloat16 tiles are widened to float32 first."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small nominal figure for the CPU
    interpreter, where parallelism does not exist and fewer programs run faster."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory seen as integers of the same width: copies through it are byte-exact
    (no float canonicalisation, and bfloat16 needs no interpreter support)."""
    return t.view(INT_OF_WIDTH[t.element_size()])


def check_paged_kv(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    """Shape/dtype checks every paged-attention launch shares. Host-side only: values
    (block ids, lengths) are not read, so no device synchronisation and CUDA-graph safe."""
    if q.dim() != 3:
        raise ValueError(f"{what}: q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{what}: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{what}: q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"{what}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{what}: q, k_cache and v_cache must share a dtype (or the caches be float8_e4m3fn), "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"{what}: block_tables must be [batch={batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (batch,):
        raise ValueError(f"{what}: seq_lens must be [batch={batch}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: {name} must be int32 (or int64), got {t.dtype}")



def check_sinks(what: str, sinks: torch.Tensor | None, num_heads: int) -> None:
    """Attention sinks, where given, as the kernels read them: float32 contiguous [num_heads]."""
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32
                              or not sinks.is_contiguous()):
        raise ValueError(f"{what}: sinks must be float32 contiguous [num_heads={num_heads}], "
                         f"got {sinks.dtype} {tuple(sinks.shape)}")
