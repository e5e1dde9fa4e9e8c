"""The GPU check's `features` stage (gpu_check.py): the features added since the last GPU run,
each a sub-check with its own ok / reason / figures, on one device:

  kv_offload  an offline engine, a 12-block device pool over a host tier: a prefix evicted from
              the device is written down to host memory and loaded back, its greedy tokens
              equal to the cold run's
  spec_exact  offline engines with and without n-gram speculative decoding: the same greedy
              tokens, drafts accepted
  async_exact offline engines with and without --async-scheduling (overlapped decode steps,
              engine/overlap.py): the same tokens, greedy and seeded
  spec_serve  `splitserve serve --speculative-config` (n-gram), 1 prefill + 1 decode worker,
              copy-heavy prompts: all complete, the decode worker's /metrics count drafts
              proposed and accepted
  lora_serve  `splitserve serve --enable-lora --lora-modules`: requests naming the adapter and
              the base model all complete, the adapter changes some prompt's output
  lora_peft   the adapter's greedy tokens in the engine against transformers + PeftModel; not
              run where peft is missing (bench/gpu/pack_deps.sh packs it and accelerate)

The offline checks run float32, as the fidelity stage's exact comparisons do (bfloat16 paths
may part at a near-tie); the serves run the device's serving dtype. The model is the demo
checkpoint (or --model): the stage shows the features work on CUDA, not how fast (serve and
engine measure that), and a tiny model keeps two serves and four engines near two minutes.
The random adapter is written in PEFT's file format directly, so building it needs no peft.
A sub-check passes (ok True), fails (False) or is not run (None, with the reason);
gpu_check_stages.features_verdict turns them into the stage's result. This module holds the
offline checks, the helpers all six share, the registry and the runner; spec_serve and
lora_serve are in gpu_check_features_serve.py.

    python -m splitserve.benchmark.gpu_check_features --device cuda --out r.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

CHECKS = ("kv_offload", "spec_exact", "async_exact", "spec_serve", "lora_serve", "lora_peft")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ADAPTER = "gpu-check-lora"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Failed(Exception):
    """The sub-check ran and found a problem (the message says which)."""


class NotRun(Exception):
    """The sub-check cannot run on this build (the message says why)."""


@dataclass
class Env:
    device: str
    model: str
    workdir: Path

    def __post_init__(self) -> None:  # bf16 serving on CUDA; the CPU dry run's sizes keep it near 2 minutes
        cuda = self.device == "cuda"
        self.serve_dtype, self.requests, self.new_tokens, self.start_timeout = \
            ("bfloat16", 32, 48, 120.0) if cuda else ("float32", 8, 24, 180.0)


def random_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)  # ids 0-4 are the demo tokenizer's special tokens
    return [rng.randrange(5, 500) for _ in range(n)]


def copy_heavy(seed: int, length: int, times: int = 3) -> list[int]:
    """A random run repeated: n-gram drafts from the prompt get accepted."""
    run = random_ids(seed, length)
    return run * times + run[: length // 2]


def verdict_of(problems: list[str], passed: str) -> str:
    if problems:
        raise Failed("; ".join(problems))
    return passed


def greedy(n: int):
    from splitserve.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def kv_offload(env: Env, row: dict) -> str:
    from splitserve.core.model_config import ModelConfig
    from splitserve.engine.llm import LLM

    bs, prefix, params = 16, random_ids(7, 100), greedy(8)  # 6 full blocks of the prefix are reusable
    cfg = ModelConfig.from_dir(env.model)
    nbytes = cfg.num_layers * 2 * bs * cfg.num_kv_heads * cfg.head_dim * 4
    with LLM(env.model, dtype="float32", device=env.device, num_kv_blocks=12, block_size=bs,
             kv_offload_bytes=64 * nbytes) as llm:
        off = llm.engine.offloader

        def run(prompt):
            out = llm.generate(prompt, params)[0]
            if not off.wait_idle():
                raise Failed("blocks were still being written down to the host tier after 10 s")
            return out

        cold, hit = run(prefix), run(prefix)
        for seed in (1, 2):  # 10 blocks each through the 12-block pool: nothing of the prefix stays
            run(random_ids(seed, 150))
        loaded_before = off.stats().counters.loaded_blocks["host"]
        again = run(prefix)
        stats = off.stats()
    c = stats.counters
    loaded = c.loaded_blocks["host"] - loaded_before
    row.update(block_nbytes=stats.block_nbytes, device_blocks=12, host_capacity=stats.host_capacity,
               stored_blocks=c.stored_blocks, loaded_blocks=c.loaded_blocks, loaded_for_the_prefix=loaded,
               cached_tokens_again=again.num_cached_tokens, dropped_blocks=c.dropped_blocks,
               hit_rate=round(stats.hit_rate, 3), equal_to_cold=again.token_ids == cold.token_ids)
    problems = []
    if c.stored_blocks["host"] < 6:
        problems.append(f"only {c.stored_blocks['host']} blocks written down to the host tier")
    if loaded != 6 or again.num_cached_tokens != 6 * bs:
        problems.append(f"the re-request loaded {loaded} of 6 prefix blocks from the host tier "
                        f"({again.num_cached_tokens} cached tokens)")
    if not (again.token_ids == hit.token_ids == cold.token_ids):
        problems.append(f"greedy tokens differ: cold {cold.token_ids}, device hit {hit.token_ids}, "
                        f"from host {again.token_ids}")
    return verdict_of(problems, f"{c.stored_blocks['host']} blocks written to host, the prefix's 6 loaded back, "
                                "tokens equal the cold run's")


def spec_exact(env: Env, row: dict) -> str:
    from splitserve.engine.llm import LLM

    prompts = [copy_heavy(s, 24) for s in range(4)] + [random_ids(9, 60)]
    kw = dict(dtype="float32", device=env.device, num_kv_blocks=128, max_num_batched_tokens=64)
    with LLM(env.model, **kw) as base:
        want = [o.token_ids for o in base.generate(prompts, greedy(32))]
    with LLM(env.model, speculative_config=NGRAM, **kw) as spec:
        got = [o.token_ids for o in spec.generate(prompts, greedy(32))]
        s = spec.engine.speculator.stats
    same = sum(a == b for a, b in zip(want, got, strict=True))
    row.update(prompts=len(prompts), identical=same, draft_tokens=s.num_draft_tokens,
               accepted_tokens=s.num_accepted_tokens, mean_accepted_length=round(s.mean_accepted_length, 3))
    problems = [f"{len(prompts) - same} of {len(prompts)} greedy outputs differ with speculation"] * (same < len(prompts))
    if not s.num_accepted_tokens:
        problems.append("no draft token was accepted: the comparison shows nothing")
    return verdict_of(problems, f"{same} greedy outputs equal with and without speculation, "
                                f"{s.num_accepted_tokens} of {s.num_draft_tokens} draft tokens accepted")


def async_exact(env: Env, row: dict) -> str:
    """--async-scheduling (engine/overlap.py) against the synchronous engine: staggered
    lengths so rows end while their next step is in flight, greedy and seeded sampling."""
    from splitserve.core.sampling_params import SamplingParams
    from splitserve.engine.llm import LLM

    prompts = [random_ids(20 + s, 8 + 9 * s) for s in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 7 * i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 7 * i, ignore_eos=True) for i in range(6)]
    kw = dict(dtype="float32", device=env.device, num_kv_blocks=128, max_num_batched_tokens=256)
    with LLM(env.model, **kw) as base:
        want = [o.token_ids for o in base.generate(prompts, params)]
    with LLM(env.model, async_scheduling=True, **kw) as overlapped:
        got = [o.token_ids for o in overlapped.generate(prompts, params)]
        steps = overlapped.engine.overlap.steps
    same = sum(a == b for a, b in zip(want, got, strict=True))
    row.update(prompts=len(prompts), identical=same, overlapped_steps=steps)
    problems = [f"{len(prompts) - same} of {len(prompts)} outputs differ with --async-scheduling"] * (same < len(prompts))
    if not steps:
        problems.append("no step overlapped: the comparison shows nothing")
    return verdict_of(problems, f"{same} outputs (greedy and seeded) equal with and without --async-scheduling, "
                                f"{steps} steps overlapped")


def write_adapter(model: str, out: Path, seed: int = 1, r: int = 8, alpha: int = 16, b_scale: float = 0.3) -> Path:
    """A random LoRA adapter in PEFT's files (A as nn.Linear's init, B as well but scaled by
    b_scale, peft's init_lora_weights=False as tests/helpers/lora_adapters.py makes them)."""
    import torch
    from safetensors.torch import save_file

    from splitserve.core.model_config import ModelConfig
    from splitserve.engine.lora.adapter import CONFIG, WEIGHTS
    from splitserve.engine.lora.args import projection_shapes

    cfg = ModelConfig.from_dir(model)
    shapes, g, tensors = projection_shapes(cfg), torch.Generator().manual_seed(seed), {}
    for layer in range(cfg.num_layers):
        for proj in LORA_TARGETS:
            (fan_in, fan_out), part = shapes[proj], "self_attn" if proj[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.rand(r, fan_in, generator=g) * 2 - 1) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = (torch.rand(fan_out, r, generator=g) * 2 - 1) / r**0.5 * b_scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model, "r": r, "lora_alpha": alpha,
        "target_modules": list(LORA_TARGETS), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": False}, indent=2))
    return out



