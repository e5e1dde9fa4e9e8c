"""The compatibility table (core/compatibility.py) and its engine-side readers: every pair of
features walked through EngineConfig and through the command-line check `serve` and the
workers run before Ray (engine/args.py compatibility_problem), each refused pair refused
with the table's one line and every other pair accepted; the real mains exit 2 with it; and
docs/compatibility.md is the rendered table. The operator and CRD side:
tests/operator/test_compatibility_crd.py."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.core.compatibility import (
    FEATURES,
    PAIRS,
    all_pairs,
    markdown_table,
    message,
    refusal,
    refusals,
    refused,
    refused_pairs,
    verdict,
    with_table,
)
from splitserve.core.speculative import SpeculativeConfig
from splitserve.engine.args import add_engine_args, compatibility_problem, flag_features
from splitserve.engine.config import EngineConfig
from tests.security.test_hostile_configs import CHILD, Case

DOCS = Path(__file__).resolve().parents[2] / "docs/compatibility.md"
CUDA = torch.cuda.is_available()
DEVICE_ONLY = "cuda_graphs=True needs a CUDA device"  # a single-feature constraint, not a pair


# ---- the table ----------------------------------------------------------------------------

def test_the_table_names_every_unordered_pair_once():
    assert len(PAIRS) == len(all_pairs()) == len(FEATURES) * (len(FEATURES) - 1) // 2
    assert {frozenset(p) for p in PAIRS} == {frozenset(p) for p in all_pairs()}
    for (a, b), v in PAIRS.items():
        assert a != b and a in FEATURES and b in FEATURES
        assert v.works == (v.reason == ""), (a, b)  # a refusal says why, in one line
        assert "\n" not in message(a, b) and "|" not in v.reason


def test_what_the_code_refuses_today():
    """The refused pairs as of this table (a flip changes this list on purpose)."""
    others = [p for p in refused_pairs() if "mtp" not in p]  # (MTP's: the next test)
    assert others == [("expert-parallel", "cuda-graphs"), ("ngram", "draft-model")]


def test_mtp_works_with_tensor_parallelism_only_today():
    """MTP speculation: every other pair refused until a test runs it (tests/engine/test_spec_decode_mtp*.py)."""
    assert [p for p in refused_pairs() if "mtp" in p] == [p for p in all_pairs() if "mtp" in p and
                                                          "tensor-parallel" not in p]


def test_refusal_is_the_first_refused_pair_in_table_order(monkeypatch):
    assert refusal(set()) is None and refusal({"lora", "ngram", "fp8-kv-cache"}) is None
    assert refusal({"async-scheduling", "lora", "tensor-parallel", "ngram"}) is None
    assert refusal({"async-scheduling", "draft-model", "tensor-parallel", "lora"}) is None
    assert refusal({"tensor-parallel", "ngram", "draft-model"}) == message("draft-model", "ngram") == (
        "n-gram speculation cannot be combined with draft-model speculation yet: one speculative config names "
        "one method")
    monkeypatch.setitem(PAIRS, ("lora", "draft-model"), refused("marked refused by this test"))
    assert refusals({"ngram", "draft-model", "lora"}) == [message("lora", "draft-model"), message("ngram", "draft-model")]
    assert refusal({"ngram", "draft-model", "lora"}) == message("lora", "draft-model")  # lora comes before ngram
    with pytest.raises(ValueError, match="unknown features \\['eagle'\\]"):
        refusal({"eagle"})


def test_the_docs_show_the_table():
    """docs/compatibility.md holds `python -m splitserve.core.compatibility`'s output, and
    `--write` (how it is regenerated) changes nothing in it today."""
    doc = DOCS.read_text()
    assert markdown_table() in doc
    assert with_table(doc) == doc


def test_write_keeps_the_prose_and_replaces_the_table(tmp_path, monkeypatch):
    doc = tmp_path / "compat.md"
    old = markdown_table().replace("| works |", "| refused |", 1)
    doc.write_text("# Prose kept\n\nwords\n\n" + old)
    subprocess.run([sys.executable, "-m", "splitserve.core.compatibility", "--write", str(doc)], check=True)
    assert doc.read_text() == "# Prose kept\n\nwords\n\n" + markdown_table()
    doc.write_text("no table here\n")
    with pytest.raises(ValueError, match="no table header"):
        with_table(doc.read_text())


# ---- EngineConfig -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return str(make_ckpt("mixtral"))  # a MoE model: expert parallelism refuses a dense one alone


def implied(features: set[str]) -> set[str]:
    """Expert parallelism runs over tensor-parallel ranks: its fields turn both on."""
    return features | ({"tensor-parallel"} if "expert-parallel" in features else set())


def engine_fields(feature: str, ckpt: str, tmp: Path) -> dict | None:
    """EngineConfig fields turning `feature` on; None: not an engine setting (a worker flag)."""
    return {
        "tensor-parallel": dict(tensor_parallel_size=2),
        "expert-parallel": dict(enable_expert_parallel=True, tensor_parallel_size=2),
        "lora": dict(enable_lora=True),
        "cuda-graphs": dict(cuda_graphs=True, device="cuda" if CUDA else "cpu"),
        "async-scheduling": dict(async_scheduling=True),
        "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
        "draft-model": dict(speculative_config={"method": "draft_model", "model": ckpt, "num_speculative_tokens": 2}),
        # (a parsed config: this walk's llama checkpoint has no MTP layer, which parsing would refuse first)
        "mtp": dict(speculative_config=SpeculativeConfig("mtp", 2)),
        "kv-offload-host": dict(kv_offload_bytes=2**20),
        "kv-offload-disk": dict(kv_offload_dir=str(tmp / "tier"), kv_offload_dir_bytes=2**20),
        "mooncake": None,
        "fp8-kv-cache": dict(kv_cache_dtype="fp8"),
        "quantized": dict(quantization="fp8"),
    }[feature]


def test_each_feature_alone_is_what_engine_config_reports(ckpt, tmp_path):
    for feature in FEATURES:
        fields = engine_fields(feature, ckpt, tmp_path)
        if fields is None:
            continue
        if feature == "cuda-graphs" and not CUDA:
            with pytest.raises(ValueError, match=DEVICE_ONLY):
                EngineConfig(model=ckpt, **fields)
            continue
        assert EngineConfig(model=ckpt, **fields).features == implied({feature})


@pytest.mark.parametrize("a, b", all_pairs(), ids=[f"{a}+{b}" for a, b in all_pairs()])
def test_engine_config_refuses_exactly_the_refused_pairs(ckpt, tmp_path, a, b):
    fa, fb = engine_fields(a, ckpt, tmp_path), engine_fields(b, ckpt, tmp_path)
    if fa is None or fb is None:
        pytest.skip("not an engine setting: the command-line walk below covers it")
    if any(fa[k] != fb[k] for k in set(fa) & set(fb)):  # one setting (the speculative method): not both
        assert not verdict(a, b).works
        return
    if "device" in fa or "device" in fb:  # CUDA graphs set the device; the other feature must not
        assert "device" not in set(fa) & set(fb)
    if verdict(a, b).works:
        if not CUDA and "cuda-graphs" in (a, b):  # accepted as a pair, refused for the device alone
            with pytest.raises(ValueError, match=DEVICE_ONLY):
                EngineConfig(model=ckpt, **fa, **fb)
            return
        assert EngineConfig(model=ckpt, **{**fa, **fb}).features == implied({a, b})
    else:
        with pytest.raises(ValueError) as err:
            EngineConfig(model=ckpt, **{**fa, **fb})
        assert str(err.value) == message(a, b)


def test_a_quantized_checkpoint_is_the_feature_without_the_flag(make_ckpt, tmp_path):
    cfg = json.loads((Path(make_ckpt("llama")) / "config.json").read_text())
    assert cfg.get("quantization_config") is None
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    from splitserve.engine.config import checkpoint_is_quantized

    assert checkpoint_is_quantized(str(tmp_path), None) and not checkpoint_is_quantized(make_ckpt("llama"), None)


# ---- the command line (serve and the workers, before Ray) ---------------------------------

FLAGS = {  # each feature's flags; the command line cannot force CUDA graphs on (auto turns them off)
    "tensor-parallel": ["-tp", "2"],
    "expert-parallel": ["--enable-expert-parallel", "-tp", "2"],
    "lora": ["--enable-lora"],
    "cuda-graphs": None,
    "async-scheduling": ["--async-scheduling"],
    "ngram": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
    "draft-model": ["--speculative-config", '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}'],
    "mtp": ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
    "kv-offload-host": ["--kv-offload-gib", "1"],
    "kv-offload-disk": ["--kv-offload-dir", "/nonexistent/tier", "--kv-offload-dir-gib", "1"],
    "mooncake": ["--kv-backend", "mooncake"],
    "fp8-kv-cache": ["--kv-cache-dtype", "fp8"],
    "quantized": ["--quantization", "fp8"],
}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--kv-backend", choices=["grpc", "mooncake"], default="grpc")  # serve's and the workers'
    return ap.parse_args(argv)


@pytest.mark.parametrize("a, b", all_pairs(), ids=[f"{a}+{b}" for a, b in all_pairs()])
def test_the_command_line_refuses_exactly_the_refused_pairs(a, b):
    if FLAGS[a] is None or FLAGS[b] is None or FLAGS[a][0] == FLAGS[b][0] == "--speculative-config":
        assert FLAGS[a] is None or FLAGS[b] is None or not verdict(a, b).works  # one flag, one method
        return
    args = parse(FLAGS[a] + FLAGS[b])
    assert flag_features(args) == implied({a, b})
    assert compatibility_problem(args) == (None if verdict(a, b).works else message(a, b))


MAINS = {"serve": "splitserve.serve", "decode-worker": "splitserve.decode_worker.main",
         "prefill-worker": "splitserve.prefill_worker.main"}


MARKED = "marked refused by this test"


def test_every_main_exits_2_with_the_tables_line_before_ray(monkeypatch):
    """The real mains, in one child process (tests/security/test_hostile_configs.py's): a
    refused pair a command line asks for, exit 2, the table's line, Ray never reached.
    prefill-pool refuses through SystemExit(line): exit 1, as its other refusals. Every pair a
    command line can reach works today (n-gram x draft model is one flag), so this test and the
    child mark TP x LoRA refused in their table: what is checked is that each main asks it."""
    assert not [(a, b) for a, b in refused_pairs() if FLAGS[a] and FLAGS[b] and FLAGS[a][0] != FLAGS[b][0]
                and not {"expert-parallel", "mtp"} & {a, b}]  # (theirs are as reachable; this checks the mains ask)
    pairs = [("tensor-parallel", "lora")]
    monkeypatch.setitem(PAIRS, pairs[0], refused(MARKED))
    cases = {f"{cmd} {a}+{b}": Case(FLAGS[a] + FLAGS[b] + ([] if cmd == "serve" else ["--redis-url", "redis://x:1"]),
                                    f"splitserve {cmd}: {message(a, b)}", module)
             for (a, b), (cmd, module) in itertools.product(pairs, MAINS.items())
             if not (cmd == "prefill-worker" and "mooncake" in (a, b))}  # it has no --kv-backend
    cases |= {f"prefill-pool {a}+{b}": Case(FLAGS[a] + FLAGS[b] + ["--redis-url", "redis://x:1"],
                                            f"splitserve prefill-pool: {message(a, b)}",
                                            "splitserve.prefill_worker.pool") for a, b in pairs}
    mark = f"import splitserve.core.compatibility as c\nc.PAIRS[{pairs[0]!r}] = c.refused({MARKED!r})\n"
    proc = subprocess.run([sys.executable, "-c", mark + CHILD, json.dumps([(n, c.module, c.argv) for n, c in cases.items()])],
                          capture_output=True, text=True, timeout=300)  # (run_cases, with the mark)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, case in cases.items():
        got = results[name]
        if name.startswith("prefill-pool"):
            assert got["code"] == case.expected, got
            continue
        assert got["code"] == 2 and got["stderr"].strip() == case.expected, (name, got)
