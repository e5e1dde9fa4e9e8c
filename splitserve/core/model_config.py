"""A checkpoint's model configuration, read from its config.json without torch (the router
and the CLIs check a model before any process starts; workers build the model from it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message names file and field."""


# architecture -> (family, q/k/v projections have a bias)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", None),  # None: read `attention_bias` from the config
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(raw.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: field 'architectures' is {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")

        def need(name: str):
            if name not in raw or raw[name] is None:
                raise CheckpointError(f"{source}: required field '{name}' is missing")
            return raw[name]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
        # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = rope or raw.get("rope_scaling") or None
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise CheckpointError(
                    f"{source}: rope type {kind!r} is not supported (supported: default, linear, llama3)")
            scaling["rope_type"] = kind
            if kind == "default":
                scaling = None
        family, qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window")
        if family == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served. Sliding-window attention is not implemented, so a
        windowed model (Mistral) is capped at its window, where full attention is exact."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings
