"""FP4 weights (engine/quant/mxfp4.py): gpt-oss's MXFP4 `_blocks` / `_scales` and
compressed-tensors' nvfp4- / mxfp4-pack-quantized, read into QuantizedWeight's FP4 layout
(packed E2M1 nibbles, a float32 scale per group). Bit equality against the formats' own dequantisers (transformers'
convert_moe_packed_tensors, compressed-tensors' compressors and dequantize), extreme E8M0
scales included; the quantized linear kernels (native CPU, Triton: the interpreter here) on
these weights (and every nibble on random FP4 weights of groups 16 to 128, decode- and
prefill-sized x) against the dequantised matmul, within tests/kernels/test_quant_linear.py's
bound; detection, modules_to_not_convert and the one-line refusals; and a llama checkpoint
quantized to NVFP4 by compressed-tensors served by LLM token-exact against transformers
running its dequantised weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from splitserve.core.model_config import CheckpointError
from splitserve.core.quantization import QuantSpec, quantization_from_config, tensors_problem
from splitserve.engine.quant import iter_quantized_weights
from splitserve.engine.quant.mxfp4 import mxfp4_weights, nvfp4_weight
from splitserve.kernels import cpu_native, quant_native, triton_quant
from splitserve.kernels.quant_weight import FP4, QuantizedWeight
from tests.kernels.test_quant_linear import assert_matches_reference, x_rows

MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def random_mxfp4(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 255):
    """uint8 blocks [*shape, K / 32, 16] and E8M0 scales [*shape, K / 32] in [low, high)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


# ---- bit equality with each format's own dequantiser -----------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_is_bit_equal_to_transformers(dtype):
    """Every E8M0 exponent but NaN's 255 (0: the subnormal 2^-127; 254: 6 x 2^127 overflows to inf,
    in both), every nibble, signed zeros included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 40, 8), seed=0)
    scales[0, :32].view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    weights = mxfp4_weights(blocks, scales, "experts.gate_up_proj")
    assert len(weights) == 3 and all(w.bits == FP4 and w.group_size == 32 and w.offsets is None for w in weights)
    assert (weights[0].out_features, weights[0].in_features) == (40, 256)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]: x @ w
    got = torch.stack([w.dequantize() for w in weights]).transpose(1, 2).to(dtype).contiguous()
    assert same_bits(got, want)
    assert want.isinf().any()


def test_mxfp4_nan_scale_and_bad_shapes_are_one_line():
    blocks, scales = random_mxfp4((2, 4, 2), seed=1)
    scales[1, 2, 0] = 255
    with pytest.raises(ValueError, match=r"^e\.down_proj: an E8M0 scale is 255, which is NaN in the MX spec$"):
        mxfp4_weights(blocks, scales, "e.down_proj")
    with pytest.raises(ValueError, match=r"^e\.w: mxfp4 blocks torch.uint8 \(2, 4, 2, 16\) and scales torch.uint8 "
                                         r"\(2, 4\) do not fit"):
        mxfp4_weights(blocks, scales[..., 0], "e.w")


def _nvfp4_compressed(n: int, k: int, seed: int):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n).unsqueeze(1)  # rows of every magnitude
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    global_scale = 448 * 6 / w.abs().amax().reshape(1)
    scale = (w.reshape(n, k // 16, 16).abs().amax(-1) / 6 * global_scale).to(torch.float8_e4m3fn).float()
    packed = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": global_scale},
                                            scheme)
    return packed, scheme, NVFP4PackedCompressor


def test_nvfp4_is_bit_equal_to_compressed_tensors():
    """decompress() (its bfloat16 result), and its dequantize() in float32: scale / global_scale
    rounded once in float32, times the E2M1 value."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed, scheme, compressor = _nvfp4_compressed(48, 128, seed=2)
    assert packed["weight_scale"].dtype == torch.float8_e4m3fn and packed["weight_global_scale"].shape == (1,)
    qw = nvfp4_weight(packed["weight_packed"], packed["weight_scale"], packed["weight_global_scale"], "m")
    assert (qw.bits, qw.group_size, qw.in_features, qw.out_features) == (FP4, 16, 128, 48)
    assert same_bits(qw.dequantize().bfloat16(), compressor.decompress(dict(packed), scheme)["weight"])
    values = unpack_fp4_from_uint8(packed["weight_packed"], 48, 128, dtype=torch.float32)
    want = dequantize(values, packed["weight_scale"].float(), args=scheme.weights,
                      global_scale=packed["weight_global_scale"], dtype=torch.float32)
    assert same_bits(qw.dequantize(), want)


