"""Mixture-of-experts: the router's top-k against transformers' routers, the torch
reference against transformers' experts and a float64 per-token loop, and the Triton
grouped GEMM (interpreter here, GPU elsewhere) against the reference."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.kernels import moe_reference, ops, triton_moe
from tests.kernels.paged_cases import TOLERANCES, assert_close

DTYPES = [torch.float32, torch.bfloat16]


def make_experts(num_experts, hidden, intermediate, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn((num_experts, 2 * intermediate, hidden), generator=gen) / hidden**0.5
    w2 = torch.randn((num_experts, hidden, intermediate), generator=gen) / intermediate**0.5
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


def make_routing(kind, tokens, num_experts, top_k, device, seed=1):
    """(weights float32, ids int64) [tokens, top_k]; ids distinct per token."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "softmax":
        weights, ids = moe_reference.select_experts(torch.randn((tokens, num_experts), generator=gen), top_k, True)
    elif kind == "one_expert":  # every token to expert num_experts - 2 (top-1)
        ids = torch.full((tokens, top_k), num_experts - 2, dtype=torch.int64)
        weights = torch.rand((tokens, top_k), generator=gen)
    else:  # "few_experts": only experts 0, 5 and last ever chosen; the others get no token
        few = torch.tensor([0, 5, num_experts - 1])
        ids = torch.stack([few[torch.randperm(3, generator=gen)[:top_k]] for _ in range(tokens)])
        weights = torch.rand((tokens, top_k), generator=gen)
    return weights.to(device), ids.to(device)


def per_token_loop(hidden, w13, w2, weights, ids):
    """The definition, one (token, k) at a time in float64."""
    x, w13, w2 = hidden.double(), w13.double(), w2.double()
    intermediate = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t]).split(intermediate)
            out[t] += float(weights[t, k]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


# (tokens, experts, top_k, hidden, intermediate, routing)
CASES = [
    (7, 4, 2, 64, 32, "softmax"),  # top-2, Mixtral-like
    (1, 16, 8, 72, 40, "softmax"),  # one token, top-8, 8 experts idle, sizes off the 32/64 tiles
    (24, 8, 1, 48, 80, "softmax"),  # top-1
    (40, 8, 1, 32, 24, "one_expert"),  # all 40 tokens to one expert: three 16-row tiles
    (9, 16, 2, 40, 56, "few_experts"),  # 13 experts with zero tokens
    (70, 4, 2, 32, 48, "softmax"),  # 140 rows: 64-row tiles
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,intermediate,routing", CASES)
def test_triton_matches_reference(device, dtype, tokens, experts, top_k, hidden, intermediate, routing):
    w13, w2 = make_experts(experts, hidden, intermediate, dtype, device)
    weights, ids = make_routing(routing, tokens, experts, top_k, device)
    x = torch.randn((tokens, hidden), generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    expected = moe_reference.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden)
    assert_close(out, expected, dtype)


def test_triton_with_model_dtype_weights_int32_ids_and_a_strided_hidden(device):
    """Qwen3-MoE hands the kernel bfloat16 routing weights; hidden may be a column slice."""
    w13, w2 = make_experts(8, 48, 40, torch.bfloat16, device)
    weights, ids = make_routing("softmax", 5, 8, 2, device)
    x = torch.randn((5, 96), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)[:, 8:56]
    weights, ids = weights.to(torch.bfloat16), ids.to(torch.int32)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, moe_reference.fused_moe(x, w13, w2, weights, ids), torch.bfloat16)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"{c[0]}x{c[1]}e-top{c[2]}-{c[5]}")
def test_reference_is_the_definition(device, case):
    tokens, experts, top_k, hidden, intermediate, routing = case
    w13, w2 = make_experts(experts, hidden, intermediate, torch.float32, device)
    weights, ids = make_routing(routing, tokens, experts, top_k, device)
    x = torch.randn((tokens, hidden), generator=torch.Generator().manual_seed(2)).to(device)
    out = moe_reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), per_token_loop(x, w13, w2, weights, ids), **TOLERANCES[torch.float32])


def test_no_tokens(device):
    w13, w2 = make_experts(4, 32, 16, torch.float32, device)
    x = torch.zeros((0, 32), device=device)
    ids = torch.zeros((0, 2), dtype=torch.int64, device=device)
    for impl in (triton_moe, moe_reference):
        out = impl.fused_moe(x, w13, w2, torch.zeros((0, 2), device=device), ids)
        assert out.shape == (0, 32) and out.dtype == torch.float32


