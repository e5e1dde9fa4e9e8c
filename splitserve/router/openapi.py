"""The OpenAPI 3.1 document of the router's HTTP API, served at GET /openapi.json.

It describes what the server accepts and answers, limits included (`n`, `stop`,
`seed`...), so generated clients and fuzzers (schemathesis in tests/security) work
from it. Fields the parser accepts but ignores (any unknown field) are allowed by
`additionalProperties`; the OpenAI parameters this server refuses are listed with the
values it accepts.
"""

from __future__ import annotations

from splitserve.router.admission import (
    INT32_MAX,
    INT64_MAX,
    MAX_CHOICES,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    UINT32_MAX,
)

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}

_SAMPLING = {
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "default": 1},
    "temperature": {"type": "number", "minimum": 0, "default": 1.0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0},
    "top_k": {"type": "integer", "minimum": -1, "maximum": INT32_MAX, "default": -1,
              "description": "-1: no top-k cut"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.0},
    "seed": {"type": "integer", "minimum": -(2**63) + MAX_CHOICES, "maximum": INT64_MAX - MAX_CHOICES,
             "description": "choice i uses seed + i"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer", "minimum": 0,
                                                                    "maximum": UINT32_MAX}},
    "ignore_eos": {"type": "boolean", "default": False},
    "skip_special_tokens": {"type": "boolean", "default": True},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "description": "only with stream: true",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
    # Known OpenAI parameters this server cannot honour: only their neutral values pass.
    "echo": {"type": "boolean", "enum": [False]},
    "suffix": {"type": "string", "maxLength": 0},
    "best_of": {"type": "integer", "enum": [1]},
    "presence_penalty": {"type": "number", "enum": [0]},
    "frequency_penalty": {"type": "number", "enum": [0]},
}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}


