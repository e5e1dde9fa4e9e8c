"""A real OTLP/gRPC trace receiver in the test process: the TraceService of the OpenTelemetry
collector protocol (opentelemetry-proto), keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    ok: bool


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - gRPC name
        with self._lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(ReceivedSpan(
                            attrs.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                            s.parent_span_id.hex(), s.start_time_unix_nano, s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes}, s.status.code != 2))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 60.0) -> list[ReceivedSpan]:
        """The trace's spans once every name in `names` has arrived (or whatever came by the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        return self.trace(trace_id)

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
