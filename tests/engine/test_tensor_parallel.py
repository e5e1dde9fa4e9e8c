"""Tensor parallelism (issue 32) on the CPU: `LLM(..., tensor_parallel_size=2)` runs two
rank processes over gloo and gives the same greedy tokens as one process, for every
family but Phi-3: dense models whose KV heads are split (llama, mistral, qwen3, gemma2: 2
KV heads) or replicated (qwen2, gemma3: 1 KV head < 2 ranks, tied embeddings), MoE models
(tensor-parallel expert slices), and quantized checkpoints, including a prefix-cache hit. Families and shapes that cannot be split are refused in one
line, before any rank process starts."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.async_engine import AsyncEngine, rank_health
from splitserve.engine.parallel.sharding import Shard, check_shardable, kv_heads, narrow, q_heads
from splitserve.engine.parallel.state import RankLost, TPState, tp
from splitserve.kernels.quant_weight import QuantizedWeight

NEW_TOKENS = 12
LENGTHS = (5, 23, 40)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in LENGTHS]


def generate(path, tp_size: int, **engine) -> tuple[list[list[int]], list[int], int]:
    """Greedy tokens of the prompts, then of a prompt sharing 32 tokens with the longest
    one (a prefix-cache hit), and that hit's cached token count."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=tp_size, **engine) as llm:
        cfg, runner = llm.engine.model_config, llm.engine.runner
        # rank 0 holds its slice only: half the q heads, its KV heads, half the vocabulary rows
        assert runner.model.layers[0].self_attn.num_heads == cfg.num_heads // tp_size
        assert runner.kv_pool.spec.num_kv_heads == max(1, cfg.num_kv_heads // tp_size)
        assert runner.model.embed_tokens.num_embeddings == -(-cfg.vocab_size // tp_size)
        ps = prompts(cfg.vocab_size)
        outs = [o.token_ids for o in llm.generate(ps, params)]
        again = ps[2][:32] + [7, 8, 9]
        hit = llm.generate([again], params)[0]
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert tp().size == 1  # the group is gone
    return outs, hit.token_ids, hit.num_cached_tokens


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "mixtral"])
def test_tp2_greedy_tokens_equal_tp1(make_ckpt, family):
    path = make_ckpt(family)
    cfg = ModelConfig.from_dir(path)
    assert cfg.num_kv_heads < cfg.num_heads  # GQA in every case; qwen2 and mixtral: 1 KV head < 2 ranks
    one = generate(path, 1)
    two = generate(path, 2)
    assert two[2] >= 32, two[2]  # the prefix cache hit at TP=2
    assert two == one


def test_tp2_over_an_fp8_kv_cache_equals_tp1(make_ckpt):
    path = make_ckpt("qwen2")  # one KV head, replicated: both ranks write the same fp8 codes
    assert generate(path, 2, kv_cache_dtype="fp8") == generate(path, 1, kv_cache_dtype="fp8")


@pytest.mark.parametrize("layout,opts", [("gptq", {}), ("awq", {}), ("fp8-block", {})])
def test_tp2_quantized_checkpoint_equals_tp1(make_ckpt, tmp_path, layout, opts):
    """Quantized q/k/v, gate/up split by rows, o_proj and down_proj by whole groups of 128
    input columns (hidden 256 and intermediate 512 give each rank 128 and 256)."""
    from tests.engine.test_quant_formats import quantize_checkpoint

    qdir, _ = quantize_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=512), tmp_path, layout, **opts)
    assert generate(qdir, 2) == generate(qdir, 1)


def test_a_quantized_split_inside_a_group_is_refused(make_ckpt, tmp_path):
    from tests.engine.test_quant_formats import quantize_checkpoint

    qdir, _ = quantize_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=384), tmp_path, "gptq")
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight: its input columns 0:192 do not "
                                              r"fall on the quantization groups \(128 columns\), so it cannot be split"):
        LLM(str(qdir), num_kv_blocks=8, tensor_parallel_size=2)
    assert tp().size == 1


def test_a_dead_rank_fails_the_next_step_at_once(make_ckpt):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(make_ckpt("llama")), num_kv_blocks=16, tensor_parallel_size=2) as llm:
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        rank1 = llm.engine.executor.group.procs[0]
        rank1.kill()
        rank1.join()
        # found before the step: its broadcast to the dead rank could block (gloo only sends)
        with pytest.raises(RankLost, match=rf"^tensor parallelism: a rank process is gone \(pid {rank1.pid}, "
                                           r"splitserve-tp-rank1, exit code -9\)$"):
            llm.generate([[5, 6, 7, 8]], params)
    assert tp().size == 1 and not rank1.is_alive()


