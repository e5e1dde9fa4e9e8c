"""The span of one HTTP request at the router: the parent of everything the request causes,
here (tokenize, route, the worker calls) and, through gRPC metadata, on the workers. Its own
parent is the client's W3C `traceparent`, when it sends one. Tracing off: one check."""

from __future__ import annotations

from aiohttp import web

from splitserve.core import tracing

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


@web.middleware
async def trace_requests(request: web.Request, handler):
    if not tracing.enabled() or request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    attributes = {"http.request.method": request.method, "url.path": request.path,
                  "gen_ai.operation.name": OPERATIONS.get(request.path)}
    # current: the request's handler (and the tasks it starts) make their spans under it
    with tracing.current_span(f"POST {request.path}", tracing.extract(request.headers), "server",
                              attributes) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            tracing.fail(span, RuntimeError(f"HTTP {response.status}"))
        return response
