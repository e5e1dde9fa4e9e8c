"""transformers as the reference: greedy generation and raw log-softmax, one prompt at a time."""

from __future__ import annotations

from functools import lru_cache

import torch

from tests.helpers.run_cache import cached_json, model_digest


@lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, dtype: str = "float32",
              eos: bool = False) -> list[int]:
    """Greedy tokens from transformers' generate (no padding: batch of one), cached between
    runs by the model directory's content, the prompt and the settings (tests/helpers/run_cache.py)."""
    key = ("hf_greedy", model_digest(model_dir), list(prompt_ids), max_new_tokens, dtype, eos)
    return cached_json("references", key, lambda: _hf_greedy(model_dir, prompt_ids, max_new_tokens, dtype, eos))


def _hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, dtype: str, eos: bool) -> list[int]:
    model = hf_model(str(model_dir), dtype)
    ids = torch.tensor([prompt_ids])
    extra = {} if eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=0 if eos else max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.eos_token_id[0], **extra)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model_dir, token_ids: list[int], dtype: str = "float32") -> torch.Tensor:
    """log-softmax over the vocabulary at every position of `token_ids` ([len, vocab])."""
    model = hf_model(str(model_dir), dtype)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_generate_logprobs(model_dir, prompt_ids: list[int], max_new_tokens: int,
                         dtype: str = "float32") -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the log-softmax of the raw logits at every generated step
    ([max_new_tokens, vocab]) from transformers' generate itself: for longrope models
    generate recomputes the cache when a sequence passes the original length, which a
    single forward pass over the whole sequence does not show."""
    from splitserve.benchmark.gpu_fidelity import generate_with_logprobs

    return generate_with_logprobs(hf_model(str(model_dir), dtype), prompt_ids, max_new_tokens)


def hf_generate_top_logprobs(model_dir, prompt_ids: list[int], max_new_tokens: int, k: int,
                             dtype: str = "float32") -> tuple[list[int], list[tuple[list[int], list[float]]]]:
    """hf_generate_logprobs reduced to what a top-k comparison reads: the greedy tokens and,
    per step, the top-k token ids and their log-probabilities, cached between runs like
    hf_greedy (the full [steps, vocab] rows are too large to keep)."""
    def compute():
        tokens, logprobs = hf_generate_logprobs(model_dir, prompt_ids, max_new_tokens, dtype)
        top = logprobs.topk(k)
        return tokens, [list(step) for step in zip(top.indices.tolist(), top.values.tolist(), strict=True)]

    key = ("hf_generate_top_logprobs", model_digest(model_dir), list(prompt_ids), max_new_tokens, k, dtype)
    tokens, steps = cached_json("references", key, compute)
    return tokens, [tuple(step) for step in steps]


def assert_greedy_and_top_logprobs_equal(model_dir, prompts: list[list[int]], outputs, new_tokens: int, top: int = 5,
                                 tolerance: float = 1e-4) -> None:
    """Each engine output (generated with logprobs=`top`) has transformers' greedy tokens, and at
    every step transformers' top-`top` token ids in order with log-probabilities within
    `tolerance` of transformers' raw log-softmax."""
    for prompt, out in zip(prompts, outputs, strict=True):
        want, ref = hf_generate_logprobs(model_dir, prompt, new_tokens)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
        for step, lp in enumerate(out.logprobs):
            best = ref[step].topk(top)
            assert [t for t, _ in lp.top] == best.indices.tolist(), (len(prompt), step)
            assert max(abs(v - r) for (_, v), r in zip(lp.top, best.values.tolist(), strict=True)) < tolerance


def assert_prefix_hit_equals_transformers(llm, model_dir, prompt: list[int], new_tokens: int, min_cached: int):
    """`prompt` (sharing a prefix with an earlier request) reuses at least `min_cached` cached
    tokens and still gives transformers' greedy tokens."""
    from splitserve.engine import SamplingParams

    hit = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    assert hit.num_cached_tokens >= min_cached, hit.num_cached_tokens
    assert hit.token_ids == hf_greedy(model_dir, prompt, new_tokens)
