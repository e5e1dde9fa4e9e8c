"""One logging set-up for every splitserve process: plain lines (no colour codes, so log
files and collectors read them as written), timestamp, level, logger, message."""

from __future__ import annotations

import logging
import sys
import threading

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int = logging.INFO) -> None:
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(level=level, format=FORMAT)


class WholeLines:
    """A text stream that passes on whole lines only, one writer at a time.

    A Ray driver prints its workers' log lines from a thread of Ray's, the text and its newline in
    two writes; our own lines written in between landed inside them (`...(backend grpc)splitserve:
    serving ...`), which log collectors then read as one record. Each thread's text is held here
    until its newline (or an explicit flush: progress bars), then written with a lock that
    stdout and stderr share, since they are often one pipe or terminal."""

    _lock = threading.RLock()  # re-entrant: a signal handler may print while this thread holds it

    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending = threading.local()

    def write(self, text: str) -> int:
        pending = getattr(self._pending, "text", "") + text
        lines, newline, rest = pending.rpartition("\n")
        self._pending.text = rest
        if newline:
            with self._lock:
                self._stream.write(lines + newline)
                self._stream.flush()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        text, self._pending.text = getattr(self._pending, "text", ""), ""
        with self._lock:
            if text:
                self._stream.write(text)
            self._stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def keep_output_lines_whole() -> None:
    """Make sys.stdout and sys.stderr pass on whole lines (WholeLines) in a process that is about
    to start Ray. Logging's handler keeps the stream it was given: its records are whole lines,
    written in one call each, so they cannot cut into another line either."""
    if not isinstance(sys.stdout, WholeLines):
        sys.stdout = WholeLines(sys.stdout)
    if not isinstance(sys.stderr, WholeLines):
        sys.stderr = WholeLines(sys.stderr)
