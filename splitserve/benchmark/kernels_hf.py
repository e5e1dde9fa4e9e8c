"""The transformers baseline of the kernel benchmark: LlamaForCausalLM built from a
LlamaConfig of the same shape (random init, same dtype and device), timed on the same
prefill and decode work with `generate`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from splitserve.benchmark.kernels_model import LlamaShape


def build_hf_llama(shape: LlamaShape, dtype: torch.dtype, device: torch.device, max_position: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, max_position_embeddings=max_position, rms_norm_eps=shape.rms_eps,
        tie_word_embeddings=False,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no float32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class _StepClock:
    """A logits processor that only timestamps: generate calls it once per new token."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def _seconds_per_generated_token(model, ids: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    """Median time between consecutive tokens of a greedy `generate` (the prefill and the
    first token are not in it), measured on the second of two identical calls."""
    from transformers import LogitsProcessor, LogitsProcessorList

    clock = type("StepClock", (_StepClock, LogitsProcessor), {})(device)
    for _ in range(2):
        clock.times.clear()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:], strict=False))


def measure_hf(
    shape: LlamaShape,
    dtype: torch.dtype,
    device: torch.device,
    batches: list[int],
    context: int,
    prefill_tokens: int,
    new_tokens: int,
    timer: Callable[[Callable[[], object], int, int], float],
) -> dict:
    """Seconds per decode step (greedy `generate`, dynamic cache) at each batch size with
    `context` prompt tokens, and seconds for one `prefill_tokens` prompt (logits of the
    last token only, as a server computes them)."""
    model = build_hf_llama(shape, dtype, device, max(context + new_tokens, prefill_tokens) + 1)
    out: dict = {"decode": [], "attention_implementation": getattr(model.config, "_attn_implementation", None)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        prompt = torch.randint(0, shape.vocab, (1, prefill_tokens), generator=gen).to(device)
        seconds = timer(lambda: model(prompt, logits_to_keep=1), 1, 3)
        out["prefill"] = {"tokens": prefill_tokens, "seconds": seconds}
        for batch in batches:
            ids = torch.randint(0, shape.vocab, (batch, context), generator=gen).to(device)
            seconds = _seconds_per_generated_token(model, ids, new_tokens, device)
            out["decode"].append({"batch": batch, "context": context, "seconds_per_step": seconds})
    return out
