"""The Triton backend of `splitserve.kernels.ops`: the same functions, with the same
signatures, as `splitserve.kernels.reference`, each implemented in its own module.

Importing this module defines the kernels. Under TRITON_INTERPRET=1 (set before the
import) they run on CPU tensors through Triton's interpreter; otherwise on CUDA tensors.
"""

from __future__ import annotations

from splitserve.kernels.triton_decode_attention import choose_num_splits, paged_decode_attention
from splitserve.kernels.triton_kv import pack_blocks, store_kv, unpack_blocks
from splitserve.kernels.triton_norm_rope import apply_rotary, rms_norm
from splitserve.kernels.triton_prefill_attention import paged_prefill_attention

__all__ = [
    "apply_rotary",
    "choose_num_splits",
    "pack_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "store_kv",
    "unpack_blocks",
]
