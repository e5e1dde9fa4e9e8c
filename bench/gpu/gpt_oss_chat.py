"""The chat half of bench/gpu/gpt_oss_20b.py: harmony conversations through the `openai` client
against a running `serve`, each answer checked for form.

Every answer must be well formed, whatever the model: `content` and `reasoning_content` are text
or absent and hold no harmony control token, the two are not the same text, `finish_reason` is
stop / length / tool_calls and says tool_calls exactly when there are tool calls, each call names
an offered tool. A trained gpt-oss must also answer as expected: reasoning present, a final
answer, the weather tool called with JSON arguments naming a city, no call after the tool's
result. A random checkpoint (the dry run) cannot, so there `expected` is recorded, not counted;
instead a streamed answer must equal the same request's non-streamed one (greedy, float32).
"""

from __future__ import annotations

import json

CONTROL = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "system", "content": "Use the tools when they help."},
               {"role": "user", "content": "What is the weather in Paris right now?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AFTER_TOOL = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "sunny"}'}]
ARITHMETIC = [{"role": "user", "content": "What is 17 * 23? Answer with the number only."}]
PRIME = [{"role": "user", "content": "Name one prime number between 20 and 30."}]

# name: (messages, reasoning_effort, tools, streamed, what a trained model answers)
CONVERSATIONS = {
    "effort_low": (ARITHMETIC, "low", None, False, "answer"),
    "effort_low_streamed": (ARITHMETIC, "low", None, True, "answer"),
    "effort_medium_streamed": (ARITHMETIC, "medium", None, True, "answer"),
    "effort_high": (PRIME, "high", None, False, "answer"),
    "tool_call": (ASK_WEATHER, "low", [WEATHER], False, "call"),
    "tool_call_streamed": (ASK_WEATHER, "low", [WEATHER], True, "call"),
    "tool_result_followup": (AFTER_TOOL, "low", [WEATHER], False, "answer"),
}
SAME_REQUEST = [("effort_low", "effort_low_streamed"), ("tool_call", "tool_call_streamed")]


def ask(client, model: str, messages, effort, tools, stream: bool, max_tokens: int) -> dict:
    """One chat completion, streamed deltas put back together: the fields as plain values."""
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens, reasoning_effort=effort)
    if tools:
        kw["tools"] = tools
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        msg = choice.message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        return {"content": msg.content or None, "reasoning_content": getattr(msg, "reasoning_content", None) or None,
                "tool_calls": calls, "finish_reason": choice.finish_reason}
    content, reasoning, calls, finish, interleaved = [], [], {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        r = getattr(delta, "reasoning_content", None)
        interleaved += bool(r and delta.content)  # one delta carrying both channels mixes them
        reasoning += [r] if r else []
        content += [delta.content] if delta.content else []
        for c in delta.tool_calls or []:
            part, fn = calls.setdefault(c.index, {"name": "", "arguments": ""}), c.function
            part["name"] += (fn.name or "") if fn else ""
            part["arguments"] += (fn.arguments or "") if fn else ""
    return {"content": "".join(content) or None, "reasoning_content": "".join(reasoning) or None,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "deltas_mixing_channels": interleaved}


def form_problems(answer: dict, tools) -> list[str]:
    """What makes an answer malformed, whatever the model (empty when none)."""
    out = []
    for field in ("content", "reasoning_content"):
        value = answer[field]
        if value is not None and not isinstance(value, str):
            out.append(f"{field} is {type(value).__name__}")
        elif value and any(t in value for t in CONTROL):
            out.append(f"{field} holds a harmony control token")
    if answer["content"] and answer["content"] == answer["reasoning_content"]:
        out.append("content and reasoning_content are the same text")
    if answer["finish_reason"] not in ("stop", "length", "tool_calls"):
        out.append(f"finish_reason {answer['finish_reason']!r}")
    if (answer["finish_reason"] == "tool_calls") != bool(answer["tool_calls"]):
        out.append(f"finish_reason {answer['finish_reason']!r} with {len(answer['tool_calls'])} tool calls")
    names = {t["function"]["name"] for t in tools or []}
    out += [f"a call to {c['name']!r}, not an offered tool" for c in answer["tool_calls"] if c["name"] not in names]
    if answer.get("deltas_mixing_channels"):
        out.append("a streamed delta carries reasoning and content together")
    return out


def expectation_problems(answer: dict, want: str) -> list[str]:
    """What a trained gpt-oss should have done and did not (empty when it did)."""
    out = [] if answer["reasoning_content"] else ["no reasoning_content"]
    if want == "answer":
        out += [] if answer["content"] else ["no content"]
        out += [] if answer["finish_reason"] == "stop" else [f"finish_reason {answer['finish_reason']!r}"]
        out += ["a tool call where an answer was due"] if answer["tool_calls"] else []
        return out
    if answer["finish_reason"] != "tool_calls" or [c["name"] for c in answer["tool_calls"]] != ["get_weather"]:
        return out + [f"not one get_weather call (finish_reason {answer['finish_reason']!r})"]
    try:
        args = json.loads(answer["tool_calls"][0]["arguments"])
    except ValueError:
        return out + ["the arguments are not JSON"]
    return out + ([] if isinstance(args, dict) and isinstance(args.get("city"), str) else ["no city argument"])


def run_chat(base_url: str, model: str, max_tokens: int, trained: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=600)
    rows, answers = {}, {}
    for name, (messages, effort, tools, stream, want) in CONVERSATIONS.items():
        try:
            answers[name] = answer = ask(client, model, messages, effort, tools, stream, max_tokens)
        except Exception as exc:  # noqa: BLE001 - an API error is this check's result
            rows[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
            continue
        form, expected = form_problems(answer, tools), expectation_problems(answer, want)
        rows[name] = {"effort": effort, "streamed": stream, "answer": answer, "form_problems": form,
                      "expected_problems": expected, "ok": not form and (not trained or not expected)}
    for a, b in SAME_REQUEST:
        same = a in answers and b in answers and all(
            answers[a][k] == answers[b][k] for k in ("content", "reasoning_content", "tool_calls", "finish_reason"))
        rows[f"{b}_equals_{a}"] = {"ok": same or trained, "equal": same,
                                   "counted": not trained}  # bf16 batches may differ on a GPU: reported there
    try:
        resp = client.responses.create(model=model, input="Say hello in French, in one word.",
                                       reasoning={"effort": "low"}, max_output_tokens=max_tokens, temperature=0)
        kinds = [item.type for item in resp.output]
        problems = [] if resp.status in ("completed", "incomplete") else [f"status {resp.status!r}"]
        if trained:
            problems += [] if "reasoning" in kinds else ["no reasoning item"]
            problems += [] if resp.output_text else ["no output_text"]
        rows["responses_create"] = {"ok": not problems, "status": resp.status, "output_items": kinds,
                                    "output_text": resp.output_text, "problems": problems}
    except Exception as exc:  # noqa: BLE001
        rows["responses_create"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"ok": all(r["ok"] for r in rows.values()), "checks": rows}
