"""Native CPU kernels: cpu_decode_attention.cpp and cpu_prefill_attention.cpp (here),
cpu_fused_ops.cpp (cpu_fused.py), cpu_quant_linear.cpp (quant_native.py) and cpu_dense_gemv.cpp
(cpu_linear.py), compiled together
into one library for this machine on first use.

Why compiled here and not shipped: `-march=native` is where the speed comes from (AVX-512 on
a server, NEON on Arm), and a binary built for one CPU faults on an older one. The build is
two C++ files with no Python or torch headers (about a second with g++), cached under
$SPLITSERVE_CACHE/kernels keyed by the source, the compiler and this CPU's feature flags, and
called through ctypes, which releases the GIL for the call. Without a C++ compiler, or if the
build fails, the engine falls back to the torch reference and says so once, with what to do.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from splitserve.core.model_dir import cache_root

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_decode_attention.cpp", _HERE / "cpu_prefill_attention.cpp", _HERE / "cpu_fused_ops.cpp",
           _HERE / "cpu_quant_linear.cpp", _HERE / "cpu_dense_gemv.cpp"]
HEADERS = [_HERE / "cpu_scalar.h", _HERE / "cpu_vec.h"]
# -fassociative-math (with the two flags it needs) lets sums be vectorised in any order, as
# SDPA's blocked sums are; no -ffast-math: NaN and infinity keep their meaning.
# SPLITSERVE_CPU_MARCH: another target than this CPU (tests build the AVX2 variant with "haswell").
MARCH = os.environ.get("SPLITSERVE_CPU_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp-simd", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
FP8_CODE = 2  # a float8_e4m3fn KV cache (engine/kv_cache.py) under a float32 or bfloat16 query


def cache_code(q: torch.Tensor, cache: torch.Tensor) -> int:
    return FP8_CODE if cache.dtype == torch.float8_e4m3fn else DTYPE_CODES[q.dtype]

ERRORS = {1: "unsupported head geometry (heads not a multiple of kv heads, > 256 heads, > 64 query heads per kv "
             "head in prefill, head_dim > 512 or an odd rotary dim)",
          3: "a sequence length is outside its block table (or shorter than its new tokens)", 4: "a block id is outside the KV pool",
          5: "quantized weight layout unsupported (bits, or a group not a multiple of 16)"}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # C entry point -> argument types (all return int: 0 or an ERRORS code)
    "splitserve_decode_attention": [_I, _I] + [_P] * 6 + [_I] * 8 + [_I64] * 3 + [_F, _I, _F, _P],
    "splitserve_prefill_attention": [_I, _I] + [_P] * 7 + [_I] * 9 + [_I64] * 3 + [_F, _I, _F, _P],
    "splitserve_rms_norm": [_I, _P, _I64, _P, _P, _I, _I, _F, _I],
    "splitserve_add_rms_norm": [_I, _P, _I64, _P, _I64, _P, _P, _P, _I, _I, _F, _I],
    "splitserve_rotary_store": [_I, _I, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I, _P, _P, _P, _P, _I, _I, _I,
                                _I, _I64, _I, _I64, _I64, _I64, _F, _F],
    "splitserve_act_and_mul": [_I, _P, _I64, _P, _I, _I, _I],
    "splitserve_quant_gemv": [_P, _I, _I, _P, _I, _P, _P, _I, _P, _P, _I, _I, _I],  # quant_native.py
    "splitserve_dense_gemv": [_P, _I, _P, _I, _P, _P, _I, _I, _I],  # cpu_linear.py
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_problem: str | None = None  # why there is no library, once a build was tried
_pools: dict[int, ThreadPoolExecutor] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [f.read_text() for f in [*SOURCES, *HEADERS]]
    key = hashlib.sha256("\0".join([*texts, version, " ".join(FLAGS), platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"splitserve_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: another process building the same key is harmless
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (and one warning) where it cannot be."""
    global _library, _problem
    if _library is not None or _problem is not None:
        return _library
    with _lock:
        if _library is None and _problem is None:
            compiler = _compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C++ compiler found (c++, g++ or clang++ on PATH, or $CXX)")
                lib = ctypes.CDLL(str(_build(compiler)))
                for name, argtypes in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = ctypes.c_int, argtypes
                _library = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _problem = str(exc)
                log.warning("native CPU kernels unavailable, using the slower torch reference: %s. "
                            "Install g++ (apt-get install g++) for it, or set SPLITSERVE_KERNELS=reference "
                            "to choose the reference and silence this.", _problem)
    return _library


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (else the caller uses the reference): a
    cache of the query's dtype, or an fp8 one."""
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and v_cache.dtype == k_cache.dtype and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and library() is not None)


