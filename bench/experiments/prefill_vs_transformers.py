"""A whole prefill through the engine against transformers' forward on the same prompt, in
one process with the same torch threads, per prompt length (issue 30): the figure a real
model's time to first token rests on. Greedy first tokens are checked to agree.

    python -m bench.experiments.smollm2_checkpoint            # SmolLM2-135M-Instruct, once
    python -m bench.experiments.prefill_vs_transformers --model ~/.cache/splitserve/smollm2-135m-instruct
    SPLITSERVE_CPU_MARCH=haswell python -m bench.experiments.prefill_vs_transformers ...   # a CPU without AVX-512

Each length: one warm-up of the engine and of transformers on a distinct prompt, then the
median of --repeats runs of each, alternating, every prompt distinct (no prefix-cache hit).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (safetensors)")
    ap.add_argument("--lengths", default="256,512,1024,1500")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from splitserve.engine import LLM, SamplingParams
    from splitserve.kernels import cpu_native

    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(args.model, num_kv_blocks=(max(lengths) // 16 + 2) * (args.repeats + 2) * 2,
              max_num_batched_tokens=max(2048, max(lengths)))
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for n in lengths:
        prompts = [[rng.randrange(100, vocab - 1) for _ in range(n)] for _ in range(args.repeats + 1)]
        ours, theirs, agree = [], [], True
        for i, p in enumerate(prompts):
            start = time.perf_counter()
            token = llm.generate([p], one)[0].token_ids[0]
            mid = time.perf_counter()
            with torch.no_grad():
                logits = hf(torch.tensor([p])).logits[0, -1]
            end = time.perf_counter()
            agree &= token == int(logits.argmax())
            if i:  # the first of each length warms both up
                ours.append(mid - start)
                theirs.append(end - mid)
        a, b = statistics.median(ours), statistics.median(theirs)
        rows.append({"prompt_tokens": n, "splitserve_s": round(a, 4), "transformers_s": round(b, 4),
                     "splitserve_tok_s": round(n / a, 1), "transformers_tok_s": round(n / b, 1),
                     "ratio": round(b / a, 3), "same_first_token": agree})
        print(f"{n} tokens: splitserve {a:.2f} s ({n / a:.0f} tok/s), transformers {b:.2f} s ({n / b:.0f} tok/s): "
              f"{b / a:.2f}x, first tokens agree: {agree}", flush=True)
    result = {"model": Path(args.model).name, "threads": args.threads, "cpu_march": cpu_native.MARCH,
              "machine": platform.machine(), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["same_first_token"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
