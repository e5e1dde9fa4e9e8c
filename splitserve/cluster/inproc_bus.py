"""The cluster bus inside one process (the default of `splitserve serve`).

Same semantics as `RedisBus`: TTL'd registry and load reports, one trimmed stream of
KV events per worker, blocking reads, msgpack payloads (encoded and decoded here too,
so both buses accept and reject exactly the same messages). It is shared by the coroutines
of one event loop; processes that need to share a bus use Redis.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Mapping

from splitserve.cluster.bus import DEFAULT_MAXLEN, START, ClusterBus, KVRecord, parse_position
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo, decode, encode


class _Stream:
    """Entries (seq, payload) in publish order; trimmed lazily like Redis' `MAXLEN ~`."""

    def __init__(self):
        self.seqs: list[int] = []
        self.payloads: list[bytes] = []

    def append(self, seq: int, payload: bytes, maxlen: int) -> None:
        self.seqs.append(seq)
        self.payloads.append(payload)
        if len(self.seqs) > 2 * maxlen:  # amortized O(1); at least maxlen stay
            del self.seqs[:-maxlen], self.payloads[:-maxlen]

    def after(self, seq: int, count: int) -> list[tuple[int, bytes]]:
        i = bisect.bisect_right(self.seqs, seq)
        return list(zip(self.seqs[i:i + count], self.payloads[i:i + count], strict=True))


class InProcBus(ClusterBus):
    def __init__(self, cluster: str = "local", clock: Callable[[], float] = time.monotonic):
        self.cluster = cluster
        self._clock = clock
        self._workers: dict[str, tuple[bytes, float]] = {}  # id -> (WorkerInfo, expires)
        self._loads: dict[str, tuple[bytes, float]] = {}
        self._streams: dict[str, _Stream] = {}
        self._seq = 0  # one counter for all streams: positions are "0-<seq>"
        self._published = asyncio.Event()  # replaced after each publish; wakes readers

    # ---- registry ----------------------------------------------------------------------
    async def register(self, info: WorkerInfo, ttl: float) -> None:
        self._workers[info.worker_id] = (encode(info), self._clock() + ttl)

    async def heartbeat(self, info: WorkerInfo, ttl: float) -> bool:
        was_live = self._live(self._workers, info.worker_id)
        await self.register(info, ttl)
        return was_live

    async def deregister(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._loads.pop(worker_id, None)
        self._streams.pop(worker_id, None)

    async def live_workers(self) -> dict[str, WorkerInfo]:
        return {w: decode(WorkerInfo, payload) for w, payload in self._unexpired(self._workers)}

    # ---- load reports ------------------------------------------------------------------
    async def publish_load(self, report: LoadReport, ttl: float) -> None:
        self._loads[report.worker_id] = (encode(report), self._clock() + ttl)

    async def loads(self) -> dict[str, LoadReport]:
        return {w: decode(LoadReport, payload) for w, payload in self._unexpired(self._loads)}

    # ---- KV events ---------------------------------------------------------------------
    async def publish_kv(self, event: KVEvent, maxlen: int = DEFAULT_MAXLEN) -> str:
        payload = encode(event)
        self._seq += 1
        self._streams.setdefault(event.worker_id, _Stream()).append(self._seq, payload, maxlen)
        self._published.set()
        self._published = asyncio.Event()
        return f"0-{self._seq}"

    async def read_kv(self, positions: Mapping[str, str], block: float | None = None,
                      count: int = 1000) -> list[KVRecord]:
        woken = self._published  # taken before looking, so no publish can slip between
        records = self._collect(positions, count)
        if records or not block:
            return records
        try:
            await asyncio.wait_for(woken.wait(), timeout=block)
        except TimeoutError:
            return []
        return self._collect(positions, count)

    async def kv_tail(self, worker_id: str) -> str:
        stream = self._streams.get(worker_id)
        return f"0-{stream.seqs[-1]}" if stream and stream.seqs else START

    async def close(self) -> None:
        self._published.set()  # release blocked readers

    # ---- helpers -----------------------------------------------------------------------
    def _collect(self, positions: Mapping[str, str], count: int) -> list[KVRecord]:
        records = []
        for worker_id, position in positions.items():
            stream = self._streams.get(worker_id)
            if stream is None:
                continue
            after = parse_position(position)[1]
            records += [KVRecord(worker_id, f"0-{seq}", decode(KVEvent, payload))
                        for seq, payload in stream.after(after, count)]
        return records

    def _live(self, table: dict[str, tuple[bytes, float]], key: str) -> bool:
        entry = table.get(key)
        return entry is not None and entry[1] > self._clock()

    def _unexpired(self, table: dict[str, tuple[bytes, float]]) -> list[tuple[str, bytes]]:
        now = self._clock()
        for key in [k for k, (_, expires) in table.items() if expires <= now]:
            del table[key]
        return [(k, payload) for k, (payload, _) in table.items()]
