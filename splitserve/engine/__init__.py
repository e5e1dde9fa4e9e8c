"""Model runtime shared by prefill and decode workers.

`from splitserve.engine import LLM` works, but nothing heavy is imported until a name is
asked for: importing `splitserve.engine.<module>` must not pull torch and the models into
a process that needs one small piece."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "splitserve.engine.llm", "GenerationOutput": "splitserve.engine.llm",
    "LLMEngine": "splitserve.engine.llm_engine", "RequestOutput": "splitserve.engine.llm_engine",
    "InvalidPromptError": "splitserve.engine.llm_engine", "EngineConfig": "splitserve.engine.config",
    "ModelConfig": "splitserve.core.model_config", "CheckpointError": "splitserve.core.model_config",
    "SamplingParams": "splitserve.core.sampling_params", "InvalidSamplingParams": "splitserve.core.sampling_params",
    "LoRARequest": "splitserve.engine.lora.request",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
