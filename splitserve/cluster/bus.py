"""The cluster bus interface: worker registry, load reports and KV event streams.

Two implementations share these semantics (and one test suite): `RedisBus` for a real
cluster and `InProcBus` for everything in one process. Payloads are the msgpack
messages of `messages.py`.

- Registry: `register`/`heartbeat` write the worker's `WorkerInfo` with a TTL; a worker
  that stops heartbeating drops out of `live_workers()` when the TTL runs out.
- Load reports: latest report per worker, with the same kind of TTL.
- KV events: one append-only stream per worker, trimmed to about `maxlen` entries
  (at least `maxlen` are kept). Positions are stream entry ids ("<ms>-<seq>", as Redis
  writes them); `START` reads a stream from its first retained entry, so a router that
  starts late rebuilds its index by replaying every stream.

What workers must do: number their events 1, 2, 3... and publish a `cleared` event as
the first event of each process lifetime (a restarted worker's old stream then reads
as "everything before this is gone"); deregister on clean shutdown.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo

START = "0-0"  # read a stream from its first retained entry
DEFAULT_MAXLEN = 100_000  # KV events kept per worker stream (about 10 MB in Redis)


class BusError(RuntimeError):
    """The bus cannot be reached or answered nonsense; the message says where and why."""


@dataclass(frozen=True)
class KVRecord:
    worker_id: str
    position: str  # this entry's id in the worker's stream; read after it for newer ones
    event: KVEvent


def parse_position(position: str) -> tuple[int, int]:
    """A stream entry id as a comparable (ms, seq) pair."""
    ms, _, seq = position.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"not a stream position: {position!r} (expected '<ms>-<seq>')") \
            from None


class ClusterBus(abc.ABC):
    """All methods are coroutines; one bus object serves one asyncio event loop."""

    cluster: str

    # ---- registry ----------------------------------------------------------------------
    @abc.abstractmethod
    async def register(self, info: WorkerInfo, ttl: float) -> None:
        """Announce (or re-announce) a worker; it stays live for `ttl` seconds."""

    @abc.abstractmethod
    async def heartbeat(self, info: WorkerInfo, ttl: float) -> bool:
        """Extend the worker's TTL. Returns False if its registration had already
        expired (it is registered again, but routers have dropped its index entries
        meanwhile and will replay its stream)."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str) -> None:
        """Remove the worker, its load report and its KV stream (clean shutdown)."""

    @abc.abstractmethod
    async def live_workers(self) -> dict[str, WorkerInfo]:
        """Workers whose registration has not expired, by id."""

    # ---- load reports ------------------------------------------------------------------
    @abc.abstractmethod
    async def publish_load(self, report: LoadReport, ttl: float) -> None: ...

    @abc.abstractmethod
    async def loads(self) -> dict[str, LoadReport]:
        """Latest unexpired report of every worker, by id."""

    # ---- KV events ---------------------------------------------------------------------
    @abc.abstractmethod
    async def publish_kv(self, event: KVEvent, maxlen: int = DEFAULT_MAXLEN) -> str:
        """Append to the worker's stream; returns the new entry's position."""

    async def publish_kv_batch(self, events: Sequence[KVEvent], maxlen: int = DEFAULT_MAXLEN) -> str | None:
        """Append several events, in order; the last one's position (None for none). A bus
        that can do it in one round trip overrides this (a worker publishes a step's worth)."""
        position = None
        for event in events:
            position = await self.publish_kv(event, maxlen)
        return position

    @abc.abstractmethod
    async def read_kv(self, positions: Mapping[str, str], block: float | None = None,
                      count: int = 1000) -> list[KVRecord]:
        """Events after `positions[worker]` for each worker, oldest first per worker, at
        most `count` per worker. With `block` (seconds), wait that long for at least one
        when none is there yet; returns [] on timeout."""

    @abc.abstractmethod
    async def kv_tail(self, worker_id: str) -> str:
        """Position of the worker's newest event (`START` when its stream is empty)."""

    @abc.abstractmethod
    async def close(self) -> None: ...
