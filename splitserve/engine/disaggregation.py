"""The engine's side of disaggregation (LLMEngine mixes it in): a prefill worker keeps a
finished prompt's blocks until they are pushed (`held`); a decode worker reserves a prompt's
blocks for a prefill worker to fill (`remote`), then admits the request with the first token
that worker sampled, or frees them when the remote prefill fails."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestOutput, Reservation

if TYPE_CHECKING:
    from splitserve.engine.sequence import Sequence


class Disaggregation:
    """Needs LLMEngine's scheduler, config, sequences, held, remote, _new_sequence,
    _skip_draw and token_output."""

    held: dict[str, Sequence]
    remote: dict[str, Sequence]

    def release_held(self, request_id: str) -> None:
        """Prefill side: the KV was pushed (or the push failed); the blocks may go."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.scheduler.free(seq)

    def held_summary(self) -> dict[str, int]:
        """Prefill side: KV blocks held for a push, per request."""
        return {rid: len(seq.block_table) for rid, seq in self.held.items()}

    def held_blocks(self, request_id: str, skip_blocks: int) -> tuple[list[int], list[int]]:
        """Prefill side: (block ids, hashes of the full ones) of a finished request's
        prompt from `skip_blocks` on, to push."""
        return self.scheduler.prompt_blocks(self.held[request_id], skip_blocks)

    def reserve_remote_prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                               num_draws_done: int = 0, detokenize: bool = True) -> Reservation | None:
        """Decode side: allocate the prompt's blocks (reusing this worker's prefix cache)
        for a prefill worker to fill. None when the pool cannot hold the prompt now."""
        if self.scheduler.bm.state is not None:  # (serve and the prefill worker refuse it first: core/hybrid.py)
            raise ValueError(f"{self.model_config.architecture}: a remote prefill ships no recurrent state yet; "
                             "a hybrid model is served colocated")
        seq = self._new_sequence(request_id, prompt, params, num_draws_done, detokenize)
        if not self.scheduler.reserve(seq):
            return None
        self.remote[request_id] = seq
        skip = seq.num_cached_tokens // self.config.block_size
        block_ids, hashes = self.scheduler.prompt_blocks(seq, skip)
        return Reservation(seq.num_cached_tokens, skip, block_ids, hashes)

    def complete_remote_prefill(self, request_id: str, first_token: int,
                                logprob: TokenLogprobs | None) -> RequestOutput:
        """Decode side: the prompt's KV arrived and the prefill worker sampled the first
        token; the request joins the running batch."""
        seq = self.remote.pop(request_id)
        self.scheduler.join_computed(seq)
        self._skip_draw(seq)  # the first token was drawn on the prefill worker
        self.sequences[request_id] = seq
        return self.token_output.append(seq, first_token, logprob)

    def cancel_remote_prefill(self, request_id: str) -> None:
        """Decode side: the remote prefill failed or the client left; free the blocks."""
        seq = self.remote.pop(request_id, None)
        if seq is not None:
            self.scheduler.free(seq)
