"""The paged KV pool: one tensor holding every block of every layer.

Layout: [num_blocks, num_layers, parts, block_size, num_kv_heads, head_dim]
(parts 2 = key, value; 1 for multi-head latent attention, whose one row per token, the
compressed latent and the rope key, serves as both: engine/models/mla.py). Block-major on purpose: all the bytes of one block, across
all layers, are contiguous. A KV transfer of block b is then one contiguous
region (one RDMA write, one checksum), and the per-layer views the attention
kernels take are plain strided views [num_blocks, block_size, kv_heads, head_dim].

FP8 KV (`--kv-cache-dtype fp8`, vLLM's flag): the pool holds float8_e4m3fn codes, half the
bytes of bf16 per token. Each attention layer has one k_scale and one v_scale (per tensor;
models/layers.py Attention, 1.0 as in vLLM when the checkpoint carries none): the KV write
stores clamp(x / scale, +-448) in e4m3 (round to nearest even, saturating), attention reads
code * scale (kernels/ops.py folds the scales into the softmax scale and the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: the KV write saturates here
# --kv-cache-dtype values; "auto" is the model's dtype, fp8 and fp8_e4m3 are the same (as in vLLM)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a --kv-cache-dtype value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else FP8


# Set by an engine process (engine_child.py) before its engine starts: its pool goes to the worker
# through shared memory, so it is made there (shared_zeros), after this check of the room there.
_shared_room_check = None


def allocate_pools_in_shared_memory(check_room) -> None:
    """CPU pools made from now on in this process start in shared memory (an engine process);
    `check_room(nbytes)` raises, saying what to do, when one does not fit."""
    global _shared_room_check
    _shared_room_check = check_room


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor made in shared memory. torch.zeros() then share_memory_() wrote the
    pool twice (a memset, then a copy into new shared memory): 1.09 s of CPU per GiB here,
    against 0.57 s for this. The pages are still all written now, not on first use: shared
    memory is a tmpfs that reserves nothing, and a pool that runs out of it mid-serve dies of
    SIGBUS, so a pool that does not fit must fail here, at start (engine_child.py checks the
    room first)."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape).zero_()


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    parts: int = 2  # key and value; 1: MLA's latent row

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block across all layers: [layers, parts, block_size, kv_heads, head_dim]."""
        return (self.num_layers, self.parts, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class KVCachePool:
    """Owns the KV memory. Allocation of blocks is the BlockManager's job.

    `scratch_blocks` extra blocks sit after the `num_blocks` usable ones: no sequence or
    transfer ever names them, so padded rows of a fixed-shape decode batch (CUDA graphs,
    engine/cuda_graphs.py) write and read there without touching real KV."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu",
                 scratch_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"KV pool needs at least one block, got num_blocks={num_blocks}")
        if spec.dtype == FP8:
            check_fp8_device(torch.device(device))
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_scratch_blocks = scratch_blocks
        shape = (num_blocks + scratch_blocks, *spec.block_shape)
        if _shared_room_check is not None and torch.device(device).type == "cpu":
            _shared_room_check(math.prod(shape) * spec.dtype.itemsize)
            self.data = shared_zeros(shape, spec.dtype)  # share_memory_() is then a no-op
        else:
            self.data = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._views_of = (0, None)  # (data_ptr, shape) the views were made of

    def __getstate__(self) -> dict:
        """Sent to another process (the engine process hands its pool to its worker): without
        the cached views, which the other side makes again from `data`."""
        return {**self.__dict__, "_views": [], "_views_of": (0, None)}

    @property
    def is_fp8(self) -> bool:
        return self.spec.dtype == FP8

    @property
    def capacity_tokens(self) -> int:
        """Tokens the usable blocks hold (scratch blocks excluded)."""
        return self.num_blocks * self.spec.block_size

    @property
    def scratch_block(self) -> int | None:
        """The first scratch block's id (None without scratch blocks)."""
        return self.num_blocks if self.num_scratch_blocks else None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of one layer, each [num_blocks, block_size, kv_heads, head_dim]
        (the same view twice for MLA's single part). Made once (two indexing ops a layer of every step cost ~3 us at batch 1) and again if
        `data` moved (share_memory_() gives it new storage)."""
        data = self.data
        if self._views_of != (data.data_ptr(), data.shape):
            last = data.shape[2] - 1
            self._views = [(data[:, i, 0], data[:, i, last]) for i in range(data.shape[1])]
            self._views_of = (data.data_ptr(), data.shape)
        return self._views[layer]

    def block(self, block_id: int) -> torch.Tensor:
        """All layers of one block: [layers, parts, block_size, kv_heads, head_dim] (a view)."""
        return self.data[block_id]

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def block_offset(self, block_id: int) -> int:
        """Byte offset of a block from the start of the pool (for one-sided writes)."""
        return block_id * self.spec.block_nbytes


def check_fp8_device(device: torch.device) -> None:
    """The Triton kernels read and write e4m3 with the GPU's own conversions (Ada, Hopper and
    later: compute capability 8.9+); older GPUs have none, so refuse at start, not mid-step."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper), "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use --kv-cache-dtype auto")


def num_blocks_for_memory(spec: KVCacheSpec, memory_bytes: int) -> int:
    return max(1, memory_bytes // spec.block_nbytes)
