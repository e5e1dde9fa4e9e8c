"""Offline batch generation: `LLM(model_path).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from splitserve.core.hashing import DEFAULT_BLOCK_SIZE
from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine, RequestOutput
from splitserve.engine.lora.offline import LoRARequest, with_lora


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs]
    choices: list[GenerationOutput] = field(default_factory=list)  # all n choices (n > 1)

    @classmethod
    def from_request(cls, out: RequestOutput) -> GenerationOutput:
        return cls(out.prompt_token_ids, out.token_ids, out.text, out.finish_reason,
                   out.num_cached_tokens, out.logprobs)


class LLM:
    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", block_size: int = DEFAULT_BLOCK_SIZE,
                 num_kv_blocks: int | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, device=device,
                                             block_size=block_size, num_kv_blocks=num_kv_blocks,
                                             **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1); nothing at tp=1."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        """One output per prompt (with `.choices` for n > 1), in prompt order. `lora_request`
        (one for all prompts, or one per prompt, None for the base model) loads the adapter on
        first use (LLM(..., enable_lora=True))."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if lora_request is not None:
            params = with_lora(self.engine, params, lora_request)
        request_ids: list[list[str]] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids = []
                request_ids.append(ids)
                for choice in range(p.n):
                    rid = f"offline-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, self.engine.params_for_choice(p, choice))
                    ids.append(rid)
        except ValueError:  # one bad prompt: none of this call's requests stay queued
            for rid in (r for ids in request_ids for r in ids):
                self.engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        results = []
        for ids in request_ids:
            choices = [GenerationOutput.from_request(finished[rid]) for rid in ids]
            first = choices[0]
            first.choices = choices
            results.append(first)
        return results
