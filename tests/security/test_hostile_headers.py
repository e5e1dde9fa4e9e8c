"""Oversized trace headers do not flood the log (issue 49): aiohttp refuses a `traceparent`
over its 8 KB line limit or a 64 KB `tracestate` with 400, and used to log each refusal as
ERROR with an 8-line traceback (522 lines for 58 requests). Now they are one WARNING line at
most per minute, with a count, never a traceback (router/http_limits.py ClientErrorLogLimit)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.http_exceptions import LineTooLong
from aiohttp.test_utils import TestServer

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.http_limits import ClientErrorLogLimit
from splitserve.router.server import RouterServer, ServerConfig


@pytest.fixture
async def router(make_ckpt):
    dispatcher = Dispatcher(DispatchConfig(model_id="m"), InProcBus())
    await dispatcher.start()
    server = TestServer(RouterServer(ServerConfig(str(make_ckpt("llama")), "m"), dispatcher).app(), host="127.0.0.1")
    await server.start_server(access_log=None)  # as router/main.py runs it
    yield server
    await server.close()
    await dispatcher.stop()


async def _status(server: TestServer, header: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n" + header + b"\r\nConnection: close\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer.split(b"\r\n", 1)[0]


async def test_100_oversized_trace_headers_log_a_handful_of_lines(router, caplog):
    headers = [b"traceparent: 00-" + b"a" * 9000 + b"-01", b"tracestate: k=" + b"v" * 65536]
    with caplog.at_level(logging.DEBUG):
        statuses = [await _status(router, headers[i % 2]) for i in range(100)]
    assert all(s.split(b" ")[1] == b"400" for s in statuses), set(statuses)
    aiohttp_lines = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert len(aiohttp_lines) <= 3, [r.getMessage() for r in aiohttp_lines]
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert all(r.levelno <= logging.WARNING for r in aiohttp_lines)
    print(f"{len(caplog.records)} log record(s) for 100 refused requests: {caplog.text!r:.300}")


def _record(exc: BaseException | None) -> logging.LogRecord:
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (),
                             (type(exc), exc, None) if exc else None)


def test_one_line_a_minute_with_the_count():
    now = [0.0]
    limit = ClientErrorLogLimit(60.0, clock=lambda: now[0])
    first = _record(LineTooLong("Got more than 8190 bytes when reading"))
    assert limit.filter(first) and first.levelno == logging.WARNING and first.exc_info is None
    assert first.getMessage().startswith("refused 1 malformed or oversized HTTP request(s) with 400 (since start")
    for _ in range(50):
        now[0] += 1
        assert not limit.filter(_record(LineTooLong("x")))
    now[0] += 10
    later = _record(LineTooLong("x"))
    assert limit.filter(later) and later.getMessage().startswith("refused 51 malformed or oversized HTTP request(s) "
                                                                 "with 400 (in the last 60 s")
    server_error = _record(RuntimeError("a handler bug"))  # the server's own errors keep their traceback
    assert limit.filter(server_error) and server_error.exc_info is not None and server_error.levelno == logging.ERROR