def test_a_frozen_rank_is_silent_until_it_thaws_and_the_step_it_held_then_completes(make_ckpt):
    """SIGSTOP: the rank lives (lost_rank says nothing) and rank 0 waits for it in the step's
    collective; its heartbeat stops, which the worker judges (rank_health). After SIGCONT the
    step completes with the tokens it would have had."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(make_ckpt("llama")), num_kv_blocks=16, tensor_parallel_size=2) as llm:
        group = llm.engine.executor.group
        want = llm.generate([[5, 6, 7]], params)[0].token_ids
        pid = group.procs[0].pid
        silent_s, who = group.silence()
        assert silent_s < 5.0 and who == f"tensor-parallel rank 1 (pid {pid})"  # (beats every 0.25 s)
        assert rank_health(group.silence(), 5.0) == (True, "")
        got: list = []
        os.kill(pid, signal.SIGSTOP)
        try:
            held = threading.Thread(target=lambda: got.append(llm.generate([[5, 6, 7]], params)[0].token_ids))
            held.start()
            deadline = time.monotonic() + 30
            while group.silence()[0] < 1.5 and time.monotonic() < deadline:
                time.sleep(0.05)
            ok, why = rank_health(group.silence(), 1.0)
            assert not ok and why.startswith(f"tensor-parallel rank 1 (pid {pid}) has not answered a heartbeat"), why
            assert held.is_alive() and group.lost_rank() is None  # waiting for it, not given up
        finally:
            os.kill(pid, signal.SIGCONT)
        held.join(timeout=60)
        assert got == [want]
        assert group.silence()[0] < 5.0
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
        # an engine on a thread (a CUDA worker's) judges the silence in its own health()
        loop = asyncio.new_event_loop()
        engine = AsyncEngine(llm.engine, loop, lambda outputs: None, heartbeat_timeout_s=1.0)
        engine.start()
        try:
            os.kill(pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 30
                while engine.health()[0] and time.monotonic() < deadline:
                    time.sleep(0.05)
                ok, why = engine.health()
                assert not ok and f"tensor-parallel rank 1 (pid {pid}) has not answered" in why, why
            finally:
                os.kill(pid, signal.SIGCONT)
            while not engine.health()[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.health() == (True, "")
        finally:
            engine.stop()
            loop.close()
    assert tp().size == 1


def test_each_rank_reads_only_its_part_of_each_checkpoint_tensor(make_ckpt):
    """iter_weights with a shard_of reads through safetensors slices: the parts are the full
    tensors' rows or columns (vocabulary rows padded with zeros on the last rank)."""
    from splitserve.engine.checkpoint import iter_weights
    from splitserve.engine.parallel.sharding import checkpoint_shard

    path = make_ckpt("llama")
    cfg = ModelConfig.from_dir(path)
    full = dict(iter_weights(path))
    for rank in (0, 1):
        t = TPState(rank, 2)
        parts = dict(iter_weights(path, lambda name, t=t: checkpoint_shard(name, cfg, t)))
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            shard = checkpoint_shard(name, cfg, t)
            assert torch.equal(parts[name], narrow(full[name], shard, name)), (rank, name)
        assert torch.equal(parts["model.norm.weight"], full["model.norm.weight"])  # replicated
    # the vocabulary (1021 rows) splits 511 + 510, the second rank padded to 511 with a zero row
    assert parts["model.embed_tokens.weight"].shape[0] == 511 and not parts["model.embed_tokens.weight"][-1].any()
    assert torch.equal(parts["model.embed_tokens.weight"][:510], full["model.embed_tokens.weight"][511:])


def test_kv_heads_split_or_replicated():
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
                                 "num_key_value_heads": 2})
    assert [kv_heads(cfg, TPState(r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    # 4 ranks over 2 KV heads: ranks 0-1 keep head 0, ranks 2-3 head 1 (their q heads 0-3, 4-7 read them)
    assert [kv_heads(cfg, TPState(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [q_heads(cfg, TPState(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]


@pytest.mark.parametrize("fields,size,why", [
    ({"architectures": ["Phi3ForCausalLM"]}, 2, "its checkpoint stores q/k/v and gate/up fused in one tensor"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, r"num_attention_heads \(6\) is not divisible by it"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2,
     r"num_key_value_heads \(3\) neither divides it nor is divisible by it"),
    ({"intermediate_size": 66}, 4, r"intermediate_size \(66\) is not divisible by it"),
])
def test_unshardable_models_are_refused_in_one_line(fields, size, why):
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, **fields}
    cfg = ModelConfig.from_dict(raw)
    with pytest.raises(CheckpointError, match=rf"^m: \w+ cannot run with tensor_parallel_size={size}: {why}"):
        check_shardable(cfg, size, "m")


def test_a_refused_family_starts_no_rank(make_ckpt):
    with pytest.raises(CheckpointError, match=r"Phi3ForCausalLM cannot run with tensor_parallel_size=2: its "
                                              r"checkpoint stores q/k/v and gate/up fused"):
        LLM(str(make_ckpt("phi3")), num_kv_blocks=8, tensor_parallel_size=2)
    assert tp().size == 1


def quantized(out_features: int, in_features: int, group: int, bits: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(0)
    cols = in_features // 2 if bits == 4 else in_features
    codes = torch.randint(0, 256, (out_features, cols), generator=g, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // group, generator=g)
    offsets = torch.rand(out_features, in_features // group, generator=g)
    return QuantizedWeight(codes, scales, offsets, bits, group, in_features, out_features)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_weight_splits_exactly_by_rows_and_by_whole_groups(bits):
    w = quantized(8, 64, 16, bits)
    full = w.dequantize()
    assert torch.equal(narrow(w, Shard(0, 4, 4), "t").dequantize(), full[4:8])
    assert torch.equal(narrow(w, Shard(1, 32, 32), "t").dequantize(), full[:, 32:64])
    with pytest.raises(CheckpointError, match=r"^t: its input columns 8:40 do not fall on the quantization "
                                              r"groups \(16 columns\), so it cannot be split across ranks$"):
        narrow(w, Shard(1, 8, 32), "t")
