"""Multi-LoRA in the engine: greedy tokens under each of three PEFT adapters (and the base
model), interleaved in one batch at concurrency 8 with fewer slots than adapters, equal
transformers + PeftModel (float32) token for token; the same prompt under adapter B after
adapter A gets B's tokens (the prefix cache keys KV by adapter); bad adapters refused in one
line with nothing changed."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from splitserve.engine import LLM, LoRARequest, SamplingParams
from splitserve.engine.llm_engine import InvalidPromptError
from splitserve.engine.lora import LoRAAdapterError
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy

NEW_TOKENS = 12


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_three_adapters_and_base_interleaved_match_peft(base, adapters):
    # 2 slots for 3 adapters: admission waits for a slot, and slots are swapped (LRU) mid-run
    llm = LLM(str(base), num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    rng = random.Random(0)
    names = [*ADAPTERS, None]
    prompts, loras = [], []
    for i in range(8):  # lengths around the block size and the 64-token chunk
        prompts.append([rng.randrange(5, 1000) for _ in range(rng.choice((7, 16, 40, 90)))])
        name = names[i % 4]
        loras.append(None if name is None else LoRARequest(name, i + 1, str(adapters[name])))
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    seen = {}
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        want = peft_greedy(base, lora and adapters[lora.lora_name], prompt, NEW_TOKENS)
        assert out.token_ids == want, (lora and lora.lora_name, len(prompt))
        seen[lora and lora.lora_name] = (prompt, out.token_ids)
    assert llm.engine.loras.slots.num_loads >= 3  # the third adapter took a slot another had
    state = llm.engine.lora_state()  # what load reports and metrics read: 2 of 3 hold a slot, swaps counted
    assert sorted(n for n, *_ in state) == sorted(ADAPTERS) and sum(r for _, _, r, _ in state) == 2
    assert sum(loads for *_, loads in state) == llm.engine.loras.slots.num_loads
    # the adapters really change the tokens: each differs from the base on the same prompt
    for name in ADAPTERS:
        prompt, tokens = seen[name]
        assert tokens != peft_greedy(base, None, prompt, NEW_TOKENS), name
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_same_prompt_under_another_adapter_never_reuses_its_kv(base, adapters):
    llm = LLM(str(base), num_kv_blocks=64, enable_lora=True, max_loras=1)
    a, b = (LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(["all-r8", "mlp-r16"]))
    prompt = list(range(10, 58))  # 3 full blocks: cacheable
    first = llm.generate(prompt, greedy(), lora_request=a)[0]
    second = llm.generate(prompt, greedy(), lora_request=b)[0]
    assert second.num_cached_tokens == 0
    assert second.token_ids == peft_greedy(base, adapters["mlp-r16"], prompt, NEW_TOKENS)
    assert first.token_ids == peft_greedy(base, adapters["all-r8"], prompt, NEW_TOKENS)
    again = llm.generate(prompt, greedy(), lora_request=a)[0]  # its own prefix is still cached
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids  # the last block is recomputed
    base_run = llm.generate(prompt, greedy())[0]
    assert base_run.num_cached_tokens == 0 and base_run.token_ids == peft_greedy(base, None, prompt, NEW_TOKENS)


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_in_one_line_and_nothing_changes(base, adapters, make_ckpt, tmp_path):
    llm = LLM(str(base), num_kv_blocks=32, enable_lora=True, max_loras=1, max_lora_rank=8)
    llm.engine.loras.add("good", str(adapters["all-r8"]))
    other = make_ckpt("mistral")  # other shapes: head_dim 16, 8 heads
    no_weights = tmp_path / "no-weights"
    shutil.copytree(adapters["all-r8"], no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    cases = {
        "rank": (adapters["mlp-r16"], "has rank 16, above --max-lora-rank 8"),
        "wrong-base": (make_adapter(other, tmp_path / "mistral-lora", seed=4, r=4, alpha=8),
                       "does not fit this model"),
        "missing": (tmp_path / "nowhere", "is not a directory"),
        "no-weights": (no_weights, "no adapter_model.safetensors"),
        "dora": (_edit_config(adapters["all-r8"], tmp_path / "dora", use_dora=True), "DoRA"),
        "bias": (_edit_config(adapters["all-r8"], tmp_path / "bias", bias="all"), "bias='all'"),
        "saved": (_edit_config(adapters["all-r8"], tmp_path / "saved", modules_to_save=["lm_head"]),
                  "modules_to_save"),
    }
    for name, (path, why) in cases.items():
        with pytest.raises(LoRAAdapterError) as err:
            llm.engine.loras.add(name, str(path))
        assert why in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    assert list(llm.engine.loras.adapters) == ["good"]
    with pytest.raises(LoRAAdapterError, match="already loaded with other weights"):
        llm.engine.loras.add("good", str(adapters["qv-r4-rslora"]))
    with pytest.raises(InvalidPromptError, match="The model `nope` does not exist"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2, lora_name="nope"))
    assert not llm.engine.has_unfinished_requests()


def test_moe_experts_are_refused(make_ckpt, tmp_path):
    import torch
    from safetensors.torch import save_file

    moe = make_ckpt("mixtral")
    path = tmp_path / "experts"  # written by hand: PEFT targets transformers' fused 3-D experts differently
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["w1"]}))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.w1"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 128), f"{prefix}.lora_B.weight": torch.zeros(96, 4)},
              str(path / "adapter_model.safetensors"))
    llm = LLM(str(moe), num_kv_blocks=16, enable_lora=True)
    with pytest.raises(LoRAAdapterError, match="MoE experts are not supported"):
        llm.engine.loras.add("experts", str(path))


def test_lora_needs_enable_lora(base, adapters):
    llm = LLM(str(base), num_kv_blocks=16)
    with pytest.raises(LoRAAdapterError, match="enable_lora=True"):
        llm.generate([1, 2, 3], greedy(), lora_request=LoRARequest("a", 1, str(adapters["all-r8"])))
    with pytest.raises(InvalidPromptError, match="not enabled"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2, lora_name="a"))


def test_a_request_waiting_for_a_slot_does_not_hold_back_the_base_model(base, adapters):
    llm = LLM(str(base), num_kv_blocks=64, enable_lora=True, max_loras=1)
    engine = llm.engine
    for name in ("all-r8", "mlp-r16"):
        engine.loras.add(name, str(adapters[name]))
    engine.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, lora_name="all-r8"))
    engine.step()  # "a" holds the one slot
    engine.add_request("b", list(range(40, 60)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                     lora_name="mlp-r16"))
    engine.add_request("base", list(range(70, 90)), greedy(8))
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["a", "base"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["b"]  # its adapter needs the slot "a" holds
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done["b"] == peft_greedy(base, adapters["mlp-r16"], list(range(40, 60)), 8)
    assert done["base"] == peft_greedy(base, None, list(range(70, 90)), 8)
