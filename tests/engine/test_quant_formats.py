"""Each quantized safetensors layout, written by these tests from a float checkpoint
(compressed-tensors' own compressors where it writes the format, else byte by byte from
the format's spec: GPTQ, AWQ, FP8 block-wise), read by engine/quant into QuantizedWeights
whose dequantize() is bit-equal to a dequantisation written here from each spec.

`quantize_checkpoint` is also what tests/engine/test_quant_models.py serves: it writes the
quantized checkpoint and a float32 one holding exactly the dequantised weights (the
reference transformers runs)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.quantization import quantization_from_config
from splitserve.engine.quant import iter_quantized_weights
from splitserve.kernels.quant_weight import QuantizedWeight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def int4_groups(wt: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """wt [K, N] -> codes [K, N], scales [G, N] (fp16 values), zeros [G, N]; asymmetric zero
    points in 1..15 (a GPTQ v1 file cannot store 0: it keeps zero - 1)."""
    k, n = wt.shape
    q = torch.empty(k, n, dtype=torch.int64)
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = g_idx == g
        block = wt[cols]
        if sym:
            s, z = fp16((block.abs().amax(0) / 7).clamp(min=1e-6)), torch.full((n,), 8)
        else:
            lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            s = fp16(((hi - lo) / 14).clamp(min=1e-6))
            z = (-lo / s).round().long().clamp(1, 15)
        q[cols] = (block / s + z).round().long().clamp(0, 15)
        scales[g], zeros[g] = s, z
    return q, scales, zeros


def pack_rows(q: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C / 8]: field i of word j holds column 8j + order[i]."""
    r, c = q.shape
    q = q.reshape(r, c // 8, 8)
    return to_int32(sum(q[:, :, o] << (4 * i) for i, o in enumerate(order)))


# ---- writers, and each format's dequantisation from its spec --------------------------------

def write_gptq(w, group=128, sym=True, act_order=False, seed=0):
    n, k = w.shape
    gs = k if group == -1 else group
    g_idx = torch.arange(k) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    q, s, z = int4_groups(w.T, g_idx, k // gs, sym)
    return {"qweight": pack_rows(q.T).T.contiguous(), "qzeros": pack_rows((z - 1) & 0xF),
            "scales": s.half(), "g_idx": g_idx.to(torch.int32)}


def spec_gptq(t):
    qweight, qzeros, scales, g_idx = t["qweight"].long(), t["qzeros"].long(), t["scales"].float(), t["g_idx"].long()
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q = torch.stack([(qweight >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(k, n)  # row 8i + j
    z = torch.stack([(qzeros >> (4 * i)) & 15 for i in range(8)], dim=2).reshape(-1, n) + 1
    return ((q - z[g_idx]).float() * scales[g_idx]).T.contiguous()


def write_awq(w, group=128):
    n, k = w.shape
    q, s, z = int4_groups(w.T, torch.arange(k) // group, k // group, sym=False)
    return {"qweight": pack_rows(q, AWQ_ORDER), "qzeros": pack_rows(z, AWQ_ORDER), "scales": s.half()}


def spec_awq(t, group=128):
    qweight, qzeros, scales = t["qweight"].long(), t["qzeros"].long(), t["scales"].float()
    k, n = qweight.shape[0], qweight.shape[1] * 8

    def unpack(x):
        out = torch.empty(x.shape[0], n, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            out[:, col::8] = (x >> (4 * i)) & 15
        return out

    g = torch.arange(k) // group
    return ((unpack(qweight) - unpack(qzeros)[g]).float() * scales[g]).T.contiguous()


def write_fp8_block(w, block=(128, 128), static=False):
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = tile.abs().amax().clamp(min=1e-6) / 448
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    # static activation scales (W8A8 recipes): read, not used, as we run weight-only
    return {"weight": codes, "weight_scale_inv": scale} | ({"input_scale": torch.tensor([0.02])} if static else {})


def spec_fp8_block(t, block=(128, 128), **_):
    codes, scale = t["weight"], t["weight_scale_inv"]
    n, k = codes.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return codes.float() * full


def ct_scheme(fmt: str, **weights):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"])
    return scheme, config.model_dump(exclude_none=True)


def write_ct_float(w, strategy="channel"):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    scheme, _ = ct_scheme("float-quantized", num_bits=8, type="float", strategy=strategy, symmetric=True)
    amax = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 448).clamp(min=1e-6)
    return dict(FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme))


def write_fp8_tensor(w):
    """AutoFP8 / vLLM-serialized FP8: one scale per tensor, and a static input scale."""
    scale = (w.abs().amax() / 448).clamp(min=1e-6)
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(()),
            "input_scale": torch.tensor(0.02)}


def spec_ct_float(t):
    return t["weight"].float() * t["weight_scale"].float()


def write_ct_pack(w, strategy="group", group=128, sym=False, bits=4, actorder=False):
    if actorder:  # the library no longer writes actorder 'group': byte by byte, as older releases have it
        return write_ct_pack_actorder(w, group)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    extra = {"group_size": group} if strategy == "group" else {}
    scheme, _ = ct_scheme("pack-quantized", num_bits=bits, type="int", strategy=strategy, symmetric=sym, **extra)
    w = w.to(torch.bfloat16)  # 16-bit scales, as released checkpoints have
    n, k = w.shape
    g = w.reshape(n, -1, group if strategy == "group" else k)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale} | ({} if sym else {"weight_zero_point": zero})
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def write_ct_pack_actorder(w, group):
    n, k = w.shape
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=torch.Generator().manual_seed(1))]
    q, s, z = int4_groups(w.T, g_idx, k // group, sym=False)  # unsigned codes and zero points: q + 8, z + 8
    return {"weight_packed": pack_rows(q.T), "weight_scale": s.T.half().contiguous(),
            "weight_zero_point": pack_rows(z).T.contiguous(), "weight_shape": torch.tensor([n, k]),
            "weight_g_idx": g_idx.to(torch.int32)}


def spec_ct_pack(t, bits=4, **_):
    packed, scale = t["weight_packed"].long(), t["weight_scale"].float()
    n, k = (int(v) for v in t["weight_shape"])
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    q = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=2).reshape(n, -1)[:, :k] - offset
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"].long()
        z = torch.stack([(zp >> (bits * i)) & mask for i in range(per)], dim=1).reshape(-1, zp.shape[1])[:n] - offset
    else:
        z = torch.zeros_like(scale, dtype=torch.int64)
    g = k // scale.shape[1]
    col_group = t["weight_g_idx"].long() if "weight_g_idx" in t else torch.arange(k) // g
    return (q - z[:, col_group]).float() * scale[:, col_group]


def write_ct_int8(w, strategy="channel", sym=True, w8a8=False):
    """naive-quantized int8 weights (int-quantized when activations are int8 too: W8A8)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme, _ = ct_int8_scheme(strategy, sym, w8a8)
    w = w.to(torch.bfloat16)
    scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    state = {"weight": w, "weight_scale": scale} | ({} if sym else {"weight_zero_point": zero})
    return dict(NaiveQuantizationCompressor.compress(state, scheme))


def ct_int8_scheme(strategy, sym, w8a8):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True) if w8a8 else None
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", strategy=strategy, symmetric=sym), input_activations=acts)
    fmt = "int-quantized" if w8a8 else "naive-quantized"
    return scheme, QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                      ignore=["lm_head"]).model_dump(exclude_none=True)


def spec_ct_int8(t, **_):
    z = t["weight_zero_point"].float() if "weight_zero_point" in t else 0.0
    return (t["weight"].float() - z) * t["weight_scale"].float()


def quant_config(layout: str, opts: dict) -> dict:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": opts.get("group", 128), "sym": opts.get("sym", True),
                "desc_act": opts.get("act_order", False), "checkpoint_format": "gptq"}
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    if layout == "fp8-tensor":  # AutoFP8's layout: no weight_block_size
        return {"quant_method": "fp8", "activation_scheme": "static"}
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if opts.get("static") else "dynamic",
                "weight_block_size": [128, 128]}
    if layout == "ct-float":
        return ct_scheme("float-quantized", num_bits=8, type="float", strategy=opts.get("strategy", "channel"),
                         symmetric=True)[1]
    if layout == "ct-int8":
        return ct_int8_scheme(opts.get("strategy", "channel"), opts.get("sym", True), opts.get("w8a8", False))[1]
    strategy = opts.get("strategy", "group")
    extra = {"group_size": opts.get("group", 128)} if strategy == "group" else {}
    config = ct_scheme("pack-quantized", num_bits=opts.get("bits", 4), type="int", strategy=strategy,
                       symmetric=opts.get("sym", False), **extra)[1]
    if opts.get("actorder"):
        config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return config


WRITERS = {"gptq": (write_gptq, spec_gptq), "awq": (write_awq, spec_awq), "fp8-block": (write_fp8_block, spec_fp8_block),
           "ct-float": (write_ct_float, spec_ct_float), "ct-pack": (write_ct_pack, spec_ct_pack),
           "ct-int8": (write_ct_int8, spec_ct_int8), "fp8-tensor": (write_fp8_tensor, spec_ct_float)}


def quantize_checkpoint(src: Path, out: Path, layout: str, linears: tuple[str, ...] = LINEARS,
                        **opts) -> tuple[Path, Path]:
    """(quantized checkpoint, float32 reference with its dequantised weights), written from
    the float checkpoint `src`; every decoder linear named in `linears` (experts' too) is
    quantized, lm_head, embeddings and a MoE router not."""
    write, spec = WRITERS[layout]
    qdir, rdir = out / "quantized", out / "reference"
    for d in (qdir, rdir):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    quantized, reference = {}, {}
    for name, w in load_file(str(next(src.glob("*.safetensors")))).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in linears:
            tensors = write(w.float(), **opts)
            quantized.update({f"{module}.{s}": t.contiguous() for s, t in tensors.items()})
            reference[name] = spec(tensors, **opts) if layout.startswith(("ct-pack", "ct-int8", "fp8")) else spec(tensors)
        else:
            quantized[name] = reference[name] = w
    save_file(quantized, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(rdir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (rdir / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = quant_config(layout, opts)
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, rdir


# ---- each reader bit-equal to the spec -------------------------------------------------------

CASES = {
    "gptq-g128-sym": ("gptq", {}),
    "gptq-g128-asym-act-order": ("gptq", {"sym": False, "act_order": True}),
    "gptq-channel-sym-act-order": ("gptq", {"group": -1, "act_order": True}),
    "awq-g128": ("awq", {}),
    "fp8-block-128": ("fp8-block", {}),
    "fp8-block-128-static-activations": ("fp8-block", {"static": True}),
    "fp8-per-tensor-autofp8": ("fp8-tensor", {}),
    "ct-float-channel": ("ct-float", {"strategy": "channel"}),
    "ct-float-tensor": ("ct-float", {"strategy": "tensor"}),
    "ct-pack-g128-asym": ("ct-pack", {}),
    "ct-pack-channel-sym": ("ct-pack", {"strategy": "channel", "sym": True}),
    "ct-pack-8bit-g128-sym": ("ct-pack", {"bits": 8, "sym": True}),
    "ct-pack-g128-actorder-group": ("ct-pack", {"actorder": True}),
    "ct-naive-int8-channel-asym": ("ct-int8", {"sym": False}),
    "ct-int8-w8a8": ("ct-int8", {"w8a8": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reader_dequantizes_bit_equal_to_the_spec(make_ckpt, tmp_path, caplog, case):
    layout, opts = CASES[case]
    caplog.set_level(logging.INFO, logger="splitserve.engine.quant.reader")
    # 320 rows and 192 columns are not multiples of 128: FP8 blocks are partial there
    shape = dict(hidden_size=192, intermediate_size=320) if layout.startswith(("fp8", "ct-float")) \
        else dict(hidden_size=256, intermediate_size=384)
    qdir, rdir = quantize_checkpoint(make_ckpt("llama", **shape), tmp_path, layout, **opts)
    spec = quantization_from_config(json.loads((qdir / "config.json").read_text()))
    reference = load_file(str(rdir / "model.safetensors"))
    seen = 0
    for name, value in iter_quantized_weights(qdir, spec):
        if isinstance(value, QuantizedWeight):
            seen += 1
            got = value.dequantize()
            assert got.dtype == torch.float32 and torch.equal(got, reference[name]), name
            # act-order permutes the inputs when there are groups to sort them into
            want_perm = (opts.get("act_order") and opts.get("group") != -1) or opts.get("actorder", False)
            assert (value.input_perm is not None) == want_perm, name
        else:
            assert torch.equal(value, reference[name]), name
    assert seen == 2 * len(LINEARS)
    weight_only = [r.getMessage() for r in caplog.records if "weight-only" in r.getMessage()]
    assert len(weight_only) == 1 and f": {spec.describe()}, 14 quantized linears;" in weight_only[0]
    asks = {"fp8-block": f"fp8 {'static' if opts.get('static') else 'dynamic'}", "ct-int8": "int8 token",
            "fp8-tensor": "fp8 static"}
    if layout in asks and (layout != "ct-int8" or opts.get("w8a8")):
        assert f"the checkpoint's {asks[layout]} activation quantization is not applied" in weight_only[0]
    else:
        assert "not applied" not in weight_only[0]
