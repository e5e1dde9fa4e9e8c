"""How each family's config.json extras become ModelConfig fields, as transformers reads them
(its defaults where a field is absent; what it would serve differently refused in one line):
the experts and their routing (Mixtral, Qwen3-MoE, GLM-4.5, DeepSeek-V3/V3.2, GLM-5,
MiniMax-M2), multi-head latent attention's dims and softmax scale, and DeepSeek sparse
attention's indexer. Split from core/model_config.py, which calls moe_fields and mla_fields."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from splitserve.core.checkpoint_error import CheckpointError
from splitserve.core.rope_config import read_rope

if TYPE_CHECKING:
    from splitserve.core.model_config import ModelConfig


def moe_fields(raw: dict, family: str, layers: int, act: str, source: str) -> dict:
    """Experts, top-k, routing normalisation and sparse layers, as transformers reads them:
    Mixtral renormalises always and every layer is sparse; Qwen3-MoE renormalises iff
    `norm_topk_prob`, and layer i is sparse unless listed in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step`."""
    # transformers 5 writes `num_local_experts` for both; Qwen3-MoE's published configs `num_experts`
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    if family == "mixtral":
        experts, top_k = int(experts or 8), int(raw.get("num_experts_per_tok", 2))
        inter, renormalize, sparse = int(raw["intermediate_size"]), True, range(layers)
    elif family in ("qwen3_moe", "qwen3_next"):
        next_ = family == "qwen3_next"  # transformers' Qwen3-Next defaults: 512 experts, top-10, renormalised
        experts = int((512 if next_ else 128) if experts is None else experts)
        top_k = int(raw.get("num_experts_per_tok", 10 if next_ else 8))
        inter = int(raw.get("moe_intermediate_size", 512 if next_ else 768))
        renormalize = bool(raw.get("norm_topk_prob", next_))
        dense, step = set(raw.get("mlp_only_layers") or ()), int(raw.get("decoder_sparse_step", 1))
        sparse = [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
    elif family == "glm4_moe":
        return _glm4_moe_fields(raw, layers, act, source)
    elif family == "minimax_m2":
        return _minimax_m2_fields(raw, layers, act, source)
    elif family == "gpt_oss":
        return _gpt_oss_fields(raw, layers, source)
    elif family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):  # transformers' defaults where absent
        groups = (1, 1) if family == "glm_moe_dsa" else (8, 4)
        fields = _glm4_moe_fields(raw, layers, act, source, dict(n_group=groups[0], topk_group=groups[1],
                                                                 n_routed_experts=256, moe_intermediate_size=2048,
                                                                 first_k_dense_replace=3, routed_scaling_factor=2.5))
        types = raw.get("mlp_layer_types")  # V3.2 may list them; else first_k_dense_replace decides
        if types is not None:
            if not isinstance(types, list) or len(types) != layers or set(types) - {"dense", "sparse"}:
                raise CheckpointError(f"{source}: field 'mlp_layer_types' must list 'dense' or 'sparse' for each of "
                                      f"the {layers} layers")
            fields["moe_layers"] = tuple(i for i, t in enumerate(types) if t == "sparse")
        return fields
    else:
        return {}
    if sparse and not 0 < top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok is {top_k}; it must be between 1 and the "
                              f"number of experts ({experts})")
    if act != "silu":
        raise CheckpointError(f"{source}: activation {act!r} is not supported for experts (supported: 'silu')")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                norm_topk_prob=renormalize, moe_layers=tuple(sparse))


def _glm4_moe_fields(raw: dict, layers: int, act: str, source: str, defaults: dict | None = None) -> dict:
    """GLM-4.5's (and DeepSeek-V3's, with its `defaults`) experts, transformers' defaults when a
    field is absent: the first `first_k_dense_replace` layers dense, DeepSeek-style routing on
    the others. Their `num_nextn_predict_layers` multi-token-prediction layers are not read."""
    d = {"n_group": 1, "topk_group": 1, "n_routed_experts": 128, "moe_intermediate_size": 1408,
         "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, **(defaults or {})}

    def get(name: str):
        value = raw.get(name)
        return d[name] if value is None else value

    experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or d["n_routed_experts"])
    top_k = int(raw.get("num_experts_per_tok", 8))
    groups, kept = int(get("n_group")), int(get("topk_group"))
    if act != "silu":
        raise CheckpointError(f"{source}: activation {act!r} is not supported for experts (supported: 'silu')")
    if groups < 1 or experts % groups or (groups > 1 and experts // groups < 2) or not 1 <= kept <= groups:
        raise CheckpointError(f"{source}: n_group ({groups}) must divide n_routed_experts ({experts}) into groups "
                              f"of at least 2, and topk_group ({kept}) be between 1 and n_group")
    if not 0 < top_k <= kept * (experts // groups):
        raise CheckpointError(f"{source}: num_experts_per_tok is {top_k}; it must be between 1 and the experts of "
                              f"the topk_group kept groups ({kept * (experts // groups)})")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                moe_layers=tuple(range(int(get("first_k_dense_replace")), layers)),
                moe_scoring="sigmoid", moe_n_group=groups, moe_topk_group=kept,
                routed_scaling_factor=float(get("routed_scaling_factor")),
                n_shared_experts=int(raw.get("n_shared_experts", 1)))


def mla_fields(raw: dict, cfg: ModelConfig, source: str) -> dict:
    """DeepSeek-V3's latent attention dims (transformers' defaults when absent), the cache row
    they imply, the rope over the qk_rope_head_dim dims only, and the softmax scale: 1/sqrt of
    the q.k width, times YaRN's mscale(mscale_all_dim) squared when the rope is scaled (as
    transformers' yarn_apply_mscale and DeepSeek's reference do)."""
    dims = {}
    for name, default in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("v_head_dim", 128),
                          ("qk_nope_head_dim", 128)):
        value = raw.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**16:
            raise CheckpointError(f"{source}: field '{name}' is {value!r}; it must be an integer from 1 to 65536")
        dims[name] = value
    q_lora = raw.get("q_lora_rank", 1536)
    if q_lora is not None and (isinstance(q_lora, bool) or not isinstance(q_lora, int) or not 1 <= q_lora <= 2**16):
        raise CheckpointError(f"{source}: field 'q_lora_rank' is {q_lora!r}; it must be null or an integer from 1 "
                              "to 65536")
    if dims["qk_rope_head_dim"] % 2:
        raise CheckpointError(f"{source}: qk_rope_head_dim ({dims['qk_rope_head_dim']}) must be even (rope pairs)")
    rope_dim = dims["qk_rope_head_dim"]
    try:
        rope, _ = read_rope(raw, cfg.family, rope_dim)
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    scale = float(dims["qk_nope_head_dim"] + rope_dim) ** -0.5
    params = rope.params
    if rope.kind != "default" and params.get("mscale_all_dim"):
        factor = float(params.get("factor") or 1.0)
        mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    index = _dsa_fields(raw, cfg, rope_dim, q_lora, source) if cfg.family in ("deepseek_v32", "glm_moe_dsa") else {}
    return dict(**dims, **index, q_lora_rank=int(q_lora or 0), rope=replace(rope, rotary_dim=rope_dim),
                local_rope=None, num_kv_heads=1, attn_scale=scale,
                head_dim=dims["kv_lora_rank"] + rope_dim + index.get("index_head_dim", 0),
                rope_interleave=bool(raw.get("rope_interleave", True)),
                qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)))


def _minimax_m2_fields(raw: dict, layers: int, act: str, source: str) -> dict:
    """MiniMax-M2's experts as transformers reads them: every layer sparse, `intermediate_size`
    is each expert's, sigmoid scores with the correction bias deciding the choice, a plain
    top-k (no groups), always renormalised, unscaled, no shared expert. Fields transformers
    ignores but that would change the model are refused rather than served differently."""
    experts, top_k = int(raw.get("num_local_experts", 256)), int(raw.get("num_experts_per_tok", 8))
    if act != "silu":
        raise CheckpointError(f"{source}: activation {act!r} is not supported for experts (supported: 'silu')")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"{source}: scoring_func {raw['scoring_func']!r} is not supported for MiniMax-M2 "
                              "(supported: 'sigmoid', the only one transformers implements)")
    if raw.get("shared_intermediate_size"):
        raise CheckpointError(f"{source}: shared_intermediate_size is {raw['shared_intermediate_size']}; MiniMax-M2 "
                              "with shared experts is not supported (transformers has none)")
    if not 0 < top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok is {top_k}; it must be between 1 and the number of "
                              f"experts ({experts})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=True, moe_layers=tuple(range(layers)), moe_scoring="sigmoid")


def _gpt_oss_fields(raw: dict, layers: int, source: str) -> dict:
    """gpt-oss's experts as transformers reads them (its defaults where absent): every layer
    sparse, `intermediate_size` each expert's, top-k of the router's logits softmaxed over the
    k (the same weights as a softmax over all experts renormalised), no shared expert; the
    experts' SwiGLU clamped at `swiglu_limit`, gated by sigmoid(`swiglu_alpha` * gate). Its
    `hidden_act` is not read (transformers ignores it too)."""
    experts, top_k = int(raw.get("num_local_experts", 128)), int(raw.get("num_experts_per_tok", 4))
    if not 0 < top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok is {top_k}; it must be between 1 and the number of "
                              f"experts ({experts})")
    limit, alpha = float(raw.get("swiglu_limit", 7.0)), float(raw.get("swiglu_alpha", 1.702))
    if not (limit > 0 and alpha > 0 and math.isfinite(limit) and math.isfinite(alpha)):
        raise CheckpointError(f"{source}: swiglu_limit ({limit}) and swiglu_alpha ({alpha}) must be positive numbers")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=True, moe_layers=tuple(range(layers)), attention_sinks=True, swiglu_limit=limit,
                swiglu_alpha=alpha)


def _dsa_fields(raw: dict, cfg: ModelConfig, rope_dim: int, q_lora, source: str) -> dict:
    """DeepSeek-V3.2's and GLM-5's indexer (transformers' defaults when absent): its heads read
    the query's latent (so q_lora_rank is required), its key (index_head_dim) rotates its first
    qk_rope_head_dim dims; GLM-5's rope pairs are interleaved, and its `indexer_types` may let a
    layer reuse the previous indexer layer's choice ("shared")."""
    glm = cfg.family == "glm_moe_dsa"
    out: dict = {"index_rope_interleave": glm, "index_shared_layers": _shared_indexer_layers(raw, cfg.num_layers,
                                                                                              source) if glm else ()}
    for name, default in (("index_topk", 2048), ("index_n_heads", 32 if glm else 64), ("index_head_dim", 128)):
        value = raw.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**20:
            raise CheckpointError(f"{source}: field '{name}' is {value!r}; it must be a positive integer")
        out[name] = value
    if not q_lora:
        raise CheckpointError(f"{source}: DeepSeek sparse attention's indexer reads the query latent: q_lora_rank "
                              "must be set")
    if out["index_head_dim"] < rope_dim:
        raise CheckpointError(f"{source}: index_head_dim ({out['index_head_dim']}) is smaller than qk_rope_head_dim "
                              f"({rope_dim}), which its key rotates")
    return out


def _shared_indexer_layers(raw: dict, layers: int, source: str) -> tuple[int, ...]:
    """GLM-5's layers without an indexer of their own, as transformers derives `indexer_types`:
    the list, else a pattern of F/S, else every `index_topk_freq`-th layer from
    `index_skip_topk_offset` on has one."""
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise CheckpointError(f"{source}: field 'indexer_types' must list 'full' or 'shared' for each of the {layers} "
                              "layers, the first 'full' (a shared layer reuses an earlier layer's choice)")
    return tuple(i for i, t in enumerate(types) if t == "shared")