def test_moe_align_groups_rows_by_expert_in_padded_tiles(device):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)  # rows 0..5 = token * 2 + k
    sorted_rows, block_experts, num_padded = triton_moe.moe_align(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_rows.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 8
    # tiles: expert 0, expert 2, expert 3 (expert 1 has none), then unused tiles
    assert block_experts.tolist()[:3] == [0, 2, 3]
    assert num_padded.tolist() == [12]
    assert sorted_rows.dtype == block_experts.dtype == torch.int32


def test_moe_align_capacity_covers_the_worst_padding(device):
    """Eight rows on eight experts, one each: every run pads 1 -> 16 rows."""
    ids = torch.arange(8, device=device).view(1, 8)
    sorted_rows, block_experts, num_padded = triton_moe.moe_align(ids, num_experts=64, block_m=16)
    assert int(num_padded) == 8 * 16 == sorted_rows.numel()
    assert block_experts.tolist() == list(range(8))
    assert sorted_rows.view(8, 16)[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_dispatches_to_both_backends(device, dtype):
    w13, w2 = make_experts(4, 32, 16, dtype, device)
    weights, ids = make_routing("softmax", 3, 4, 2, device)
    x = torch.randn((3, 32), generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    results = {}
    try:
        for name in ("triton", "reference"):
            ops.set_backend(name)
            results[name] = ops.fused_moe(x, w13, w2, weights, ids)
    finally:
        ops.set_backend(None)
    assert_close(results["triton"], results["reference"], dtype)


def test_bad_shapes_are_refused_with_the_shapes(device):
    w13, w2 = make_experts(4, 32, 16, torch.float32, device)
    x = torch.zeros((3, 32), device=device)
    weights, ids = torch.zeros((3, 2), device=device), torch.zeros((3, 2), dtype=torch.int64, device=device)
    for impl in (triton_moe, moe_reference):
        with pytest.raises(ValueError, match=r"w13 \(4, 30, 32\) and w2 \(4, 32, 16\) do not fit hidden size 32"):
            impl.fused_moe(x, w13[:, :30], w2, weights, ids)
        with pytest.raises(ValueError, match=r"must both be \[tokens=3, top_k\], got \(3, 2\) and \(2, 2\)"):
            impl.fused_moe(x, w13, w2, weights, ids[:2])
        with pytest.raises(ValueError, match="topk_ids must be int32 or int64, got torch.float32"):
            impl.fused_moe(x, w13, w2, weights, weights)
        with pytest.raises(ValueError, match="must share a dtype, got torch.bfloat16, torch.float32"):
            impl.fused_moe(x.bfloat16(), w13, w2, weights, ids)


# --- routing and the reference against transformers --------------------------------

def _transformers_moe(family, num_experts, top_k, hidden, intermediate, norm_topk_prob=False):
    """transformers' router and experts modules (eager experts: the loop over experts)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router

        cfg = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=num_experts,
                            num_experts_per_tok=top_k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router

        cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts,
                             num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    cfg._experts_implementation = "eager"
    torch.manual_seed(5)
    router, experts = Router(cfg), Experts(cfg)
    for p in (router.weight, experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.2)
    return router, experts


@pytest.mark.parametrize("family,norm_topk_prob,renormalize", [
    ("mixtral", None, True),  # Mixtral always renormalises over its top-k
    ("qwen3_moe", True, True),
    ("qwen3_moe", False, False),
])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_select_experts_matches_transformers_router(family, norm_topk_prob, renormalize, top_k):
    router, _ = _transformers_moe(family, 16, top_k, 32, 24, norm_topk_prob=bool(norm_topk_prob))
    x = torch.randn((11, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
        weights, ids = moe_reference.select_experts(torch.nn.functional.linear(x, router.weight), top_k, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=0, rtol=0)
    if not renormalize:
        assert (weights.sum(-1) < 1).all()  # the top-k of 16 probabilities, left as they are


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_reference_matches_transformers_experts(family):
    router, experts = _transformers_moe(family, 8, 2, 32, 24, norm_topk_prob=True)
    x = torch.randn((13, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, weights, ids = router(x)
        expected = experts(x, ids, weights)
        out = moe_reference.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("forced", ["moe", pytest.param("every kernel", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_engine_greedy_tokens_unchanged_with_the_triton_moe_kernel(make_ckpt, monkeypatch, family, forced, device):
    """The MoE layers through the Triton kernel against the reference: a 24-token step budget
    chunks the 40-token prompt and mixes prefill with decode. `moe` forces only the MoE kernel
    through Triton; `every kernel` forces the attention, norm and rotary kernels too, which
    through the interpreter costs ~40 s a family here (`make test` runs it, `make test-fast`
    the MoE-only case; the other kernels' engine test is test_engine_triton_interpreter.py).
    On a GPU the engine runs there, eagerly (the reference kernels cannot be captured in a graph)."""
    calls = []
    original = triton_moe.fused_moe
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *args: calls.append(args[0].shape[0]) or original(*args))
    path = make_ckpt(family)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    try:
        for backend in ("reference", "triton"):
            with monkeypatch.context() as m:
                if forced == "moe":
                    ops.set_backend("reference")
                    if backend == "triton":
                        m.setattr(ops, "fused_moe", lambda *args: triton_moe.fused_moe(*args))
                else:
                    ops.set_backend(backend)
                llm = LLM(str(path), num_kv_blocks=32, max_num_batched_tokens=24, device=str(device),
                          cuda_graphs=False)
                tokens[backend] = [out.token_ids for out in llm.generate(prompts, [params] * 3)]
            assert bool(calls) == (backend == "triton")
    finally:
        ops.set_backend(None)
    assert tokens["triton"] == tokens["reference"]
    assert 1 in calls and 24 in calls  # decode-only steps and full chunked-prefill steps
