"""The cluster bus on Redis (`--redis-url`), with the key layout of `messages.py`:

  splitserve:{cluster}:workers:{id}  WorkerInfo, expires after the heartbeat TTL
  splitserve:{cluster}:load:{id}     LoadReport, same TTL
  splitserve:{cluster}:kv:{id}       Stream of KV events, field `m`, XADD MAXLEN ~ maxlen

Streams are replayable, so a restarted router rebuilds its index from them and several
router replicas read the same history (active-active).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from splitserve.cluster.bus import DEFAULT_MAXLEN, START, BusError, ClusterBus, KVRecord
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo, decode, encode, key_prefix

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 30.0  # must exceed the longest blocking read
# After an outage or a Redis restart (which loses every registration) routers keep the
# workers they knew for this long, while the workers re-register (they retry every 0.2 s).
REGISTRY_GRACE_S = 6.0


class RedisBus(ClusterBus):
    def __init__(self, url: str, cluster: str = "local"):
        self.url = url
        self.cluster = cluster
        self._prefix = key_prefix(cluster)
        try:
            self._redis = aioredis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S)
        except ValueError as exc:
            raise BusError(f"invalid Redis URL {url!r}: {exc} (expected "
                           "redis://host:port/db)") from None
        self._outage_at: float | None = None  # monotonic time of the last failure or restart seen
        self._run_id: str | None = None  # Redis server instance: a new one means its data is gone
        self._known: dict[str, WorkerInfo] = {}  # the registry as last read while Redis was healthy

    def _key(self, kind: str, worker_id: str) -> str:
        return f"{self._prefix}{kind}:{worker_id}"

    @asynccontextmanager
    async def _call(self, what: str) -> AsyncIterator[None]:
        """Turn client exceptions into a BusError that says what failed where."""
        try:
            yield
        except RedisError as exc:
            self._outage_at = time.monotonic()
            raise BusError(f"Redis at {self.url} failed to {what}: {exc}. Check that Redis is "
                           f"up and --redis-url points at it.") from exc

    # ---- registry ----------------------------------------------------------------------
    async def register(self, info: WorkerInfo, ttl: float) -> None:
        async with self._call(f"register worker {info.worker_id}"):
            await self._redis.set(self._key("workers", info.worker_id), encode(info),
                                  px=_ms(ttl))

    async def heartbeat(self, info: WorkerInfo, ttl: float) -> bool:
        key, payload = self._key("workers", info.worker_id), encode(info)
        async with self._call(f"refresh the heartbeat of worker {info.worker_id}"):
            if await self._redis.set(key, payload, px=_ms(ttl), xx=True):
                return True
            await self._redis.set(key, payload, px=_ms(ttl))
            return False

    async def deregister(self, worker_id: str) -> None:
        async with self._call(f"deregister worker {worker_id}"):
            await self._redis.delete(self._key("workers", worker_id),
                                     self._key("load", worker_id), self._key("kv", worker_id))

    async def live_workers(self) -> dict[str, WorkerInfo]:
        async with self._call("list the workers entries"):  # (and see whether Redis restarted)
            run_id = (await self._redis.info("server")).get("run_id")
        if self._run_id is not None and run_id != self._run_id:
            log.warning("Redis at %s restarted (run id %s -> %s): its registry is empty until workers "
                        "re-register; keeping the %d known workers for %.0fs", self.url, self._run_id, run_id,
                        len(self._known), REGISTRY_GRACE_S)
            self._outage_at = time.monotonic()
        self._run_id = run_id
        live = await self._read_all("workers", WorkerInfo)
        if self._outage_at is not None and time.monotonic() - self._outage_at < REGISTRY_GRACE_S:
            return {**self._known, **live}
        self._known = live
        return live

    # ---- load reports ------------------------------------------------------------------
    async def publish_load(self, report: LoadReport, ttl: float) -> None:
        async with self._call(f"publish the load of worker {report.worker_id}"):
            await self._redis.set(self._key("load", report.worker_id), encode(report),
                                  px=_ms(ttl))

    async def loads(self) -> dict[str, LoadReport]:
        return await self._read_all("load", LoadReport)

    # ---- KV events ---------------------------------------------------------------------
    async def publish_kv(self, event: KVEvent, maxlen: int = DEFAULT_MAXLEN) -> str:
        async with self._call(f"publish KV event {event.event_id} of worker {event.worker_id}"):
            entry = await self._redis.xadd(self._key("kv", event.worker_id), {"m": encode(event)},
                                           maxlen=maxlen, approximate=True)
        return entry.decode()

    async def publish_kv_batch(self, events: Sequence[KVEvent], maxlen: int = DEFAULT_MAXLEN) -> str | None:
        if not events:
            return None
        first, last = events[0], events[-1]
        async with self._call(f"publish KV events {first.event_id}-{last.event_id} of worker {first.worker_id}"):
            pipe = self._redis.pipeline(transaction=False)  # one round trip, applied in order
            for event in events:
                pipe.xadd(self._key("kv", event.worker_id), {"m": encode(event)}, maxlen=maxlen, approximate=True)
            entries = await pipe.execute()
        return entries[-1].decode()

    async def read_kv(self, positions: Mapping[str, str], block: float | None = None,
                      count: int = 1000) -> list[KVRecord]:
        if not positions:  # nothing to follow yet: still honour the wait
            if block:
                await asyncio.sleep(block)
            return []
        streams = {self._key("kv", w): p for w, p in positions.items()}
        async with self._call("read KV event streams"):
            reply = await self._redis.xread(streams, count=count,
                                            block=_ms(block) if block else None)
        records = []
        skip = len(self._prefix) + len("kv:")
        for key, entries in reply or []:
            worker_id = key.decode()[skip:]
            for entry_id, fields in entries:
                position = entry_id.decode()
                try:
                    event = decode(KVEvent, fields[b"m"])
                except Exception as exc:  # a foreign or corrupt entry must not stop routing
                    log.error("skipping undecodable KV event %s in stream %s: %r; the router "
                              "will resync worker %s on the event-id gap this leaves",
                              position, key.decode(), exc, worker_id)
                    continue
                records.append(KVRecord(worker_id, position, event))
        return records

    async def kv_tail(self, worker_id: str) -> str:
        async with self._call(f"read the stream tail of worker {worker_id}"):
            last = await self._redis.xrevrange(self._key("kv", worker_id), count=1)
        return last[0][0].decode() if last else START

    async def close(self) -> None:
        await self._redis.aclose()

    # ---- helpers -----------------------------------------------------------------------
    async def _read_all(self, kind: str, cls: type) -> dict:
        pattern = _glob_escape(self._prefix + kind + ":") + "*"
        skip = len(self._prefix) + len(kind) + 1
        async with self._call(f"list the {kind} entries"):
            keys = [k async for k in self._redis.scan_iter(match=pattern, count=1000)]
            values = await self._redis.mget(keys) if keys else []
        out = {}
        for key, payload in zip(keys, values, strict=True):
            if payload is None:  # expired between SCAN and MGET
                continue
            try:
                out[key.decode()[skip:]] = decode(cls, payload)
            except Exception as exc:
                log.error("ignoring undecodable %s entry %s: %r", kind, key.decode(), exc)
        return out


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
