"""Thin I/O: read every worker's load report of one cluster from Redis.

Keys are `splitserve:{cluster}:load:{worker_id}` (msgpack LoadReport, with a TTL, so
a dead worker's report disappears by itself); see splitserve/cluster/messages.py.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from splitserve.cluster.messages import LoadReport, decode, key_prefix

log = logging.getLogger(__name__)


class LoadReportsUnavailable(RuntimeError):
    pass


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
            f"cannot read load reports of cluster {cluster!r} from {redis_url}: {exc}; "
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
