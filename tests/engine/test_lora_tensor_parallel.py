"""LoRA under tensor parallelism: each rank holds its part of every adapter, split as the
base weights are (lora_A replicated and lora_B split by output rows for q/k/v and gate/up;
lora_A split by input columns and lora_B replicated for o_proj and down_proj), so a tp=2
engine's greedy tokens under three adapters and the base model, mixed in one batch with
fewer slots than adapters, equal transformers + PeftModel (float32). Loads reach every
rank and are atomic (a rank that cannot read an adapter leaves it on no rank); an unloaded
adapter is refused as at tp=1, a request running under it finishes under it on every rank,
and its weights leave the ranks once no request holds it. Qwen2 (one KV head, replicated on
both ranks; q/k/v biases) under an adapter of every projection also equals PEFT.

One tp=2 engine for the module (each start spawns a rank process)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine import LLM, LoRARequest, SamplingParams
from splitserve.engine.llm_engine import InvalidPromptError
from splitserve.engine.lora import LoRAAdapterError
from splitserve.engine.lora import manager as lora_manager
from splitserve.engine.lora.ranks import load_verdict, plan_step
from splitserve.engine.lora.sharding import lora_split, rank_parts, whole_shapes
from splitserve.engine.parallel.state import TPState, tp
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy

NEW_TOKENS = 10


def test_replicated_kv_heads_and_qkv_biases_match_peft(make_ckpt, tmp_path):
    # (before the module's engine starts: one tensor-parallel engine per process)
    qwen2 = make_ckpt("qwen2")  # 1 KV head < 2 ranks: both ranks hold all of k/v's rows of lora_B
    adapter = make_adapter(qwen2, tmp_path / "qwen2-all", seed=5, r=8, alpha=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (20, 37)]
    with LLM(str(qwen2), num_kv_blocks=32, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate(prompts, greedy(), lora_request=[LoRARequest("all", 1, str(adapter)), None])
    assert outs[0].token_ids == peft_greedy(qwen2, adapter, prompts[0], NEW_TOKENS)
    assert outs[0].token_ids != peft_greedy(qwen2, None, prompts[0], NEW_TOKENS)  # the adapter matters
    assert outs[1].token_ids == peft_greedy(qwen2, None, prompts[1], NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(base, adapters):
    # "all-r8" loads at start (--lora-modules); the others at runtime
    with LLM(str(base), num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, tensor_parallel_size=2,
             enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules={"all-r8": str(adapters["all-r8"])}) as llm:
        yield llm


def greedy(n=NEW_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def truncated(adapter, path):
    shutil.copytree(adapter, path)
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def test_a_start_up_adapter_that_cannot_be_read_fails_the_start_and_ends_its_ranks(base, adapters, tmp_path):
    # (first in the module: one tensor-parallel engine per process, and the module's starts below)
    broken = truncated(adapters["all-r8"], tmp_path / "broken")
    with pytest.raises(LoRAAdapterError, match="^LoRA adapter 'broken': cannot read "):
        LLM(str(base), num_kv_blocks=16, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8,
            lora_modules={"broken": str(broken)})
    assert tp().size == 1  # the group is gone: another tensor-parallel engine can start in this process


def test_base_and_three_adapters_in_one_batch_match_peft(llm, base, adapters):
    engine = llm.engine
    assert engine.loras.rank_adapters() == [["all-r8"]]  # the start-up adapter reached rank 1
    # rank 0's slots hold its half of qkv's output rows and of down_proj's input columns
    cfg = ModelConfig.from_dir(base)
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2
    assert engine.loras.slots.b["layers.0.self_attn.qkv_proj"].shape[1] == qkv
    assert engine.loras.slots.a["layers.0.mlp.down_proj"].shape[2] == cfg.intermediate_size // 2
    rng = random.Random(1)
    names = [*ADAPTERS, None]
    prompts, loras = [], []
    for i in range(8):  # 2 slots for 3 adapters: admission waits, slots are swapped on both ranks
        prompts.append([rng.randrange(5, 1000) for _ in range(rng.choice((7, 16, 40, 90)))])
        name = names[i % 4]
        loras.append(None if name is None else LoRARequest(name, i + 1, str(adapters[name])))
    outs = llm.generate(prompts, greedy(), lora_request=loras)
    changed = set()
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        assert out.token_ids == peft_greedy(base, lora and adapters[lora.lora_name], prompt, NEW_TOKENS), \
            (lora and lora.lora_name, len(prompt))
        if lora is not None and out.token_ids != peft_greedy(base, None, prompt, NEW_TOKENS):
            changed.add(lora.lora_name)
    assert changed == set(ADAPTERS)  # every adapter changes the tokens of one of its prompts at least
    assert engine.loras.slots.num_loads >= 3
    assert engine.loras.rank_adapters() == [sorted(ADAPTERS)]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_runtime_load_and_unload_reach_every_rank(llm, base, adapters):
    engine, prompt = llm.engine, list(range(30, 70))
    assert engine.add_lora("late", str(adapters["mlp-r16"])) > 0
    assert "late" in engine.loras.rank_adapters()[0]
    engine.add_request("running", prompt, greedy(lora_name="late"))
    engine.step()
    assert engine.remove_lora("late")  # while a request runs under it
    with pytest.raises(InvalidPromptError, match="^The model `late` does not exist.$"):  # as tp=1 says it
        llm.generate(prompt, greedy(lora_name="late"))
    assert "late" in engine.loras.rank_adapters()[0]  # rank 1 keeps its weights for the running request
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done["running"] == peft_greedy(base, adapters["mlp-r16"], prompt, NEW_TOKENS)  # finished under it
    # rank 0's adapter object is gone (no request holds it): the query carries its forget to rank 1
    assert "late" not in engine.loras.rank_adapters()[0]
    assert llm.generate(prompt, greedy())[0].token_ids == peft_greedy(base, None, prompt, NEW_TOKENS)


def test_a_load_one_rank_cannot_read_is_kept_by_no_rank(llm, base, adapters, tmp_path, monkeypatch):
    engine = llm.engine
    broken = truncated(adapters["qv-r4-rslora"], tmp_path / "broken")
    # refused by rank 0 first: the ranks are not asked
    with pytest.raises(LoRAAdapterError, match="^LoRA adapter 'broken': cannot read .*adapter_model.safetensors"):
        engine.add_lora("broken", str(broken))
    # rank 0 reads a good copy, rank 1 the truncated file: the load is undone on every rank
    real = lora_manager.load_adapter
    monkeypatch.setattr(lora_manager, "load_adapter",
                        lambda name, path, *a: real(name, str(adapters["qv-r4-rslora"]), *a))
    with pytest.raises(LoRAAdapterError) as err:
        engine.add_lora("broken", str(broken))
    assert "cannot read" in str(err.value) and str(err.value).endswith("(tensor-parallel rank 1)")
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert "broken" not in engine.loras.adapters and all("broken" not in held for held in engine.loras.rank_adapters())
    with pytest.raises(InvalidPromptError, match="The model `broken` does not exist"):
        llm.generate([1, 2, 3], greedy(lora_name="broken"))
    # the name is free: a good load under it serves its tokens
    engine.add_lora("broken", str(adapters["qv-r4-rslora"]))
    prompt = list(range(100, 120))
    assert llm.generate(prompt, greedy(lora_name="broken"))[0].token_ids == \
        peft_greedy(base, adapters["qv-r4-rslora"], prompt, NEW_TOKENS)


# ---- the pure parts (no rank process) ------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: 1 KV head < 2 ranks, replicated
def test_each_ranks_parts_follow_the_base_weight_split(make_ckpt, family):
    cfg = ModelConfig.from_dir(make_ckpt(family))
    d, r = cfg.head_dim, 4
    torch.manual_seed(0)
    for proj, out, inp in [("self_attn.q_proj", cfg.num_heads * d, cfg.hidden_size),
                           ("self_attn.k_proj", cfg.num_kv_heads * d, cfg.hidden_size),
                           ("mlp.up_proj", cfg.intermediate_size, cfg.hidden_size),
                           ("self_attn.o_proj", cfg.hidden_size, cfg.num_heads * d),
                           ("mlp.down_proj", cfg.hidden_size, cfg.intermediate_size)]:
        a, b, x = torch.randn(r, inp), torch.randn(out, r), torch.randn(3, inp)
        splits = [lora_split(f"model.layers.1.{proj}", cfg, TPState(rank, 2)) for rank in range(2)]
        parts = [rank_parts(s, a, b) for s in splits]
        assert all(whole_shapes(s, (r, p[0].shape[1]), (p[1].shape[0], r)) == ((r, inp), (out, r))
                   for s, p in zip(splits, parts, strict=True)), proj
        whole = x @ a.T @ b.T
        if proj in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: the ranks' terms sum to the delta
            cols = [x[:, s.start:s.start + s.length] for s, _ in splits]
            total = sum(c @ pa.T @ pb.T for c, (pa, pb) in zip(cols, parts, strict=True))
            torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-4)  # (another summation order)
        else:  # column-parallel: each rank's output rows of the delta, exactly
            for (s, _), (pa, pb) in zip(splits, parts, strict=True):
                assert torch.equal(pa, a)
                assert torch.equal(x @ pa.T @ pb.T, (x @ a.T @ b[s.start:s.start + s.length].T))
    if family == "qwen2":  # both ranks hold the one KV head: all of k's rows
        assert [lora_split("model.layers.0.self_attn.k_proj", cfg, TPState(k, 2))[0].length for k in (0, 1)] == [d, d]
    assert lora_split("model.layers.0.self_attn.q_proj", cfg, TPState(0, 1)) is None


def test_load_verdict_and_step_plan():
    assert load_verdict("a", [(None, 5), (None, 5)]) is None
    assert load_verdict("a", [(None, 5), ("LoRA adapter 'a': bad", None)]) == \
        "LoRA adapter 'a': bad (tensor-parallel rank 1)"
    assert "files changed while the tensor-parallel ranks read them" in load_verdict("a", [(None, 5), (None, 6)])

    class Seq:
        def __init__(self, key):
            self.lora = None if key is None else type("A", (), {"key": key})()

    entries = [(Seq(("x", 1)), 3), (Seq(("x", 1)), 1), (Seq(None), 2), (Seq(("y", 2)), 1)]
    plan = plan_step(entries, {("x", 1): 1, ("y", 2): 0}, [("z", 3)])
    assert plan.runs == [(1, 4), (-1, 2), (0, 1)] and plan.slots == {1: ("x", 1), 0: ("y", 2)}
    assert plan.token_slots() == [1, 1, 1, 1, -1, -1, 0] and plan.forget == [("z", 3)]
