"""The decode step's small ops on CPU, native (cpu_fused_ops.cpp, built by cpu_native.py).

Same contracts as the torch reference (reference.rms_norm, the residual add with the norm that
reads it, apply_rotary + store_kv, the gated MLP's activation * up); each is one C call over rows already in memory. Callers ask
`supports()` first and take the reference where it says no (another device or dtype, an
fp16 KV cache, strides the kernel does not walk, no compiler). An fp8 KV cache is written
natively (rotary_store_supported).
"""

from __future__ import annotations

import torch

from splitserve.kernels import cpu_native
from splitserve.kernels.cpu_native import DTYPE_CODES


def supports(*tensors: torch.Tensor) -> bool:
    """All on CPU in one dtype the kernels store, last dim contiguous, and the library built.
    Called several times a layer: a plain loop, no generator (it showed in profiles)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.stride(-1) != 1:
            return False
    return cpu_native.library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows [n, last dim]: x itself when it is already 2-D (a reshape costs ~1 us a call)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _empty(rows: torch.Tensor, shape: torch.Size, width: int | None = None) -> torch.Tensor:
    """A contiguous result of `shape` (last dim `width` if given) for `rows` [n, d]: made from
    integers (torch.empty of a torch.Size takes twice as long) and viewed as `shape` after."""
    out = torch.empty(rows.shape[0], rows.shape[1] if width is None else width, dtype=rows.dtype)
    return out if len(shape) == 2 and width is None else out.view(*shape[:-1], out.shape[1])


def _check(code: int) -> None:
    if code:
        raise ValueError(f"native CPU kernel refused its input: {cpu_native.ERRORS.get(code, code)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of rows x [..., hidden] (Gemma's (1 + w) form with `gemma`)."""
    rows = _rows(x)  # a view where it can be: rows `stride(0)` apart
    weight = weight.contiguous()
    out = _empty(rows, x.shape)
    _check(cpu_native.library().splitserve_rms_norm(DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0),
                                                     weight.data_ptr(), out.data_ptr(), rows.shape[0],
                                                     rows.shape[1], float(eps), int(gemma)))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) for rows [..., hidden] of one shape, in one pass."""
    rows, deltas = _rows(x), _rows(delta)
    weight = weight.contiguous()
    total, out = _empty(rows, x.shape), _empty(rows, x.shape)
    _check(cpu_native.library().splitserve_add_rms_norm(
        DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0), deltas.data_ptr(), deltas.stride(0), weight.data_ptr(),
        total.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], float(eps), int(gemma)))
    return total, out


def heads_walkable(t: torch.Tensor) -> bool:
    """[n, heads, dim] with heads `dim` apart inside a row (a reshaped slice of the qkv output)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """Neox rotary on the first cos.shape[-1] dims of q and k; k (rotated) and v written to
    their slots of the paged cache (an fp8 cache: as reference.quantize_fp8 with the scales);
    returns the rotated q, contiguous [n, heads, dim]."""
    n, heads, dim = q.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty((n, heads, dim), dtype=q.dtype)
    code = cpu_native.library().splitserve_rotary_store(
        DTYPE_CODES[q.dtype], cpu_native.cache_code(q, k_cache), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[-1], out.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slots.data_ptr(), n, heads, k.shape[1], dim, k_cache.shape[0], k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), float(k_scale), float(v_scale))
    _check(code)
    return out


def rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache) -> bool:
    fp8 = k_cache.dtype == torch.float8_e4m3fn  # codes written from q's dtype (heads up to 512 dims)
    if fp8 and not (v_cache.dtype == k_cache.dtype and k_cache.device.type == "cpu" and k_cache.stride(-1) == 1
                    and q.shape[2] <= 512):
        return False
    return (supports(q, k, v, cos, sin, *(() if fp8 else (k_cache, v_cache))) and all(map(heads_walkable, (q, k, v)))
            and k.shape == v.shape and k.shape[1:] == k_cache.shape[2:] and q.shape[2] == k.shape[2]
            and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
            and cos.stride() == sin.stride() and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[2])


def act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(x[..., :inter]) * x[..., inter:] for rows x [..., 2 * inter]; act = SiLU or GELU-tanh."""
    rows = _rows(x)
    inter = x.shape[-1] // 2
    out = _empty(rows, x.shape, inter)
    _check(cpu_native.library().splitserve_act_and_mul(DTYPE_CODES[x.dtype], rows.data_ptr(), rows.stride(0),
                                                        out.data_ptr(), rows.shape[0], inter, int(gelu)))
    return out
