"""One log line per distinct fault per interval, however often the fault repeats.

A fault that recurs on every request (a broken disk, a hostile client) would otherwise
write a line per occurrence and bury everything else in the log: 700 warnings in 5 s for one
deleted directory. Each fault has a key (what went wrong, e.g. "disk tier read"); the first
occurrence is logged at once, later ones within `interval_s` are only counted, and the next
line that gets through says how many were left out. Thread-safe; the clock is injectable
for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class FaultLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # key -> when its last line was written
        self._held: dict[str, int] = {}  # key -> occurrences since, not logged

    def report(self, key: str, message: str, *args, level: int = logging.WARNING) -> bool:
        """Log `message % args` unless `key` was logged within the interval; True when it was."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            message += f" ({held} more like this in the last {self.interval_s:.0f}s not logged)"
        self.logger.log(level, message, *args)
        return True
