"""`--kv-cache-dtype fp8` through the engine: the flag and its names, twice the tokens of
bf16 in the same KV memory, greedy output against a float KV cache on a random-weight model,
the prefix cache and a prefill -> decode handoff over fp8 blocks, and the checkpoint's own
per-layer scales."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_config import CheckpointError
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.args import add_engine_args, engine_config_from_args
from splitserve.engine.config import EngineConfig
from splitserve.kernels import ops, reference

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(10, 60))] for _ in range(n)]


def parse(*argv):
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    return ap.parse_args(list(argv))


def test_the_flag_takes_vllms_names():
    for name, dtype in [("auto", torch.bfloat16), ("fp8", FP8), ("fp8_e4m3", FP8)]:
        cfg = engine_config_from_args(parse("--dtype", "bfloat16", "--kv-cache-dtype", name), "m", "m")
        assert cfg.kv_torch_dtype == dtype
    assert engine_config_from_args(parse(), "m", "m").kv_torch_dtype == torch.float32  # auto: the model's
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of \\['auto', 'fp8', 'fp8_e4m3'\\], got 'fp8_e5m2'"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


def test_fp8_holds_twice_the_tokens_of_bf16_in_the_same_memory(make_ckpt):
    path = str(make_ckpt("llama"))
    budget = 3 * 2**20
    engines = {kv: LLM(path, dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=kv).engine
               for kv in ("auto", "fp8")}
    f32 = LLM(path, kv_cache_memory_bytes=budget).engine
    pools = {kv: e.runner.kv_pool for kv, e in engines.items()}
    assert pools["auto"].data.dtype == torch.bfloat16 and pools["fp8"].data.dtype == FP8
    assert pools["fp8"].spec.block_nbytes * 2 == pools["auto"].spec.block_nbytes
    assert engines["fp8"].num_total_blocks == 2 * engines["auto"].num_total_blocks == 4 * f32.num_total_blocks
    assert pools["fp8"].capacity_tokens == 2 * pools["auto"].capacity_tokens
    assert pools["fp8"].nbytes <= budget + pools["fp8"].spec.block_nbytes  # + the scratch block


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_greedy_output_with_fp8_kv_against_float_kv(make_ckpt):
    """Random weights have near-tied logits, so e4m3's 3 mantissa bits flip some argmaxes
    after a while (docs/benchmarks.md: on this model 2 of 8 outputs are identical over 32
    tokens, a mean common prefix of 15.9). What must hold: every first token (the prefill's
    own logits) equal and a mean common prefix of at least a quarter of the output."""
    path = str(make_ckpt("llama"))
    ps = prompts()
    want = LLM(path, num_kv_blocks=128).generate(ps, GREEDY)
    got = LLM(path, num_kv_blocks=128, kv_cache_dtype="fp8").generate(ps, GREEDY)
    prefixes = [common_prefix(w.token_ids, g.token_ids) for w, g in zip(want, got, strict=True)]
    assert min(prefixes) >= 1, prefixes
    assert sum(prefixes) / len(prefixes) >= 8, prefixes


def test_native_and_reference_kernels_give_the_same_tokens_over_fp8(make_ckpt):
    """The same fp8 codes are written and read by both paths; only summation order differs."""
    path = str(make_ckpt("llama"))
    ps = prompts(4, seed=1)
    native = LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8").generate(ps, GREEDY)
    ops.set_backend("reference")
    try:
        ref = LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8").generate(ps, GREEDY)
    finally:
        ops.set_backend(None)
    assert [o.token_ids for o in native] == [o.token_ids for o in ref]


def test_a_prefix_cache_hit_reads_the_same_fp8_blocks(make_ckpt):
    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=64, kv_cache_dtype="fp8")
    prompt = prompts(1, seed=2)[0] + list(range(100, 140))
    first = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32
    assert again.token_ids == first.token_ids


def test_prefill_here_decode_there_over_fp8_blocks(make_ckpt):
    """A prefill engine's fp8 blocks, moved byte for byte, decode as one engine would."""
    from tests.engine.test_disaggregation_handoff import drain, handoff

    path = str(make_ckpt("llama"))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = prompts(1, seed=3)[0] + list(range(200, 230))
    single = LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8").generate(prompt, params)[0]
    prefill, decode = (LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8").engine for _ in range(2))
    assert decode.runner.kv_pool.data.dtype == FP8
    handoff(prefill, decode, "r", prompt, params)
    assert drain(decode)["r"].token_ids == single.token_ids


def with_kv_scales(src, dst, scales: dict[str, torch.Tensor]):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(dst / "model.safetensors"))
    save_file({**weights, **scales}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_checkpoints_kv_scales_are_used_with_fp8_and_ignored_otherwise(make_ckpt, tmp_path):
    src = make_ckpt("llama")
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
              "model.layers.0.self_attn.v_scale": torch.tensor(0.02),
              "model.layers.1.self_attn.kv_scale": torch.tensor([0.5])}
    path = str(with_kv_scales(src, tmp_path / "scaled", scales))
    fp8 = LLM(path, num_kv_blocks=16, kv_cache_dtype="fp8").engine.runner.model
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in fp8.layers] == [
        (pytest.approx(0.05), pytest.approx(0.02)), (0.5, 0.5)]
    auto = LLM(path, num_kv_blocks=16).engine.runner.model  # a float cache stores values, not codes
    assert [(a.self_attn.k_scale, a.self_attn.v_scale) for a in auto.layers] == [(1.0, 1.0), (1.0, 1.0)]
    # the scaled codes: what layer 0 wrote is x / 0.05 in e4m3
    llm = LLM(path, num_kv_blocks=16, kv_cache_dtype="fp8")
    llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.runner.kv_pool.data[:, 0].float().abs().max() > 20  # raw values are ~1; codes / 0.05


def test_a_lone_or_malformed_kv_scale_is_one_clear_error(make_ckpt, tmp_path):
    src = make_ckpt("llama")
    lone = with_kv_scales(src, tmp_path / "lone", {"model.layers.0.self_attn.k_scale": torch.tensor(0.1)})
    with pytest.raises(CheckpointError, match=r"K or V alone in layers \[0\]"):
        LLM(str(lone), num_kv_blocks=16, kv_cache_dtype="fp8")
    bad = with_kv_scales(src, tmp_path / "bad", {"model.layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0]),
                                                  "model.layers.0.self_attn.v_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_scale' must be one positive number"):
        LLM(str(bad), num_kv_blocks=16, kv_cache_dtype="fp8")


def test_store_through_the_engines_op_matches_the_reference_write():
    """ops.store_kv (the reference path the Triton wrapper shares) quantises as documented."""
    x = torch.randn(3, 2, 8) * 100
    k_cache = torch.zeros(2, 4, 2, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    reference.store_kv(x, x, k_cache, v_cache, torch.tensor([0, 5, 6]), 2.0, 0.5)
    assert torch.equal(k_cache.view(8, 2, 8)[[0, 5, 6]].view(torch.uint8), x.div(2.0).to(FP8).view(torch.uint8))
    assert torch.equal(v_cache.view(8, 2, 8)[[0, 5, 6]].view(torch.uint8), x.div(0.5).to(FP8).view(torch.uint8))
