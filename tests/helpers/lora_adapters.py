"""Random PEFT LoRA adapters for the small checkpoints, written by `peft` itself, and
transformers + PeftModel (float32) as the reference for their greedy tokens.

`init_lora_weights=False` gives random A and B; B is scaled down so an adapter changes the
model's greedy tokens without collapsing them into one repeated token. Seeded: the same
arguments write the same bytes."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from tests.helpers.run_cache import cached_json, model_digest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# three adapters unlike each other: every projection; attention q/v with rsLoRA; o and the MLP at rank 16
ADAPTERS = {
    "all-r8": dict(seed=1, r=8, alpha=16, targets=ALL),
    "qv-r4-rslora": dict(seed=2, r=4, alpha=8, targets=("q_proj", "v_proj"), rslora=True),
    "mlp-r16": dict(seed=3, r=16, alpha=8, targets=("o_proj", "gate_proj", "up_proj", "down_proj")),
}


def make_adapter(base: Path, out: Path, seed: int, r: int, alpha: int, targets=ALL, rslora: bool = False,
                 b_scale: float = 0.3, **extra) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_model.safetensors").is_file():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                                            init_lora_weights=False, **extra))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    peft.save_pretrained(out)
    return out


@lru_cache(maxsize=8)
def _peft_model(base: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of base + adapter (the base model alone for None), cached between runs."""
    from tests.helpers.reference import hf_greedy

    if adapter is None:
        return hf_greedy(base, prompt, new_tokens)
    key = ("peft_greedy", model_digest(base), model_digest(adapter), list(prompt), new_tokens)

    def run() -> list[int]:
        model = _peft_model(str(base), str(adapter))
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return cached_json("references", key, run)
