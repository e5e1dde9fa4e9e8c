"""Tokens per expert (engine/expert_tokens.py, splitserve_moe_expert_tokens_total): every
MoE layer counts, on the device, exactly the experts its router chose for every token the
engine ran (checked against the router's own choices, captured by a hook); the host copies
them at most once per PUBLISH_INTERVAL_S; the worker's counter advances by the difference."""

from __future__ import annotations

import random

import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.expert_tokens import PUBLISH_INTERVAL_S
from splitserve.kernels.moe_reference import select_experts
from splitserve.metrics import Metrics, sync_expert_tokens

NEW_TOKENS = 6


def test_each_layer_counts_its_routers_choices(make_ckpt):
    path = make_ckpt("qwen3_moe")  # layer 1 dense (mlp_only_layers), top-3 of 8
    cfg = ModelConfig.from_dir(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, cfg.vocab_size) for _ in range(n)] for n in (9, 30)]
    with LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        counts = llm.engine.runner.expert_tokens
        assert counts.read() == tuple((layer, (0,) * 8) for layer in (0, 2))
        want = {0: torch.zeros(8, dtype=torch.int64), 2: torch.zeros(8, dtype=torch.int64)}

        def chosen(layer: int):
            def hook(_module, _inputs, logits) -> None:  # (returns None: the output stays)
                ids = select_experts(logits, 3, cfg.norm_topk_prob)[1]
                want[layer].add_(torch.bincount(ids.reshape(-1), minlength=8))
            return hook

        hooks = [llm.engine.runner.model.layers[layer].mlp.gate.register_forward_hook(chosen(layer)) for layer in want]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        for hook in hooks:
            hook.remove()
        got = counts.read()
        # every token the engine ran: the prompts, then each new token but the last, 3 experts each
        ran = sum(len(p) + NEW_TOKENS - 1 for p in prompts)
        assert [layer for layer, _ in got] == [0, 2]
        assert all(sum(per_expert) == 3 * ran for _, per_expert in got)
        assert got == tuple((layer, tuple(want[layer].tolist())) for layer in (0, 2))
        stats = llm.engine.stats()
        assert stats.expert_tokens == got  # (the first snapshot copies at once)


def test_the_host_copies_at_most_once_an_interval(make_ckpt):
    with LLM(str(make_ckpt("mixtral")), num_kv_blocks=64) as llm:
        counts = llm.engine.runner.expert_tokens
        first = counts.snapshot(now=100.0)
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert counts.snapshot(now=100.0 + PUBLISH_INTERVAL_S / 2) == first  # not copied again yet
        later = counts.snapshot(now=100.0 + PUBLISH_INTERVAL_S)
        assert later == counts.read() and sum(later[0][1]) == 2 * 5  # top-2 of 5 tokens run


def test_a_dense_model_counts_nothing(make_ckpt):
    with LLM(str(make_ckpt("llama")), num_kv_blocks=64) as llm:
        assert llm.engine.runner.expert_tokens.read() == () and llm.engine.stats().expert_tokens == ()


def test_the_counter_advances_by_the_difference():
    m = Metrics()
    sync_expert_tokens(m, "decode", "w1", ((0, (3, 0)), (2, (1, 5))))
    sync_expert_tokens(m, "decode", "w1", ((0, (4, 2)), (2, (1, 5))))

    def value(layer: str, expert: str) -> float:
        return m.registry.get_sample_value("splitserve_moe_expert_tokens_total", {
            "role": "decode", "worker": "w1", "layer": layer, "expert": expert})

    assert [value("0", "0"), value("0", "1"), value("2", "0"), value("2", "1")] == [4, 2, 1, 5]
