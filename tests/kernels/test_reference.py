"""The torch reference itself: it keeps gather workspaces between calls, which must not
tie it to the autograd mode of the first caller."""

from __future__ import annotations

import torch

from splitserve.kernels import reference
from tests.kernels.paged_cases import make_paged_kv, randn


def test_reference_alternates_between_inference_mode_and_normal_mode(device):
    kv = make_paged_kv([40, 9], 2, 64, torch.float32, device)
    q = randn((2, 4, 64), torch.float32, device)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    qp = randn((5, 4, 64), torch.float32, device)
    args = (kv.k_cache, kv.v_cache, kv.block_tables)
    with torch.inference_mode():  # how the engine calls it
        first = reference.paged_decode_attention(q, *args, kv.seq_lens, 0.125)
        first_p = reference.paged_prefill_attention(qp, *args, cu, kv.seq_lens, 0.125)
    again = reference.paged_decode_attention(q, *args, kv.seq_lens, 0.125)  # how tests call it
    again_p = reference.paged_prefill_attention(qp, *args, cu, kv.seq_lens, 0.125)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.testing.assert_close(again_p, first_p, atol=0, rtol=0)


def test_a_whole_prompt_uses_sdpa_causal_bit_for_bit_as_the_explicit_mask(device):
    """A sequence whose new tokens are its whole context runs SDPA with is_causal (half the
    work at 2k tokens); it must equal the explicit-mask attention exactly, GQA included."""
    lens = [300, 17]
    kv = make_paged_kv(lens, 2, 64, torch.float32, device)
    q = randn((sum(lens), 4, 64), torch.float32, device)
    cu = torch.tensor([0, 300, 317], dtype=torch.int32, device=device)
    got = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    for b, (start, length) in enumerate(zip([0, 300], lens, strict=True)):
        k = reference._gather_kv(kv.k_cache, kv.block_tables[b], length, "k").transpose(0, 1)[None]
        v = reference._gather_kv(kv.v_cache, kv.block_tables[b], length, "v").transpose(0, 1)[None]
        pos = torch.arange(length, device=device)
        mask = (pos[None, :] <= pos[:, None])[None, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + length].transpose(0, 1)[None], k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
        assert torch.equal(got[start:start + length], want[0].transpose(0, 1))
