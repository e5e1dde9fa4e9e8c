"""spec.engine.speculative: vLLM's speculative-config object, checked as the engine checks it
(core/speculative.py, without reading checkpoints: they are in the pods) and passed to the
decode workers as --speculative-config (prefill workers produce one token: no speculation)."""

from __future__ import annotations

from splitserve.core.speculative import SpeculativeConfigError, parse_speculative_config


def speculative_flag(value, problems: list[str]) -> str:
    """The --speculative-config JSON for the decode workers ("" when absent); a bad object
    adds one problem (the CR's status says it)."""
    if value is None:
        return ""
    if not isinstance(value, dict):
        problems.append(f"spec.engine.speculative must be an object, got {type(value).__name__}")
        return ""
    try:
        config = parse_speculative_config(value, check_files=False)
    except SpeculativeConfigError as exc:
        problems.append(f"spec.engine.speculative: {exc}")
        return ""
    return config.to_json() if config is not None else ""
