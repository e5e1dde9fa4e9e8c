"""Distributed tracing with OpenTelemetry, off unless asked for (docs/architecture.md, "Tracing";
the settings: core/tracing_config.py).

Off, nothing of OpenTelemetry is imported and every call here is a check of one global: a
no-op span, metadata passed through unchanged. On, spans go through a BatchSpanProcessor: a
request only appends to a queue; export happens on the SDK's thread, and an exporter that is
down costs a log line, never the request. The W3C `traceparent` travels in gRPC metadata.
Spans are started with explicit parents and not made current, except where a coroutine or a
thread must pass its span on implicitly (current_span): contexts attached in an async
generator can be detached in another context.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterable, Mapping

from splitserve.core.tracing_config import TracingConfig

log = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
FLUSH_AT_EXIT_MS = 2000  # a collector that is down must not hold the process at exit longer


# ---- the process's tracer -------------------------------------------------------------------
_tracer = None  # an opentelemetry Tracer once configure() ran with a config; None: off


def enabled() -> bool:
    return _tracer is not None


def configure(config: TracingConfig | None, service_name: str) -> None:
    """Start exporting this process's spans (once; later calls change nothing)."""
    global _tracer
    if config is None or _tracer is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=_sampler(config), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    atexit.register(provider.force_flush, FLUSH_AT_EXIT_MS)
    _quiet_exporter_logs()
    _tracer = provider.get_tracer("splitserve")
    log.info("tracing: %s spans to %s over OTLP/%s (sampler %s %g)", service_name, config.endpoint,
             config.protocol, config.sampler, config.sampler_arg)


def _sampler(config: TracingConfig):
    from opentelemetry.sdk.trace import sampling as s

    base = {"always_on": s.ALWAYS_ON, "always_off": s.ALWAYS_OFF,
            "traceidratio": s.TraceIdRatioBased(config.sampler_arg)}[config.sampler.removeprefix("parentbased_")]
    return s.ParentBased(base) if config.sampler.startswith("parentbased_") else base


def _exporter(config: TracingConfig):
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.endpoint, insecure=config.insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)


class _NoTraceback(logging.Filter):
    """An unreachable collector: the exporter's warning stays one line, its traceback goes
    (docs/runbook.md, "Traces are missing")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.msg = f"{record.getMessage()}: {record.exc_info[1]!r}"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _quiet_exporter_logs() -> None:
    for name in ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export",
                 "opentelemetry.exporter.otlp.proto.grpc.exporter",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        logging.getLogger(name).addFilter(_NoTraceback())


# ---- spans -----------------------------------------------------------------------------
class _NoSpan:
    """What start() and span() give with tracing off."""

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def end(self, end_time=None) -> None:
        pass


_NO_SPAN = _NoSpan()


def _context(parent):
    """An OpenTelemetry Context from a span, a context or None (the current one)."""
    if parent is None or parent is _NO_SPAN:
        return None
    from opentelemetry import trace
    from opentelemetry.context import Context

    return parent if isinstance(parent, Context) else trace.set_span_in_context(parent)


def start(name: str, parent=None, kind: str = "internal", attributes: Mapping | None = None,
          start_ns: int | None = None):
    """A started span (end it with .end()), child of `parent` (a span, a context from
    extract(), or None: the current span). Not made current: safe in async generators."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent), kind=SpanKind[kind.upper()],
                              attributes=_clean(attributes), start_time=start_ns)


@contextlib.contextmanager
def span(name: str, parent=None, kind: str = "internal", attributes: Mapping | None = None):
    """start() as a context manager, ended on exit; an exception marks it failed."""
    if _tracer is None:
        yield _NO_SPAN
        return
    s = start(name, parent, kind, attributes)
    try:
        yield s
    except BaseException as exc:
        fail(s, exc)
        raise
    finally:
        s.end()


def fail(s, exc: BaseException) -> None:
    """Mark a span failed (a cancelled call too: the client left, or it migrated)."""
    if s is _NO_SPAN:
        return
    from opentelemetry.trace import Status, StatusCode

    s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))


@contextlib.contextmanager
def current_span(name: str, parent=None, kind: str = "internal", attributes: Mapping | None = None):
    """span(), made the current span for the body (a coroutine, never an async generator)."""
    if _tracer is None:
        yield _NO_SPAN
        return
    from opentelemetry import trace

    s = start(name, parent, kind, attributes)
    with trace.use_span(s, end_on_exit=True, record_exception=False, set_status_on_exception=True):
        yield s


def current():
    """The current context (its span the parent of what follows), for a later start(); None: off."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def exemplar() -> dict[str, str] | None:
    """The current span's trace id as a Prometheus exemplar (a dashboard's link from a latency
    point to its trace), or None: tracing off, or the request not sampled."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return {"trace_id": format(context.trace_id, "032x")} if context.trace_flags.sampled else None


def record(name: str, parent, start_ns: int, end_ns: int, attributes: Mapping | None = None) -> None:
    """A span that already happened: timings measured elsewhere (the engine, a thread)."""
    if _tracer is None:
        return
    start(name, parent, attributes=attributes, start_ns=start_ns).end(end_time=end_ns)


def _clean(attributes: Mapping | None) -> dict | None:
    return None if attributes is None else {k: v for k, v in attributes.items() if v is not None}


# ---- propagation (W3C trace context) ----------------------------------------------------------
def extract(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None):
    """The remote parent carried by HTTP headers or gRPC metadata, or None."""
    if _tracer is None or headers is None:
        return None
    carrier = {k.lower(): v for k, v in (headers.items() if isinstance(headers, Mapping) else headers)
               if k.lower() in TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def extract_grpc(context):
    """The remote parent in a gRPC call's metadata (a servicer's `context`), or None."""
    return None if _tracer is None else extract(context.invocation_metadata())


def inject(metadata: tuple = (), parent=None) -> tuple:
    """gRPC metadata plus the trace context of `parent` (or the current span)."""
    if _tracer is None:
        return metadata
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=_context(parent))
    return tuple(metadata or ()) + tuple(carrier.items())


def request_attributes(model: str, params, input_tokens: int) -> dict:
    """A request's attributes, named after the OpenTelemetry GenAI semantic conventions."""
    return {"gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.seed": params.seed, "gen_ai.usage.input_tokens": input_tokens}
