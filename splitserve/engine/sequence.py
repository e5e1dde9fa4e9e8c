"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.core.text_output import TextAssembler

if TYPE_CHECKING:
    from splitserve.engine.lora.adapter import LoRAAdapter

LONG_ROPE_SALT = 0x10A6_20BE


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field-wise equality: two requests may look alike
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by output tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (context length)
    text: TextAssembler | None = None  # only when text is wanted or stop strings are set
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when its prefill first got a step here (monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full token blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_registered_blocks: int = 0  # leading blocks published to the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    finish_reason: str | None = None
    num_resumed_tokens: int = 0  # the prompt's last tokens that this request generated before a migration
    hold_kv: bool = False  # prefill worker: keep the blocks after finishing, until pushed
    long_rope: bool = False  # longrope model past its original length: long factors (engine/models/rope.py)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: object | None = None  # structured outputs: an llguidance matcher, advanced per token (engine/grammar.py)
    draft_token_ids: list[int] = field(default_factory=list)  # this step's speculative drafts (engine/spec/)
    lora: LoRAAdapter | None = None  # the adapter it runs under (engine/lora/); None: the base model
    state_slot: int = -1  # hybrid models: its recurrent-state slot while admitted (engine/block_manager.py)

    @property
    def hash_salt(self) -> int:
        """KV computed with longrope's long factors is another cache entry than the same
        tokens computed with the short ones; KV computed under a LoRA adapter is its own too."""
        return (LONG_ROPE_SALT if self.long_rope else 0) ^ (self.lora.salt if self.lora is not None else 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def first_token_times(self) -> dict[str, float]:
        """On its first token, if prefilled here: seconds queued (arrival to the first step that
        computed its prompt) and prefilling (that step to now), for RequestOutput."""
        if self.num_output_tokens != 1 or self.first_scheduled_time is None:
            return {}
        return {"queue_s": self.first_scheduled_time - self.arrival_time,
                "prefill_s": time.monotonic() - self.first_scheduled_time}

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
