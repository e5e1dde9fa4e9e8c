"""The attention of a CPU decode step in two native calls whose arguments are prepared once
per layer (issue 30).

A decode step at batch 1 spends the time of its kernels' work many times over in Python:
SmolLM2-135M's layers spent ~46 us each between the qkv and o projections (rotary + KV write,
then decode attention), of which a few us were the kernels. The rest was checking, for every
layer of every step, what cannot change while a model serves (device, dtypes, the KV pool's
layout and strides, the head geometry) and assembling ~50 ctypes arguments from tensor
attributes. `PreparedDecodeAttention.prepare` makes those checks once, the first time a layer
runs a pure-decode step, keeps the arguments that belong to the layer, and each step passes
only what changes (the qkv rows, the rope rows, the slots and block tables): a SmolLM2 decode
step 21.9 -> 20.9 ms (thread time, same prompts, A/B in one process).

Same kernels and arguments as ops.rotary_and_store_kv + ops.paged_decode_attention on the
native backend, so the same bits (tests/kernels/test_cpu_decode_step.py). `prepare` returns
None where those would not take the native path (another device or backend, a layout the
kernels do not walk); the layer then takes the general path, which checks per call.
"""

from __future__ import annotations

import torch

from splitserve.kernels import cpu_fused, cpu_native, ops
from splitserve.kernels.cpu_native import DTYPE_CODES


class PreparedDecodeAttention:
    def __init__(self, attention, qkv: torch.Tensor, rot: int, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.dtype, self.cache_stride = qkv.dtype, k_cache.stride()
        self.heads, self.kv_heads, self.dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.q_size, self.row = attention.q_size, qkv.shape[1]
        self.k_offset = attention.q_size * qkv.element_size()
        self.v_offset = (attention.q_size + attention.kv_size) * qkv.element_size()
        self.rot = rot
        self.codes = (DTYPE_CODES[qkv.dtype], cpu_native.cache_code(qkv, k_cache))
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        self.k_scale, self.v_scale = (attention.k_scale, attention.v_scale) if fp8 else (1.0, 1.0)
        self.scale = attention.scale * self.k_scale  # as ops.paged_decode_attention folds it
        self.window, self.softcap = int(attention.window), float(attention.softcap)
        # gpt-oss's sink logits: the layer's own tensor (a float32 [heads] parameter), read by
        # address each step, so a value loaded in place is seen; another dtype is converted each step
        self.sinks = getattr(attention, "sinks", None)
        if self.sinks is not None and tuple(self.sinks.shape) != (self.heads,):
            raise ValueError(f"attention sinks must be [num_heads={self.heads}], got shape {tuple(self.sinks.shape)}")
        self.caches = (k_cache.data_ptr(), v_cache.data_ptr())
        self.pool = (k_cache.shape[0], k_cache.shape[1])  # blocks, block size
        self.strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))

    @classmethod
    def prepare(cls, attention, qkv, cos, sin, k_cache, v_cache, meta) -> PreparedDecodeAttention | None:
        """The prepared calls for this layer, or None where the native kernels would not take
        these tensors (the checks ops.rotary_and_store_kv and ops.paged_decode_attention make)."""
        if not qkv.is_cpu or qkv.dim() != 2 or ops.backend_for(qkv) != "native":
            return None
        n = qkv.shape[0]
        q = qkv[:, :attention.q_size].view(n, attention.num_heads, attention.head_dim)
        kv = attention.kv_size
        k = qkv[:, attention.q_size:attention.q_size + kv].view(n, attention.num_kv_heads, attention.head_dim)
        v = qkv[:, attention.q_size + kv:].view(n, attention.num_kv_heads, attention.head_dim)
        if not (qkv.is_contiguous() and qkv.shape[1] == attention.q_size + 2 * kv
                and cpu_fused.rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache)
                and cpu_native.supports(q, k_cache, v_cache)):
            return None
        prepared = cls(attention, qkv, cos.shape[-1], k_cache, v_cache)
        return prepared if prepared.fits(qkv, cos, sin, k_cache, meta) else None

    def fits(self, qkv, cos, sin, k_cache, meta) -> bool:
        """This step's tensors are laid out as the prepared arguments assume (cheap: asked of
        every layer of every decode step)."""
        slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
        return (k_cache.data_ptr() == self.caches[0] and k_cache.stride() == self.cache_stride and qkv.dtype == self.dtype and qkv.is_cpu and qkv.dim() == 2
                and qkv.stride() == (self.row, 1) and cos.dtype == self.dtype and cos.shape[-1] == self.rot
                and cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
                and slots.dtype == torch.int64 and slots.is_contiguous() and tables is not None
                and tables.dtype == torch.int32 and tables.is_contiguous() and lens.dtype == torch.int32
                and lens.is_contiguous() and len(lens) == len(slots) == qkv.shape[0] == len(tables)
                and ops.backend_for(qkv) == "native")  # set_backend() / SPLITSERVE_KERNELS may change

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        """Rotary on q and k, k and v into their slots, attention over each sequence's
        context: the output rows [n, heads * head_dim] for o_proj."""
        lib = cpu_native.library()
        n, base = qkv.shape[0], qkv.data_ptr()
        q = torch.empty((n, self.heads, self.dim), dtype=self.dtype)
        k_ptr, v_ptr = self.caches
        blocks, block_size = self.pool
        cpu_fused._check(lib.splitserve_rotary_store(
            *self.codes, base, self.row, base + self.k_offset, self.row, base + self.v_offset, self.row,
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), self.rot, q.data_ptr(), k_ptr, v_ptr,
            meta.slot_mapping.data_ptr(), n, self.heads, self.kv_heads, self.dim, blocks, block_size, *self.strides,
            self.k_scale, self.v_scale))
        out = torch.empty((n, self.q_size), dtype=self.dtype)
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        args = (*self.codes, q.data_ptr(), k_ptr, v_ptr, out.data_ptr(), tables.data_ptr(), lens.data_ptr())
        sinks = self.sinks if self.sinks is None or self.sinks.dtype == torch.float32 else self.sinks.float()
        shape = (self.heads, self.kv_heads, self.dim, block_size, tables.shape[1], blocks, *self.strides, self.scale,
                 self.window, self.softcap, cpu_native.sinks_pointer(sinks))
        fn = lib.splitserve_decode_attention
        if torch.get_num_threads() == 1:
            code = fn(*args, 0, n, *shape)
            if code:
                raise ValueError(f"native decode attention refused its input: {cpu_native.ERRORS.get(code, code)}")
        else:  # sequences split over the native kernels' thread pool, as ops' path does
            cpu_native._run_sliced(lambda first, end: fn(*args, first, end, *shape), lens, "decode attention")
        return out if self.v_scale == 1.0 else out.mul_(self.v_scale)
