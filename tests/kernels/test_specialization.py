"""The kernels' arguments that change from step to step are not specialised on: Triton
would otherwise compile a new variant of a kernel in the middle of traffic whenever one of
them became 1 or a multiple of 16 (measured on an H200: 10 compilations, ~0.3 s each,
during the first 64 requests of the engine benchmark, none after this; bench/gpu/diagnose.py).
Triton ignores a name that is not a parameter, so a typo or a rename would silently bring
the compilations back: every name must be a parameter of its kernel."""

from __future__ import annotations

import inspect

import pytest

from splitserve.kernels import (
    triton_decode_attention,
    triton_fused,
    triton_kv,
    triton_moe,
    triton_prefill_attention,
)

# kernel -> the arguments that vary per step (counts, a block table's width, metadata pointers)
PER_STEP = {
    triton_prefill_attention._prefill_kernel: {"num_seqs", "stride_btb"},
    triton_decode_attention._decode_split_kernel: {"tokens_per_split", "num_splits", "stride_btb"},
    triton_decode_attention._decode_merge_kernel: {"num_splits"},
    triton_moe._moe_gemm_kernel: {"num_rows"},
}
ALIGNMENT = {
    triton_prefill_attention._prefill_kernel: {"block_tables_ptr", "cu_seqlens_ptr", "seq_lens_ptr"},
    triton_decode_attention._decode_split_kernel: {"block_tables_ptr", "seq_lens_ptr"},
    triton_kv._store_kv_kernel: {"slots_ptr"},
    triton_fused._rotary_store_kernel: {"slots_ptr"},
}
KERNELS = sorted(set(PER_STEP) | set(ALIGNMENT) | {triton_fused._act_and_mul_kernel,
                                                    triton_fused._add_rms_norm_kernel}, key=lambda k: k.__name__)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_unspecialised_names_are_parameters_and_cover_the_per_step_ones(kernel):
    params = set(inspect.signature(kernel.fn).parameters)
    assert set(kernel.do_not_specialize) <= params
    assert set(kernel.do_not_specialize_on_alignment) <= params
    assert PER_STEP.get(kernel, set()) <= set(kernel.do_not_specialize)
    assert ALIGNMENT.get(kernel, set()) <= set(kernel.do_not_specialize_on_alignment)
