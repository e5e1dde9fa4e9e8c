"""A streamed response's events, built from the chat stream's deltas.

The chat path streams a choice as deltas of `reasoning_content`, `content` and
`tool_calls` (router/chat_output.py). Here they become the Responses API's events, each
with its `sequence_number`: `response.created` and `response.in_progress` first; then per
output item `response.output_item.added`, `response.content_part.added` (reasoning and
messages), the deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), and when the next item begins or the choice
ends their `.done` events and `response.output_item.done`; last `response.completed`
(`response.incomplete` when cut at max_output_tokens, `response.failed` after an `error`
event). The items the events built are the final response's output, ids included.
"""

from __future__ import annotations

from splitserve.router import responses_output as O


class ResponseEvents:
    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []  # items, in order; the last may still be open
        self.open: str | None = None  # "reasoning" | "message" | "call" | None
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def start(self, response: dict) -> list[dict]:
        return [self.event("response.created", response=response), self.event("response.in_progress",
                                                                               response=response)]

    def feed(self, delta: dict) -> list[dict]:
        """The events for one chat delta (its reasoning, then content, then tool calls)."""
        events: list[dict] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item; `status`: the items' (completed, or incomplete when cut)."""
        return self._close(status)

    def end(self, response: dict) -> list[dict]:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(response["status"],
                                                                                            "response.failed")
        return [self.event(kind, response=response)]

    def error(self, code: str | None, message: str, param: str | None) -> list[dict]:
        return [self.event("error", code=code, message=message, param=param)]

    # ---- items --------------------------------------------------------------------------
    @property
    def index(self) -> int:
        return len(self.output) - 1

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open != kind:
            events += self._close("completed")
            item_id = O.new_id("rs" if kind == "reasoning" else "msg")
            item = O.reasoning_item(item_id, "", "in_progress") if kind == "reasoning" else \
                O.message_item(item_id, None, "in_progress")
            part = O.reasoning_part("") if kind == "reasoning" else O.text_part("")
            item["content"] = []  # the part is added by its own event
            events.append(self._added(item))
            item["content"] = [part]
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=self.index,
                                     content_index=0, part=dict(part)))
            self.open = kind
        item = self.output[-1]
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=item["id"], output_index=self.index, content_index=0, delta=text,
                                 **extra))
        return events

    def _call(self, delta: dict) -> list[dict]:
        events = []
        function = delta.get("function") or {}
        if delta["index"] not in self.calls:  # the call's first delta names it
            events += self._close("completed")
            item = O.function_call_item(O.new_id("fc"), delta["id"], function["name"], "", "in_progress")
            events.append(self._added(item))
            self.calls[delta["index"]] = self.index
            self.open = "call"
        arguments = function.get("arguments") or ""
        if arguments:
            item = self.output[self.calls[delta["index"]]]
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.calls[delta["index"]], delta=arguments))
        return events

    def _added(self, item: dict) -> dict:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=self.index, item=dict(item))

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        item, index, kind = self.output[-1], self.index, self.open
        self.open = None
        item["status"] = status if kind != "call" else "completed"
        if kind == "call":
            done = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"])]
        else:
            part = item["content"][0]
            name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            done = [self.event(name, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                               **extra),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=dict(part))]
        return done + [self.event("response.output_item.done", output_index=index, item=_copy(item))]


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