def _error(description: str, retry_after: bool = False) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    if retry_after:
        out["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                          "schema": {"type": "integer", "minimum": 1}}}
    return out


def _generation_responses(kind: str) -> dict:
    return {
        "200": {"description": f"the {kind} (JSON), or a text/event-stream of chunks when stream is true",
                "content": {"application/json": {"schema": {"type": "object", "required": ["id", "object", "choices"],
                                                            "properties": {"id": {"type": "string"},
                                                                           "object": {"type": "string"},
                                                                           "choices": {"type": "array"},
                                                                           "usage": {"type": "object"}}}},
                            # each server-sent event: `data:` holds a JSON chunk, an error, or [DONE]
                            "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                             "properties": {"data": {"type": "string"}}}}}},
        "400": _error("invalid request (names the parameter)"),
        "401": _error("missing or wrong API key"),
        "404": _error("unknown model"),
        "413": _error("request body larger than 64 MiB"),
        "429": _error("too many requests in flight (--max-queued-requests)", retry_after=True),
        "503": _error("no healthy decode worker, or every worker tried failed"),
        "504": _error("the request's deadline (--request-timeout) passed"),
    }


def _tokenizer_responses(schema: dict) -> dict:
    return {"200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
            "400": _error("invalid request (names the parameter), or longer than the context"),
            "401": _error("missing or wrong API key"),
            "404": _error("unknown model"),
            "413": _error("request body larger than --max-request-body-mb"),
            "429": _error("too many long inputs being tokenized already")}


_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object", "description": "a JSON schema"}}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_STRUCTURED = {  # vLLM's structured-output extras (router/structured_fields.py): one at a time
    "structured_outputs": {"type": "object", "properties": {
        "json": {"type": "object"}, "regex": {"type": "string", "minLength": 1},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "grammar": {"type": "string", "minLength": 1}, "json_object": {"type": "boolean"}}},
    "guided_json": {"type": "object", "description": "a JSON schema"},
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "guided_grammar": {"type": "string", "minLength": 1, "description": "Lark or GBNF"},
}


def openapi_document(served_model: str, max_model_len: int, auth: bool) -> dict:
    completion = {"type": "object", "required": ["model", "prompt"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "enum": [served_model]},
        "prompt": {"description": f"text or token ids; prompt + max_tokens <= {max_model_len} tokens",
                   "oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS}]},
        "max_tokens": {"type": "integer", "minimum": 1, "default": 16},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **_STRUCTURED, **_SAMPLING}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "name": {"type": "string"}, "tool_call_id": {"type": "string"}, "reasoning_content": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL}}}
    chat = {"type": "object", "required": ["model", "messages"], "additionalProperties": True, "properties": {
        "model": {"type": "string", "enum": [served_model]},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean", "default": False},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "description": "needs logprobs: true"},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "schema": {"type": "object"},
                "strict": {"type": "boolean"}}}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]}, "function": _FUNCTION}}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "function"], "properties": {
                                      "type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object", "required": ["name"]}}}]},
        "parallel_tool_calls": {"type": "boolean", "default": True},
        "chat_template_kwargs": {"type": "object", "description": "variables for the chat template"},
        **_STRUCTURED, **_SAMPLING}}
    security = [{"bearer": []}] if auth else []
    model_name = {"type": "string", "enum": [served_model], "description": "optional: the served model"}
    tokenize = {"oneOf": [
        {"type": "object", "required": ["prompt"], "additionalProperties": True, "properties": {
            "model": model_name, "prompt": {"type": "string", "description": f"at most {max_model_len} tokens"},
            "add_special_tokens": {"type": "boolean", "default": True},
            "return_token_strs": {"type": "boolean", "default": False}}},
        {"type": "object", "required": ["messages"], "additionalProperties": True, "properties": {
            "model": model_name, "messages": {"type": "array", "minItems": 1, "items": message},
            "add_generation_prompt": {"type": "boolean", "default": True},
            "add_special_tokens": {"type": "boolean", "default": False},
            "return_token_strs": {"type": "boolean", "default": False},
            # vLLM's options that change the rendering: refused (only their neutral values pass)
            "continue_final_message": {"type": "boolean", "enum": [False]},
            "chat_template": {"type": "null"}}}]}
    detokenize = {"type": "object", "required": ["tokens"], "additionalProperties": True, "properties": {
        "model": model_name, "tokens": {"type": "array", "maxItems": max_model_len,
                                        "items": {"type": "integer", "minimum": 0}}}}
    tokens_out = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}}
    text_out = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    model_object = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "root": {"type": "string"}, "parent": {"type": "string", "description": "a LoRA adapter's base model"}}}
    plain = {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    return _with_expect_refusal({
        "openapi": "3.1.0",
        "info": {"title": "splitserve router", "version": "1",
                 "description": "OpenAI-compatible completions served by disaggregated prefill/decode workers."},
        "paths": {
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "security": security,
                "requestBody": {"required": True, "content": {"application/json": {"schema": completion}}},
                "responses": _generation_responses("completion")}},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "security": security,
                "requestBody": {"required": True, "content": {"application/json": {"schema": chat}}},
                "responses": _generation_responses("chat completion")}},
            "/v1/responses": {"post": {
                "operationId": "createResponse", "security": security,
                "description": "OpenAI's Responses API over the chat path; the served subset: docs/api.md",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["model", "input"], "additionalProperties": True,
                    "properties": {"model": {"type": "string"}, "input": {"type": ["string", "array"]},
                                   "instructions": {"type": ["string", "null"]},
                                   "previous_response_id": {"type": ["string", "null"]},
                                   "store": {"type": "boolean", "default": True},
                                   "stream": {"type": "boolean", "default": False}}}}}},
                "responses": {"200": {"description": "the response (JSON), or a text/event-stream of Responses "
                                                     "events when stream is true",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              "400": _error("a bad or unsupported request field"),
                              "404": _error("previous_response_not_found, or an unknown model")}}},
            "/v1/responses/{response_id}": {
                "get": {"operationId": "retrieveResponse", "security": security,
                        "parameters": [{"name": "response_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}}],
                        "responses": {"200": {"description": "a stored response", "content": {"application/json": {
                            "schema": {"type": "object"}}}}, "404": _error("not stored in this router process")}},
                "delete": {"operationId": "deleteResponse", "security": security,
                           "parameters": [{"name": "response_id", "in": "path", "required": True,
                                           "schema": {"type": "string"}}],
                           "responses": {"200": {"description": "deleted", "content": {"application/json": {
                               "schema": {"type": "object"}}}}, "404": _error("not stored in this router process")}}},
            "/v1/models": {"get": {
                "operationId": "listModels", "security": security,
                "responses": {"200": {"description": "the served model", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"type": "string"}, "data": {"type": "array"}}}}}},
                    "401": _error("missing or wrong API key")}}},
            "/v1/models/{model_id}": {"get": {
                "operationId": "retrieveModel", "security": security,
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the served model", "content": {"application/json": {
                    "schema": model_object}}},
                    "401": _error("missing or wrong API key"), "404": _error("not the served model")}}},
            "/tokenize": {"post": {
                "operationId": "tokenize", "security": security,
                "description": "vLLM's /tokenize: a text, or messages through the chat template, to token ids",
                "requestBody": {"required": True, "content": {"application/json": {"schema": tokenize}}},
                "responses": _tokenizer_responses(tokens_out)}},
            "/detokenize": {"post": {
                "operationId": "detokenize", "security": security,
                "description": "vLLM's /detokenize: token ids to text (special tokens kept)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": detokenize}}},
                "responses": _tokenizer_responses(text_out)}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "ready", "content": {"application/json": {"schema": {"type": "object"}}}},
                "503": {"description": "no decode worker", "content": {"application/json": {
                    "schema": {"type": "object"}}}}}}},
            "/livez": {"get": {"operationId": "livez", "responses": {
                "200": {"description": "the router process answers (liveness)", "content": {"application/json": {
                    "schema": {"type": "object"}}}}}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": plain}},
            "/openapi.json": {"get": {"operationId": "openapi", "responses": {
                "200": {"description": "this document", "content": {"application/json": {
                    "schema": {"type": "object"}}}}}}},
        },
        "components": {"schemas": {"Error": _ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    })


def _with_expect_refusal(doc: dict) -> dict:
    """Every operation may answer 417: an Expect header other than 100-continue (http_limits.py)."""
    for operations in doc["paths"].values():
        for operation in operations.values():
            operation["responses"].setdefault("417", _error("an Expect header other than 100-continue"))
    return doc
