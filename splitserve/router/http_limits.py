"""What the router accepts from a client connection (clients are untrusted): body size,
time to send it, idle connections; which client request ids are safe to echo; and how much
of the log a client's malformed requests may take (ClientErrorLogLimit)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError

from splitserve.router.errors import APIError

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


class ClientErrorLogLimit(logging.Filter):
    """aiohttp answers a request it cannot parse (a `traceparent` over its 8 KB line limit, a 64 KB
    `tracestate`, a garbled request line) with 400, rightly, and logs each one as `ERROR
    aiohttp.server` with an 8-line traceback: 58 such requests were 522 lines. A client's bad
    request is not the server's error. This turns them into one WARNING line, at most one per
    `interval_s`, with how many were refused since the last; other records pass untouched."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self.refused, self.last = 0, None

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or record.levelno < logging.WARNING:
            return True  # (aiohttp logs a first request with a bad method at DEBUG already)
        self.refused += 1
        now = self.clock()
        if self.last is not None and now - self.last < self.interval_s:
            return False
        record.msg = "refused %d malformed or oversized HTTP request(s) with 400 (%s, latest: %s)"
        since = "since start" if self.last is None else f"in the last {now - self.last:.0f} s"
        record.args = (self.refused, since, " ".join(f"{type(exc).__name__}: {exc}".split())[:200])
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = record.stack_info = None  # never a traceback
        self.refused, self.last = 0, now
        return True


def limit_client_error_logs(interval_s: float = 60.0) -> None:
    """Install ClientErrorLogLimit on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientErrorLogLimit) for f in logger.filters):
        logger.addFilter(ClientErrorLogLimit(interval_s))


async def expect_continue(request: web.Request) -> web.Response | None:
    """aiohttp's Expect handling with the error in OpenAI's format: `100-continue` is answered
    (the client may then send its body); any other expectation is refused with 417 and a JSON
    error, where aiohttp's own answer was a plain-text 417 (found by schemathesis)."""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the body's bytes are counted from here, as aiohttp does
        return None
    err = APIError(417, f"unknown expectation in the Expect header ({expect[:64]!r}): only 100-continue is "
                   "supported; drop the header", param="Expect", code="expectation_failed")
    return web.Response(status=417, body=err.to_json(), content_type="application/json")
