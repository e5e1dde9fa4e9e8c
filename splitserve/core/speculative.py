"""`--speculative-config`: the JSON object vLLM takes, parsed and checked without torch (serve,
the workers and the operator refuse a bad one before anything starts).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

- ngram (prompt lookup): the drafts are the tokens that followed the latest earlier occurrence
  of the sequence's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min).
- draft_model: a second checkpoint with the target's vocabulary ("model": its directory)
  proposes the drafts (engine/spec/draft_model.py).
- mtp: the target checkpoint's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5:
  config.json's num_nextn_predict_layers >= 1) proposes them (engine/spec/mtp.py); no "model".
- disable_by_batch_size: no drafts in a step whose running batch holds more sequences than
  this (speculation costs compute that a full batch no longer has to spare).
- eagle is recognised and checked (its model must exist and share the target's vocabulary)
  but not built yet: it is refused at start, never silently ignored.

Limits: num_speculative_tokens and prompt_lookup_max at most MAX_SPECULATIVE_TOKENS (32). vLLM
sets none, but its examples and published recipes use 2-8 (ngram 3-5, EAGLE up to 8): past
that, nearly every drafted token is rejected, and each costs a verification position in every
step. A million were accepted once: every step and metrics sync then walked a million-entry
list per position, and idle workers fell out of the registry. The JSON itself is parsed with
core/bounded_json.py (1,000 nested brackets were a RecursionError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.core import bounded_json

METHODS = ("ngram", "draft_model", "mtp", "eagle")
BUILT = ("ngram", "draft_model", "mtp")
# the architectures whose MTP layers the engine builds (engine/spec/mtp_model.py)
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
MAX_SPECULATIVE_TOKENS = 32  # num_speculative_tokens and prompt_lookup_max (see above)
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
         "model"}


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot be served; the message is one line."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None

    def to_json(self) -> str:
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            fields |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if self.disable_by_batch_size is not None:
            fields["disable_by_batch_size"] = self.disable_by_batch_size
        if self.model is not None:
            fields["model"] = self.model
        return json.dumps(fields, separators=(",", ":"))


def _positive(raw: dict, key: str, default: int | None, limit: int | None = None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpeculativeConfigError(f"{key} must be a positive integer, got {value!r}")
    if limit is not None and value > limit:
        raise SpeculativeConfigError(f"{key} is {value}; at most {limit} is supported (drafts that long are "
                                     "almost all rejected; docs/architecture.md, Speculative decoding)")
    return value


def parse_speculative_config(value: str | dict | SpeculativeConfig | None, target_model: str | None = None,
                             check_files: bool = True) -> SpeculativeConfig | None:
    """A checked config (None: no speculation). A draft model's vocabulary is compared with
    the `target_model` checkpoint's (when given); `check_files=False` checks the shape only
    (the operator: the checkpoints are in the pods, not here)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = bounded_json.loads(value)  # depth-bounded: deep nesting is a refusal, not a RecursionError
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError(f"must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise SpeculativeConfigError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
    method = value.get("method")
    if method not in METHODS:
        raise SpeculativeConfigError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    if "num_speculative_tokens" not in value:
        raise SpeculativeConfigError("num_speculative_tokens is required")
    k = _positive(value, "num_speculative_tokens", None, MAX_SPECULATIVE_TOKENS)
    lo = _positive(value, "prompt_lookup_min", 1, MAX_SPECULATIVE_TOKENS)
    hi = _positive(value, "prompt_lookup_max", 4, MAX_SPECULATIVE_TOKENS)
    if method == "ngram" and lo > hi:
        raise SpeculativeConfigError(f"prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
    model = value.get("model")
    own_model = method in ("ngram", "mtp")  # no second checkpoint
    if not own_model and (not isinstance(model, str) or not model):
        raise SpeculativeConfigError(f"method {method} needs \"model\": a checkpoint directory")
    if own_model and model is not None:
        raise SpeculativeConfigError(f"method {method} takes no model" + (
            " (its drafter is the target checkpoint's own MTP layer)" if method == "mtp" else ""))
    if not own_model and check_files:
        _check_draft_model(model, target_model)
    if method == "mtp" and check_files and target_model is not None:
        problem = mtp_problem(_config(target_model, "target model"))
        if problem:
            raise SpeculativeConfigError(f"method mtp: {problem}")
    if method not in BUILT:
        raise SpeculativeConfigError(f"method {method!r} is not built yet (built: {', '.join(BUILT)}); "
                                     "docs/architecture.md, Speculative decoding")
    return SpeculativeConfig(method, k, lo, hi, _positive(value, "disable_by_batch_size", None), model)


def mtp_problem(raw: dict) -> str | None:
    """Why a checkpoint's config.json cannot draft with its MTP layers (None: it can)."""
    layers = raw.get("num_nextn_predict_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        return f"the model's config.json needs num_nextn_predict_layers >= 1 (its MTP layers), got {layers!r}"
    arch = (raw.get("architectures") or [None])[0]
    if arch not in MTP_ARCHITECTURES:
        return f"MTP layers are built for {', '.join(MTP_ARCHITECTURES)}, not {arch}"
    return None


def _config(model: str, what: str) -> dict:
    config = Path(model) / "config.json"
    if not config.is_file():
        raise SpeculativeConfigError(f"{what} {model}: no config.json there")
    try:
        raw = bounded_json.load_file(config)
    except (OSError, ValueError) as exc:
        raise SpeculativeConfigError(f"{what} {model}: cannot read config.json: {exc}") from None
    if not isinstance(raw, dict):
        raise SpeculativeConfigError(f"{what} {model}: config.json is not a JSON object")
    return raw


def _vocab_size(model: str, what: str) -> int | None:
    raw = _config(model, what)
    text = raw.get("text_config")
    return raw.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)


def _check_draft_model(model: str, target_model: str | None) -> None:
    vocab = _vocab_size(model, "draft model")
    target = _vocab_size(target_model, "target model") if target_model is not None else vocab
    if vocab != target:
        raise SpeculativeConfigError(f"draft model {model} has vocab_size {vocab}, the target model {target}: "
                                     "drafts must use the target's vocabulary")
