"""Multi-LoRA serving: PEFT adapters in a fixed number of slots, batched across a step."""

from splitserve.engine.lora.adapter import LoRAAdapterError
from splitserve.engine.lora.manager import UnknownLoRAError
from splitserve.engine.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest", "UnknownLoRAError"]