def test_compressed_tensors_mxfp4_is_bit_equal():
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    scale = 2.0 ** torch.floor(torch.log2(w.reshape(24, 3, 32).abs().amax(-1) / 6))
    packed = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert packed["weight_scale"].dtype == torch.uint8
    qw = nvfp4_weight(packed["weight_packed"], packed["weight_scale"], None, "m")
    assert qw.group_size == 32
    assert same_bits(qw.dequantize().bfloat16(), MXFP4PackedCompressor.decompress(dict(packed), scheme)["weight"])


# ---- the kernels on these weights ------------------------------------------------------------

def _fp4_weights() -> dict[str, QuantizedWeight]:
    """A gpt-oss-like MXFP4 expert (exponents around 2^-6, as trained weights have) and an NVFP4
    linear, with N and K off the kernels' tiles."""
    blocks, scales = random_mxfp4((70, 12), seed=4, low=118, high=124)
    packed, _, _ = _nvfp4_compressed(70, 384, seed=5)
    return {"mxfp4": mxfp4_weights(blocks, scales, "m")[0],
            "nvfp4": nvfp4_weight(packed["weight_packed"], packed["weight_scale"], packed["weight_global_scale"], "m")}


@pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the native CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_native_kernel_on_fp4_weights(kind, dtype):
    qw = _fp4_weights()[kind]
    bias = torch.randn(70)
    for rows in (1, 3, 16, 65):
        x = x_rows(rows, 384, dtype)
        assert quant_native.supports(x, qw)
        assert_matches_reference(quant_native.quantized_linear(x, qw, bias), x, qw, bias)


def random_fp4(n: int, k: int, group: int, seed: int, device="cpu") -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) / 8
    return QuantizedWeight(codes.to(device), scales.to(device), None, FP4, group, k, n)


@pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the native CPU kernels")
@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_native_kernel_on_every_fp4_nibble(group):
    """Groups of 16 take the pshufb-to-FP8 path, multiples of 32 the AVX-512 lookup; 300 rows
    span two of the kernel's x blocks; bias and leading dims as the other layouts'."""
    qw = random_fp4(93, 384, group, seed=group)
    bias = torch.randn(93)
    for rows, dtype in ((1, torch.float32), (5, torch.bfloat16), (300, torch.float32)):
        x = x_rows(rows, 384, dtype)
        assert_matches_reference(quant_native.quantized_linear(x, qw, bias), x, qw, bias)


