"""One choice of a request at the router: its worker stream (through the dispatcher, so
migrations are invisible here), the text the client sees, its logprobs and latency
metrics, and its OpenAI-shaped chunks."""

from __future__ import annotations

import time

from splitserve.core import tracing
from splitserve.core.text_output import TextAssembler
from splitserve.router import responses as R


class ChoiceRun:
    """One choice of a request: its worker stream, text, logprobs and latency metrics."""

    def __init__(self, server, rid: str, index: int, prompt: list[int], params, decision, chat=None):
        self.server, self.rid, self.index, self.prompt, self.params = server, rid, index, prompt, params
        self.decision = decision
        self.chat = chat  # chat: a ChatOutput (router/chat_output.py), which splits reasoning and tool calls
        self.text = TextAssembler(server.tokenizer, list(params.stop), params.skip_special_tokens, params.min_tokens)
        self.want_logprobs = params.logprobs is not None
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.served_by: dict[str, str | int] = {}  # who actually served it (after any migration)
        self.start = time.monotonic()
        self.echo_text = ""  # completions with echo: the prompt, sent before the completion

    async def events(self):
        """(text delta, new logprobs, finish_reason) per worker chunk."""
        m, model = self.server.metrics, self.server.config.served_model_name
        itl = m.inter_token_latency.labels(model=model)  # looked up once, not per token
        sub_id = self.rid if self.index == 0 else f"{self.rid}-{self.index}"
        last = None
        async for ev in self.server.dispatcher.generate(sub_id, self.prompt, self.params, self.decision):
            now = time.monotonic()
            if ev.decode_worker:  # first chunk from a (possibly new) decode worker
                self.served_by = {"decode": ev.decode_worker, "prefill": ev.prefill_worker,
                                  "decode_cached": ev.num_cached_tokens, "prefill_cached": ev.prefill_cached_tokens}
            if last is None:
                self.cached_tokens = ev.num_cached_tokens
                m.time_to_first_token.labels(model=model).observe(now - self.start, tracing.exemplar())
            elif ev.token_ids:  # a chunk of n tokens (--stream-interval): n gaps of a n-th of its wait
                gap = (now - last) / len(ev.token_ids)
                for _ in ev.token_ids:
                    itl.observe(gap)
            last = now
            delta = self.text.add(ev.token_ids, final=ev.finish_reason is not None)
            self.logprobs.extend(ev.logprobs)
            finish = "stop" if delta.stopped else ev.finish_reason
            yield delta.text, ev.logprobs, finish
            if finish is not None:
                self.finish_reason = finish
                m.e2e_request_latency.labels(model=model).observe(now - self.start)
                m.request_success.labels(model=model, finish_reason=finish).inc()
                m.generation_tokens.labels(model=model).inc(len(self.text.token_ids))
                m.prompt_tokens.labels(model=model).inc(len(self.prompt))
                if self.params.lora_name is not None:  # per adapter (router/lora.py)
                    m.lora_requests.labels(adapter=self.params.lora_name).inc()
                    m.lora_generation_tokens.labels(adapter=self.params.lora_name).inc(len(self.text.token_ids))
                return  # a stop string ends the stream here; the worker call is cancelled

    async def run_to_end(self) -> None:
        async for _ in self.events():
            pass
        if self.chat is not None:
            self.chat.take(self.text.text, self.text.token_ids, final=True)

    def logprobs_out(self, chat: bool) -> list[R.TokenLogprob]:  # same entries; the shape differs later
        return [self._token_logprob(lp) for lp in self.logprobs]

    def _token_logprob(self, lp) -> R.TokenLogprob:
        tok = self.server.tokenizer
        return R.TokenLogprob(tok.decode([lp.token_id], skip_special_tokens=False), lp.logprob,
                              [(tok.decode([t], skip_special_tokens=False), v) for t, v in lp.top])

    async def chunks(self, model: str, created: int, chat: bool):
        if chat:
            async for chunk in self._chat_chunks(model, created):
                yield chunk
            return
        first = True
        offset = 0
        if self.echo_text:  # completions' echo: the prompt first, as its own chunk
            yield R.completion_chunk(self.rid, model, created, self.index, self.echo_text)
            offset, first = len(self.echo_text), False
        pending: list = []  # logprobs of tokens whose text is held back: sent with the next chunk
        async for text, lps, finish in self.events():
            pending.extend(lps)
            if not text and finish is None and not first:
                continue  # nothing visible yet (held back, or an incomplete character)
            lps, pending = pending, []
            lp_out = [self._token_logprob(lp) for lp in lps] if self.want_logprobs else None
            yield R.completion_chunk(self.rid, model, created, self.index, text, finish, lp_out, offset)
            offset += len(text)
            first = False

    async def _chat_chunks(self, model: str, created: int):
        """Chat deltas: content, reasoning_content and tool_calls as the ChatOutput finds them;
        the first carries the role, the last the finish reason."""
        first = True
        pending: list = []  # logprobs of tokens whose text is held back: sent with the next chunk
        seen = 0  # tokens given to the ChatOutput: all of the choice's, across migrations
        async for text, lps, finish in self.events():
            pending.extend(lps)
            deltas = self.chat.take(text, self.text.token_ids[seen:], final=finish is not None)
            seen = len(self.text.token_ids)
            if not deltas and finish is None and not first:
                continue  # nothing to send yet (held back, or an incomplete character)
            lps, pending = pending, []
            lp_out = [self._token_logprob(lp) for lp in lps] if self.want_logprobs else None
            reason = self.chat.finish_reason(finish)
            deltas = deltas or [{} if self.chat.message.tool_calls else {"content": ""}]
            for i, fields in enumerate(deltas):
                last = i == len(deltas) - 1
                yield R.chat_chunk(self.rid, model, created, self.index, None, reason if last else None,
                                   lp_out if i == 0 else None, first=first and i == 0, fields=fields)
            first = False
