"""core/tracing.py without a collector: which settings turn tracing on, and how; bad ones are
one clear line; off, a process imports nothing of OpenTelemetry."""

import subprocess
import sys

import pytest

from splitserve.core.tracing_config import TracingConfig, tracing_config


def test_off_unless_an_endpoint_is_given():
    assert tracing_config(None, {}) is None
    assert tracing_config("http://c:4317", {"OTEL_SDK_DISABLED": "true"}) is None


def test_the_flag_and_the_standard_variables():
    assert tracing_config("http://c:4317", {}) == TracingConfig("http://c:4317", "grpc", "parentbased_always_on", 1.0,
                                                                 insecure=True)
    # vLLM's host:port form: gRPC, over TLS unless the SDK's variable says insecure
    assert tracing_config("jaeger:4317", {}).insecure is False
    assert tracing_config("jaeger:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}).insecure is True
    assert tracing_config("https://c:4317", {}).insecure is False
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t:4318", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    # the OTLP/HTTP path is added as the SDK adds it to the variable; the flag wins over the variables
    assert tracing_config(None, env) == TracingConfig("https://t:4318/v1/traces", "http/protobuf",
                                                      "parentbased_traceidratio", 0.25, insecure=False)
    assert tracing_config("http://flag:4318/custom", env).endpoint == "http://flag:4318/custom"
    assert tracing_config(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1"}).endpoint == "http://x:1"


@pytest.mark.parametrize("endpoint, env, message", [
    ("ftp://collector:4317", {}, "must be a URL like http://collector:4317"),
    ("collector", {}, "must be a URL like http://collector:4317"),
    ("collector:4318", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "must be a URL like"),
    ("http://c:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "'http/json' is not one of"),
    ("http://c:4317", {"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER 'sometimes'"),
    ("http://c:4317", {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "in [0, 1]"),
    ("http://c:4317", {"OTEL_TRACES_SAMPLER_ARG": "half"}, "'half' must be a number"),
])
def test_bad_settings_are_one_line(endpoint, env, message):
    with pytest.raises(ValueError, match="^.*$") as err:
        tracing_config(endpoint, env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_off_imports_nothing_of_opentelemetry():
    code = ("import sys, splitserve.router.main, splitserve.decode_worker.worker, splitserve.prefill_worker.worker, "
            "splitserve.core.tracing as t\n"
            "t.configure(None, 'x'); s = t.start('a'); s.end(); t.record('b', None, 0, 1)\n"
            "assert t.inject(('k', 'v')) == ('k', 'v') and t.extract({'traceparent': 'x'}) is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_serve_refuses_a_bad_endpoint_in_one_line(make_ckpt):
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(make_ckpt("llama")),
                          "--otlp-traces-endpoint", "ftp://collector:4317"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("splitserve serve: OTLP traces endpoint 'ftp://collector:4317' must be a URL like "
                                  "http://collector:4317 (or, for gRPC, host:port as vLLM takes it)")


HTTP_EXPORT = r"""
import http.server, os, threading, time
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest as Req
from splitserve.core import tracing
from splitserve.core.tracing_config import tracing_config
got = []
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        req = Req.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        got.extend((self.path, s.name, s.trace_id.hex(), s.parent_span_id.hex())
                   for r in req.resource_spans for ss in r.scope_spans for s in ss.spans)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
os.environ.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="50")
tracing.configure(tracing_config(f"http://127.0.0.1:{srv.server_port}"), "probe")
parent = tracing.extract({"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
with tracing.span("outer", parent) as outer:
    md = tracing.inject((("authorization", "x"),), outer)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.05)
print(got, md[0], md[1][0], md[1][1][:35])
"""


def test_http_protobuf_export_keeps_the_callers_trace():
    out = subprocess.run([sys.executable, "-c", HTTP_EXPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"[('/v1/traces', 'outer', '{'ab' * 16}', '{'cd' * 8}')] ('authorization', 'x') "
                                  f"traceparent 00-{'ab' * 16}")
