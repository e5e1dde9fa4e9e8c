"""Every pair the compatibility table (core/compatibility.py) marks WORKS, run through `LLM`
with both features on: greedy float32 tokens equal each feature's single-feature reference,
and both features visibly engaged (a pair that silently ran one feature proves nothing).

The table is read at collection time, so a pair flipped to WORKS later is walked here
automatically; a feature this file cannot switch on fails its pairs unless SKIPPED says why.

References, by what the features alone are proven to give: transformers (float32) on the
float checkpoint; transformers + PEFT for an adapter's requests; the dequantised
checkpoint for a quantized one; and for an FP8 KV cache (not exact against float) `LLM`
with FP8 KV alone, on the dequantised weights or the adapter merged into them.

The workload: a 100-token prompt, two 150-token prompts that push it out of a 12-block
pool (only with a tier: then it comes back from the tier), two prompts sharing its first
blocks, and a repetitive prompt the n-gram proposer drafts from. Mooncake is a worker's KV
backend, not an engine's: its pairs hand every prompt from a prefill engine to a decode
engine (both with the other feature on) over Mooncake's tcp transport, as the workers do.
CUDA graphs cannot be captured on the CPU (cuda_graphs=True is refused there): their pairs
run the step the graphs hold, the padded static-buffer decode step, eagerly (capture=False,
`new_llm`), and their test ids say so ("-padded-step-no-capture"); capture itself is checked on a GPU only
(tests/engine/test_cuda_graphs.py's CUDA test, bench/gpu/graphs_tp_lora.py)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import shutil
from contextlib import contextmanager

import pytest
import torch

from splitserve.core.compatibility import all_pairs, verdict
from splitserve.engine import LLM, LoRARequest, SamplingParams
from splitserve.engine.kv_offload.block_file import HEADER
from splitserve.engine.lora.offline import with_lora
from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.kvtransfer import KVReceiver
from splitserve.kvtransfer.sender import create_sender
from splitserve.metrics import Metrics
from tests.engine.test_disaggregation_handoff import drain
from tests.engine.test_kv_offload_tiers import block_nbytes
from tests.engine.test_quant_formats import quantize_checkpoint
from tests.engine.test_spec_decode_exact import NGRAM, copy_heavy
from tests.engine.test_tensor_parallel_kv import prefill_side
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy
from tests.helpers.processes import join_child
from tests.helpers.reference import hf_greedy
from tests.kvtransfer.conftest import config_for

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
BS = 16
PREFIX = [(i * 37 + 11) % 900 + 5 for i in range(100)]  # 6 full blocks to cache, offload and bring back
ROUNDS = [  # generated round by round, each round one batch
    [PREFIX],
    [[(i * 53 + 101) % 900 + 5 for i in range(150)]],  # 10 blocks each: with 12, nothing of PREFIX stays
    [[(i * 53 + 202) % 900 + 5 for i in range(150)]],
    [PREFIX + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], PREFIX[:48] + [21, 22, 23]],
    [copy_heavy(1, 12, 3)],
]
TIERS = {"kv-offload-host", "kv-offload-disk"}

# feature -> why its pairs are not run here; any other feature must be switched on by engine_kwargs
SKIPPED: dict[str, str] = {
    "expert-parallel": "it needs a MoE checkpoint, this walk's are dense: its pairs that work are run on MoE "
                       "checkpoints by tests/engine/test_expert_parallel_features.py (EP with the feature against "
                       "one process with it) and test_expert_parallel_tensor_parallel.py (TP: against transformers)",
    "mtp": "it needs a checkpoint with an MTP layer (DeepSeek-V3, GLM-4.5): alone it is run by "
           "tests/engine/test_spec_decode_mtp.py, its one pair that works (TP) by test_spec_decode_mtp_tensor_parallel.py",
}
# what engine_kwargs below switches on; Mooncake (a worker's --kv-backend, not an engine's) by
# handing every prompt off between two engines over Mooncake's tcp transport (mooncake_rounds);
# CUDA graphs by their padded step run eagerly (new_llm: no capture on the CPU)
SWITCHED_ON = {"tensor-parallel", "lora", "cuda-graphs", "async-scheduling", "ngram", "draft-model",
               "kv-offload-host", "kv-offload-disk", "mooncake", "fp8-kv-cache", "quantized"}
PADDED_EAGERLY = "padded-step-no-capture"  # the id suffix of a CUDA-graph pair: capture is checked on a GPU only


def works_pairs() -> list[tuple[str, str]]:
    return [pair for pair in all_pairs() if verdict(*pair).works]


class World:
    """The checkpoints of the module: a float llama with its adapter, and a GPTQ llama wide
    enough to split over two ranks in whole groups of 128, with its dequantised float twin
    and an adapter of its own shape."""

    def __init__(self, make_ckpt, root):
        self.float = make_ckpt("llama")
        wide = make_ckpt("llama", hidden_size=256, intermediate_size=512)
        self.quantized, self.dequantised = quantize_checkpoint(wide, root / "gptq", "gptq")
        spec = ADAPTERS["all-r8"]
        self.adapters = {self.float: make_adapter(self.float, root / "adapter-float", **spec),
                         self.dequantised: make_adapter(wide, root / "adapter-wide", **spec)}
        self.root = root
        self.merged: dict = {}

    def merged_with_adapter(self, base):
        """`base` with its adapter merged into the weights (what FP8 KV alone runs for LoRA)."""
        if base not in self.merged:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            out = self.root / f"merged-{base.name}"
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            PeftModel.from_pretrained(model, self.adapters[base]).merge_and_unload().save_pretrained(out)
            for f in base.iterdir():  # tokenizer files
                if f.is_file() and not (out / f.name).exists():
                    shutil.copy(f, out / f.name)
            self.merged[base] = out
        return self.merged[base]


@pytest.fixture(scope="module")
def world(make_ckpt, tmp_path_factory):
    return World(make_ckpt, tmp_path_factory.mktemp("pairs"))


def engine_kwargs(features: set[str], world: World, tmp_path) -> dict:
    """LLM's arguments with exactly `features` on (Mooncake: see mooncake_rounds)."""
    model = world.quantized if "quantized" in features else world.float
    kw = dict(model=str(model), block_size=BS, max_num_batched_tokens=64,
              num_kv_blocks=12 if features & TIERS else 64)
    nbytes = block_nbytes(model)
    for feature in features:
        if feature == "tensor-parallel":
            kw["tensor_parallel_size"] = 2
        elif feature == "lora":
            kw.update(enable_lora=True, max_lora_rank=16)
        elif feature == "async-scheduling":
            kw["async_scheduling"] = True
        elif feature == "ngram":
            kw["speculative_config"] = NGRAM
        elif feature == "draft-model":  # the float weights draft (a quantized target's own, unquantized;
            # under an adapter, the adapter merged in: the base model alone never agrees with it)
            draft = world.dequantised if "quantized" in features else world.float
            draft = world.merged_with_adapter(draft) if "lora" in features else draft
            kw["speculative_config"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
            if "async-scheduling" in features:  # a draft model always drafts, and a step that may draft is
                # not overlapped: off above one running sequence, so round 4's two decodes overlap
                kw["speculative_config"]["disable_by_batch_size"] = 1
        elif feature == "kv-offload-host":  # with a disk tier under it: too small to hold PREFIX, it spills
            kw["kv_offload_bytes"] = (8 if "kv-offload-disk" in features else 64) * nbytes
        elif feature == "kv-offload-disk":
            kw.update(kv_offload_dir=str(tmp_path / "tier"), kv_offload_dir_bytes=64 * (nbytes + HEADER.size))
        elif feature == "fp8-kv-cache":
            kw["kv_cache_dtype"] = "fp8"
        elif feature not in ("quantized", "mooncake", "cuda-graphs"):  # (the checkpoint chosen above;
            # two engines; the padded step turned on after the start: new_llm)
            raise AssertionError(f"engine_kwargs cannot switch on {feature!r}")
    return kw


def new_llm(features: set[str], world: World, tmp_path) -> LLM:
    """An LLM with exactly `features` on; CUDA graphs as their padded static-buffer step, run
    eagerly (capture=False) for every pure-decode step, by every tensor-parallel rank too
    (parallel/padded_decode.py): what a captured graph replays, without the capture."""
    llm = LLM(**engine_kwargs(features, world, tmp_path))
    if "cuda-graphs" in features and llm.engine.runner.decode_graphs is None:  # (async scheduling has it)
        llm.engine.runner.enable_decode_graphs(capture=False)
    return llm


def run_rounds(llm: LLM, lora: LoRARequest | None) -> list:
    outs = []
    for prompts in ROUNDS:
        outs += llm.generate(prompts, GREEDY, lora_request=lora)
        if llm.engine.offloader is not None:
            assert llm.engine.offloader.wait_idle()  # stores land before the next round looks them up
    return outs


@contextmanager
def mooncake_link(decode: LLM):
    """A Mooncake receiver on the decode engine's pool and a sender, over tcp, as the workers hold them
    (share_kv_pool: under TP every rank's shard, each a Mooncake segment: kvtransfer/segments.py)."""
    metrics = Metrics()
    receiver = KVReceiver(decode.engine.share_kv_pool(), config_for("mooncake"), metrics, worker_id="decode")
    receiver.start()
    sender = create_sender("mooncake", config_for("mooncake"), metrics)
    try:
        yield receiver, sender, metrics
    finally:
        sender.close()
        receiver.stop()


_handoff_ids = itertools.count()


def handed_off(prefill: LLM, decode: LLM, link, prompt: list[int], lora: LoRARequest | None):
    """`prompt` prefilled on `prefill`, its KV pushed over Mooncake into the blocks `decode`
    reserved (past its own cached prefix), then decoded there (what the workers do)."""
    receiver, sender, _ = link
    rid = f"handoff-{next(_handoff_ids)}"
    on_decode, on_prefill = (with_lora(llm.engine, [GREEDY], lora)[0] if lora else GREEDY for llm in (decode, prefill))
    slot = decode.engine.reserve_remote_prefill(rid, prompt, on_decode)
    assert slot is not None
    prefill.engine.add_request(rid, prompt, SamplingParams(**{**on_prefill.__dict__, "max_tokens": 1}), hold_kv=True)
    first = drain(prefill.engine)[rid]
    src, hashes = prefill.engine.held_blocks(rid, slot.skip_blocks)
    done = receiver.expect(rid, slot.block_ids, slot.block_hashes, lambda ids: None)
    sender.push(rid, receiver.address, prefill.engine.share_kv_pool(), src, slot.block_ids, hashes)
    assert done.result(timeout=30).ok
    prefill.engine.release_held(rid)
    decode.engine.complete_remote_prefill(rid, first.token_ids[0], None)
    return drain(decode.engine)[rid]


def mooncake_rounds(features: set[str], world: World, tmp_path, lora: LoRARequest | None) -> tuple[list, LLM]:
    """The rounds' prompts one by one through a prefill engine and a decode engine, each with
    the other feature on, every prompt's KV moved over Mooncake; (outputs, the decode engine)."""
    other = features - {"mooncake"}
    if "tensor-parallel" in other:
        return mooncake_rounds_tp(other, world, tmp_path)
    with new_llm(other, world, tmp_path / "prefill") as prefill:
        decode = new_llm(other, world, tmp_path / "decode")
        with mooncake_link(decode) as link:
            outs = []
            for prompt in (p for r in ROUNDS for p in r):
                outs.append(handed_off(prefill, decode, link, prompt, lora))
                for llm in (prefill, decode):
                    if llm.engine.offloader is not None:
                        assert llm.engine.offloader.wait_idle()
            sent = link[2].kv_transfer_bytes.labels(backend="mooncake", direction="sent")._value.get()
            assert sent > 0  # the KV really went over Mooncake
        assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks  # every held block released
    return outs, decode


def mooncake_rounds_tp(other: set[str], world: World, tmp_path) -> tuple[list, LLM]:
    """mooncake_rounds with both engines at TP 2: one tensor-parallel engine per process, so
    the prefill engine runs in a process of its own (test_tensor_parallel_kv.prefill_side),
    writing each block's heads from its ranks' pool shards into the decode ranks' shards."""
    assert other == {"tensor-parallel"}, other  # (the only pair of the two; prefill_side knows no other feature)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(str(world.float), 2, child, "mooncake"))
    proc.start()
    try:
        decode = LLM(**engine_kwargs(other, world, tmp_path / "decode"))
        assert conn.recv() == list(decode.engine.share_kv_pool().spec.block_shape)  # the prefill engine is up
        with mooncake_link(decode) as (receiver, _, metrics):
            outs = []
            for i, prompt in enumerate(p for r in ROUNDS for p in r):
                rid = f"tp-handoff-{i}"
                slot = decode.engine.reserve_remote_prefill(rid, prompt, GREEDY)
                done = receiver.expect(rid, slot.block_ids, slot.block_hashes, lambda ids: None)
                conn.send((rid, prompt, receiver.address, slot.skip_blocks, slot.block_ids))
                first = conn.recv()
                assert done.result(timeout=30).ok
                decode.engine.complete_remote_prefill(rid, first, None)
                outs.append(drain(decode.engine)[rid])
            received = metrics.kv_transfer_bytes.labels(backend="mooncake", direction="received")._value.get()
            assert received > 0  # the KV really went over Mooncake
        conn.send(None)
    finally:
        join_child(proc)
    assert proc.exitcode == 0
    return outs, decode


def reference(features: set[str], world: World) -> list[list[int]]:
    """What the features are each proven to give alone, prompt by prompt."""
    base = world.dequantised if "quantized" in features else world.float
    prompts = [p for r in ROUNDS for p in r]
    if "fp8-kv-cache" in features:
        model = world.merged_with_adapter(base) if "lora" in features else base
        with LLM(str(model), block_size=BS, max_num_batched_tokens=64, num_kv_blocks=64, kv_cache_dtype="fp8") as ref:
            return [o.token_ids for r in ROUNDS for o in ref.generate(r, GREEDY)]
    if "lora" in features:
        return [peft_greedy(base, world.adapters[base], p, NEW_TOKENS) for p in prompts]
    return [hf_greedy(base, p, NEW_TOKENS) for p in prompts]


def assert_engaged(features: set[str], llm: LLM, outs: list, world: World, want: list[list[int]]) -> None:
    """Each feature of the pair did its part in this run (`want`: the pair's reference tokens)."""
    engine = llm.engine
    prefix_again = outs[len(ROUNDS[0]) + len(ROUNDS[1]) + len(ROUNDS[2])]  # round 4's first: PREFIX + 10
    if "tensor-parallel" in features:
        cfg = engine.model_config
        assert engine.runner.model.layers[0].self_attn.num_heads == cfg.num_heads // 2  # rank 0's half
        if "draft-model" in features:  # rank 0 runs the draft model whole (engine/spec/draft_model.py)
            assert engine.speculator.draft.runner.model.layers[0].self_attn.num_heads == cfg.num_heads
    if "lora" in features:
        assert want != reference(features - {"lora"}, world)  # the adapter changes the tokens: it was applied
        assert engine.loras.slots.num_loads >= 1
    if "async-scheduling" in features:
        assert engine.stats().overlapped_steps > 0
    if "cuda-graphs" in features and "draft-model" not in features:  # (a draft model drafts in every decode
        # step here, and steps with drafts are verified eagerly: graphs replay only steps without drafts)
        assert engine.runner.decode_graphs.steps > 0  # decode steps ran the padded static-buffer step
    if features & {"ngram", "draft-model"}:
        stats = engine.speculator.stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    if features & TIERS:
        c = engine.offloader.stats().counters
        assert prefix_again.num_cached_tokens >= 6 * BS  # PREFIX's 6 blocks, back from a tier
        if "kv-offload-host" in features:
            assert c.stored_blocks["host"] > 0
        if "kv-offload-disk" in features:
            assert c.loaded_blocks["disk"] > 0  # with host + disk, the host tier spilled PREFIX there
        else:
            assert c.loaded_blocks["host"] >= 6
    else:
        assert prefix_again.num_cached_tokens >= 6 * BS  # the device prefix cache
    if "fp8-kv-cache" in features:
        assert engine.runner.kv_pool.spec.dtype == torch.float8_e4m3fn
    if "quantized" in features:
        assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert engine.num_free_blocks == engine.num_total_blocks  # every block back


# WORKS pairs that do not (yet) give their references' tokens: (a, b) -> the bug, as found. Strict:
# the day the bug is fixed the pair passes, and the entry must go.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}


def pair_params() -> list:
    return [pytest.param(pair, id="+".join(pair) + (f"-{PADDED_EAGERLY}" if "cuda-graphs" in pair else ""),
                         marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[pair])]
                         if pair in KNOWN_BROKEN else []) for pair in works_pairs()]


@pytest.mark.parametrize("pair", pair_params())
def test_a_working_pair_gives_its_single_feature_references_tokens(pair, world, tmp_path):
    features = set(pair)
    skipped = sorted(features & set(SKIPPED))
    if skipped:
        pytest.skip(f"{' x '.join(pair)}: {SKIPPED[skipped[0]]}")
    unknown = features - SWITCHED_ON
    if unknown:
        pytest.fail(f"{' x '.join(pair)} works in the table but this test cannot switch on {sorted(unknown)}: "
                    "add it to engine_kwargs, or to SKIPPED with the reason")
    want = reference(features, world)
    base = world.dequantised if "quantized" in features else world.float
    lora = LoRARequest("all-r8", 1, str(world.adapters[base])) if "lora" in features else None
    if "mooncake" in features:
        outs, llm = mooncake_rounds(features, world, tmp_path, lora)
    else:
        llm = new_llm(features, world, tmp_path)
        outs = run_rounds(llm, lora)
    with llm:
        got = [o.token_ids for o in outs]
        diverged = [(i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        assert not diverged, f"{' x '.join(pair)}: prompt, tokens, reference's: {diverged}"
        assert_engaged(features, llm, outs, world, want)
