"""Rotary-embedding parameters from config.json (torch-free), in the shapes transformers
4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`, per layer type for Gemma 3)
write them. The tables themselves are computed in engine/models/rope.py."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_ALIASES = {"su": "longrope"}  # Phi-3's first name for longrope


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"
    params: dict = field(default_factory=dict)  # the scaling parameters (factor, short_factor, ...)
    rotary_dim: int = 0  # leading dims of each head that rotate (partial_rotary_factor); 0: all
    max_position_embeddings: int = 0

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)

    @property
    def long_after(self) -> int | None:
        """longrope: positions beyond this use the long factors (see engine/models/rope.py)."""
        return self.original_max_position_embeddings if self.kind == "longrope" else None


def read_rope(raw: dict, family: str, head_dim: int) -> tuple[RopeSpec, RopeSpec | None]:
    """(rope of full-attention layers, rope of sliding layers when it differs)."""
    if family == "glm4_moe":  # transformers' default for GLM-4.5 configs that do not say
        raw = {"partial_rotary_factor": 0.5, **raw}
    if family == "qwen3_next":  # transformers' default
        raw = {"partial_rotary_factor": 0.25, **raw}
    if family == "minimax_m2":  # transformers: rotary_dim / head_dim unless a factor is given; theta 5e6
        raw = {"rope_theta": 5_000_000.0, **({"partial_rotary_factor": raw["rotary_dim"] / head_dim}
                                             if raw.get("rotary_dim") else {}), **raw}
    if family == "gpt_oss":  # transformers' defaults: theta 150,000, YaRN x32 from 4,096 positions
        raw = {"rope_theta": 150_000.0, **raw}
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 4096}
    params = raw.get("rope_parameters")
    if family == "gemma3":
        if params and "full_attention" in params:
            full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        else:  # transformers 4: rope_theta + rope_scaling for global layers, rope_local_base_freq for local
            full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
            local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
        local.setdefault("rope_theta", 10_000.0)
        return _spec(full, raw, head_dim), _spec(local, raw, head_dim)
    if params is None:
        params = {"rope_theta": raw.get("rope_theta", 10_000.0), **(raw.get("rope_scaling") or {})}
    return _spec(dict(params), raw, head_dim), None


def _spec(p: dict, raw: dict, head_dim: int) -> RopeSpec:
    kind = p.pop("rope_type", None) or p.pop("type", None) or "default"
    p.pop("type", None)
    kind = _ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(KINDS)})")
    theta = float(p.pop("rope_theta", raw.get("rope_theta", 10_000.0)))
    fraction = float(p.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if "original_max_position_embeddings" not in p and raw.get("original_max_position_embeddings"):
        p["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if kind in ("linear", "dynamic", "yarn", "llama3") and not p.get("factor") and kind != "yarn":
        raise ValueError(f"rope type {kind!r} needs a 'factor'")
    if kind == "longrope" and not (p.get("short_factor") and p.get("long_factor")):
        raise ValueError("rope type 'longrope' needs 'short_factor' and 'long_factor'")
    rotary = int(head_dim * fraction)
    return RopeSpec(theta, kind, p, 0 if rotary == head_dim else rotary,
                    int(raw.get("max_position_embeddings", 4096)))
