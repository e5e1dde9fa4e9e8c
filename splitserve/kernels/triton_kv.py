"""KV movement kernels: writing new K/V rows into the pool by slot, and packing /
unpacking whole blocks (every layer at once) for KV transfer.

store_kv runs every forward pass on the hot path, so it reads no values on the host.
pack/unpack serve transfers, where one host check of the block ids is cheap next to the
copy and turns a bad id into a clear error instead of a wild write. All three move raw
bits (integers of the element's width), so they are byte-exact for every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.reference import quantize_fp8
from splitserve.kernels.triton_common import as_raw_bits, kernel, pow2

COPY_CHUNK = 4096  # elements per program when moving blocks


@kernel(do_not_specialize_on_alignment=["slots_ptr"])
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # a negative slot is padding (e.g. a CUDA-graph batch filled up): write nothing
    valid_slot = (tl.zeros([HEADS_PAD, HEAD_DIM_PAD], tl.int64) + slot) >= 0  # broadcast explicitly
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & valid_slot
    key = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                  mask=mask)
    value = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                    mask=mask)
    k_dst = block * stride_kcb + in_block * stride_kct + heads[:, None] * stride_kch + dims[None, :] * stride_kcd
    v_dst = block * stride_vcb + in_block * stride_vct + heads[:, None] * stride_vch + dims[None, :] * stride_vcd
    tl.store(k_cache_ptr + k_dst, key, mask=mask)
    tl.store(v_cache_ptr + v_dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same contract as reference.store_kv (slot = block_id * block_size + offset; an fp8
    cache gets reference.quantize_fp8(x, scale)), plus: negative slots are skipped. Slots are
    trusted to lie inside the pool."""
    what = "store_kv"
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"{what}: key and value must both be [n, kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"{what}: caches must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: slot_mapping must be int [n={key.shape[0]}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    launch = _store_kv_kernel.for_tensors(what, key, value, k_cache, v_cache, slot_mapping)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{what}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    n, num_kv_heads, head_dim = key.shape
    if n == 0:
        return
    # Another dtype (rare, but every step for an fp8 cache): converted with torch, whose
    # rounding is the reference's (fp8: divided in x's dtype, saturated, to nearest even; one
    # fused elementwise op each on the GPU); the kernel then moves raw bits only.
    if k_cache.dtype == torch.float8_e4m3fn:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    launch[(n,)](
        as_raw_bits(key), as_raw_bits(value), as_raw_bits(k_cache), as_raw_bits(v_cache), slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=pow2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pow2(head_dim), BLOCK_SIZE=k_cache.shape[1], num_warps=4,
    )


@kernel
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_elems, src_block_stride, dst_block_stride,
                        GATHER: tl.constexpr, CHUNK: tl.constexpr):
    """GATHER: dst[i] = src[ids[i]] (pack); otherwise dst[ids[i]] = src[i] (unpack)."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    block = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:
        src = src_ptr + block * src_block_stride + offs
        dst = dst_ptr + i * dst_block_stride + offs
    else:
        src = src_ptr + i * src_block_stride + offs
        dst = dst_ptr + block * dst_block_stride + offs
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


def _check_pool_and_ids(what: str, pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    if pool.dim() < 2 or not pool[:1].is_contiguous():
        raise ValueError(f"{what}: pool must be [num_blocks, ...] with each block contiguous "
                         f"(the KVCachePool layout), got shape {tuple(pool.shape)} strides {pool.stride()}")
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
        raise ValueError(f"{what}: block_ids must be a 1-D integer tensor, got {block_ids.dtype} "
                         f"{tuple(block_ids.shape)}")
    ids = block_ids.to(device=pool.device, dtype=torch.int64)
    if ids.numel():
        lo, hi = (int(x) for x in torch.aminmax(ids))
        if lo < 0 or hi >= pool.shape[0]:
            raise IndexError(f"{what}: block ids must lie in [0, {pool.shape[0]}), got min {lo} max {hi}; "
                             "the transfer names blocks this pool does not have")
    return ids


def _block_elems(pool: torch.Tensor) -> int:
    n = 1
    for d in pool.shape[1:]:
        n *= d
    return n


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gather blocks (all layers) into one contiguous buffer [n, *pool.shape[1:]]."""
    ids = _check_pool_and_ids("pack_blocks", pool, block_ids)
    launch = _copy_blocks_kernel.for_tensors("pack_blocks", pool, ids)
    buffer = torch.empty((ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    elems = _block_elems(pool)
    if ids.numel() and elems:
        launch[(ids.numel(), triton.cdiv(elems, COPY_CHUNK))](
            as_raw_bits(pool), as_raw_bits(buffer), ids, elems, pool.stride(0), elems,
            GATHER=True, CHUNK=COPY_CHUNK, num_warps=4,
        )
    return buffer


def unpack_blocks(buffer: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a packed buffer into destination blocks of the pool (ids should be distinct:
    two writes to one block race, as they would in any parallel copy)."""
    what = "unpack_blocks"
    ids = _check_pool_and_ids(what, pool, block_ids)
    elems = _block_elems(pool)
    if buffer.numel() != ids.numel() * elems:
        raise ValueError(f"{what}: buffer has {buffer.numel()} elements but {ids.numel()} blocks of "
                         f"{tuple(pool.shape[1:])} need {ids.numel() * elems}")
    src = buffer.to(device=pool.device, dtype=pool.dtype).contiguous()
    launch = _copy_blocks_kernel.for_tensors(what, pool, src, ids)
    if ids.numel() and elems:
        launch[(ids.numel(), triton.cdiv(elems, COPY_CHUNK))](
            as_raw_bits(src), as_raw_bits(pool), ids, elems, elems, pool.stride(0),
            GATHER=False, CHUNK=COPY_CHUNK, num_warps=4,
        )
