"""What a caller names to run a request under a LoRA adapter (vLLM's LoRARequest shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what requests call it (the OpenAI `model` field when served)
    lora_int_id: int  # vLLM's numeric id; kept for callers that pass it, not used for identity
    lora_path: str  # a PEFT adapter directory: adapter_config.json + adapter_model.safetensors
