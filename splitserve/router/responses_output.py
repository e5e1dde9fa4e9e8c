"""Response objects of the Responses API: output items, usage, and the `response` itself.

Pure builders of plain dicts, in the shape of the `openai` SDK's `Response` (the tests
parse them with it). A chat choice's message becomes output items in the order the model
wrote them: its reasoning (a `reasoning` item with `reasoning_text` content; no summary is
generated), its text (a `message` with one `output_text` part), then its tool calls (one
`function_call` item each; `call_id` is the chat call's id).
"""

from __future__ import annotations

import time
import uuid

from splitserve.router.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    """resp_, msg_, rs_, fc_: OpenAI's prefixes."""
    return f"{prefix}_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [reasoning_part(text)], "status": status}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, status: str = "completed") -> list[dict]:
    """A chat choice's message (router/chat_output.py message_dict) → output items; `status`:
    the last one's (incomplete when the choice was cut)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    if items and items[-1]["type"] != "function_call":
        items[-1]["status"] = status  # a cut choice: the item it was cut in
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def finish_status(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished choice: cut at max_output_tokens is incomplete."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(rid: str, created: int, req: ResponsesRequest, output: list[dict], status: str,
                     usage: dict | None = None, incomplete: dict | None = None, error: dict | None = None) -> dict:
    """The `response` object; the request's settings are repeated as OpenAI repeats them."""
    done = status in ("completed", "incomplete", "failed")
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if done and status != "failed" else None,
            "error": error, "incomplete_details": incomplete, "model": req.model, "output": output,
            "usage": usage, "store": req.store, "background": False, **req.echo}
