"""What the router accepts from a client connection (clients are untrusted): body size,
time to send it, idle connections; and which client request ids are safe to echo."""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiohttp import web

_CLIENT_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces: safe in logs and headers


@dataclass(frozen=True)
class HTTPLimits:
    max_body_mb: float = 16.0  # larger bodies: 413
    body_read_timeout_s: float = 30.0  # a body still arriving after this: 408
    idle_timeout_s: float = 75.0  # keep-alive idle, or headers never completed: connection closed

    def __post_init__(self) -> None:
        for name in ("max_body_mb", "body_read_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be a positive number, got {getattr(self, name)}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id, if it is safe to log and echo back."""
    value = request.headers.get("X-Request-Id")
    return value if value is not None and _CLIENT_ID.match(value) else None
