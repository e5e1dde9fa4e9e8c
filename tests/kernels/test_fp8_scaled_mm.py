"""FP8 x FP8 linears through torch._scaled_mm (kernels/fp8_scaled_mm.py): the layer against
its definition (per-token activation scales, per-row weight scales), which weights take the
path, and a whole FP8 checkpoint through the engine token for token against transformers
with the same activation quantization. torch._scaled_mm runs on the CPU too; on a GPU of
compute capability 8.9+ the engine takes this path by itself (EngineConfig.fp8_activations)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.models.quant_linear import QuantizedLinear, move_weight
from splitserve.kernels import ops
from splitserve.kernels.fp8_scaled_mm import (
    E4M3_MAX,
    device_has_fp8_matmul,
    fp8_linear,
    fp8_linear_reference,
    quantize_per_token,
    rowwise,
)
from splitserve.kernels.quant_weight import FP8, QuantizedWeight
from tests.engine.test_quant_formats import quantize_checkpoint
from tests.helpers.reference import hf_model


def _fp8_weight(n: int, k: int, per_tensor: bool, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
    scale = (amax / E4M3_MAX).reshape(-1, 1).expand(n, 1).contiguous()
    return QuantizedWeight((w / scale).to(torch.float8_e4m3fn), scale, None, FP8, k, k, n)


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_fp8_linear_is_its_definition(device, per_tensor, dtype, rows):
    """On a GPU (the GPU check's kernel stage) this is cuBLAS's FP8 GEMM; here the CPU's."""
    if device.type == "cuda" and not device_has_fp8_matmul(device):
        pytest.skip("this GPU has no FP8 tensor cores (compute capability < 8.9)")
    qw = move_weight(_fp8_weight(96, 64, per_tensor), device, dtype)
    w = rowwise(qw)
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x = torch.cat([x, torch.zeros(1, 64, dtype=dtype)]).to(device)  # a token of zeros: zero output
    bias = torch.randn(96).to(dtype).to(device)
    got, want = fp8_linear(x, w, bias), fp8_linear_reference(x, w, bias)
    assert got.dtype == dtype and got.shape == (rows + 1, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got[-1].float(), bias.float(), rtol=0, atol=0)
    # and it is an FP8 result, not the weight-only one: the activations were rounded to e4m3
    weight_only = (x.float() @ qw.dequantize().T + bias.float()).to(dtype)  # (float32 on the GPU too)
    assert not torch.equal(got[:-1], weight_only[:-1])
    assert (got.float() - weight_only.float()).norm() < 0.05 * weight_only.float().norm()


def test_per_token_scales_map_each_rows_maximum_to_e4m3s_largest_value():
    x = torch.tensor([[1.0, -896.0, 3.0], [0.5, 0.25, -0.125]])
    codes, scales = quantize_per_token(x)
    assert scales.flatten().tolist() == [2.0, pytest.approx(0.5 / 448, rel=1e-6)]
    assert codes.float().abs().amax(dim=1).tolist() == [448.0, 448.0]


def test_only_weights_with_a_scale_per_row_and_cublas_shapes_take_the_path():
    ok = _fp8_weight(32, 64, per_tensor=False)
    assert rowwise(ok) is not None
    blocked = QuantizedWeight(ok.codes, torch.ones(32, 2), None, FP8, 32, 64, 32)  # scales per 32 columns
    odd = _fp8_weight(24, 64, per_tensor=False)  # N not a multiple of 16
    int8 = QuantizedWeight(torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32, 1), None, 8, 64, 64, 32)
    permuted = QuantizedWeight(ok.codes, ok.scales, None, FP8, 64, 64, 32, input_perm=torch.randperm(64))
    assert [rowwise(w) for w in (blocked, odd, int8, permuted)] == [None] * 4


def test_the_engine_takes_it_only_where_asked_or_where_fp8_tensor_cores_are():
    assert EngineConfig(model="x", device="cpu").fp8_activations_min_rows is None  # auto: no FP8 tensor cores
    assert EngineConfig(model="x", device="cpu", fp8_activations=True).fp8_activations_min_rows == 1
    assert EngineConfig(model="x", device="cpu", fp8_activations=False).fp8_activations_min_rows is None


def test_auto_keeps_decode_sized_matmuls_weight_only():
    """auto on a GPU: W8A8 from 5 rows up (prefill), the weight-only kernel below (decode)."""
    qw = _fp8_weight(32, 64, per_tensor=False)
    linear = QuantizedLinear(64, 32)
    linear.set_part(None, qw)
    linear.finish()
    assert linear.use_fp8_activations(min_rows=5) == 1
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(linear(x[:4]), ops.quantized_linear(x[:4], qw))  # 4 rows: weight-only
    assert torch.equal(linear(x), fp8_linear(x, rowwise(qw)))  # 5 rows: FP8 activations


def _hf_w8a8_greedy(model_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers on the dequantised weights, each decoder linear's input quantized per
    token to e4m3 first: what the W8A8 engine computes."""
    model = hf_model(str(model_dir), "float32")

    def quantized_input(module, args):
        codes, scales = quantize_per_token(args[0].reshape(-1, args[0].shape[-1]))
        return ((codes.float() * scales).reshape(args[0].shape),)

    hooks = [m.register_forward_pre_hook(quantized_input) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and ".layers." in name]
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=model.generation_config.eos_token_id[0])
        return out[0, len(prompt):].tolist()
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("layout,strategy", [("fp8-tensor", None), ("ct-float", "channel")])
def test_an_fp8_checkpoint_through_the_engine_matches_transformers_with_fp8_activations(
        make_ckpt, tmp_path, layout, strategy):
    opts = {"strategy": strategy} if strategy else {}
    qdir, rdir = quantize_checkpoint(make_ckpt("llama"), tmp_path, layout, **opts)
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64, fp8_activations=True)
    layers = llm.engine.runner.model.layers
    assert all(len(layer.self_attn.qkv_proj.fp8_rowwise) == 1 and len(layer.mlp.down_proj.fp8_rowwise) == 1
               for layer in layers)
    rng = random.Random(5)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (9, 75)]  # 75: a chunked prefill
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_w8a8_greedy(rdir, prompt, 16), f"prompt of {len(prompt)} tokens"
