"""What a hybrid model (recurrent state per sequence: Qwen3-Next) runs with today, in one place:
EngineConfig, `serve` and the worker mains ask `hybrid_problem` before any process starts and
print its one line. The foundation (issue 53, part 1) serves hybrids through `LLM` and a
colocated `serve` (one decode worker, no prefill workers); the rest needs the state to travel
or be saved, which is not built yet (docs/architecture.md, "Hybrid models with recurrent state").

Torch-free: the CLIs import it before any process starts."""

from __future__ import annotations

from splitserve.core.compatibility import FEATURES

# feature (core/compatibility.py's keys) -> why a hybrid cannot use it yet
REFUSED: dict[str, str] = {
    "tensor-parallel": "its recurrent-state heads are not sharded over ranks",
    "expert-parallel": "it needs tensor parallelism, which a hybrid does not run",
    "lora": "adapters on the Gated DeltaNet projections are not built",
    "cuda-graphs": "the recurrent layers read per-sequence state slots that the captured decode step does not stage",
    "async-scheduling": "the overlapped (padded) decode step does not stage the recurrent-state slots",
    "ngram": "rejected drafts would need the recurrent state rolled back, which is not built",
    "draft-model": "rejected drafts would need the recurrent state rolled back, which is not built",
    "mtp": "rejected drafts would need the recurrent state rolled back, which is not built",
    "kv-offload-host": "offloaded blocks are prefix-cache blocks, and a hybrid's prefix cache is off (no state "
                       "checkpoints at block boundaries yet)",
    "kv-offload-disk": "offloaded blocks are prefix-cache blocks, and a hybrid's prefix cache is off (no state "
                       "checkpoints at block boundaries yet)",
    "mooncake": "disaggregated KV transfer does not ship the recurrent state yet",
    "fp8-kv-cache": "no test has run an FP8 KV cache with a hybrid's attention layers yet",
    "quantized": "no quantized hybrid checkpoint has been checked yet",
}


def hybrid_problem(cfg, features: set[str] | frozenset[str], prefill_workers: int = 0,
                   decode_workers: int = 1) -> str | None:
    """Why this hybrid (`cfg`, a ModelConfig with recurrent layers) cannot run as asked, or None;
    None for a model that is not a hybrid."""
    if cfg is None or not cfg.linear_layers:
        return None
    name = f"{cfg.architecture} (a hybrid model with recurrent state)"
    for feature in FEATURES:
        if feature in features and feature in REFUSED:
            return f"{name} cannot run with {FEATURES[feature]} yet: {REFUSED[feature]}"
    if prefill_workers:
        return (f"{name} cannot be served disaggregated yet (prefill workers): the prefill worker does not ship "
                f"the recurrent state with the KV blocks; serve it colocated with --prefill-workers 0")
    if decode_workers > 1:
        return (f"{name} runs on one decode worker for now: migration and peer prefix pulls between decode "
                f"workers do not carry the recurrent state yet")
    return None
