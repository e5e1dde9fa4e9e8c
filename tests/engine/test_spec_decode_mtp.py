"""The "mtp" method: the checkpoint's own multi-token-prediction layer drafts (engine/spec/mtp.py).

transformers does not build MTP layers, so the tiny checkpoints are made here: transformers
saves a DeepSeek-V3 / GLM-4.5 of L + 1 layers, layer L gains the MTP tensors (enorm, hnorm,
eh_proj, shared_head.*) and config.json says num_hidden_layers = L, num_nextn_predict_layers
= 1. Two kinds: a random MTP layer (it rarely agrees with the model: drafts mostly rejected,
outputs still exact) and one that reproduces the model (L = 1, the MTP layer a copy of layer 0
reading only the next token's embedding, which has RMS 1, and the model's norm and head: it
predicts what the model will say one position later, so most drafts are kept).

Greedy tokens over 40 new tokens equal transformers float32 and the engine without
speculation; seeded sampled requests give the tokens of sampling without speculation; a
prefix-cache hit and a decode engine after a remote prefill (windows that start late) stay
exact; every block of the MTP pool comes back; config refusals are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_dir import checkpoint_problem
from splitserve.core.speculative import SpeculativeConfigError
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from tests.engine.test_deepseek_v3 import NEW_TOKENS, prompts, write_deepseek_v3
from tests.engine.test_disaggregation_handoff import drain, handoff
from tests.engine.test_glm4_moe import write_glm4_moe
from tests.helpers.reference import hf_greedy

WRITERS = {"deepseek_v3": write_deepseek_v3, "glm4_moe": write_glm4_moe}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def write_mtp_checkpoint(out: Path, family: str, reproduces: bool = False, seed: int = 0) -> Path:
    """A tiny checkpoint of `family` with one MTP layer (see the module's docstring)."""
    layers = 1 if reproduces else 2
    # (reproducing: every layer MoE, so that layer 0 and the MTP layer are of one kind)
    WRITERS[family](out, seed=seed, num_hidden_layers=layers + 1, **({"first_k_dense_replace": 0} if reproduces else {}))
    weights = load_file(out / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    mtp = f"model.layers.{layers}."
    gen = torch.Generator().manual_seed(seed + 1)
    if reproduces:
        embed = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()  # enorm ~ identity
        for name in [n for n in weights if n.startswith("model.layers.0.")]:
            weights[mtp + name.removeprefix("model.layers.0.")] = weights[name].clone()
        extra = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                 "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
                 "shared_head.norm.weight": weights["model.norm.weight"].clone(),
                 "shared_head.head.weight": weights["lm_head.weight"].clone()}
    else:
        vocab = weights["lm_head.weight"].shape[0]
        extra = {"enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                 "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                 "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=gen),
                 "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
                 "shared_head.head.weight": 0.08 * torch.randn(vocab, hidden, generator=gen)}
    weights |= {mtp + name: t.contiguous() for name, t in extra.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers,
                                                 "num_nextn_predict_layers": 1}))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, kind) -> directory, made on first use."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, kind: str) -> str:
        if (family, kind) not in made:
            made[family, kind] = write_mtp_checkpoint(tmp_path_factory.mktemp(f"{family}-{kind}"), family,
                                                      reproduces=kind == "reproducing")
        return str(made[family, kind])
    return get


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(ckpt: str, speculative: dict | None = MTP, **kw) -> LLM:
    return LLM(ckpt, num_kv_blocks=64, speculative_config=speculative, **kw)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_random_mtp_layer_drafts_and_greedy_tokens_equal_transformers_and_no_speculation(checkpoints, family):
    ckpt = checkpoints(family, "random")
    spec = engine(ckpt)
    ps = prompts(spec.engine.model_config.vocab_size)
    got = [o.token_ids for o in spec.generate(ps, GREEDY)]
    assert got == [o.token_ids for o in engine(ckpt, None).generate(ps, GREEDY)]
    assert got == [hf_greedy(ckpt, p, NEW_TOKENS) for p in ps]
    stats = spec.engine.speculator.stats
    # it drafted at nearly every step (2 prompts, 40 tokens: fewer drafts near max_tokens)
    assert stats.num_drafts > 60 and stats.num_draft_tokens > 2.8 * stats.num_drafts
    drafter = spec.engine.speculator.draft
    drafter.release_finished()
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and spec.engine.num_free_blocks == 64


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_an_mtp_layer_that_reproduces_the_model_gets_most_drafts_kept(checkpoints, family):
    ckpt = checkpoints(family, "reproducing")
    spec = engine(ckpt)
    ps = prompts(spec.engine.model_config.vocab_size)
    got = [o.token_ids for o in spec.generate(ps, GREEDY)]
    assert got == [hf_greedy(ckpt, p, NEW_TOKENS) for p in ps]
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, vars(stats)
    assert stats.mean_accepted_length > 2.0  # tokens per verified step
    # the random layer of the other fixture, for contrast: the same prompts keep far fewer
    random_spec = engine(checkpoints(family, "random"))
    random_spec.generate(ps, GREEDY)
    rs = random_spec.engine.speculator.stats
    assert rs.num_accepted_tokens < 0.5 * rs.num_draft_tokens


