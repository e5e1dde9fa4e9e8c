"""Model runtime shared by prefill and decode workers."""

from splitserve.engine.config import CheckpointError, EngineConfig, ModelConfig
from splitserve.engine.llm import LLM, GenerationOutput
from splitserve.engine.llm_engine import InvalidPromptError, LLMEngine, RequestOutput
from splitserve.engine.sampling_params import InvalidSamplingParams, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "GenerationOutput",
    "RequestOutput", "CheckpointError", "InvalidPromptError", "InvalidSamplingParams",
]
