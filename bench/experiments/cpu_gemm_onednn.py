"""Would oneDNN serve our CPU linears better than MKL? (issue 30: vLLM's CPU backend, which runs
its linears through oneDNN, is 1.7-1.9x ahead of us on SmolLM2.)

One offline engine, one thread: prefill time of one prompt and decode tok/s at batch 1 and 8
with every float32 linear on MKL (`F.linear` on the input-major weights), then as the engine
runs them (kernels/cpu_linear.py: oneDNN from two rows up, MKL for one), same engine, fresh
prompts (no prefix-cache hit), and whether greedy tokens stay the same.

    taskset -c 1 python -m bench.experiments.cpu_gemm_onednn --model DIR --prompt-tokens 900
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.kernels import cpu_linear


def use_onednn(on: bool) -> None:
    """The engine's float32 CPU linears through oneDNN (kernels/cpu_linear.py), or MKL alone."""
    cpu_linear._available = None if on else False
    if on and not cpu_linear.available():
        raise SystemExit("this torch build has no oneDNN linear")


def measure(llm: LLM, vocab: int, prompt_tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt(prompt_tokens), one)
    prefill = []
    for _ in range(3):
        p = prompt(prompt_tokens)
        start = time.perf_counter()
        llm.generate(p, one)
        prefill.append(time.perf_counter() - start)
    out = {"prefill_ms": round(statistics.median(prefill) * 1e3, 1)}
    for batch in (1, 8):
        prompts = [prompt(64) for _ in range(batch)]

        def timed(n: int, prompts=prompts) -> float:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start

        timed(2)
        out[f"decode_tok_s_batch{batch}"] = round(statistics.median(
            batch * 31 / (timed(32) - timed(1)) for _ in range(3)), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--json")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(ns.model)
    vocab = llm.engine.model_config.vocab_size
    check = torch.randint(10, vocab, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=24)
    use_onednn(False)
    before = llm.generate(check, greedy)[0].token_ids
    result = {"model": ns.model, "prompt_tokens": ns.prompt_tokens, "mkl": measure(llm, vocab, ns.prompt_tokens, 1)}
    use_onednn(True)
    result["onednn"] = measure(llm, vocab, ns.prompt_tokens, 2)
    result["same_greedy_tokens"] = llm.generate(check, greedy)[0].token_ids == before
    print(json.dumps(result, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