def lora_peft(env: Env, row: dict) -> str:
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise NotRun(f"peft is not importable ({exc})") from None
    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.engine.llm import LLM
    from splitserve.engine.lora.request import LoRARequest

    adapter = write_adapter(env.model, env.workdir / "features_lora_adapter")
    prompts, new = [random_ids(300 + i, 24) for i in range(4)], 16
    with LLM(env.model, dtype="float32", device=env.device, num_kv_blocks=64, enable_lora=True) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy(new), lora_request=LoRARequest(ADAPTER, 1, str(adapter)))]
        base = [o.token_ids for o in llm.generate(prompts, greedy(new))]
    hf = AutoModelForCausalLM.from_pretrained(env.model, dtype=torch.float32).to(env.device)
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    theirs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=env.device)
            out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            theirs.append(out[0, len(p):].tolist())
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    changed = sum(a != b for a, b in zip(ours, base, strict=True))
    row.update(prompts=len(prompts), tokens=new, identical=same, changed_by_adapter=changed, first_differing_token=[
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None) for a, b in zip(ours, theirs, strict=True)])
    problems = [f"{len(prompts) - same} of {len(prompts)} outputs differ from PeftModel's"] * (same < len(prompts))
    if not changed:  # else agreeing with peft would show nothing
        problems.append("the adapter changed no output of the engine")
    return verdict_of(problems, f"{same} of {len(prompts)} greedy outputs token-identical to transformers + PeftModel "
                                f"({changed} changed by the adapter)")


