"""The per-step cost of structured outputs: output tokens/s of the offline engine with and
without a JSON schema, at batch 1 and 32, same prompts and the same number of tokens.

The schema asks for more tokens than `--max-tokens` (a long array of fixed-length strings),
so every constrained sequence runs to the limit exactly as the unconstrained ones do
(`ignore_eos`): the forward passes are the same, and the difference is the grammar's work
(the batch bitmask, computed on a helper thread while the forward pass runs, its application
in the sampler, and advancing each matcher). Each configuration is timed `--repeats` times
alternately with and without the schema after a warm-up; the medians are reported.

    python -m bench.experiments.structured_overhead     # or: make bench-structured
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.experiments.harness import RESULTS, load_average, write_json
from splitserve.core.structured import StructuredSpec
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.demo import ensure_demo_checkpoint
from splitserve.engine.grammar import advance, apply_mask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 64, "maxItems": 64,
              "items": {"type": "string", "minLength": 8, "maxLength": 8}}}}


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


def compare(llm: LLM, prompts: list[list[int]], free: SamplingParams, constrained: SamplingParams,
            repeats: int) -> dict:
    """Free and constrained runs alternate, so a load change on a shared machine hits both;
    the ratio is the median of the back-to-back pairs."""
    timed(llm, prompts, free), timed(llm, prompts, constrained)  # warm-up (and the schema's one compilation)
    rows = []
    for _ in range(repeats):
        (n_free, t_free), (n_json, t_json) = timed(llm, prompts, free), timed(llm, prompts, constrained)
        assert n_free == n_json == len(prompts) * free.max_tokens, (n_free, n_json)
        rows.append((n_free / t_free, n_json / t_json))
    return {"output_tokens": len(prompts) * free.max_tokens,
            "free_tokens_per_s": round(statistics.median(r[0] for r in rows), 1),
            "json_schema_tokens_per_s": round(statistics.median(r[1] for r in rows), 1),
            "ratio": round(statistics.median(r[1] / r[0] for r in rows), 3),
            "best_free_tokens_per_s": round(max(r[0] for r in rows), 1),
            "best_json_schema_tokens_per_s": round(max(r[1] for r in rows), 1),
            "pairs_tokens_per_s": [[round(a, 1), round(b, 1)] for a, b in rows]}


def grammar_step_us(llm: LLM, spec: StructuredSpec, batch: int, steps: int) -> dict:
    """The grammar's own work per engine step, without the model: the batch bitmask, its
    application to [batch, vocab] logits, and advancing every matcher by the chosen token.
    Best of 5 runs of `steps` steps (the machine is shared: the minimum is the cost)."""
    grammars = llm.engine.grammars
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(5):
        matchers = [grammars.matcher(spec) for _ in range(batch)]
        start = time.perf_counter()
        for _ in range(steps):
            mask = grammars.start_masks(matchers).result()
            tokens = apply_mask(logits, mask, copy=True).argmax(-1).tolist()
            for m, t in zip(matchers, tokens, strict=True):
                advance(m, t, "bench")
        best = min(best, (time.perf_counter() - start) / steps)
    return {"batch": batch, "steps": steps, "grammar_us_per_step": round(best * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_overhead.json")
    ns = ap.parse_args(argv)
    model = ns.model or str(ensure_demo_checkpoint())
    llm = LLM(model, num_kv_blocks=1024, max_num_seqs=32)
    rng = random.Random(0)
    spec = StructuredSpec.json_schema(SCHEMA, "bench")
    results, load_before = [], load_average()
    for batch in (1, 32):
        prompts = [[rng.randrange(5, 1000) for _ in range(ns.prompt_len)] for _ in range(batch)]
        free = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=ns.max_tokens, structured=spec)
        row = {"batch": batch, **compare(llm, prompts, free, constrained, ns.repeats)}
        row.update(grammar_step_us(llm, spec, batch, min(ns.max_tokens, 100)))
        results.append(row)
        print(f"batch {batch:2d}: {row['free_tokens_per_s']:8.1f} tok/s free, {row['json_schema_tokens_per_s']:8.1f} "
              f"tok/s with the JSON schema; paired ratio {row['ratio']:.3f}; grammar work "
              f"{row['grammar_us_per_step']:.0f} us/step")
    write_json(ns.out, {
        "what": "offline engine output tokens/s with and without a JSON schema (llguidance), same prompts and tokens",
        "model": Path(model).name, "vocab_size": llm.engine.model_config.vocab_size, "max_tokens": ns.max_tokens,
        "prompt_len": ns.prompt_len, "repeats": ns.repeats, "schema": SCHEMA, "results": results,
        "load_average": {"before": load_before, "after": load_average()},
        "date": datetime.now(UTC).isoformat(timespec="seconds")})
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
