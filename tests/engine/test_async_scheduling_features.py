"""Async scheduling (engine/overlap.py) with LoRA adapters and with n-gram or draft-model speculation: greedy
float32 tokens equal transformers (+ PEFT for an adapter) token for token, and equal the
synchronous engine's (seeded sampling too), while overlapped steps really run: mixed
base/adapter decode steps launched ahead, and plain decode steps overlapped in the same engine
whose other steps draft (drafts proposed and accepted). Steps that cannot overlap (a slot swap,
a sequence whose tail recurs: it may draft) drain first and run ordinarily."""

from __future__ import annotations

import random

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from tests.helpers.lora_adapters import ADAPTERS, peft_greedy


def _random(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 900) for _ in range(n)]


def _copy_heavy(seed: int, length: int = 12, times: int = 3) -> list[int]:
    run = _random(seed, length)
    return run * times + run[: length // 2]


def _greedy(n: int, lora: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora_name=lora)


def _run(ckpt, requests: dict, async_scheduling: bool, **config) -> tuple[dict, LLMEngine, list[list]]:
    """Each request's tokens (and finish reason); the adapters of every overlapped step."""
    engine = LLMEngine(EngineConfig(model=str(ckpt), async_scheduling=async_scheduling, **config))
    launched: list[list] = []
    if engine.overlap is not None:
        launch = engine.overlap._launch

        def recording(seqs, *plan, launch=launch):
            launched.append([s.lora.name if s.lora is not None else None for s in seqs])
            return launch(seqs, *plan)

        engine.overlap._launch = recording
    got = {rid: {"tokens": [], "reason": None} for rid in requests}
    for step in range(400):
        for rid, (at, prompt, params) in requests.items():
            if at == step:
                engine.add_request(rid, prompt, params)
        if not engine.has_unfinished_requests() and all(at < step for at, _, _ in requests.values()):
            break
        for out in engine.step():
            got[out.request_id]["tokens"] += out.new_token_ids
            got[out.request_id]["reason"] = out.finish_reason if out.finished else None
    if engine.overlap is not None:
        engine.step()  # a step still in flight is drained
    assert engine.num_free_blocks == engine.num_total_blocks and not engine.sequences
    engine.close()  # (tensor parallelism: its rank processes end)
    return got, engine, launched


def test_lora_mixed_batches_overlap_and_equal_peft(base, adapters):
    """Base and three adapters in one batch, two slots (a third adapter waits, then swaps in:
    that step drains), staggered arrivals and finishes."""
    names = [*ADAPTERS, None]
    plan = [(0, "all-r8", 30), (0, None, 26), (0, "mlp-r16", 14), (0, None, 12), (2, "qv-r4-rslora", 16),
            (6, "all-r8", 10)]  # (arrival step, adapter, new tokens)
    requests = {f"r{i}": (at, _random(10 + i, 9 + 5 * i), _greedy(n, lora)) for i, (at, lora, n) in enumerate(plan)}
    config = dict(num_kv_blocks=96, enable_lora=True, max_loras=2, max_lora_rank=16,
                  lora_modules={name: str(path) for name, path in adapters.items()})
    overlapped, engine, launched = _run(base, requests, True, **config)
    for rid, (_, prompt, params) in requests.items():
        adapter = adapters[params.lora_name] if params.lora_name else None
        assert overlapped[rid]["tokens"] == peft_greedy(base, adapter, prompt, params.max_tokens), rid
        assert overlapped[rid]["reason"] == "length"
    sync, _, _ = _run(base, requests, False, **config)
    assert overlapped == sync
    assert engine.overlap.steps == len(launched) >= 15
    mixed = [step for step in launched if None in step and len(set(step)) >= 3]  # base and two adapters
    assert len(mixed) >= 3, launched
    assert {name for step in launched for name in step} == set(names)  # every adapter ran overlapped
    assert engine.loras.slots.num_loads >= 3  # the third adapter swapped in (in an ordinary step)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def test_ngram_drafts_in_ordinary_steps_and_plain_steps_overlap(base):
    """Copy-heavy prompts draft (their tails recur); random ones mostly do not, and their
    decode steps overlap once the copy-heavy requests have finished or stop recurring."""
    requests = {
        "copy1": (0, _copy_heavy(1), _greedy(14)),
        "rand1": (0, _random(2, 30), _greedy(40)),
        "copy2": (3, _copy_heavy(3, 10, 4), _greedy(12)),
        "rand2": (1, _random(4, 11), _greedy(36)),
        "late": (30, _random(5, 17), _greedy(20)),
    }
    config = dict(num_kv_blocks=96, speculative_config=NGRAM)
    overlapped, engine, launched = _run(base, requests, True, **config)
    for rid, (_, prompt, params) in requests.items():
        assert overlapped[rid]["tokens"] == peft_greedy(base, None, prompt, params.max_tokens), rid
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # speculation ran, and helped
    assert engine.overlap.steps == len(launched) >= 10  # and so did overlapped steps
    sync, sync_engine, _ = _run(base, requests, False, **config)
    assert overlapped == sync and sync_engine.overlap is None


def test_ngram_seeded_sampling_equals_the_synchronous_engine(base):
    """Sampled drafts are verified with the request's generator, one draw per token, so a
    seeded request gives the same tokens overlapped or not."""
    sampled = dict(temperature=0.8, top_k=40, ignore_eos=True)
    requests = {
        "a": (0, _copy_heavy(7), SamplingParams(max_tokens=24, seed=1, **sampled)),
        "b": (0, _random(8, 20), SamplingParams(max_tokens=30, seed=2, **sampled)),
        "c": (2, _random(9, 13), _greedy(18)),
    }
    config = dict(num_kv_blocks=96, speculative_config=NGRAM)
    overlapped, engine, _ = _run(base, requests, True, **config)
    sync, _, _ = _run(base, requests, False, **config)
    assert overlapped == sync
    assert engine.overlap.steps > 0 and engine.speculator.stats.num_draft_tokens > 0


def test_lora_and_ngram_together(base, adapters):
    requests = {
        "base": (0, _copy_heavy(11), _greedy(16)),
        "adapted": (0, _random(12, 21), _greedy(24, "all-r8")),
        "other": (2, _copy_heavy(13, 9, 3), _greedy(14, "mlp-r16")),
    }
    config = dict(num_kv_blocks=96, enable_lora=True, max_loras=2, speculative_config=NGRAM,
                  lora_modules={name: str(adapters[name]) for name in ("all-r8", "mlp-r16")})
    overlapped, engine, launched = _run(base, requests, True, **config)
    for rid, (_, prompt, params) in requests.items():
        adapter = adapters[params.lora_name] if params.lora_name else None
        assert overlapped[rid]["tokens"] == peft_greedy(base, adapter, prompt, params.max_tokens), rid
    assert engine.overlap.steps > 0 and engine.speculator.stats.num_draft_tokens > 0
    assert any(name is not None for step in launched for name in step)


def test_a_draft_model_drafts_at_low_batch_and_steps_overlap_above_disable_by_batch_size(base):
    """A draft model always proposes, so a step that may draft never overlaps; past
    disable_by_batch_size nothing drafts and decode steps overlap. The draft model catches up
    on the tokens of overlapped steps in one chunk. Greedy equals transformers, and seeded
    sampling the synchronous engine."""
    draft = {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    requests = {
        "a": (0, _copy_heavy(21), _greedy(40)),
        "b": (0, _random(22, 15), _greedy(14)),
        "c": (0, _random(23, 9), SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=12, ignore_eos=True)),
        "d": (1, _random(24, 12), _greedy(10)),
    }
    config = dict(num_kv_blocks=96, speculative_config=draft)
    overlapped, engine, launched = _run(base, requests, True, **config)
    for rid in "abd":
        _, prompt, params = requests[rid]
        assert overlapped[rid]["tokens"] == peft_greedy(base, None, prompt, params.max_tokens), rid
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and engine.overlap.steps == len(launched) >= 5
    assert any(len(step) == 4 for step in launched)  # the four decode overlapped, drafting off
    sync, _, _ = _run(base, requests, False, **config)
    assert overlapped == sync


def test_tensor_parallel_overlapped_steps_with_adapters_equal_peft(base, adapters):
    """tp=2: each overlapped step's staged inputs, LoRA plan and the previous step's tokens
    reach rank 1 (parallel/padded_decode.py), which runs the same padded step on its slices;
    ordinary steps (prefills, a swap) in between take the broadcast eager path."""
    plan = [(0, "all-r8", 20), (0, None, 16), (0, "qv-r4-rslora", 12), (3, "mlp-r16", 10), (4, None, 9)]
    requests = {f"t{i}": (at, _random(40 + i, 8 + 6 * i), _greedy(n, lora)) for i, (at, lora, n) in enumerate(plan)}
    config = dict(num_kv_blocks=64, tensor_parallel_size=2, enable_lora=True, max_loras=2,
                  lora_modules={name: str(path) for name, path in adapters.items()})
    got, engine, launched = _run(base, requests, True, **config)
    for rid, (_, prompt, params) in requests.items():
        adapter = adapters[params.lora_name] if params.lora_name else None
        assert got[rid]["tokens"] == peft_greedy(base, adapter, prompt, params.max_tokens), rid
    assert engine.overlap.steps == len(launched) >= 8
    assert any(None in step and len(set(step)) >= 2 for step in launched)  # base and adapter rows, overlapped