# Where the native prefill attention beat torch's SDPA (flash) on one core, measured: float32
# with an unrolled head size, 1.1-1.9x (most at a few hundred tokens); bf16 0.86x and head_dim
# 80 0.72x, so those stay with SDPA.
PREFILL_HEAD_DIMS = (32, 64, 128, 256)


def supports_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return q.dtype == torch.float32 and q.shape[-1] in PREFILL_HEAD_DIMS and supports(q, k_cache, v_cache)


def sinks_pointer(sinks: torch.Tensor | None) -> int | None:
    """The address of float32 contiguous [num_heads] sink logits (ops._sinks makes them so), or
    None (a null pointer: no sinks)."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.device.type != "cpu":
        raise ValueError(f"native attention: sinks must be contiguous float32 on the CPU, got {sinks.dtype}")
    return sinks.data_ptr()


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None, window=0,
                           softcap=0.0, sinks=None) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention; call supports() first."""
    fn = library().splitserve_decode_attention
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = block_tables.to(device="cpu", dtype=torch.int32).contiguous()
    lens = seq_lens.to(device="cpu", dtype=torch.int32).contiguous()
    _, heads, dim = q.shape
    args = (DTYPE_CODES[q.dtype], cache_code(q, k_cache), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            out.data_ptr(), tables.data_ptr(), lens.data_ptr())
    shape = (heads, k_cache.shape[2], dim, k_cache.shape[1], tables.shape[1], k_cache.shape[0],
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(scale), int(window), float(softcap),
             sinks_pointer(sinks))

    _run_sliced(lambda first, end: fn(*args, first, end, *shape), lens, "decode attention")
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window=0,
                            softcap=0.0, sinks=None) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention; call supports() first."""
    fn = library().splitserve_prefill_attention
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = block_tables.to(device="cpu", dtype=torch.int32).contiguous()
    cu = cu_seqlens_q.to(device="cpu", dtype=torch.int32).contiguous()
    lens = seq_lens.to(device="cpu", dtype=torch.int32).contiguous()
    num_seqs, kv_heads = len(lens), k_cache.shape[2]
    args = (DTYPE_CODES[q.dtype], cache_code(q, k_cache), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            out.data_ptr(), tables.data_ptr(), cu.data_ptr(), lens.data_ptr(), num_seqs)
    shape = (q.shape[1], kv_heads, q.shape[2], k_cache.shape[1], tables.shape[1], k_cache.shape[0],
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(scale), int(window), float(softcap),
             sinks_pointer(sinks))

    # (sequence, kv head) pairs are the unit of work a thread takes, weighed by new tokens x length
    work = ((cu[1:] - cu[:-1]).to(torch.int64) * lens.to(torch.int64)).repeat_interleave(kv_heads)
    _run_sliced(lambda first, end: fn(*args, first, end, *shape), work, "prefill attention")
    return out


def _run_sliced(run, work: torch.Tensor, what: str) -> None:
    """run(first, end) over [0, len(work)): in one call, or, with several torch threads, in slices
    of about equal work on our pool (ctypes drops the GIL, so they run in parallel, as torch's
    own ops would). A kernel's refusal code becomes a ValueError naming it."""
    items = len(work)
    threads = min(torch.get_num_threads(), items)
    if threads <= 1:
        codes = [run(0, items)]
    else:
        bounds = _balanced_bounds(work, threads)
        codes = list(_executor().map(run, bounds[:-1], bounds[1:]))
    bad = next((c for c in codes if c), 0)
    if bad:
        raise ValueError(f"native {what} refused its input: {ERRORS.get(bad, bad)}")


def _balanced_bounds(lens: torch.Tensor, parts: int) -> list[int]:
    """Split points of the batch into `parts` slices of about equal context (the work)."""
    total = lens.to(torch.int64).cumsum(0)
    targets = total[-1] * torch.arange(1, parts, dtype=torch.int64) // parts
    cuts = (torch.searchsorted(total, targets) + 1).clamp(max=len(lens)).tolist()  # after the one that crosses
    return [0, *cuts, len(lens)]


def _executor() -> ThreadPoolExecutor:
    threads = torch.get_num_threads()
    with _lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="decode-attention")
        return _pools[threads]
