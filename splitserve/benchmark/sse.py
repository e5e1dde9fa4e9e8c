"""Incremental Server-Sent Events decoding for OpenAI streams (pure, no I/O).

Bytes arrive in arbitrary pieces; only `data:` fields matter to the OpenAI
protocol. Comment lines (`: keep-alive`) and other fields are skipped. Each event's
data lines are joined with newlines, as the SSE specification says.
"""

from __future__ import annotations


class SSEDecoder:
    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Returns the data payloads of the events completed by this chunk."""
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buffer = self._buffer[newline + 1:]
            if not line:  # a blank line ends the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            if field == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)

    def close(self) -> list[str]:
        """Flushes an event whose final blank line never came (some servers omit it)."""
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events
