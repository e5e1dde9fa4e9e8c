"""Expert parallelism with each other feature the compatibility table lets it combine with:
over two gloo ranks with --enable-expert-parallel and the feature on, greedy tokens equal
one process's with the same feature on (whose own tokens its tests check against
transformers), and both features visibly engaged (rank 0 holds E/2 whole experts; the
feature did its part). The workload is the pairwise walk's (test_compatibility_pairs.py):
prompts that push a 100-token prefix out of a 12-block pool and bring it back, a prefix hit,
and a repetitive prompt the n-gram proposer drafts from."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from splitserve.engine import LLM, LoRARequest, SamplingParams
from splitserve.engine.kv_offload.block_file import HEADER
from splitserve.engine.models.quant_moe import QuantizedExperts
from splitserve.kvtransfer.sender import create_sender
from tests.engine.test_compatibility_pairs import (
    BS,
    GREEDY,
    ROUNDS,
    TIERS,
    mooncake_link,
    run_rounds,
)
from tests.engine.test_disaggregation_handoff import drain
from tests.engine.test_gguf_moe import write_qwen3moe_gguf
from tests.engine.test_kv_offload_tiers import block_nbytes
from tests.engine.test_quant_formats import quantize_checkpoint
from tests.engine.test_spec_decode_exact import NGRAM
from tests.helpers.lora_adapters import ADAPTERS, make_adapter
from tests.helpers.processes import join_child
from tests.kvtransfer.conftest import config_for

FEATURES = ["lora", "fp8-kv-cache", "ngram", "draft-model", "async-scheduling", "kv-offload-host", "kv-offload-disk",
            "quantized", "quantized-gguf"]


@pytest.fixture(scope="module")
def checkpoints(make_ckpt, tmp_path_factory):
    """A float Mixtral with an adapter on q/v (LoRA on an expert or the router is refused for
    every MoE family), an FP8 block-wise Qwen3-MoE (every expert projection quantized), and
    a Qwen3-MoE GGUF (its experts stacked, Q4_0 / Q8_0: each expert read as its own tensor)."""
    root = tmp_path_factory.mktemp("ep-features")
    mixtral = make_ckpt("mixtral")
    adapter = make_adapter(mixtral, root / "adapter", **ADAPTERS["qv-r4-rslora"])
    wide = make_ckpt("qwen3_moe", hidden_size=256, head_dim=64, moe_intermediate_size=256, intermediate_size=512)
    quantized, _ = quantize_checkpoint(wide, root / "quant", "fp8-block")
    gguf = root / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(make_ckpt("qwen3_moe", mlp_only_layers=[], moe_intermediate_size=96), gguf)
    return {"float": mixtral, "quantized": quantized, "quantized-gguf": gguf, "adapter": adapter}


def engine_kwargs(feature: str, model, tmp_path) -> dict:
    kw = dict(model=str(model), block_size=BS, max_num_batched_tokens=64,
              num_kv_blocks=12 if feature in TIERS else 64)
    nbytes = block_nbytes(model) if feature in TIERS else 0
    extra = {"lora": dict(enable_lora=True, max_lora_rank=16),
             "fp8-kv-cache": dict(kv_cache_dtype="fp8"),
             "ngram": dict(speculative_config=NGRAM),
             "draft-model": dict(speculative_config={"method": "draft_model", "model": str(model),
                                                     "num_speculative_tokens": 3}),
             "async-scheduling": dict(async_scheduling=True),
             "kv-offload-host": dict(kv_offload_bytes=64 * nbytes),
             "kv-offload-disk": dict(kv_offload_dir=str(tmp_path / "tier"), kv_offload_dir_bytes=64 * (nbytes + HEADER.size)),
             "quantized": {}, "quantized-gguf": {}, "mooncake": {}}[feature]
    return {**kw, **extra}


def assert_engaged(feature: str, llm: LLM, outs: list) -> None:
    engine = llm.engine
    prefix_again = outs[len(ROUNDS[0]) + len(ROUNDS[1]) + len(ROUNDS[2])]
    if feature == "lora":
        assert engine.loras.slots.num_loads >= 1
    if feature == "fp8-kv-cache":
        assert engine.runner.kv_pool.spec.dtype == torch.float8_e4m3fn
    if feature in ("ngram", "draft-model"):
        stats = engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    if feature == "async-scheduling":
        assert engine.stats().overlapped_steps > 0
    if feature in TIERS:
        tier = feature.removeprefix("kv-offload-")
        assert engine.offloader.stats().counters.loaded_blocks[tier] > 0
        assert prefix_again.num_cached_tokens >= 6 * BS  # PREFIX's 6 blocks, back from the tier
    if feature.startswith("quantized"):
        experts, cfg = engine.runner.model.layers[0].mlp.experts, engine.model_config
        assert isinstance(experts, QuantizedExperts)
        assert experts.w13[0].out_features == 2 * cfg.moe_intermediate_size  # each expert whole
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize("feature", FEATURES)
def test_ep2_with_a_feature_gives_one_process_tokens_with_it(checkpoints, tmp_path, feature):
    model = checkpoints[feature if feature.startswith("quantized") else "float"]
    lora = LoRARequest("qv", 1, str(checkpoints["adapter"])) if feature == "lora" else None
    with LLM(**engine_kwargs(feature, model, tmp_path / "one")) as llm:
        want = [o.token_ids for o in run_rounds(llm, lora)]
        if lora is not None:  # the adapter changes the tokens: comparing them shows it was applied
            assert want != [o.token_ids for o in run_rounds(llm, None)]
    with LLM(**engine_kwargs(feature, model, tmp_path / "ep"), tensor_parallel_size=2,
             enable_expert_parallel=True) as llm:
        outs = run_rounds(llm, lora)
        cfg, mlp = llm.engine.model_config, llm.engine.runner.model.layers[0].mlp
        held = len(mlp.experts.w13) if mlp.experts is not None else mlp.w13.shape[0]
        assert (held, mlp.local_experts) == (cfg.num_experts // 2, cfg.num_experts // 2)  # E/2 whole experts
        assert_engaged(feature, llm, outs)
    assert [o.token_ids for o in outs] == want
    assert GREEDY.max_tokens == 12 and all(len(t) == 12 for t in want)


def expert_parallel_prefill_side(path: str, conn) -> None:
    """A prefill engine at TP 2 with expert parallelism, in a process of its own (one TP group
    per process; test_tensor_parallel_kv.prefill_side's loop): for each (request id, prompt,
    receiver, skip_blocks, destination blocks) it prefills, pushes the KV over Mooncake and
    answers the first token."""
    first_only = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with LLM(path, block_size=BS, num_kv_blocks=64, max_num_batched_tokens=64, tensor_parallel_size=2,
             enable_expert_parallel=True) as p, create_sender("mooncake", config_for("mooncake")) as sender:
        pool = p.engine.share_kv_pool()
        conn.send(list(pool.spec.block_shape))
        while (job := conn.recv()) is not None:
            rid, prompt, address, skip, dest = job
            p.engine.add_request(rid, prompt, first_only, hold_kv=True)
            outs = []
            while p.engine.has_unfinished_requests():
                outs += p.engine.step()
            src, hashes = p.engine.held_blocks(rid, skip)
            sender.push(rid, address, pool, src, dest, hashes)
            p.engine.release_held(rid)
            conn.send(outs[-1].token_ids[0])


def test_ep2_prefill_and_decode_engines_hand_kv_over_mooncake(checkpoints, tmp_path):
    """Both engines at TP 2 with expert parallelism, as a prefill and a decode worker run them:
    every prompt prefilled in its own process, its KV pushed over Mooncake's tcp transport into
    each decode rank's pool shard, decoded there; the tokens are one process's."""
    model = checkpoints["float"]
    with LLM(**engine_kwargs("mooncake", model, tmp_path)) as llm:
        want = [o.token_ids for o in run_rounds(llm, None)]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=expert_parallel_prefill_side, args=(str(model), child))
    proc.start()
    try:
        decode = LLM(**engine_kwargs("mooncake", model, tmp_path), tensor_parallel_size=2, enable_expert_parallel=True)
        with decode:
            assert decode.engine.runner.model.layers[0].mlp.local_experts == 4  # 8 experts over 2 ranks
            assert conn.recv() == list(decode.engine.share_kv_pool().spec.block_shape)  # the prefill engine is up
            with mooncake_link(decode) as (receiver, _, metrics):
                outs = []
                for i, prompt in enumerate(p for r in ROUNDS for p in r):
                    rid = f"ep-handoff-{i}"
                    slot = decode.engine.reserve_remote_prefill(rid, prompt, GREEDY)
                    done = receiver.expect(rid, slot.block_ids, slot.block_hashes, lambda ids: None)
                    conn.send((rid, prompt, receiver.address, slot.skip_blocks, slot.block_ids))
                    first = conn.recv()
                    assert done.result(timeout=30).ok
                    decode.engine.complete_remote_prefill(rid, first, None)
                    outs.append(drain(decode.engine)[rid].token_ids)
                received = metrics.kv_transfer_bytes.labels(backend="mooncake", direction="received")._value.get()
                assert received > 0  # the KV really went over Mooncake
            conn.send(None)
    finally:
        join_child(proc)
    assert proc.exitcode == 0
    assert outs == want
