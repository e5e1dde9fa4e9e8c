"""Which engine features combine: one table, read by every place that refuses a combination.

EngineConfig (engine/config.py), the `serve` and worker command lines (engine/args.py
`compatibility_problem`), the operator's parse_spec (operator/spec_compatibility.py), the
CRD's CEL rules (generated from this table by operator/spec_compatibility.py) and
docs/compatibility.md (its table rewritten by `python -m splitserve.core.compatibility --write`) all read PAIRS,
so a combination is refused everywhere or nowhere, in the same one line.

PAIRS names every unordered pair of FEATURES once and records what the code does today:
WORKS, or refused(why). Making a pair work is a one-line edit here (after the code supports
it); tests/engine/test_compatibility_table.py and tests/operator/test_compatibility_crd.py
walk every pair through every consumer, and fail until the CRD rules and the docs are
regenerated. Constraints of a single feature (CUDA graphs need a CUDA device, async
scheduling needs the padded decode step, a checkpoint's own limits) stay where they are.

Torch-free and engine-free: the operator imports it.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

# key -> the words every refusal uses; the order is the order refusals are looked for in
FEATURES: dict[str, str] = {
    "tensor-parallel": "tensor parallelism (size > 1)",
    "expert-parallel": "expert parallelism",
    "lora": "LoRA adapters",
    "cuda-graphs": "CUDA graphs forced on (cuda_graphs=True)",
    "async-scheduling": "async scheduling",
    "ngram": "n-gram speculation",
    "draft-model": "draft-model speculation",
    "mtp": "MTP speculation",
    "kv-offload-host": "the host KV offload tier",
    "kv-offload-disk": "the disk KV offload tier",
    "mooncake": "Mooncake KV transfer",
    "fp8-kv-cache": "FP8 KV cache",
    "quantized": "quantized checkpoints",
}


@dataclass(frozen=True)
class Verdict:
    works: bool
    reason: str = ""


WORKS = Verdict(True)


def refused(reason: str) -> Verdict:
    return Verdict(False, reason)


_MTP_UNTESTED = "no test has run the two together yet"

# Every unordered pair, once. Flip a pair by editing its line (then regenerate: module docstring).
PAIRS: dict[tuple[str, str], Verdict] = {
    ("tensor-parallel", "lora"): WORKS,  # adapters sharded like the base weights (engine/lora/sharding.py)
    ("tensor-parallel", "cuda-graphs"): WORKS,  # each rank replays its own graphs (engine/parallel/padded_decode.py)
    ("tensor-parallel", "async-scheduling"): WORKS,  # the padded step broadcast to the ranks (parallel/padded_decode.py)
    ("tensor-parallel", "ngram"): WORKS,
    ("tensor-parallel", "draft-model"): WORKS,  # rank 0 runs the draft model whole, alone (engine/spec/draft_model.py)
    ("tensor-parallel", "kv-offload-host"): WORKS,  # rank 0 gathers / scatters every rank's heads (kv_offload/device_blocks.py)
    ("tensor-parallel", "kv-offload-disk"): WORKS,  # one file per block, every rank's heads under one MAC
    ("tensor-parallel", "mooncake"): WORKS,  # a Mooncake segment per rank's pool shard (kvtransfer/segments.py)
    ("tensor-parallel", "fp8-kv-cache"): WORKS,
    ("tensor-parallel", "quantized"): WORKS,  # a GPTQ/AWQ checkpoint must split in whole groups (its own check)
    # expert parallelism (engine/parallel/expert_parallel.py) needs tensor parallelism: its own check
    # (core/expert_parallel.py) refuses it alone
    ("tensor-parallel", "expert-parallel"): WORKS,
    ("expert-parallel", "lora"): WORKS,  # adapters on attention (experts and router refuse them for every MoE)
    ("expert-parallel", "cuda-graphs"): refused("its all-to-all reads the split sizes on the host in every MoE layer, "
                                                "which a CUDA graph cannot capture"),
    ("expert-parallel", "async-scheduling"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "ngram"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "draft-model"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "kv-offload-host"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "kv-offload-disk"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "mooncake"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "fp8-kv-cache"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("expert-parallel", "quantized"): WORKS,  # tests/engine/test_expert_parallel_features.py
    ("lora", "cuda-graphs"): WORKS,  # adapter slots a static input, deltas gathered by slot (engine/lora/apply.py)
    ("lora", "async-scheduling"): WORKS,  # a decode step's grouping by adapter is known ahead (engine/overlap.py)
    ("lora", "ngram"): WORKS,
    ("lora", "draft-model"): WORKS,
    ("lora", "kv-offload-host"): WORKS,
    ("lora", "kv-offload-disk"): WORKS,
    ("lora", "mooncake"): WORKS,
    ("lora", "fp8-kv-cache"): WORKS,
    ("lora", "quantized"): WORKS,
    ("cuda-graphs", "async-scheduling"): WORKS,
    ("cuda-graphs", "ngram"): WORKS,
    ("cuda-graphs", "draft-model"): WORKS,
    ("cuda-graphs", "kv-offload-host"): WORKS,
    ("cuda-graphs", "kv-offload-disk"): WORKS,
    ("cuda-graphs", "mooncake"): WORKS,
    ("cuda-graphs", "fp8-kv-cache"): WORKS,
    ("cuda-graphs", "quantized"): WORKS,
    ("async-scheduling", "ngram"): WORKS,  # a step that may draft is not overlapped (engine/overlap.py)
    ("async-scheduling", "draft-model"): WORKS,  # a step that may draft is not overlapped (Speculator.drafts_ahead)
    ("async-scheduling", "kv-offload-host"): WORKS,
    ("async-scheduling", "kv-offload-disk"): WORKS,
    ("async-scheduling", "mooncake"): WORKS,
    ("async-scheduling", "fp8-kv-cache"): WORKS,
    ("async-scheduling", "quantized"): WORKS,
    ("ngram", "draft-model"): refused("one speculative config names one method"),
    ("ngram", "kv-offload-host"): WORKS,
    ("ngram", "kv-offload-disk"): WORKS,
    ("ngram", "mooncake"): WORKS,
    ("ngram", "fp8-kv-cache"): WORKS,
    ("ngram", "quantized"): WORKS,
    ("draft-model", "kv-offload-host"): WORKS,
    ("draft-model", "kv-offload-disk"): WORKS,
    ("draft-model", "mooncake"): WORKS,
    ("draft-model", "fp8-kv-cache"): WORKS,
    ("draft-model", "quantized"): WORKS,  # the draft model itself loads unquantized
    # MTP speculation (engine/spec/mtp.py): tested alone, through serve disaggregated (gRPC) and with TP
    ("tensor-parallel", "mtp"): WORKS,  # rank 0 runs the MTP layer whole, alone (test_spec_decode_mtp_tensor_parallel.py)
    ("expert-parallel", "mtp"): refused(_MTP_UNTESTED),
    ("lora", "mtp"): refused(_MTP_UNTESTED),
    ("cuda-graphs", "mtp"): refused("its drafter reads the hidden states of every step, which a captured decode "
                                    "step does not keep"),
    ("async-scheduling", "mtp"): refused("an overlapped decode step keeps no hidden states for the MTP layer"),
    ("ngram", "mtp"): refused("one speculative config names one method"),
    ("draft-model", "mtp"): refused("one speculative config names one method"),
    ("mtp", "kv-offload-host"): refused(_MTP_UNTESTED),
    ("mtp", "kv-offload-disk"): refused(_MTP_UNTESTED),
    ("mtp", "mooncake"): refused(_MTP_UNTESTED),
    ("mtp", "fp8-kv-cache"): refused(_MTP_UNTESTED),
    ("mtp", "quantized"): refused(_MTP_UNTESTED),
    ("kv-offload-host", "kv-offload-disk"): WORKS,
    ("kv-offload-host", "mooncake"): WORKS,
    ("kv-offload-host", "fp8-kv-cache"): WORKS,
    ("kv-offload-host", "quantized"): WORKS,
    ("kv-offload-disk", "mooncake"): WORKS,
    ("kv-offload-disk", "fp8-kv-cache"): WORKS,
    ("kv-offload-disk", "quantized"): WORKS,
    ("mooncake", "fp8-kv-cache"): WORKS,
    ("mooncake", "quantized"): WORKS,
    ("fp8-kv-cache", "quantized"): WORKS,
}


def all_pairs() -> list[tuple[str, str]]:
    """Every unordered pair of FEATURES, in FEATURES order: the order refusals are found in."""
    return list(itertools.combinations(FEATURES, 2))


def verdict(a: str, b: str) -> Verdict:
    return PAIRS[(a, b)] if (a, b) in PAIRS else PAIRS[(b, a)]


def message(a: str, b: str) -> str:
    """The one line every consumer refuses the pair (a, b) with."""
    first, second = sorted((a, b), key=list(FEATURES).index)
    return f"{FEATURES[first]} cannot be combined with {FEATURES[second]} yet: {verdict(a, b).reason}"


def refused_pairs() -> list[tuple[str, str]]:
    return [pair for pair in all_pairs() if not verdict(*pair).works]


def refusal(features: set[str] | frozenset[str]) -> str | None:
    """The first refused pair among `features` (FEATURES order), as its one line; None: they combine."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)} (known: {', '.join(FEATURES)})")
    found = refusals(features)
    return found[0] if found else None