def test_fp4_layout_is_the_e2m1_table():
    qw = QuantizedWeight(torch.arange(256, dtype=torch.uint8).reshape(16, 16), torch.ones(16, 1), None, FP4, 32, 32, 16)
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(qw.dequantize()[:, 0::2], values.repeat(16, 1)) and torch.equal(qw.dequantize()[:, 1], values)
    with pytest.raises(ValueError, match="fp4 weights have no offsets"):
        QuantizedWeight(qw.codes, qw.scales, torch.zeros(16, 1), FP4, 32, 32, 16)


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_triton_kernel_on_fp4_weights(kind):
    """On a GPU the real kernel; here Triton's interpreter."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = _fp4_weights()[kind]
    qw = QuantizedWeight(cpu.codes.to(device), cpu.scales.to(device), None, FP4, cpu.group_size, cpu.in_features,
                         cpu.out_features)
    for rows, dtype in ((3, torch.float32), (17, torch.bfloat16)):
        x = x_rows(rows, 384, dtype, device)
        rounding = 2**-8 if device.type == "cuda" and dtype != torch.float32 else 0.0
        assert_matches_reference(triton_quant.quantized_linear(x, qw), x, qw, weight_rounding=rounding)
    odd = random_fp4(33, 24 * 13, 24, seed=9, device=device)  # a scale per element: groups of 24
    x = x_rows(2, 24 * 13, torch.float32, device)
    assert_matches_reference(triton_quant.quantized_linear(x, odd), x, odd)


# ---- detection and the reader ----------------------------------------------------------------

def test_detection_and_refusals():
    spec = quantization_from_config({"quantization_config": MXFP4})
    assert (spec.method, spec.format, spec.group_size) == ("mxfp4", "mxfp4", 32)
    assert spec.not_converted == tuple(MXFP4["modules_to_not_convert"])
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16, "symmetric": True}}}}
    assert quantization_from_config({"quantization_config": nvfp4}) == QuantSpec(
        "compressed-tensors", "nvfp4-pack-quantized", bits=4, group_size=16)
    nvfp4["config_groups"]["g"]["weights"]["group_size"] = 32
    with pytest.raises(CheckpointError, match=r"^c: compressed-tensors nvfp4-pack-quantized float4 group 32 \(fp4, "
                                              r"symmetric, group 16\) is not supported \(supported: .*mxfp4 \(gpt-oss\)\)$"):
        quantization_from_config({"quantization_config": nvfp4}, "c")
    with pytest.raises(CheckpointError, match=r"^c: mxfp4 with modules_to_not_convert 'lm_head'"):
        quantization_from_config({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}},
                                 "c")


def _write(d, tensors: dict, qc: dict | None):
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"quantization_config": qc} if qc else {}))


def _headers(d) -> dict:
    from splitserve.core.checkpoint_check import safetensors_header

    return safetensors_header(d / "model.safetensors")[0]


def test_reader_yields_one_weight_per_expert(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gu_blocks, gu_scales = random_mxfp4((4, 64, 2), seed=6, low=110, high=130)
    down_blocks, down_scales = random_mxfp4((4, 64, 1), seed=7, low=110, high=130)
    exp = "model.layers.0.mlp.experts"
    tensors = {f"{exp}.gate_up_proj_blocks": gu_blocks, f"{exp}.gate_up_proj_scales": gu_scales,
               f"{exp}.down_proj_blocks": down_blocks, f"{exp}.down_proj_scales": down_scales,
               f"{exp}.gate_up_proj_bias": torch.randn(4, 64), "model.layers.0.mlp.router.weight": torch.randn(4, 64)}
    _write(tmp_path / "m", tensors, MXFP4)
    spec = quantization_from_config({"quantization_config": MXFP4})
    assert tensors_problem(spec, _headers(tmp_path / "m"), "m") is None
    got = dict(iter_quantized_weights(tmp_path / "m", spec))
    assert sorted(got) == sorted([f"{exp}.{e}.{p}.weight" for e in range(4) for p in ("gate_up_proj", "down_proj")]
                                 + [f"{exp}.gate_up_proj_bias", "model.layers.0.mlp.router.weight"])
    want = convert_moe_packed_tensors(gu_blocks, gu_scales, dtype=torch.float32)
    for e in range(4):
        assert same_bits(got[f"{exp}.{e}.gate_up_proj.weight"].dequantize(), want[e].T.contiguous())


def test_quantized_tensors_where_modules_to_not_convert_says_float(tmp_path):
    blocks, scales = random_mxfp4((8, 2), seed=8, low=120, high=125)
    name = "model.layers.3.self_attn.q_proj"
    _write(tmp_path / "m", {f"{name}_blocks": blocks, f"{name}_scales": scales}, MXFP4)
    spec = quantization_from_config({"quantization_config": MXFP4})
    assert tensors_problem(spec, _headers(tmp_path / "m"), "m") == (
        f"m: {name}_blocks is quantized, but quantization_config's modules_to_not_convert lists it")
    _write(tmp_path / "bad", {f"{name}_blocks": blocks, f"{name}_scales": scales[:, :1].contiguous()}, {"quant_method": "mxfp4"})
    plain = quantization_from_config({"quantization_config": {"quant_method": "mxfp4"}})
    assert tensors_problem(plain, _headers(tmp_path / "bad"), "bad") == (
        f"bad: {name}_blocks has shape [8, 2, 16] and {name}_scales [8, 1]; mxfp4 stores [..., N, K / 32, 16] and "
        "[..., N, K / 32]")
    assert tensors_problem(None, _headers(tmp_path / "bad"), "bad").startswith(
        f"bad: holds quantized tensors (e.g. '{name}_blocks') but config.json has no quantization_config")


# ---- an NVFP4 checkpoint through the engine -------------------------------------------------

def nvfp4_checkpoint(src, tmp_path):
    """`src` (a float32 llama checkpoint) with every decoder linear quantized by compressed-tensors'
    NVFP4 compressor (nvfp4-pack-quantized, NVFP4A16), and a float32 twin holding compressed-tensors'
    own dequantisation of the same tensors (what transformers runs)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    quantized, reference = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            quantized[name] = reference[name] = w
            continue
        n, k = w.shape
        global_scale = (448 * 6 / w.abs().amax()).reshape(1)
        scale = (w.reshape(n, k // 16, 16).abs().amax(-1) / 6 * global_scale).to(torch.float8_e4m3fn).float()
        packed = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale,
                                                 "weight_global_scale": global_scale}, scheme)
        module = name.removesuffix(".weight")
        quantized |= {f"{module}.{s}": t for s, t in packed.items()}
        values = unpack_fp4_from_uint8(packed["weight_packed"], n, k, dtype=torch.float32)
        reference[name] = dequantize(values, packed["weight_scale"].float(), args=scheme.weights,
                                     global_scale=global_scale, dtype=torch.float32)
    config = json.loads((src / "config.json").read_text())
    qdir, rdir = tmp_path / "nvfp4", tmp_path / "reference"
    for d, tensors in ((qdir, quantized), (rdir, reference)):
        d.mkdir()
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (rdir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                     "ignore": ["lm_head"], "config_groups": {"group_0": {
                                         "targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                         "weights": scheme.weights.model_dump(mode="json")}}}
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, rdir


def test_nvfp4_llama_through_llm_matches_transformers(make_ckpt, tmp_path):
    import random

    from splitserve.engine import LLM, SamplingParams
    from splitserve.engine.models.quant_linear import QuantizedLinear
    from tests.helpers.reference import hf_greedy

    qdir, rdir = nvfp4_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=384), tmp_path)
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=64)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and [(p.bits, p.group_size) for p in qkv.parts] == [(FP4, 16)]
    rng = random.Random(5)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 75)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, 24), f"prompt of {len(prompt)} tokens"


