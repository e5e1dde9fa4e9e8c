"""LLM.generate's `lora_request`: load each named adapter once, then tag the requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.lora.adapter import LoRAAdapterError
from splitserve.engine.lora.request import LoRARequest


def with_lora(engine, params: list[SamplingParams],
              lora: LoRARequest | Sequence[LoRARequest | None]) -> list[SamplingParams]:
    """`params` with each prompt's adapter name set (the adapter loaded if it is not yet)."""
    loras = [lora] * len(params) if isinstance(lora, LoRARequest) else list(lora)
    if len(loras) != len(params):
        raise ValueError(f"{len(params)} prompts but {len(loras)} LoRA requests")
    if engine.loras is None and any(r is not None for r in loras):
        raise LoRAAdapterError("lora_request needs LLM(..., enable_lora=True)")
    for r in {r.lora_name: r for r in loras if r is not None}.values():
        engine.loras.add(r.lora_name, r.lora_path)
    return [p if r is None else replace(p, lora_name=r.lora_name) for p, r in zip(params, loras, strict=True)]


__all__ = ["LoRARequest", "with_lora"]
