"""Would oneDNN serve our CPU linears better than MKL? (issue 30: vLLM's CPU backend, which runs
its linears through oneDNN, is 1.7-1.9x ahead of us on SmolLM2.)

One offline engine, one thread: prefill time of one prompt and decode tok/s at batch 1 and 8
with today's linears (MKL's float32 GEMM on input-major weights), then with every decoder
linear swapped in place for a oneDNN one (`torch._C._nn.mkldnn_linear` over the weight
converted once with `to_mkldnn()`, as `torch.utils.mkldnn.to_mkldnn(nn.Linear)` does), same
engine, fresh prompts (no prefix-cache hit), and whether greedy tokens stay the same.
An experiment, not a serving path: the engine does not use oneDNN (see docs/benchmarks.md).

    taskset -c 1 python -m bench.experiments.cpu_gemm_onednn --model DIR --prompt-tokens 900
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.llm import LLM


class OneDNNLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("packed", linear.weight.detach().contiguous().to_mkldnn())
        self.bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.packed, self.bias).to_dense()
        return y.reshape(*x.shape[:-1], y.shape[-1])


def swap_linears(model: nn.Module) -> int:
    """Every decoder linear (not the LM head) replaced; how many."""
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, OneDNNLinear(child))
                n += 1
    return n


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
    before = llm.generate(check, greedy)[0].token_ids
    result = {"model": ns.model, "prompt_tokens": ns.prompt_tokens, "mkl": measure(llm, vocab, ns.prompt_tokens, 1)}
    result["swapped_linears"] = swap_linears(llm.engine.runner.model)
    result["onednn"] = measure(llm, vocab, ns.prompt_tokens, 2)
    result["same_greedy_tokens"] = llm.generate(check, greedy)[0].token_ids == before
    print(json.dumps(result, indent=2))
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
