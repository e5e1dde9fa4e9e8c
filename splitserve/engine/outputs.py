"""What the engine hands back: a request's output after a step, and the blocks reserved
for a remote prefill."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.core.logprobs import TokenLogprobs


@dataclass
class RequestOutput:
    # With EngineConfig.delta_outputs (a serving worker's engine) the cumulative fields
    # (prompt_token_ids, token_ids, text, logprobs) are left empty: only this step's part.
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # produced by this step
    text: str  # output text so far (stop strings excluded)
    new_text: str  # text that became final this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int
    logprobs: list[TokenLogprobs]
    new_logprobs: list[TokenLogprobs]
    error: str | None = None  # set when the engine failed the request (finish_reason "abort")
    # On the output with the first token of a request prefilled by this engine: seconds from
    # add_request to its first step (queue) and from there to this token (prefill), vLLM's
    # request_queue_time / request_prefill_time. None on every other output.
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass
class Reservation:
    """Decode side of a remote prefill: where the prefill worker writes the prompt's KV."""

    num_cached_tokens: int  # prompt tokens this worker's prefix cache already holds
    skip_blocks: int  # leading blocks not to send (cached here)
    block_ids: list[int]  # destination blocks, from `skip_blocks` on
    block_hashes: list[int]  # chained hashes of the full ones
