"""A checkpoint's model configuration, read from its config.json without torch (the router
and the CLIs check a model before any process starts; workers build the model from it).

One reader for every family in `core/architectures.py`: the families differ in which
config fields they use (Gemma's soft-capping and query scalar, Qwen3's q/k norms,
per-layer sliding windows, per-layer-type rope), and the defaults transformers applies
when a field is absent are applied here the same way. (Just over 300 lines: the families'
extra fields already live in core/family_fields.py and the hybrids' checks in core/hybrid.py;
what stays is the one reader and its range checks.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from splitserve.core import bounded_json
from splitserve.core.architectures import ARCHITECTURES, architecture_for, unsupported
from splitserve.core.checkpoint_error import CheckpointError
from splitserve.core.family_fields import mla_fields, moe_fields
from splitserve.core.rope_config import RopeSpec, read_rope

SUPPORTED_ARCHITECTURES = ARCHITECTURES  # the one table; kept under its old name
FULL, SLIDING = "full_attention", "sliding_attention"
_ACTIVATIONS = {"silu", "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec  # full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]  # FULL or SLIDING, one per layer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm of q and k per head before rope (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + w) RMSNorms in float32, sandwich norms, scaled embeddings
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    local_rope: RopeSpec | None = None  # sliding-window layers, when they differ (Gemma 3)
    # mixture of experts (Mixtral, Qwen3-MoE); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the sparse MoE block
    # DeepSeek-style routing (GLM-4.5; engine/models/moe_routing.py): sigmoid scores, a
    # correction bias, grouped top-k, a scaled sum, shared experts beside the routed ones
    moe_scoring: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # multi-head latent attention (DeepSeek-V3; engine/models/mla.py), 0 when absent. For MLA,
    # num_kv_heads (1) and head_dim (kv_lora_rank + qk_rope_head_dim) describe the KV cache's row:
    # one compressed latent plus one rope key per token, shared by every query head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope over (x0, x1), (x2, x3)... pairs (DeepSeek's layout)
    # DeepSeek sparse attention (DSA: DeepSeek-V3.2; engine/models/dsa.py), index_topk 0 when absent:
    # a lightning indexer picks each query's index_topk tokens; its key joins the cache row
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves
    index_shared_layers: tuple[int, ...] = ()  # GLM-5: layers reusing the previous indexer layer's choice
    # gpt-oss (engine/models/gpt_oss.py): per-head attention sinks, and experts with biases whose
    # SwiGLU clamps gate and up at swiglu_limit and gates with sigmoid(swiglu_alpha * gate); 0: absent
    attention_sinks: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # hybrid models (Qwen3-Next): the layers with recurrent state instead of KV (Gated DeltaNet);
    # layer_types says FULL for them (no window), kv_layers the ones that do have KV
    linear_layers: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)  # config.json, for family extras

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory needs config.json)")
        try:  # bounded: a hostile config.json (100,000 nested brackets, gigabytes) is one line, not a crash
            raw = bounded_json.load_file(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        except ValueError as exc:  # JSONDecodeError (too deep, too large, garbled) or UnicodeDecodeError
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object")
        arch = architecture_for(raw)
        if arch not in ARCHITECTURES:
            raise CheckpointError(unsupported(arch, source))
        family = ARCHITECTURES[arch].family

        def need(name: str):
            if name not in raw or raw[name] is None:
                raise CheckpointError(f"{source}: required field '{name}' is missing")
            return raw[name]

        _check_sizes(raw, source)
        gemma = family in ("gemma2", "gemma3")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in _ACTIVATIONS:
            raise CheckpointError(f"{source}: activation {act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        # MiniMax-M2: transformers' default head_dim is 128, not hidden // heads (64 for M2); gpt-oss 64
        head_dim = int(raw.get("head_dim") or {"minimax_m2": 128, "gpt_oss": 64}.get(family, hidden // heads))
        try:
            rope, local_rope = read_rope(raw, family, head_dim)
        except ValueError as exc:
            raise CheckpointError(f"{source}: {exc}") from exc
        window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
            window = None
        if family == "minimax_m2":  # transformers' MiniMax-M2 attends to every position
            window = None
        if family == "gpt_oss" and "sliding_window" not in raw:
            window = 128  # transformers' default
        window = int(window) if window else None
        eos = raw.get("eos_token_id")
        attention_bias = bool(raw.get("attention_bias", family == "gpt_oss"))
        cfg = cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5 if family == "gpt_oss" else 1e-6)),
            rope=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            # Qwen2 biases q/k/v always; Llama/Qwen3/Gemma follow attention_bias (o_proj too)
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=attention_bias and family in ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss"),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=window,
            layer_types=_layer_types(raw, family, layers, window, source),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=act,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3")
            or (family == "glm4_moe" and bool(raw.get("use_qk_norm"))),
            gemma_norms=gemma,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma and raw.get("query_pre_attn_scalar")
            else 0.0,
            local_rope=local_rope,
            linear_layers=_linear_layers(raw, layers, source) if family == "qwen3_next" else (),
            raw=raw,
            **moe_fields(raw, family, layers, act, source),
        )
        if family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
            cfg = replace(cfg, **mla_fields(raw, cfg, source))
        return cfg

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        return self.sliding_window or 0 if self.layer_types[layer] == SLIDING else 0

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose KV the pool holds, in order (every layer but a hybrid's recurrent ones)."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a fixed-size recurrent state per sequence (engine/recurrent_state.py)."""
        return bool(self.linear_layers)

    @property
    def kv_parts(self) -> int:
        """Tensors a layer caches per token: key and value (2), or MLA's one latent row (1)."""
        return 1 if self.kv_lora_rank else 2


