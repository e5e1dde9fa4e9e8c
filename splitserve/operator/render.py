"""spec -> every child manifest, in apply order. Pure: the same inputs always give
the same manifests, which is what drift correction compares against."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cert_manager import IssuerRef, certificate
from .render_common import metadata
from .render_policy import render_monitors, render_network_policies, render_pdbs
from .render_prefill import render_prefill
from .render_workloads import render_decode, render_redis, render_router
from .spec import InferenceSpec


@dataclass(frozen=True)
class Replicas:
    """Replicas per scaled role: the autoscaler's decision, or the spec's when off."""
    prefill: int
    decode: int


def render_all(spec: InferenceSpec, replicas: Replicas, ray_version: str) -> list[dict]:
    out: list[dict] = []
    if spec.tls_issuer is not None:  # before the pods, which mount its Secret
        out.append(certificate(spec.name, spec.namespace, spec.tls_issuer, metadata(spec, "tls")))
    if not spec.external_redis:
        out += render_redis(spec)
    out += render_router(spec)
    out += render_prefill(spec, replicas.prefill, ray_version)
    out += render_decode(spec, replicas.decode)
    out += render_pdbs(spec)
    out += render_network_policies(spec)
    out += render_monitors(spec)
    return out


def unwanted_children(spec: InferenceSpec, ray_version: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of optional children this spec does not want: those
    a spec with every option on would render, minus those this spec renders. The
    operator deletes them if they exist and it owns them."""
    everything = replace(spec, redis_url="", redis_url_secret=None, service_monitor=True, pod_monitor=True,
                         network_policy=True, tls_issuer=IssuerRef("any"))
    wanted = {key(m) for m in render_all(spec, Replicas(1, 1), ray_version)}
    return sorted({key(m) for m in render_all(everything, Replicas(1, 1), ray_version)} - wanted)


def key(manifest: dict) -> tuple[str, str, str]:
    return manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]