def test_seeded_sampling_gives_the_tokens_of_sampling_without_speculation(checkpoints):
    ckpt = checkpoints("deepseek_v3", "reproducing")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    spec = engine(ckpt)
    ps = prompts(spec.engine.model_config.vocab_size)
    assert [o.token_ids for o in spec.generate(ps, params)] == \
        [o.token_ids for o in engine(ckpt, None).generate(ps, params)]
    assert spec.engine.speculator.stats.num_accepted_tokens > 0


def test_a_prefix_hit_and_a_remote_prefill_start_the_window_late_and_stay_exact(checkpoints):
    """Positions the engine did not compute have no hidden states: the MTP rows start after
    them (a prefix-cache hit; a decode engine whose prompt KV came from a prefill engine)."""
    ckpt = checkpoints("glm4_moe", "reproducing")
    spec = engine(ckpt)
    ps = prompts(spec.engine.model_config.vocab_size)
    long = ps[1]
    spec.generate([long], GREEDY)
    hit = long[:40] + [7, 8, 9]  # two cached blocks
    before = spec.engine.speculator.stats.snapshot()
    [out] = spec.generate([hit], GREEDY)
    assert out.num_cached_tokens == 32
    assert out.token_ids == hf_greedy(ckpt, hit, NEW_TOKENS)
    assert spec.engine.speculator.stats.num_accepted_tokens > before.num_accepted_tokens
    prefill, decode = LLM(ckpt, num_kv_blocks=64).engine, engine(ckpt).engine
    handoff(prefill, decode, "r", long, GREEDY)
    assert drain(decode)["r"].token_ids == hf_greedy(ckpt, long, NEW_TOKENS)
    assert decode.speculator.stats.num_accepted_tokens > 0


def test_config_refusals_are_one_line(checkpoints, make_ckpt):
    llama = make_ckpt("llama")
    with pytest.raises(SpeculativeConfigError, match=r"^method mtp: the model's config.json needs "
                                                     r"num_nextn_predict_layers >= 1 \(its MTP layers\), got None$"):
        EngineConfig(model=llama, speculative_config=MTP)
    ckpt = checkpoints("glm4_moe", "random")
    with pytest.raises(SpeculativeConfigError, match=r"^method mtp takes no model \(its drafter is the target "):
        EngineConfig(model=ckpt, speculative_config={**MTP, "model": ckpt})
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens is 33; at most 32"):
        EngineConfig(model=ckpt, speculative_config={**MTP, "num_speculative_tokens": 33})
    assert EngineConfig(model=ckpt, speculative_config=MTP).features == {"mtp"}
    assert checkpoint_problem(ckpt) is None  # serve's check: layer L is an MTP layer, not one too many
    with pytest.raises(ValueError, match="^LoRA adapters cannot be combined with MTP speculation yet"):
        EngineConfig(model=ckpt, speculative_config=MTP, enable_lora=True)
