"""Thin I/O: read every worker's load report of one cluster from Redis.

Keys are `splitserve:{cluster}:load:{worker_id}` (msgpack LoadReport, with a TTL, so
a dead worker's report disappears by itself); see splitserve/cluster/messages.py.
The Redis URL is the spec's, or the one in the Secret spec.redis.urlSecretRef names;
a password in it never reaches a log line or the status.
"""

from __future__ import annotations

import base64
import binascii
import logging
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

from splitserve.cluster.messages import LoadReport, decode, key_prefix

from .kube import ApiError, KubeClient
from .spec import InferenceSpec

log = logging.getLogger(__name__)


class LoadReportsUnavailable(RuntimeError):
    pass


def redacted(url: str) -> str:
    """The URL with its password (if any) replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


async def redis_url(client: KubeClient, spec: InferenceSpec) -> str:
    """The URL the deployment's pods use. Reading spec.redis.urlSecretRef takes `get`
    on Secrets, which the chart grants only with rbac.readSecrets=true."""
    ref = spec.redis_url_secret
    if ref is None:
        return spec.effective_redis_url
    where = f"Secret {spec.namespace}/{ref.name} key {ref.key!r} (spec.redis.urlSecretRef)"
    try:
        secret = await client.get("v1", "Secret", spec.namespace, ref.name)
    except ApiError as exc:
        hint = ("; the operator reads Secrets only when the chart is installed with rbac.readSecrets=true"
                if exc.status == 403 else "")
        raise LoadReportsUnavailable(f"cannot read the Redis URL from {where}: HTTP {exc.status}{hint}") from exc
    if secret is None:
        raise LoadReportsUnavailable(f"cannot read the Redis URL: {where} does not exist")
    data = (secret.get("data") or {}).get(ref.key)
    if data is None:
        raise LoadReportsUnavailable(f"cannot read the Redis URL: {where} has no such key")
    try:
        url = base64.b64decode(data, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise LoadReportsUnavailable(f"cannot read the Redis URL: {where} is not UTF-8 text") from exc
    if not url.startswith(("redis://", "rediss://")):
        raise LoadReportsUnavailable(f"the Redis URL in {where} must start with redis:// or rediss://")
    return url


async def read_load_reports(redis_url: str, cluster: str, timeout_s: float = 5.0) -> list[LoadReport]:
    """All decodable reports; a malformed one is logged and skipped (it must not
    block scaling of the others). Raises LoadReportsUnavailable if Redis is unreachable."""
    client = aioredis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    pattern = f"{key_prefix(cluster)}load:*"
    try:
        keys = [k async for k in client.scan_iter(match=pattern, count=500)]
        payloads = await client.mget(keys) if keys else []
    except (aioredis.RedisError, OSError) as exc:
        raise LoadReportsUnavailable(
            f"cannot read load reports of cluster {cluster!r} from {redacted(redis_url)}: {exc}; "
            "check the Redis pod/URL and the NetworkPolicy allowing the operator in") from exc
    finally:
        await client.aclose()
    reports = []
    for k, payload in zip(keys, payloads, strict=True):
        if payload is None:  # expired between SCAN and MGET
            continue
        try:
            reports.append(decode(LoadReport, payload))
        except Exception as exc:  # noqa: BLE001 - any decoding failure means "skip this one"
            log.warning("skipping malformed load report %s: %s", k, exc)
    return reports
