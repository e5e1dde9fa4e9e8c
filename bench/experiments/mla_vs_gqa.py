"""Multi-head latent attention against grouped-query attention at an equal parameter count,
on this machine's CPU, float32: tokens of KV capacity per GiB, decode step time (batch 1 and 8
at a 512-token context), and MLA's two exact prefill forms (absorbed like decode, or
expanded per head as transformers computes it) on a 1,024-token prompt, which picks
engine/models/mla.py's EXPANDED_PREFILL.

    python -m bench.experiments.mla_vs_gqa   # bench/results/mla_vs_gqa.json, ~4 min here

Both models are random (transformers' own classes, saved by it), 8 layers of hidden 1,024 and
16 query heads with dense MLPs (first_k_dense_replace = every layer, so only attention
differs): MLA with q_lora_rank 384, kv_lora_rank 256, rope 32, nope 64, v 64 (DeepSeek-V3's
proportions at this width); GQA with 4 KV heads of 64 (Llama-3-8B's 32:8 grouping), its MLP
widened until the parameter counts match within 1%. Timings alternate the models over 3
rounds and report medians (the machine is shared and noisy).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.core.model_config import ModelConfig, kv_bytes_per_token
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.mla import MlaAttention

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "mla_vs_gqa.json"
COMMON = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, max_position_embeddings=4096,
              bos_token_id=0, eos_token_id=[1], tie_word_embeddings=False)
MLA = dict(kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
           num_key_value_heads=16, first_k_dense_replace=8, n_routed_experts=8, num_experts_per_tok=2,
           n_group=1, topk_group=1, moe_intermediate_size=64, intermediate_size=2816)
GQA_KV_HEADS = 4
ROUNDS = 3


def save(model, tok, out: Path) -> Path:
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    model.save_pretrained(str(out))
    return out


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build(root: Path) -> tuple[Path, Path, dict]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from splitserve.engine.demo import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    mla = DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=tok.get_vocab_size(), **COMMON, **MLA)).float()
    target = params(mla)
    inter = 2816
    while True:  # widen GQA's MLP until the counts match
        cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), **COMMON, num_key_value_heads=GQA_KV_HEADS, head_dim=64,
                          intermediate_size=inter)
        with torch.device("meta"):
            n = params(LlamaForCausalLM(cfg))
        if n >= target * 0.995:
            break
        inter += 16
    gqa = LlamaForCausalLM(cfg).float()
    for model in (mla, gqa):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    shapes = {"mla_params": params(mla), "gqa_params": params(gqa), "gqa_intermediate_size": inter}
    return save(mla, tok, root / "mla"), save(gqa, tok, root / "gqa"), shapes


_fresh = iter(range(10**9))


def fresh(prompt: list[int]) -> list[int]:
    """`prompt` whose first two tokens were never used before: no prefix-cache hit across calls."""
    n = next(_fresh)
    return [5 + n % 1000, 5 + n // 1000 % 1000, *prompt[2:]]


def decode_step_ms(llm: LLM, batch: int, context: int = 512, steps: int = 24) -> float:
    """Median wall time of `steps` pure decode steps (engine.step()) of `batch` sequences that
    have `context` tokens each, after their prefills finished."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{next(_fresh)}", fresh([5 + (i * 7 + j) % 1000 for j in range(context)]), params)
    while engine.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # the prefills (and the first decode steps of the early ones)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1000


def prefill_ms(llm: LLM, expanded: bool, prompt: list[int]) -> tuple[float, list[int]]:
    for m in llm.engine.runner.model.modules():
        if isinstance(m, MlaAttention):
            m.expanded_prefill = expanded
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return (time.perf_counter() - t0) * 1000, out.token_ids


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        mla_dir, gqa_dir, shapes = build(Path(tmp))
        result: dict = {"shapes": {**shapes, "mla": MLA, "gqa_kv_heads": GQA_KV_HEADS, **COMMON},
                        "torch_threads": torch.get_num_threads()}
        kv = {}
        for name, d in (("mla", mla_dir), ("gqa", gqa_dir)):
            cfg = ModelConfig.from_dir(d)
            for dtype, size in (("bfloat16", 2), ("float32", 4), ("fp8", 1)):
                per = kv_bytes_per_token(cfg, 1, size)
                kv[f"{name}_{dtype}"] = {"bytes_per_token": per, "tokens_per_gib": 2**30 // per}
        result["kv_capacity"] = kv
        llms = {name: LLM(str(d), num_kv_blocks=2048, max_num_batched_tokens=1024, max_num_seqs=8)
                for name, d in (("mla", mla_dir), ("gqa", gqa_dir))}
        steps: dict[str, list[float]] = {}
        for _ in range(ROUNDS):
            for name, llm in llms.items():
                for batch in (1, 8):
                    steps.setdefault(f"{name}_batch{batch}", []).append(decode_step_ms(llm, batch))
        result["decode_step_ms_median"] = {k: round(statistics.median(v), 2) for k, v in steps.items()}
        result["decode_step_ms_runs"] = {k: [round(x, 2) for x in v] for k, v in steps.items()}
        prompt = [5 + (j * 13) % 1000 for j in range(1024)]
        forms: dict[str, list[float]] = {"absorbed": [], "expanded": []}
        tokens: dict[str, list[list[int]]] = {"absorbed": [], "expanded": []}
        for _ in range(ROUNDS):
            for form in ("absorbed", "expanded"):
                ms, ids = prefill_ms(llms["mla"], form == "expanded", fresh(prompt))
                forms[form].append(ms)
                tokens[form].append(ids)
        result["mla_prefill_1024_ms_median"] = {k: round(statistics.median(v), 1) for k, v in forms.items()}
        result["mla_prefill_1024_ms_runs"] = {k: [round(x, 1) for x in v] for k, v in forms.items()}
        result["mla_prefill_forms_same_token"] = tokens["absorbed"] == tokens["expanded"]
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
