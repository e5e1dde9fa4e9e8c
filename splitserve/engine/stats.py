"""An engine's state as other threads may see it: taken by the engine thread between steps
(LLMEngine.stats), read by anyone (load reports, /health, metrics) without a lock."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """What other threads may know of an engine: taken by the engine thread between
    steps and read by anyone (load reports, /health, metrics)."""

    steps: int
    waiting: int  # queued, not yet scheduled
    running: int  # in the running batch (prefilling or decoding)
    prefilling: int  # running with prompt tokens still to compute
    queued_prompt_tokens: int  # prompt tokens still to compute, waiting or prefilling
    remote_prefills: int  # decode side: waiting for KV from a prefill worker
    held_for_push: int  # prefill side: finished, blocks kept for a KV push
    sequences: int
    free_blocks: int
    total_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    held_blocks: int = 0  # prefill side: KV blocks of the held_for_push sequences
    prompt_tokens_computed: int = 0  # prefill tokens run so far
    step_seconds: float = 0.0  # wall time of steps so far
    loras: tuple[tuple[str, int, bool, int], ...] = ()  # per loaded adapter: name, block-hash salt, holds a slot, swaps in
    kv_offload: object = None  # OffloadStats of the host/disk tiers (engine/kv_offload/stats.py); None: no tiers
    spec_decode: object = None  # SpecDecodeStats (engine/spec/speculator.py); None: no speculation
    overlapped_steps: int = 0  # decode steps launched ahead (--async-scheduling, engine/overlap.py)
    # per MoE layer: (layer, tokens routed to each expert so far), copied from the device at most once a
    # second (engine/expert_tokens.py); (): a dense model
    expert_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # hybrid models: recurrent-state slots free and in all (engine/recurrent_state.py); 0 total: no state
    free_state_slots: int = 0
    total_state_slots: int = 0
    # time.time() of the snapshot: it counts every request handed to the engine before then
    # (a worker adds what it handed over since: worker_base/worker.py). Not compared: a
    # snapshot that differs only in its time is not sent again.
    taken_at: float = field(default=0.0, compare=False)

    @property
    def state_slot_usage(self) -> float:
        return 1.0 - self.free_state_slots / self.total_state_slots if self.total_state_slots else 0.0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0
