"""Architecture -> model class. The table of what is served is core/architectures.py; this
maps each entry's family to the class that builds it."""

from __future__ import annotations

from torch import nn

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from splitserve.engine.models.gemma import GemmaForCausalLM
from splitserve.engine.models.glm4_moe import Glm4MoeForCausalLM
from splitserve.engine.models.gpt_oss import GptOssForCausalLM
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.minimax_m2 import MiniMaxM2ForCausalLM
from splitserve.engine.models.moe import MoeForCausalLM
from splitserve.engine.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,  # the checkpoint's fused qkv_proj / gate_up_proj are our names
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "mixtral": MoeForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "deepseek_v32": DeepseekV3ForCausalLM,  # with DSA's indexer (models/dsa.py)
    "glm_moe_dsa": DeepseekV3ForCausalLM,  # GLM-5: the same, its indexer's rope interleaved, some layers sharing
    "gpt_oss": GptOssForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,  # hybrid: recurrent state slots (engine/recurrent_state.py)
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.family]
    except KeyError:
        raise CheckpointError(f"{cfg.architecture}: no engine model for family {cfg.family!r}") from None