def refusals(features: set[str] | frozenset[str]) -> list[str]:
    """Every refused pair among `features` (FEATURES order), each as its one line."""
    return [message(a, b) for a, b in all_pairs() if a in features and b in features and not verdict(a, b).works]


def markdown_table() -> str:
    """docs/compatibility.md's table: a row per pair (tests/engine/test_compatibility_table.py
    keeps the docs equal to it)."""
    rows = ["| Feature | Feature | Combined | Why not (the refusal's line) |", "|---|---|---|---|"]
    for a, b in all_pairs():
        v = verdict(a, b)
        rows.append(f"| {FEATURES[a]} | {FEATURES[b]} | {'works' if v.works else 'refused'} | "
                    f"{'' if v.works else v.reason} |")
    return "\n".join(rows) + "\n"


def with_table(doc: str) -> str:
    """`doc` (docs/compatibility.md) with its table replaced by today's: the prose above the
    table's header row is kept; the table runs to the end of the file."""
    header = markdown_table().splitlines()[0]
    prose, found, _ = doc.partition(header)
    if not found:
        raise ValueError(f"no table header {header!r} in the document: add it where the table goes")
    return prose + markdown_table()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m splitserve.core.compatibility",
                                 description="print the feature compatibility table (docs/compatibility.md's)")
    ap.add_argument("--write", metavar="DOC", nargs="?", const="docs/compatibility.md",
                    help="rewrite the table in DOC (default docs/compatibility.md), keeping its prose")
    args = ap.parse_args(argv)
    if args.write is None:
        print(markdown_table(), end="")
        return
    with open(args.write, encoding="utf-8") as f:
        doc = f.read()
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(with_table(doc))


if __name__ == "__main__":
    main()
