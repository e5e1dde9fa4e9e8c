"""The KV receiver's bound on PushBlocks streams: per peer, and in idle time.

The gRPC server already caps concurrent streams (`max_concurrent_pushes`). Within that,
one peer (one connection: one prefill worker) may hold at most `max_pushes_per_peer`,
and a stream that sends nothing for `idle_timeout_s` (not even its header) is cancelled,
which unblocks its handler (`_StreamBroken`: the lease rules for a vanished sender
apply). So stuck or idle senders cannot keep real pushes out and turn every request
into a local prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class PeerBusy(Exception):  # noqa: N818 - a refusal, answered RESOURCE_EXHAUSTED
    pass


@dataclass(eq=False)
class Slot:
    peer: str
    context: object  # grpc.ServicerContext: cancel() ends the stream from another thread
    last_frame: float = field(default_factory=time.monotonic)
    frames: int = 0


class StreamGuard:
    def __init__(self, max_per_peer: int, idle_timeout_s: float, worker_id: str = ""):
        self.max_per_peer = max_per_peer
        self.idle_timeout_s = idle_timeout_s
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._slots: set[Slot] = set()
        self._per_peer: Counter[str] = Counter()
        self.idle_cancelled = 0
        self.refused = 0

    def enter(self, peer: str, context) -> Slot:
        with self._lock:
            if self._per_peer[peer] >= self.max_per_peer:
                self.refused += 1
                raise PeerBusy(f"KV receiver of {self.worker_id}: peer {peer} already has {self._per_peer[peer]} "
                               f"pushes open (max_pushes_per_peer {self.max_per_peer})")
            slot = Slot(peer, context)
            self._slots.add(slot)
            self._per_peer[peer] += 1
            return slot

    def leave(self, slot: Slot) -> None:
        with self._lock:
            if slot in self._slots:
                self._slots.discard(slot)
                self._per_peer[slot.peer] -= 1
                if not self._per_peer[slot.peer]:
                    del self._per_peer[slot.peer]

    @staticmethod
    def watch(slot: Slot, stream: Iterator) -> Iterator:
        """The stream's frames, noting when each arrived."""
        for frame in stream:
            slot.last_frame = time.monotonic()
            slot.frames += 1
            yield frame

    def cancel_idle(self, now: float | None = None) -> float:
        """Cancel streams idle too long; returns the seconds until the next one could be."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [s for s in self._slots if now - s.last_frame >= self.idle_timeout_s]
            for s in idle:  # leave() runs when their handlers unwind
                self._slots.discard(s)
                self._per_peer[s.peer] -= 1
            for peer in [p for p, n in self._per_peer.items() if n <= 0]:
                del self._per_peer[peer]
            nxt = min((s.last_frame + self.idle_timeout_s - now for s in self._slots), default=self.idle_timeout_s)
        for s in idle:
            self.idle_cancelled += 1
            log.warning("KV receiver of %s: cancelled a PushBlocks stream from %s idle for %.1fs after %d frame(s)",
                        self.worker_id, s.peer, now - s.last_frame, s.frames)
            s.context.cancel()
        return max(nxt, 0.05)

    def open_streams(self) -> int:
        with self._lock:
            return len(self._slots)
