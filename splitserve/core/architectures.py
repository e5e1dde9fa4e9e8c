"""The model architectures splitserve serves, in one place: `serve`, the CLIs and the
router check a checkpoint against this table before any process or Ray starts, the
README's table is generated from it (`python -m splitserve.core.architectures`), and
each entry names the engine module that builds it and what it was checked against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    family: str  # the engine's model module: splitserve/engine/models/<module>.py
    module: str
    model_types: tuple[str, ...]  # config.json `model_type` values naming it
    covers: str  # checkpoints people run with it


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "llama", ("llama",), "Llama 2, Llama 3 / 3.1 / 3.2 / 3.3 (llama3 rope)"),
    "MistralForCausalLM": Architecture("mistral", "llama", ("mistral",), "Mistral 7B (sliding window)"),
    "Qwen2ForCausalLM": Architecture("qwen2", "llama", ("qwen2",), "Qwen2, Qwen2.5 (yarn for long context)"),
    "Qwen3ForCausalLM": Architecture("qwen3", "llama", ("qwen3",), "Qwen3 dense (q/k RMSNorm)"),
    "Phi3ForCausalLM": Architecture("phi3", "llama", ("phi3",), "Phi-3, Phi-3.5, Phi-4, Phi-4-mini (longrope)"),
    "Gemma2ForCausalLM": Architecture("gemma2", "gemma", ("gemma2",), "Gemma 2 (soft-capping, alternating windows)"),
    "Gemma3ForCausalLM": Architecture("gemma3", "gemma", ("gemma3_text",), "Gemma 3 text models (1B; 5:1 windows)"),
    "MixtralForCausalLM": Architecture("mixtral", "moe", ("mixtral",), "Mixtral 8x7B, 8x22B (top-2 of 8 experts)"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "moe", ("qwen3_moe",),
                                        "Qwen3-MoE 30B-A3B, 235B-A22B (top-8 of 128 experts, q/k RMSNorm)"),
    "Glm4MoeForCausalLM": Architecture("glm4_moe", "glm4_moe", ("glm4_moe",),
                                       "GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7 (sigmoid top-8 of 128-160 "
                                       "experts, score-correction bias, a shared expert; partial rotary)"),
    "MiniMaxM2ForCausalLM": Architecture("minimax_m2", "minimax_m2", ("minimax_m2",),
                                         "MiniMax-M2, M2.1, M2.5 (sigmoid top-8 of 256 experts, score-correction "
                                         "bias; q/k RMSNorm over all heads at once; partial rotary)"),
    "DeepseekV3ForCausalLM": Architecture("deepseek_v3", "deepseek_v3", ("deepseek_v3",),
                                          "DeepSeek-V3, V3.1, R1, Kimi K2 (multi-head latent attention: one "
                                          "compressed latent cached per token; grouped sigmoid top-8 of 256 "
                                          "experts, a shared expert)"),
    "DeepseekV32ForCausalLM": Architecture("deepseek_v32", "deepseek_v3", ("deepseek_v32",),
                                           "DeepSeek-V3.2 (V3's model with DeepSeek sparse attention: a lightning "
                                           "indexer picks each query's top-2048 tokens)"),
    "GlmMoeDsaForCausalLM": Architecture("glm_moe_dsa", "deepseek_v3", ("glm_moe_dsa",),
                                         "GLM-5 (MLA with DeepSeek sparse attention, interleaved indexer rope, "
                                         "layers sharing an indexer's choice; sigmoid top-8 of 256 experts)"),
    "Qwen3NextForCausalLM": Architecture("qwen3_next", "qwen3_next", ("qwen3_next",),
                                         "Qwen3-Next 80B-A3B (Gated DeltaNet + gated attention 3:1, recurrent "
                                         "state slots; top-10 of 512 experts + a gated shared expert). LLM and "
                                         "colocated serve only (docs/architecture.md, hybrid models)"),
    "GptOssForCausalLM": Architecture("gpt_oss", "gpt_oss", ("gpt_oss",),
                                      "gpt-oss-20b, gpt-oss-120b (attention sinks, alternating 128-token windows, "
                                      "YaRN; top-4 of 32-128 experts with biases and a clamped SwiGLU)"),
}

CHECKED_AGAINST = ("transformers' generate on tiny random checkpoints (float32, CPU): greedy tokens identical, "
                   "top-5 logprobs within 1e-4, through the engine, prefix-cache hits and `splitserve serve` "
                   "disaggregated")


def architecture_for(config: dict) -> str | None:
    """The architecture a config.json names (`architectures`, else its `model_type`)."""
    archs = config.get("architectures")
    if archs:
        return archs[0]
    model_type = config.get("model_type", "")
    return next((name for name, a in ARCHITECTURES.items() if model_type in a.model_types), None)


def unsupported(name: str | None, source: str) -> str:
    """The one line said when a checkpoint's architecture is not served."""
    return (f"{source}: architecture {name!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}")


def markdown_table() -> str:
    rows = ["| architecture | covers | engine module |", "|---|---|---|"]
    rows += [f"| `{name}` | {a.covers} | `engine/models/{a.module}.py` |" for name, a in ARCHITECTURES.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
