"""Structured outputs, engine side: one llguidance matcher per constrained sequence, and
the batch's token bitmask each step.

- Compilation is cached per spec (an LRU of compiled matchers; a request gets a cheap
  deep copy), so a schema every request repeats is compiled once per worker.
- A matcher is advanced with every token the sequence accepts. A sequence that arrives
  with tokens it generated elsewhere (a migration) gets a matcher fed those tokens, so
  the grammar state is rebuilt from the stream itself.
- The bitmask of every constrained sequence due a token this step is computed in one call
  (llguidance's executor, on its own threads) on a helper thread while the model runs the
  forward pass; unconstrained rows are never touched, and the sampler applies the mask to
  the processed logits before choosing. EOS is in a mask only when the grammar accepts
  the output as complete; the engine ends a sequence whose grammar can take nothing more.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from splitserve.core.structured import InvalidStructuredSpec, StructuredSpec, grammar_text

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A spec that does not compile, or resumed tokens the grammar does not accept."""


@dataclass
class BatchMask:
    """Allowed tokens of some rows of a batch: bit t of row r's words says whether token t may follow."""

    rows: list[int]  # indices into the sampled sequences
    bitmask: torch.Tensor  # int32 [num sampled sequences, ceil(vocab / 32)]


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 128,
                 mask_threads: int | None = None):
        # vocab_size is the model's (its logits width); ids the tokenizer lacks are never allowed
        self.unavailable = ""  # why this tokenizer cannot be constrained (the engine still serves the rest)
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        except Exception as exc:  # a tokenizer.json llguidance cannot read: constrained requests are refused
            log.warning("structured outputs are unavailable with this tokenizer: %s", exc)
            self.tokenizer, self.unavailable = None, str(exc)
        self.vocab_size = self.tokenizer.vocab_size if self.tokenizer is not None else vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[StructuredSpec, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor(mask_threads)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.compilations = 0  # cache misses (tests, metrics)

    def close(self) -> None:
        self._helper.shutdown(wait=False, cancel_futures=True)

    # ---- matchers ---------------------------------------------------------------------
    def matcher(self, spec: StructuredSpec, resumed: list[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, advanced over `resumed` (tokens this request generated
        before a migration)."""
        if self.tokenizer is None:
            raise GrammarError(f"structured outputs are unavailable with this model's tokenizer: {self.unavailable}")
        matcher = self._compile(spec).deep_copy()
        if resumed and not matcher.consume_tokens(list(resumed)):
            raise GrammarError(f"the {len(resumed)} resumed tokens do not match the {spec.kind}: "
                               f"{matcher.get_error()}")
        return matcher

    def _compile(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        try:
            text = grammar_text(spec)
        except InvalidStructuredSpec as exc:
            raise GrammarError(f"invalid {spec.kind} ({spec.param}): {exc}") from None
        compiled = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if compiled.is_error():
            raise GrammarError(f"invalid {spec.kind} ({spec.param}): {compiled.get_error().splitlines()[0]}")
        self.compilations += 1
        self._compiled[spec] = compiled
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled

    # ---- the batch's bitmask ---------------------------------------------------------------
    def start_masks(self, matchers: list[llguidance.LLMatcher | None]) -> Future[BatchMask] | None:
        """Begin computing the bitmask for the sequences about to be sampled (None for an
        unconstrained one); None when none is constrained. The result is ready to apply once
        the forward pass is done; no matcher may change until then."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        work = [(matchers[i], i) for i in rows]
        return self._helper.submit(self._fill, work, bitmask, rows)

    def _fill(self, work: list, bitmask: torch.Tensor, rows: list[int]) -> BatchMask:
        self._executor.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        return BatchMask(rows, bitmask)


def advance(matcher: llguidance.LLMatcher, token: int, request_id: str) -> None:
    """The sequence accepted `token`. Only tokens the mask allowed are sampled, so a refusal
    is a bug (or a prefill worker that sampled under another grammar); the matcher is then
    in its error state and the engine ends the sequence with "abort"."""
    if not matcher.consume_token(token):
        log.error("request %s: token %d is not allowed by its grammar (%s); ending it", request_id, token,
                  matcher.get_error())


_BITS = torch.arange(32, dtype=torch.int32)


def apply_mask(logits: torch.Tensor, mask: BatchMask, copy: bool) -> torch.Tensor:
    """Disallowed tokens of the masked rows to -inf (a copy of `logits` when `copy`)."""
    if copy:
        logits = logits.clone()
    rows = torch.tensor(mask.rows, dtype=torch.long)
    words = mask.bitmask[rows]
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).reshape(len(mask.rows), -1)[:, : logits.shape[-1]]
    allowed = allowed.to(logits.device, non_blocking=True).bool()
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
