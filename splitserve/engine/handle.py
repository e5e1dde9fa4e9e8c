"""One engine handle: the calls a worker makes on its engine, defined once.

An engine runs in one of three places: in the caller's thread (LLMEngine itself: `LLM`,
tests), on a thread of the worker (AsyncEngine) or in a process of its own
(EngineProcess, engine_child.py). `EngineCalls` lists the engine's calls; LLMEngine has
each of them, synchronous (it may take more optional arguments and return more: its
`add_request` returns the Sequence, a worker's returns nothing). `EngineHandle` is what a
worker holds: the same calls, awaited, plus the life of the loop (start, stop, health,
the stats of the last step).

The calls are written here once and reach the engine by name: a handle implements only
`_invoke(method, *args)`, which runs `LLMEngine.<method>(*args)` where the engine lives
(AsyncEngine: on its thread, between steps; EngineProcess: one ("call", id, method, args)
message over the pipe, answered by one ("result", id, error, value)). Only the names in
CALLS cross the pipe. tests/engine/test_engine_handle.py holds the three classes to the
signatures below."""

from __future__ import annotations

from typing import Protocol

from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestOutput, Reservation
from splitserve.engine.stats import EngineStats


class EngineCalls(Protocol):
    """The engine's calls. Their bodies forward by name; LLMEngine defines its own."""

    async def _invoke(self, method: str, *args, result: bool = True):
        """LLMEngine.<method>(*args) where the engine lives; its value, unless `result` is False
        (then None: add_request's Sequence stays with the engine). Each handle defines it:
        AsyncEngine on its thread, EngineProcess over the pipe."""
        ...

    # ---- requests -------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                          hold_kv: bool = False, num_draws_done: int = 0) -> None:
        """Queue a request; its outputs reach the handle's `on_outputs`. No text: the router
        builds it (detokenize=False)."""
        await self._invoke("add_request", request_id, prompt, params, hold_kv, num_draws_done, False, result=False)

    async def abort(self, request_id: str, free_reservation: bool = True) -> bool:
        return await self._invoke("abort", request_id, free_reservation)

    # ---- disaggregation (engine/disaggregation.py) ------------------------------------------
    async def reserve_remote_prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                                     num_draws_done: int = 0) -> Reservation | None:
        return await self._invoke("reserve_remote_prefill", request_id, prompt, params, num_draws_done, False)

    async def complete_remote_prefill(self, request_id: str, first_token: int,
                                      logprob: TokenLogprobs | None) -> RequestOutput:
        return await self._invoke("complete_remote_prefill", request_id, first_token, logprob)

    async def cancel_remote_prefill(self, request_id: str) -> None:
        await self._invoke("cancel_remote_prefill", request_id, result=False)

    async def held_blocks(self, request_id: str, skip_blocks: int) -> tuple[list[int], list[int]]:
        return await self._invoke("held_blocks", request_id, skip_blocks)

    async def release_held(self, request_id: str) -> None:
        await self._invoke("release_held", request_id, result=False)

    async def held_summary(self) -> dict[str, int]:
        return await self._invoke("held_summary")

    async def cached_block_hashes(self) -> list[int]:
        return await self._invoke("cached_block_hashes")

    # ---- peer prefix pulls (engine/peer_prefix.py) ------------------------------------------
    async def reserve_pull(self, prefix: list[int]) -> tuple[list[int], list[int], int | None, int] | None:
        return await self._invoke("reserve_pull", prefix)

    async def adopt_pulled(self, block_ids: list[int], hashes: list[int], parent: int | None) -> None:
        await self._invoke("adopt_pulled", block_ids, hashes, parent, result=False)

    async def drop_pulled(self, block_ids: list[int]) -> None:
        await self._invoke("drop_pulled", block_ids, result=False)

    async def pin_prefix(self, prefix: list[int], skip_blocks: int) -> tuple[list[int], list[int]]:
        return await self._invoke("pin_prefix", prefix, skip_blocks)

    async def unpin(self, block_ids: list[int]) -> None:
        await self._invoke("unpin", block_ids, result=False)

    # ---- LoRA adapters (engine/lora/engine_setup.py) ----------------------------------------
    async def add_lora(self, name: str, path: str) -> int:
        return await self._invoke("add_lora", name, path)

    async def remove_lora(self, name: str) -> bool:
        return await self._invoke("remove_lora", name)


CALLS = frozenset(name for name in vars(EngineCalls)
                  if not name.startswith("_") and callable(vars(EngineCalls)[name]))


class EngineHandle(EngineCalls, Protocol):
    """What a worker holds: the engine's calls and its loop's life. The KV pool is the
    engine's own (shared memory for an engine process): the KV transfer reads and writes it."""

    stats: EngineStats | None  # as of the last loop iteration
    steps: int
    step_failures: int
    kv_pool: object

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def alive(self) -> bool: ...

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): dead, a step stalled, frozen, a tensor-parallel rank silent."""
        ...

    def step_running_s(self) -> float | None:
        """How long the step in progress has been running; None between steps."""
        ...
