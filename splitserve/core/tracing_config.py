"""Tracing settings: `--otlp-traces-endpoint` (vLLM's flag) and the standard OpenTelemetry
variables, resolved once by the process that reads the flags (core/tracing.py uses them).

On with the flag or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT;
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or _PROTOCOL) picks `grpc` (default) or `http/protobuf`,
OTEL_TRACES_SAMPLER / _ARG the sampler (parentbased_always_on by default: a client's
sampled flag decides), OTEL_SDK_DISABLED=true turns it off. The result travels inside a
worker's config, so a Ray actor need not share the environment of `serve`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str
    protocol: str = "grpc"
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0
    insecure: bool = True  # plaintext gRPC (http:// or OTEL_EXPORTER_OTLP_TRACES_INSECURE); else TLS


def tracing_config(endpoint: str | None, env: Mapping[str, str] = os.environ) -> TracingConfig | None:
    """The tracing settings from the flag and the OTEL_* variables; None: tracing off.
    Raises ValueError with one line naming the setting at fault."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r} is not one of {PROTOCOLS}")
    url = urlparse(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    if url.scheme not in ("http", "https", "grpc") or not url.hostname or (url.scheme == "grpc" and (
            protocol != "grpc" or not url.port)):
        raise ValueError(f"OTLP traces endpoint {endpoint!r} must be a URL like http://collector:4317 (or, for "
                         "gRPC, host:port as vLLM takes it)")
    # host:port (vLLM's form): TLS unless the SDK's variable says insecure, as the SDK does
    flag = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get("OTEL_EXPORTER_OTLP_INSECURE") or "false"
    insecure = url.scheme == "http" or (url.scheme == "grpc" and flag.strip().lower() == "true")
    sampler = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if sampler not in SAMPLERS:
        raise ValueError(f"OTEL_TRACES_SAMPLER {sampler!r} is not one of {SAMPLERS}")
    raw = env.get("OTEL_TRACES_SAMPLER_ARG") or "1.0"
    try:
        ratio = float(raw)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG {raw!r} must be a number in [0, 1]")
    if protocol == "http/protobuf" and url.path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"  # the OTLP/HTTP path, as the SDK adds to the variable
    return TracingConfig(endpoint, protocol, sampler, ratio, insecure)


def add_tracing_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--otlp-traces-endpoint", metavar="URL",
                    help="export OpenTelemetry traces over OTLP to this collector, e.g. http://collector:4317 "
                         "(plaintext), https://... (TLS) or host:port (gRPC, TLS unless "
                         "OTEL_EXPORTER_OTLP_TRACES_INSECURE=true) "
                         "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or http/protobuf; OTEL_TRACES_SAMPLER[_ARG] "
                         "sample; the client's W3C traceparent is honoured). Default: off, or "
                         "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_config_from_args(args: argparse.Namespace, prog: str) -> TracingConfig | None:
    try:
        return tracing_config(getattr(args, "otlp_traces_endpoint", None))
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
