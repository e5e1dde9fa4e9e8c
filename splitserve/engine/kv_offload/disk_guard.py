"""What keeps a broken disk from reaching a request: every disk-tier file operation runs on one
thread of its own and is waited for with a timeout, and a tier that keeps failing is switched
off until a probe succeeds.

- `DiskIO`: the engine thread (a load-back read) and the offload writer (a write) hand their
  file operation to the `kv-disk-io` thread and wait at most a timeout. A read that hangs (a
  wedged network volume; a FIFO cannot: files are opened O_NONBLOCK) costs the step that one
  timeout, then the tier counts as stuck until the operation returns, and nothing waits on
  it meanwhile. Removals are posted without waiting.
- `TierSwitch`: on after `trip_after` failures in a row or one timeout it turns off; while
  off, every `retry_s` (doubling up to `max_retry_s`) one operation is let through as a
  probe, and the first success turns it back on. Pure bookkeeping; the clock is injectable.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class DiskTimeout(TimeoutError):
    """The disk operation did not finish in time (it may still finish later)."""


class DiskIO:
    def __init__(self, name: str = "kv-disk-io"):
        self._queue: queue.Queue[tuple[Callable, Future] | None] = queue.Queue()
        self._stuck_since: float | None = None  # set when a caller gave up waiting on the running operation
        self._running: Future | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def stuck(self) -> bool:
        """An operation ran past its caller's timeout and has not returned yet."""
        return self._stuck_since is not None

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        """fn() on the disk thread; its result, its exception, or DiskTimeout after `timeout`
        seconds (at once while an earlier operation is stuck)."""
        if self.stuck:
            raise DiskTimeout("an earlier disk operation has not returned")
        future: Future = Future()
        self._queue.put((fn, future))
        try:
            return future.result(timeout)
        except TimeoutError:
            with self._lock:
                if not future.done():
                    self._stuck_since = time.monotonic()
                    future.cancel()  # still queued: never runs; running: it finishes, unwaited
            raise DiskTimeout(f"no answer from the disk within {timeout:g}s") from None

    def post(self, fn: Callable[[], object]) -> None:
        """fn() on the disk thread, not waited for (fn reports its own failures)."""
        self._queue.put((fn, Future()))

    def close(self, timeout: float = 5.0) -> bool:
        """Stop after the queued operations; False if the thread did not end in `timeout`."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it (or nobody waits)
                future.set_exception(exc)
            with self._lock:
                self._stuck_since = None  # whatever hung has returned


class TierSwitch:
    def __init__(self, trip_after: int = 5, retry_s: float = 5.0, max_retry_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.trip_after, self.retry_s, self.max_retry_s, self.clock = trip_after, retry_s, max_retry_s, clock
        self.on = True
        self.failures_in_row = 0
        self.times_off = 0  # how often it was switched off (a metric)
        self._backoff = retry_s
        self._probe_at = 0.0

    def allow(self) -> bool:
        """May an operation run now? While off: once per backoff interval, as a probe."""
        if self.on:
            return True
        now = self.clock()
        if now < self._probe_at:
            return False
        self._probe_at = now + self._backoff  # one probe per interval
        return True

    def succeeded(self) -> bool:
        """An operation worked; True when this switched the tier back on."""
        self.failures_in_row = 0
        if self.on:
            return False
        self.on, self._backoff = True, self.retry_s
        return True

    def failed(self, stalled: bool = False) -> bool:
        """An operation failed (stalled: timed out); True when this switched the tier off."""
        self.failures_in_row += 1
        if not self.on:
            self._backoff = min(self._backoff * 2, self.max_retry_s)  # a failed probe
            self._probe_at = self.clock() + self._backoff
            return False
        if stalled or self.failures_in_row >= self.trip_after:
            self.on = False
            self.times_off += 1
            self._probe_at = self.clock() + self._backoff
            return True
        return False