def served(name: str):
    """gpu_check_features_serve's sub-check `name`, imported when it runs: that module imports this
    one's helpers at import, so importing it here at import would be a cycle."""
    def check(env: Env, row: dict) -> str:
        from splitserve.benchmark import gpu_check_features_serve

        return getattr(gpu_check_features_serve, name)(env, row)

    return check


FUNCTIONS = {"kv_offload": kv_offload, "spec_exact": spec_exact, "async_exact": async_exact,
             "spec_serve": served("spec_serve"),
             "lora_serve": served("lora_serve"), "lora_peft": lora_peft}


def run_check(name: str, env: Env) -> dict:
    row: dict = {"name": name}
    started = time.monotonic()
    print(f"features: {name} ...", file=sys.stderr, flush=True)
    try:
        ok, reason = True, FUNCTIONS[name](env, row)
    except NotRun as exc:
        ok, reason = None, f"not run: {exc}"
    except Failed as exc:
        ok, reason = False, str(exc)
    except Exception as exc:  # noqa: BLE001 - one broken sub-check must not hide the others
        traceback.print_exc()
        ok, reason = False, f"raised {exc!r}"
    row.update(ok=ok, reason=reason, seconds=round(time.monotonic() - started, 1))
    print(f"features: {name}: ok={ok} ({reason[:300]})", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, help="serve logs and the adapter (default: --out's folder)")
    ap.add_argument("--model", help="checkpoint (default: the demo model)")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset, in order")
    args = ap.parse_args(argv)
    from splitserve.engine.demo import ensure_demo_checkpoint

    env = Env(args.device, str(args.model or ensure_demo_checkpoint()), args.workdir or args.out.parent)
    env.workdir.mkdir(parents=True, exist_ok=True)
    result = {"device": args.device, "model": Path(env.model).name, "serve_dtype": env.serve_dtype, "checks": []}
    for name in [c for c in args.checks.split(",") if c]:
        result["checks"].append(run_check(name, env))
        tmp = args.out.with_suffix(".tmp")  # after each, whole: a timeout keeps what was checked
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)
    return 0 if all(row["ok"] is not False for row in result["checks"]) else 1


if __name__ == "__main__":  # the imported module's main: the serve checks raise its Failed / NotRun, not __main__'s
    from splitserve.benchmark.gpu_check_features import main as imported_main

    raise SystemExit(imported_main())
