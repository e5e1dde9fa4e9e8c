"""HTTP errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every client mistake is an `APIError` with a 4xx status and a message that says what
to change; the server turns it into a JSON response (or an SSE `data:` line once a
stream has started) and never into a 5xx.
"""

from __future__ import annotations

import json


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def to_json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.type}, param={self.param!r}: {self.message})"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def missing_parameter(param: str) -> APIError:
    return invalid_request(f"you must provide a '{param}' parameter", param,
                           "missing_required_parameter")


def wrong_type(param: str, expected: str, value: object) -> APIError:
    return invalid_request(f"'{param}' must be {expected}, got {_json_type(value)}", param,
                           "invalid_type")


def unsupported(param: str, message: str) -> APIError:
    return invalid_request(f"'{param}' is not supported by this server: {message}", param,
                           "unsupported_parameter")


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(404, f"The model '{model}' does not exist on this server; it serves: "
                    f"{', '.join(served) or '(none)'}. See GET /v1/models.",
                    "not_found_error", "model", "model_not_found")


def context_length_exceeded(message: str, param: str = "prompt") -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def authentication_failed() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                    "with the key the server was started with (--api-key).",
                    "authentication_error", None, "invalid_api_key")


def rate_limited(message: str = "Too many requests in flight; retry after a short wait.") \
        -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded")


def route_not_found(method: str, path: str) -> APIError:
    return APIError(404, f"No route for {method} {path}. Routes: POST /v1/completions, "
                    "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.",
                    "not_found_error", None, "unknown_url")


def service_unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, "no_healthy_worker")


def server_error(request_id: str) -> APIError:
    return APIError(500, f"Internal error while serving request {request_id}; the router's "
                    "log has the traceback under this id.", "server_error", None, None)


def deadline_exceeded(rid: str, timeout: float | None) -> APIError:
    return APIError(504, f"request {rid} did not finish within its deadline of {timeout}s (--request-timeout); "
                    "it was aborted on every worker. Ask for fewer tokens or retry later.", "timeout_error",
                    code="request_timeout")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
