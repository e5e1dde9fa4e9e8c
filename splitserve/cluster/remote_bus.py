"""Embedded mode: workers in other processes (Ray actors) reach the router process's
in-process bus through a small gRPC service. Only what workers do is exposed
(register, heartbeat, deregister, publish load, publish KV events); cluster mode
uses Redis for all of it.

The bridge is a control plane: whoever can call it can put a worker in front of user
traffic. So it is served with the run's LinkSecurity (cluster token / mTLS: a process
without them gets UNAUTHENTICATED), and it refuses a worker that serves another model
or block size than the router (FAILED_PRECONDITION naming both), which would otherwise
miss every prefix-cache lookup and answer with the wrong model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import fields

import grpc
import msgpack

from splitserve.cluster.bus import DEFAULT_MAXLEN, BusError, ClusterBus, KVRecord
from splitserve.cluster.messages import (
    KVEvent,
    LoadReport,
    WorkerInfo,
    decode,
    encode,
    kv_dtype_refusal,
    registration_refusal,
)
from splitserve.proto.build import ensure_built
from splitserve.security.links import NO_SECURITY, LinkSecurity

ensure_built()
from splitserve.proto import worker_pb2 as pb  # noqa: E402
from splitserve.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

log = logging.getLogger(__name__)


class RemoteBus(ClusterBus):
    """Worker side of the embedded bus."""

    def __init__(self, address: str, cluster: str = "local", timeout: float = 5.0,
                 security: LinkSecurity = NO_SECURITY):
        self.address = address
        self.cluster = cluster
        self.timeout = timeout
        self._metadata = security.metadata
        self._channel = security.aio_channel(address)
        self._stub = pb_grpc.BusStub(self._channel)

    async def _call(self, method: str, payload: bytes, ttl: float = 0.0):
        try:
            reply = await self._stub.Call(pb.BusCall(method=method, payload=payload, ttl=ttl), timeout=self.timeout,
                                          metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise BusError(f"embedded bus at {self.address}: {method} failed: {exc.code().name} "
                           f"{exc.details()}") from None
        return msgpack.unpackb(reply.result, raw=False)

    async def register(self, info: WorkerInfo, ttl: float) -> None:
        await self._call("register", encode(info), ttl)

    async def heartbeat(self, info: WorkerInfo, ttl: float) -> bool:
        return bool(await self._call("heartbeat", encode(info), ttl))

    async def deregister(self, worker_id: str) -> None:
        await self._call("deregister", msgpack.packb(worker_id))

    async def publish_load(self, report: LoadReport, ttl: float) -> None:
        await self._call("publish_load", encode(report), ttl)

    async def publish_kv(self, event: KVEvent, maxlen: int = DEFAULT_MAXLEN) -> str:
        return await self._call("publish_kv", encode(event))

    async def publish_kv_batch(self, events: Sequence[KVEvent], maxlen: int = DEFAULT_MAXLEN) -> str | None:
        if not events:
            return None
        return await self._call("publish_kv_batch", msgpack.packb([encode(e) for e in events], use_bin_type=True))

    def _router_only(self, what: str):
        raise BusError(f"{what} is read by routers from the embedded bus itself, not through {self.address}")

    async def live_workers(self) -> dict[str, WorkerInfo]:
        self._router_only("live_workers")

    async def loads(self) -> dict[str, LoadReport]:
        self._router_only("loads")

    async def read_kv(self, positions: Mapping[str, str], block: float | None = None,
                      count: int = 1000) -> list[KVRecord]:
        self._router_only("read_kv")

    async def kv_tail(self, worker_id: str) -> str:
        self._router_only("kv_tail")

    async def close(self) -> None:
        await self._channel.close()


class BusServicer(pb_grpc.BusServicer):
    """Router side: applies workers' calls to the in-process bus. With `model` and
    `block_size`, a worker registering with other values is refused."""

    def __init__(self, bus: ClusterBus, model: str | None = None, block_size: int | None = None, metrics=None):
        self.bus = bus
        self.model = model
        self.block_size = block_size
        self.metrics = metrics

    async def Call(self, request: pb.BusCall, context) -> pb.BusReply:  # noqa: N802 - gRPC name
        m, payload, ttl = request.method, request.payload, request.ttl
        try:
            if m in ("register", "heartbeat", "publish_load") and not 0 < ttl <= MAX_TTL_S:
                raise ValueError(f"ttl {ttl} is not in (0, {MAX_TTL_S}]")
            if m in ("register", "heartbeat"):
                info = checked(WorkerInfo, payload)
                refusal = registration_refusal(info, self.model, self.block_size) or kv_dtype_refusal(
                    info, (await self.bus.live_workers()).values())
                if refusal is not None:
                    reason, message = refusal
                    log.error("bus bridge: %s", message)
                    if self.metrics is not None:
                        self.metrics.worker_registrations_refused.labels(reason=reason).inc()
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
                    return pb.BusReply()
                register = self.bus.register if m == "register" else self.bus.heartbeat
                result = await register(info, ttl)
            elif m == "deregister":
                worker_id = msgpack.unpackb(payload, raw=False)
                if not isinstance(worker_id, str):
                    raise TypeError(f"a worker id must be a string, got {type(worker_id).__name__}")
                result = await self.bus.deregister(worker_id)
            elif m == "publish_load":
                result = await self.bus.publish_load(checked(LoadReport, payload), ttl)
            elif m == "publish_kv":
                result = await self.bus.publish_kv(checked(KVEvent, payload))
            elif m == "publish_kv_batch":
                items = msgpack.unpackb(payload, raw=False)
                if not isinstance(items, list) or not 0 < len(items) <= MAX_KV_BATCH:
                    raise ValueError(f"a KV event batch must be a list of 1 to {MAX_KV_BATCH} events")
                if not all(isinstance(item, bytes) for item in items):
                    raise TypeError("a KV event batch holds encoded events")
                events = [checked(KVEvent, item) for item in items]  # all checked before any is applied
                result = await self.bus.publish_kv_batch(events)
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown bus method {m!r}")
                return pb.BusReply()
        except (TypeError, ValueError, KeyError, msgpack.UnpackException) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {m} payload: {exc}")
            return pb.BusReply()
        except BusError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{m}: {exc}")
            return pb.BusReply()
        return pb.BusReply(result=msgpack.packb(result))


MAX_TTL_S = 3600.0
MAX_KV_BATCH = 1024  # events in one publish_kv_batch call (workers send at most PUBLISH_BATCH)

_FIELD_TYPES = {"str": str, "int": int, "float": (int, float), "Role": str, "list[int]": list,
                "int | None": (int, type(None)), "bool": bool}


def checked(cls: type, payload: bytes):
    """decode() plus a type check of every field: a message from another process must not
    put a non-string worker id or a non-list of hashes into the routers' state."""
    message = decode(cls, payload)
    for f in fields(cls):
        value, expected = getattr(message, f.name), _FIELD_TYPES.get(str(f.type), object)
        if (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
            raise TypeError(f"{cls.__name__}.{f.name} must be {f.type}, got {type(value).__name__}")
    if isinstance(message, KVEvent):
        if message.kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"KVEvent.kind {message.kind!r} is not stored, removed or cleared")
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in message.block_hashes):
            raise TypeError("KVEvent.block_hashes must be integers")
    if isinstance(message, WorkerInfo) and message.role not in ("prefill", "decode"):
        raise ValueError(f"WorkerInfo.role {message.role!r} is not prefill or decode")
    return message


def open_bus(url: str | None, cluster: str = "local", security: LinkSecurity = NO_SECURITY) -> ClusterBus:
    """None/"" -> a fresh in-process bus; redis://... -> Redis; grpc://host:port -> embedded bus
    (with the run's cluster token / mTLS)."""
    if not url:
        from splitserve.cluster.inproc_bus import InProcBus

        return InProcBus(cluster)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from splitserve.cluster.redis_bus import RedisBus

        return RedisBus(url, cluster)
    if url.startswith("grpc://"):
        return RemoteBus(url.removeprefix("grpc://"), cluster, security=security)
    raise ValueError(f"bus URL {url!r}: expected redis://host:port[/db] (or grpc://host:port for embedded mode)")
