"""Per-request sampling parameters (OpenAI-compatible meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from splitserve.core.structured import StructuredSpec

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT32_MAX = 2**32 - 1
MAX_N = 128
FLOAT32_MAX = 3.4028234663852886e38  # the wire type of temperature, top_p, min_p


def _is_int(value, lo: int, hi: int) -> bool:
    """A real integer (bool is an int subclass in Python, but not a count) in [lo, hi]:
    the bounds are those of the wire types these values travel in."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


class InvalidSamplingParams(ValueError):
    """A parameter a client sent is out of range; the message names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (0: only the chosen token)
    skip_special_tokens: bool = True
    # Logits processing (engine/logits_processors.py), in vLLM's order: logit_bias, min_tokens,
    # then the penalties. presence/frequency count output tokens (OpenAI's definition);
    # repetition divides or multiplies the logits of every token seen, prompt included (HF's).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings not checked, before this
    # Structured outputs (core/structured.py): the output must match this; the engine masks
    # every other token (engine/grammar.py) and ends the sequence when the grammar is complete.
    structured: StructuredSpec | None = None
    # The LoRA adapter the request runs under (engine/lora/), by the name it was loaded as;
    # None: the base model. It rides with the parameters so every hop (prefill, migration) keeps it.
    lora_name: str | None = None

    @property
    def processes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def resumed(self, num_produced: int) -> SamplingParams | None:
        """The budget left after `num_produced` tokens were generated elsewhere (a request
        migrated mid-stream): max_tokens counts only what is still to come. None when
        nothing is left. The one place the migration budget is computed (router and
        decode worker both ask here)."""
        if num_produced == 0 or (self.max_tokens is None and not self.min_tokens):
            return self
        if self.max_tokens is None:
            return replace(self, min_tokens=max(0, self.min_tokens - num_produced))
        if num_produced >= self.max_tokens:
            return None
        return replace(self, max_tokens=self.max_tokens - num_produced,
                       min_tokens=max(0, self.min_tokens - num_produced))

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidSamplingParams(param, msg)

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
                bad(name, f"{name} must be a number, got {value!r}")
            if abs(value) > FLOAT32_MAX:  # would arrive at the worker as inf
                bad(name, f"{name} must be at most {FLOAT32_MAX:.3g}, got {value:.3g}")
        if not _is_int(self.n, 1, MAX_N):
            bad("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k, -1, INT32_MAX):
            bad("top_k", f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and not _is_int(self.max_tokens, 1, INT32_MAX):
            bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed, INT64_MIN, INT64_MAX):
            bad("seed", f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if self.logprobs is not None and not _is_int(self.logprobs, 0, 20):
            bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t, 0, UINT32_MAX) for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be a list of token ids (non-negative integers)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                bad(name, f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            bad("repetition_penalty", f"repetition_penalty must be a number in (0, 100], got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 1024:
            bad("logit_bias", "logit_bias must map at most 1024 token ids to biases")
        for token, bias in self.logit_bias.items():
            if not _is_int(token, 0, UINT32_MAX) or not _is_number(bias) or not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"logit_bias must map token ids to numbers in [-100, 100], got {token!r}: {bias!r}")
        if not _is_int(self.min_tokens, 0, INT32_MAX):
            bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            bad("structured", f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
