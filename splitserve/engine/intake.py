"""Request intake of the engine: a prompt checked (vocabulary, context, KV pool) and turned
into a Sequence with its text assembler, generator, adapter and grammar; split from
llm_engine.py, whose LLMEngine mixes it in (it uses the engine's tokenizer, scheduler,
configuration and grammars)."""

from __future__ import annotations

from dataclasses import replace

import torch

from splitserve.core.context import ContextLengthError, completion_budget
from splitserve.core.sampling_params import SamplingParams
from splitserve.core.text_output import TextAssembler
from splitserve.engine.grammar import GrammarError
from splitserve.engine.lora.engine_setup import resolve_lora
from splitserve.engine.sequence import Sequence


class InvalidPromptError(ValueError):
    """The prompt cannot be served (empty, out-of-vocabulary ids, too long)."""


class UnknownModelError(InvalidPromptError):
    """The request names a LoRA adapter this engine does not have (never loaded, or just
    unloaded): workers answer NOT_FOUND, which the router turns into 404 model_not_found."""


class RequestIntake:
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    hold_kv: bool = False, num_draws_done: int = 0, detokenize: bool = True) -> Sequence:
        """Queue a request. `hold_kv` keeps its blocks after it finishes (prefill workers
        push them, then call release_held). `num_draws_done`: sampled tokens this
        request already produced elsewhere (migration), so a seeded stream continues.
        `detokenize=False`: no output text (workers: the router builds it), so only a
        request with stop strings is detokenized, to find them."""
        seq = self._new_sequence(request_id, prompt, params, num_draws_done, detokenize)
        seq.hold_kv = hold_kv
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      num_draws_done: int = 0, detokenize: bool = True) -> Sequence:
        if request_id in self.sequences or request_id in self.held or request_id in self.remote:
            raise ValueError(f"request id {request_id!r} is already in use on this worker")
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(tokens)
        self.check_fits(tokens, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id, token_ids=tokens, num_prompt_tokens=len(tokens), params=params,
            max_total_tokens=self.max_total_tokens,
            text=(TextAssembler(self.tokenizer, list(params.stop), params.skip_special_tokens, params.min_tokens)
                  if detokenize or params.stop else None),
            generator=generator)
        seq.lora = resolve_lora(self.loras, params.lora_name)  # before any block hash: the adapter salts them
        seq.long_rope = self.long_rope_after is not None and len(tokens) > self.long_rope_after
        seq.num_resumed_tokens = num_draws_done
        if params.structured is not None:  # a migrated request's grammar state: rebuilt from its tokens
            try:
                seq.grammar = self.grammars.matcher(params.structured, tokens[len(tokens) - num_draws_done:])
            except GrammarError as exc:
                raise InvalidPromptError(str(exc)) from None
        for _ in range(num_draws_done):
            self._skip_draw(seq)
        return seq

    def _skip_draw(self, seq: Sequence) -> None:
        """Advance a seeded generator past one sampled token (the sampler draws one
        exponential per vocabulary entry per token for non-greedy requests)."""
        if seq.generator is not None and not seq.params.greedy:
            torch.empty(self.model_config.vocab_size, device=self.runner.device).exponential_(
                generator=seq.generator)

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence: the context length, and never more than the whole KV pool."""
        return int(min(self.max_model_len, self.scheduler.num_blocks * self.config.block_size))

    def validate_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise InvalidPromptError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidPromptError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_total_tokens:
            raise InvalidPromptError(
                f"the prompt has {len(tokens)} tokens; this model serves at most {self.max_total_tokens - 1} "
                "prompt tokens (context length, leaving room for one output token)")

    def check_fits(self, tokens: list[int], params: SamplingParams) -> None:
        """Prompt plus max_tokens within the context (and the KV pool): never a silent cut."""
        try:
            completion_budget(len(tokens), params.max_tokens, self.max_total_tokens, what=(
                "This model's maximum context length" if self.max_total_tokens == self.max_model_len
                else "This engine's KV cache (--num-kv-blocks x --block-size)"))
        except ContextLengthError as exc:
            raise InvalidPromptError(str(exc)) from None

    def params_for_choice(self, params: SamplingParams, index: int) -> SamplingParams:
        """Choice `index` of an n>1 request: its own sub-request, seed offset by the index."""
        seed = None if params.seed is None else params.seed + index
        return replace(params, n=1, seed=seed)
