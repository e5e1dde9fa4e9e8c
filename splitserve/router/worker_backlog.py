"""What this router has sent each worker that the worker's last load report cannot show yet,
and whether a decode worker is idle: the two things prefill_placement.py weighs besides
the reports themselves.

- Sent: per worker, [send time, prompt tokens it is to compute] of each request routed
  there since its last load report. A request's tokens drop to 0 once its prompt is
  computed (`settle`: its first token came back, or its call ended), so back-to-back
  requests between two reports do not count each other as backlog.
- Ended: per decode worker, when this router's calls to it ended since its last report. A
  call ends after the worker finished the request, so a report that counted it running is
  known to be out of date for it (`idle`).
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_UNSETTLED = 10_000  # routed decisions whose prompt tokens still count (never streamed: dropped oldest first)


class WorkerBacklog:
    def __init__(self, sync):
        self.sync = sync  # IndexSync: its `loads` are the latest load report of each worker
        self._sent: dict[str, list[list]] = {}
        self._unsettled: OrderedDict[int, list[list]] = OrderedDict()  # id(decision) -> its entries in _sent
        self._ended: dict[str, list[float]] = {}

    def _report_time(self, worker: str) -> float:
        report = self.sync.loads.get(worker)
        return report.timestamp if report is not None else 0.0

    def pending(self, worker: str) -> list[list]:
        """[send time, prompt tokens] of what was sent `worker` since its last load report."""
        since = self._report_time(worker)
        sent = [e for e in self._sent.get(worker, []) if e[0] > since]
        self._sent[worker] = sent
        return sent

    def record(self, decision, prompt_tokens: int, block_size: int) -> None:
        """A routed decision: its decode worker and prefill worker (if any) were sent a request;
        the one that computes the uncached prompt has that many tokens more to do."""
        now = time.time()
        computes = decision.prefill_worker or decision.decode_worker
        cached = decision.prefill_cached_blocks if decision.prefill_worker else decision.decode_cached_blocks
        entries = []
        for w in filter(None, (decision.decode_worker, decision.prefill_worker)):
            entries.append([now, max(0, prompt_tokens - cached * block_size) if w == computes else 0])
            self._sent.setdefault(w, []).append(entries[-1])
        self._unsettled[id(decision)] = entries
        while len(self._unsettled) > MAX_UNSETTLED:
            self._unsettled.popitem(last=False)

    def settle(self, decision) -> None:
        """The decision's prompt is computed: it no longer weighs on either worker's backlog."""
        for entry in self._unsettled.pop(id(decision), []):
            entry[1] = 0

    def call_ended(self, worker: str) -> None:
        since = self._report_time(worker)
        ended = [t for t in self._ended.get(worker, []) if t > since][-MAX_UNSETTLED:]
        ended.append(time.time())
        self._ended[worker] = ended

    def idle(self, worker: str) -> bool:
        """Whether everything `worker`'s last report counted (running, waiting), and all this
        router sent it since, were calls of this router that have ended since that report.
        (The caller checks that none of its calls there is in flight now.)"""
        report = self.sync.loads.get(worker)
        if report is None:
            return False
        ended = [t for t in self._ended.get(worker, []) if t > report.timestamp]
        return report.running + report.waiting + len(self.pending(worker)) <= len(ended)