def kv_bytes_per_token(cfg: ModelConfig, tp_size: int = 1, element_size: int = 2) -> int:
    """KV bytes a token takes in one rank's pool: K and V of its KV heads (replicated when there
    are fewer heads than ranks), or MLA's one latent row, in every layer."""
    heads = cfg.num_kv_heads // tp_size if cfg.num_kv_heads >= tp_size else 1
    return len(cfg.kv_layers) * cfg.kv_parts * heads * cfg.head_dim * element_size


def shardable_problem(cfg: ModelConfig, size: int) -> str | None:
    """Why this model cannot be split over `size` tensor-parallel ranks (engine/parallel/sharding.py
    splits heads, KV heads and intermediate sizes evenly), or None; torch-free, so that serve
    refuses it before any process starts."""
    if size <= 1:
        return None
    if cfg.family == "phi3":
        return "its checkpoint stores q/k/v and gate/up fused in one tensor, which the loader does not split per rank"
    if cfg.num_heads % size:
        return f"num_attention_heads ({cfg.num_heads}) is not divisible by it"
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        return f"num_key_value_heads ({cfg.num_kv_heads}) neither divides it nor is divisible by it"
    if cfg.num_layers > len(cfg.moe_layers) and cfg.intermediate_size % size:  # some layer has a dense MLP
        return f"intermediate_size ({cfg.intermediate_size}) is not divisible by it"
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        return f"moe_intermediate_size ({cfg.moe_intermediate_size}) is not divisible by it"
    return None


# Sanity bounds on a config's sizes, far above any released model (Llama 3.1 405B: 126 layers,
# 128 heads, hidden 16,384, intermediate 53,248; Gemma 3: a 262,144-token vocabulary; DeepSeek-V3:
# 256 experts; Llama 4: 10M positions): a config beyond them is hostile or garbled, and is refused before a worker tries
# to build it (num_hidden_layers 100,000 took 194 s and 8 GB before failing inside a worker).
SIZE_LIMITS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "hidden_size": 2**20, "intermediate_size": 2**20, "moe_intermediate_size": 2**20, "head_dim": 2**16,
               "vocab_size": 2**22, "num_local_experts": 4096, "num_experts": 4096, "n_routed_experts": 4096,
               "num_experts_per_tok": 4096,
               # the rope table is built this long unless --max-model-len is given (Llama 4 Scout: 10,485,760)
               "max_position_embeddings": 2**24}


def _check_sizes(raw: dict, source: str) -> None:
    """Each size field that is present: an integer within SIZE_LIMITS (0 allowed for the expert
    fields: a dense model may carry them as 0; _moe_fields checks them where they are used)."""
    for name, limit in SIZE_LIMITS.items():
        value = raw.get(name)
        if value is None:
            continue
        least = 0 if name in ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok") else 1
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= limit:
            raise CheckpointError(f"{source}: field '{name}' is {value!r}; it must be an integer from {least} "
                                  f"to {limit}")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                              f"({kv_heads})")


def _layer_types(raw: dict, family: str, layers: int, window: int | None, source: str) -> tuple[str, ...]:
    """Which layers attend through the sliding window, as transformers decides."""
    types = raw.get("layer_types")
    if family in ("deepseek_v32", "glm_moe_dsa", "qwen3_next"):  # DSA, or no window (hybrid: _linear_layers)  # "indexed_attention" on every layer: DSA, no window
        return (FULL,) * layers
    if types is not None:
        if len(types) != layers or set(types) - {FULL, SLIDING}:
            raise CheckpointError(f"{source}: field 'layer_types' must list {FULL!r} or {SLIDING!r} for each of "
                                  f"the {layers} layers")
        return tuple(types) if window else (FULL,) * layers
    if not window:
        return (FULL,) * layers
    if family in ("gemma2", "gpt_oss"):
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(layers))
    if family == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    if family == "qwen2" or family == "qwen3":  # layers from max_window_layers on use the window
        first = int(raw.get("max_window_layers", layers))
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    return (SLIDING,) * layers  # Mistral, Phi-3: every layer


_HYBRID_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim")


def _linear_layers(raw: dict, layers: int, source: str) -> tuple[int, ...]:
    """Qwen3-Next's Gated DeltaNet layers: `layer_types`, else transformers' default (every
    `full_attention_interval`-th layer, 4, attends); its state sizes must be present."""
    for name in _HYBRID_FIELDS:
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**16:
            raise CheckpointError(f"{source}: field '{name}' is {value!r}; it must be an integer from 1 to 65536")
    if raw["linear_num_value_heads"] % raw["linear_num_key_heads"]:
        raise CheckpointError(f"{source}: linear_num_value_heads ({raw['linear_num_value_heads']}) is not a multiple "
                              f"of linear_num_key_heads ({raw['linear_num_key_heads']})")
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {FULL, "linear_attention"}:
        raise CheckpointError(f"{source}: field 'layer_types' must list 'linear_attention' or {FULL!r} for each of "
                              f"the {layers} layers")
    if FULL not in types:
        raise CheckpointError(f"{source}: field 'layer_types' has no {FULL!r} layer (a hybrid needs one)")
    return tuple(i for i, t in enumerate(types) if t == "linear_attention")