def test_tensor_parallel_split_must_keep_whole_fp4_groups():
    """gpt-oss-20b's experts (intermediate 2880) split over 2 ranks in whole 32-column groups, not
    over 4 (720 columns a rank); expert parallelism keeps experts whole; attention stays float."""
    from types import SimpleNamespace

    from splitserve.core.quantization import tensor_parallel_split_problem

    gpt_oss = SimpleNamespace(num_heads=64, head_dim=64, num_layers=24, moe_layers=range(24), intermediate_size=2880,
                              num_experts=32, moe_intermediate_size=2880)
    spec = quantization_from_config({"quantization_config": MXFP4})
    assert tensor_parallel_split_problem(spec, gpt_oss, 2) is None
    assert tensor_parallel_split_problem(spec, gpt_oss, 4) == (
        "its mlp.experts.N.down_proj has 2880 input columns, 720 per rank, which is not whole quantization groups "
        "of 32 (mxfp4 (E2M1 values, an E8M0 scale per 32))")
    assert tensor_parallel_split_problem(spec, gpt_oss, 4, expert_parallel=True) is None
    nvfp4 = QuantSpec("compressed-tensors", "nvfp4-pack-quantized", bits=4, group_size=16)
    dense = SimpleNamespace(num_heads=9, head_dim=64, num_layers=2, moe_layers=(), intermediate_size=1536, num_experts=0)
    assert tensor_parallel_split_problem(nvfp4, dense, 4) is None
    assert tensor_parallel_split_problem(nvfp4, dense, 8).startswith("its self_attn.o_proj has 576 input columns, 72")
